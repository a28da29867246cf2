"""`slot_init`: the same records as the dataclass's own `__init__` makes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest

from poimen._core.intents import Completed, Failed
from poimen._core.slots import slot_init
from poimen._engine.protocol import Write
from poimen._engine.steps import Invoke, Run


@dataclass(frozen=True, slots=True)
class Plain:
    a: str
    b: Any = None
    c: int = field(default=3, compare=False)


@slot_init
@dataclass(frozen=True, slots=True)
class Fast:
    a: str
    b: Any = None
    c: int = field(default=3, compare=False)


def test_the_same_fields_defaults_and_refusals_as_the_dataclass() -> None:
    for args, kw in [(("x",), {}), (("x", 1), {}), (("x",), {"c": 4}), ((), {"a": "y", "b": [1]})]:
        want, got = Plain(*args, **kw), Fast(*args, **kw)
        assert [getattr(got, f.name) for f in dataclasses.fields(got)] == [
            getattr(want, f.name) for f in dataclasses.fields(want)
        ]
    assert Fast("x", 1, 2) == Fast("x", 1, 5) and hash(Fast("x")) == hash(Fast("x", None, 9))
    with pytest.raises(dataclasses.FrozenInstanceError):
        Fast("x").a = "y"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Fast()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Fast("x", d=1)  # type: ignore[call-arg]
    assert dataclasses.replace(Fast("x", 1), b=2) == Fast("x", 2)


def test_the_call_paths_records_take_it() -> None:
    for cls in (Invoke, Run, Write, Completed, Failed):
        assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"
    assert Run("failed", error="e") == Run("failed", None, "e", None)
    assert Failed("i", "e").rejected is False


def test_a_field_it_cannot_set_is_refused() -> None:
    @dataclass(frozen=True, slots=True)
    class Factory:
        a: list[int] = field(default_factory=list)

    with pytest.raises(TypeError, match="does not handle"):
        slot_init(Factory)
