"""Undo's rules (docs/undo.md): a tool's undo, checked when it is registered, and how its
arguments follow, twice alike, from the original call's. The sequence that runs undos is
`poimen._undo`'s."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from poimen._core.effects import _impure_names
from poimen._core.intents import Intent
from poimen._core.keys import JSONValue, encode_args
from poimen._core.tools import check_tool_id
from poimen.errors import ArgumentError, NondeterministicUndoError, RegistrationError

#: How an undo's arguments follow from the original call: (recorded arguments, recorded
#: result) -> the undo's arguments. The result is None when none was recorded (an
#: Indeterminate call, a landed resolution without one).
UndoArgs = Callable[[Mapping[str, Any], Any], Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class UndoRule:
    """A tool's undo: the undo tool's id and how its arguments follow from the original call
    (None: the original's recorded arguments as they are)."""

    tool: str
    args: UndoArgs | None = field(default=None, compare=False)

    def derive(self, original: Intent) -> dict[str, JSONValue]:
        """The undo's arguments for `original`. Derived twice: a derivation that gives two
        answers could never find its own undo again after a crash. ArgumentError names
        what went wrong."""
        if self.args is None:
            data, _ = encode_args(json.loads(original.args))
            return data
        texts: list[str] = []
        data = {}
        for _ in range(2):  # fresh copies each time: a derivation may mutate what it gets
            recorded = json.loads(original.args)
            result = None if original.result is None else json.loads(original.result)
            try:
                derived = self.args(recorded, result)
            except Exception as exc:  # the user's code: whatever it raises stops the undo
                raise ArgumentError(
                    f"undo tool {self.tool!r}: its argument derivation raised "
                    f"{type(exc).__name__}: {exc}",
                    tool_id=self.tool,
                    argument="<undo_args>",
                ) from exc
            data, text = encode_args(derived)
            texts.append(text)
        if texts[0] != texts[1]:
            raise ArgumentError(
                f"undo tool {self.tool!r}: its argument derivation gave two sets of arguments "
                "for one call; it must depend on the recorded arguments and result only",
                tool_id=self.tool,
                argument="<undo_args>",
            )
        return data


def undo_rule(tool_id: str, undo: object, args: object) -> UndoRule | None:
    """The undo a registration names, checked; None when it names none."""
    if undo is None:
        if args is not None:
            raise RegistrationError(
                f"tool {tool_id!r}: undo_args needs undo=<the undo tool's id>", tool_id=tool_id
            )
        return None
    if not isinstance(undo, str):
        raise RegistrationError(
            f"tool {tool_id!r}: undo must be the undo tool's id, not {undo!r}", tool_id=tool_id
        )
    check_tool_id(undo)
    if args is None:
        return UndoRule(undo)
    if not callable(args):
        raise RegistrationError(
            f"tool {tool_id!r}: undo_args must be a function (arguments, result) -> "
            f"arguments, not {args!r}",
            tool_id=tool_id,
        )
    impure = sorted(_impure_names(args))
    if impure:
        raise NondeterministicUndoError(
            f"tool {tool_id!r}: undo_args {getattr(args, '__qualname__', args)!r} reads "
            f"{', '.join(impure)}: an undo's arguments must depend on the original call's "
            "arguments and result only",
            tool_id=tool_id,
            names=impure,
        )
    return UndoRule(undo, args)
