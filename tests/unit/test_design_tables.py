"""docs/design.md's rule tables name every effect class and every refusal of the send gate:
a class or a refusal added to the code and not to the page fails here (§14 counts the page as
a place a new class edits)."""

from __future__ import annotations

import ast
import inspect
import re
from typing import get_args

from poimen._core import decide, effects
from tests.unit.test_module_map import DESIGN, _section


def _first_column(section: str) -> list[str]:
    return [line.split("|")[1] for line in section.splitlines() if line.startswith("| ")]


def _class_names() -> list[str]:
    return [c.__name__ for c in get_args(effects.EffectClass)]


def test_every_effect_class_has_a_row_in_the_class_table_and_in_decides_table() -> None:
    text = DESIGN.read_text(encoding="utf-8")
    classes = _first_column(_section(text, "2. Effect classes"))
    decided = _first_column(_section(text, "5. Recovery and decisions"))
    for name in _class_names():
        assert any(f"`{name}(" in c for c in classes), f"§2 has no row for {name}"
        assert any(re.search(rf"\b{name}\b", c) for c in decided), f"§5 has no row for {name}"


def test_every_refusal_of_the_send_gate_is_in_its_table() -> None:
    tree = ast.parse(inspect.getsource(decide.send_gate))
    codes: set[str] = {
        n.args[0].value
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Refused"
        and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)
    }
    assert codes, "send_gate refuses nothing?"
    table = _section(DESIGN.read_text(encoding="utf-8"), "6. Retries on the call path, and "
                     "requests that never left")
    missing = sorted(c for c in codes if f"| `{c}` |" not in table)
    assert not missing, f"§6's send gate table misses the refusals {missing}"
