"""A frozen slotted dataclass's `__init__` that sets each field through its slot (the call
path's small records: made several times a call)."""

from __future__ import annotations

import dataclasses
import types
from typing import TypeVar

T = TypeVar("T")


def slot_init(cls: type[T]) -> type[T]:
    """Replace the dataclass's `__init__` by one of the same signature that sets each field
    through its slot's descriptor: the generated one of a frozen dataclass calls
    `object.__setattr__` per field, about 1k instructions each. For dataclasses of positional
    fields with plain defaults or none, and no `__post_init__` (refused otherwise)."""
    fs = dataclasses.fields(cls)  # type: ignore[arg-type]
    if hasattr(cls, "__post_init__") or any(
        f.default_factory is not dataclasses.MISSING or not f.init or f.kw_only for f in fs
    ):
        raise TypeError(f"slot_init: {cls.__name__} has fields it does not handle")
    ns: dict[str, object] = {}
    params, body = [], []
    for i, f in enumerate(fs):
        slot = getattr(cls, f.name)
        if not isinstance(slot, types.MemberDescriptorType):
            raise TypeError(f"slot_init: {cls.__name__}.{f.name} is not a slot")
        ns[f"_s{i}"] = slot.__set__
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            ns[f"_d{i}"] = f.default
            params.append(f"{f.name}=_d{i}")
        body.append(f"    _s{i}(self, {f.name})\n")
    exec(f"def __init__(self, {', '.join(params)}):\n{''.join(body)}", ns)
    init = ns["__init__"]
    assert isinstance(init, types.FunctionType)
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = {**{f.name: f.type for f in fs}, "return": None}
    setattr(cls, "__init__", init)  # noqa: B010 - a method of the class, replaced
    return cls
