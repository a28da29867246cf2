"""Calls waiting for a person too long: a tool's ``escalate_after`` threshold re-notifies an
INDETERMINATE or AWAITING_APPROVAL call older than it, to the kernel's notifiers and its
escalation notifiers (``Kernel(escalate_to=...)``), once per call; `poimen status
--older-than`, the console's badge and the per-tool oldest-age metrics read the same ages.

A call's age counts from its creation (`created_at`), as everywhere the log shows an age.
Every time here is the store's clock (`Store.now`), so a test moves it without sleeping.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from poimen._core.intents import Intent, IntentState
from poimen.errors import RegistrationError
from poimen.store._base import NewNotification, Store

S = IntentState
#: The notification an overdue call gets, once (its delivery id is the intent's).
OVERDUE = "overdue"
#: The states in which a call waits for a person.
WAITING = (S.INDETERMINATE, S.AWAITING_APPROVAL)
SCAN_LIMIT = 10_000


def threshold(tool_id: str, after: object) -> float | None:
    """A registration's ``escalate_after``, checked: positive seconds, or None."""
    if after is None:
        return None
    if (
        isinstance(after, bool)
        or not isinstance(after, int | float)
        or not math.isfinite(after)
        or after <= 0
    ):
        raise RegistrationError(
            f"tool {tool_id!r}: escalate_after must be a positive number of seconds, "
            f"not {after!r}",
            tool_id=tool_id,
            field="escalate_after",
        )
    return float(after)


def overdue_note(
    intent: Intent, after: float, now: float, notifiers: tuple[str, ...]
) -> NewNotification:
    payload = {
        "intent_id": intent.id,
        "call_id": intent.call_id,
        "tool_id": intent.tool_id,
        "effect": intent.effect,
        "state": intent.state.value,
        "reason": intent.reason if intent.state == S.INDETERMINATE else "awaiting_approval",
        "created_at": intent.created_at,
        "age_s": now - intent.created_at,
        "escalate_after_s": after,
    }
    return NewNotification(
        delivery_id=f"{intent.id}:{OVERDUE}",
        kind=OVERDUE,
        payload=json.dumps(payload, sort_keys=True),
        notifiers=notifiers,
    )


def overdue(store: Store, tool_id: str, after: float, now: float) -> list[Intent]:
    """The tool's calls waiting for a person for `after` seconds or longer, oldest first."""
    out: list[Intent] = []
    for state in WAITING:
        rows = store.list_intents(state=state, tool_id=tool_id, limit=SCAN_LIMIT)
        out.extend(i for i in rows if now - i.created_at >= after)
    return sorted(out, key=lambda i: (i.created_at, i.id))


class Ageing:
    """Escalates overdue calls: at most every `every` seconds of the store's clock (default:
    a quarter of the shortest threshold, at most 60 s), one notification per call."""

    def __init__(self, *, every: float | None = None) -> None:
        self.thresholds: dict[str, float] = {}
        self.every = every
        self._next: float | None = None
        self._done: set[str] = set()

    def maybe_run(self, store: Store, notifiers: tuple[str, ...]) -> int:
        """Queue an ``overdue`` notification for each overdue call that has none; returns
        how many were queued."""
        if not self.thresholds:
            return 0
        now = store.now()
        if self._next is not None and now < self._next:
            return 0
        every = self.every or min(60.0, min(self.thresholds.values()) / 4)
        self._next = now + every
        queued = 0
        seen: set[str] = set()
        for tool_id, after in sorted(self.thresholds.items()):
            for it in overdue(store, tool_id, after, now):
                seen.add(it.id)
                if it.id in self._done:
                    continue
                self._done.add(it.id)
                if any(n.kind == OVERDUE for n in store.notifications(it.id)):
                    continue
                if store.add_notification(it.id, overdue_note(it, after, now, notifiers), now):
                    queued += 1
        self._done &= seen
        return queued


def is_overdue(intent: Intent, thresholds: Mapping[str, float], now: float) -> bool:
    """Whether a call waits for a person past its tool's threshold (the console's badge)."""
    after = thresholds.get(intent.tool_id)
    return (
        after is not None and intent.state in WAITING and now - intent.created_at >= after
    )


def older_than(store: Store, seconds: float, *, limit: int = 1_000_000) -> list[Intent]:
    """Every call waiting for a person (INDETERMINATE, AWAITING_APPROVAL) created at least
    `seconds` ago, oldest first: what `poimen status --older-than` reports."""
    now = store.now()
    rows = [
        i
        for state in WAITING
        for i in store.list_intents(state=state, limit=limit)
        if now - i.created_at >= seconds
    ]
    return sorted(rows, key=lambda i: (i.created_at, i.id))


@dataclass(frozen=True, slots=True)
class Oldest:
    """Per tool, the age of the oldest call waiting in each state."""

    indeterminate: Mapping[str, float]
    approval: Mapping[str, float]


def oldest_by_tool(store: Store, counts: Mapping[tuple[str, str], int], now: float) -> Oldest:
    """The metrics' per-tool oldest ages: one indexed read per tool that has such calls."""

    def of(state: IntentState) -> dict[str, float]:
        out: dict[str, float] = {}
        for tool in sorted({t for (t, s), n in counts.items() if s == state and n > 0}):
            first: Sequence[Intent] = store.list_intents(state=state, tool_id=tool, limit=1)
            if first:
                out[tool] = max(0.0, now - first[0].created_at)
        return out

    return Oldest(indeterminate=of(S.INDETERMINATE), approval=of(S.AWAITING_APPROVAL))
