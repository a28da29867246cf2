"""What the focused models share (docs/verification.md, "The rules of issue 20").

The call protocol's model (`_system`) is a world of workers, leases and lookups. The rules
added since (an approval's window, the provider's key window judged at the send, undo beside
retention, a spill beside a settle and a reader) each live in a smaller world of their own:
a focused model is a transition system over its own state, searched by the same explorer
(`_explore.explore`), its rules the project's own (`Rules`) or, in the store's statements,
written out with the flag that puts the rule back as it was before its fix.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any, NamedTuple

from poimen._core.intents import Intent, IntentState, Owner
from verification.model._world import BASE, Label, Rules


class Step(NamedTuple):
    """A transition: its label (the words of a trace), the state after it, whether it is a
    crash (liveness asks for a crash-free run) and the property it breaks, if any."""

    label: Label
    state: Any
    crash: bool = False
    violation: str | None = None


class Focused:
    """A focused model: subclasses give the initial state, the successors, the properties
    and the words. No symmetry between actors is used: every state is its own."""

    name = "focused"

    def __init__(self, cfg: Any, rules: Rules) -> None:
        self.cfg = cfg
        self.rules = rules

    def initial(self) -> Hashable:
        raise NotImplementedError

    def successors(self, s: Any) -> Iterator[Step]:
        raise NotImplementedError

    def check(self, s: Any) -> str | None:
        raise NotImplementedError

    def settled(self, s: Any) -> bool:
        raise NotImplementedError

    def show(self, s: Any) -> list[str]:
        raise NotImplementedError

    def say(self, label: Label) -> str:
        """A transition in words: its label's parts (who, what)."""
        return "a tick passes" if label == ("tick",) else ": ".join(str(x) for x in label)

    def canon(self, s: Any) -> Any:
        return s

    def orbit(self, s: Any) -> list[Any]:
        return [s]

    def excused(self, s: Any) -> bool:
        return False


OWNER = Owner("w0", "h", 2, "s")


def intent(**fields: Any) -> Intent:
    """An intent for a rule to judge: `fields` over harmless defaults, times in ticks after
    `BASE` (the call recorded at BASE)."""
    base: dict[str, Any] = {
        "id": "in_0",
        "call_id": "c0",
        "tool_id": "t0",
        "effect": "unsafe",
        "args": "{}",
        "args_hash": "h",
        "key": None,
        "request_id": None,
        "state": IntentState.DISPATCHED,
        "fence": 1,
        "owner": None,
        "lease_expires_at": None,
        "timeout_s": 1.0,
        "deadline_at": None,
        "next_check_at": None,
        "unknown_count": 0,
        "attempts": 1,
        "result": None,
        "error": None,
        "reason": None,
        "created_at": BASE,
        "updated_at": BASE,
    }
    base.update(fields)
    return Intent(**base)
