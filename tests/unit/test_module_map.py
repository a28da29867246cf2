"""docs/design.md's module map lists every module, once, with tests that exist.

A package's `__init__.py` that holds only its docstring is the folder's description, not a
module of its own; every other file under src/poimen/ must have a row, and so must every file
under verification/ (the soak and the model check, outside the wheel), named from the root.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "poimen"
VERIFICATION = ROOT / "verification"
DESIGN = ROOT / "docs" / "design.md"


def _section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def map_rows() -> list[tuple[list[str], list[str]]]:
    """Each row's modules (first column) and tests (last column)."""
    rows = []
    for line in _section(DESIGN.read_text(encoding="utf-8"), "13. Module map").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or set(cells[0]) <= {"-"}:
            continue
        modules = re.findall(r"`([\w/]+\.py)`", cells[0])
        if modules:
            rows.append((modules, re.findall(r"`(tests/[^`]*)`", cells[-1])))
    return rows


def modules() -> set[str]:
    out = set()
    for base, path in [(PACKAGE, p) for p in PACKAGE.rglob("*.py")] + [
        (ROOT, p) for p in VERIFICATION.rglob("*.py")
    ]:
        body = ast.parse(path.read_text(encoding="utf-8")).body
        docstring_only = all(
            isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body
        )
        if path.name == "__init__.py" and docstring_only:
            continue
        out.add(path.relative_to(base).as_posix())
    return out


def test_every_module_is_in_the_map_once() -> None:
    listed = [m for mods, _ in map_rows() for m in mods]
    repeated = sorted({m for m in listed if listed.count(m) > 1})
    assert not repeated, f"listed twice in docs/design.md's module map: {repeated}"
    missing = sorted(modules() - set(listed))
    assert not missing, f"modules missing from docs/design.md's module map: {missing}"
    gone = sorted(set(listed) - modules())
    assert not gone, f"docs/design.md's module map lists modules that do not exist: {gone}"


def test_every_row_names_tests_that_exist() -> None:
    for mods, tests in map_rows():
        assert tests, f"the module map's row for {mods} names no tests"
        for t in tests:
            assert (ROOT / t.split("::")[0]).exists(), f"{mods}: {t} does not exist"


def test_the_sections_are_numbered_once_each_in_order() -> None:
    numbers = [
        int(n)
        for n in re.findall(r"^## (\d+)\. ", DESIGN.read_text(encoding="utf-8"), re.MULTILINE)
    ]
    assert numbers == list(range(1, len(numbers) + 1)), numbers
