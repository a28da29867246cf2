"""The happy path's history, held in the intent row (schema version 7).

A call that dispatches and settles without incident writes one row per commit: its intent.
Its attempt 1 and its events (dispatched, then completed or failed) are what the row says,
built here from it for every reader. The first write that deviates from that path "spills"
them: it writes these very rows into attempts and events, clears ``inline_history``, then
writes as before. So an intent's history is the same whether read from its row or from the
tables, and an inline intent has no row in either table.
"""

from __future__ import annotations

import json
from typing import Any

from poimen._core.intents import Attempt, Event, Intent, IntentState

S = IntentState
#: The id of an event read from its intent row: it has no row of its own (yet).
INLINE_EVENT_ID = 0
_SETTLED = {S.COMPLETED: "completed", S.FAILED: "failed"}
# json.dumps(..., sort_keys=True) without building an encoder per event.
DETAIL = json.JSONEncoder(sort_keys=True)


def detail_json(detail: dict[str, Any]) -> str:
    """An event's detail as stored: None values left out, keys sorted."""
    return DETAIL.encode({k: v for k, v in detail.items() if v is not None})


def inline_attempt(it: Intent) -> Attempt:
    """Attempt 1 of an intent whose history is in its row."""
    outcome = _SETTLED.get(it.state)
    settled = outcome is not None
    return Attempt(
        intent_id=it.id,
        number=1,
        fence=1,
        owner=it.owner,
        started_at=it.created_at,
        ended_at=it.updated_at if settled else None,
        outcome=outcome,
        result=it.result if settled else None,
        error=it.error if settled else None,
        late_outcome=None,
        late_result=None,
    )


def inline_events(it: Intent) -> list[Event]:
    """The events of an intent whose history is in its row: dispatched, and its outcome."""
    actor = it.owner.worker_id if it.owner is not None else ""
    out = [
        Event(
            INLINE_EVENT_ID,
            it.id,
            it.created_at,
            "dispatched",
            None,
            S.DISPATCHED.value,
            actor,
            detail_json(
                {"attempt": 1, "fence": 1, "key": it.key, "request_id": it.request_id}
            ),
        )
    ]
    outcome = _SETTLED.get(it.state)
    if outcome is not None:
        out.append(
            Event(
                INLINE_EVENT_ID,
                it.id,
                it.updated_at,
                outcome,
                S.DISPATCHED.value,
                it.state.value,
                "kernel",
                detail_json({"fence": 1, "error": it.error}),
            )
        )
    return out


def attempt_row(a: Attempt) -> tuple[Any, ...]:
    """The parameters of `Sql.insert_spilled_attempt`."""
    o = a.owner
    return (
        a.intent_id,
        a.number,
        a.fence,
        None if o is None else o.worker_id,
        None if o is None else o.host,
        None if o is None else o.pid,
        None if o is None else o.pid_start,
        a.started_at,
        a.ended_at,
        a.outcome,
        a.result,
        a.error,
    )


def event_row(e: Event) -> tuple[Any, ...]:
    """The parameters of `Sql.insert_event`."""
    return (e.intent_id, e.at, e.kind, e.from_state, e.to_state, e.actor, e.detail)
