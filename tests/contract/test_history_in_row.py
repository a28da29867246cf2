"""Schema version 7: a call on the happy path writes one row per commit, its attempt 1 and
events read from the intent row; the first write off that path spills them into the
history tables, so every reader sees the same history either way. A version 6 log, filled,
keeps every row through migration 7. On both backends."""

from __future__ import annotations

from typing import Any

import pytest

from poimen._core.intents import Attempt, Event, IntentState
from poimen.store import Store, open_store
from poimen.store._base import DENIAL_COLUMNS, EVENT_COLUMNS, INTENT_COLUMNS, latest_version
from tests.contract.test_migrations import write_log_before
from tests.contract.test_store_contract import A, B, claim, dispatch, note, raw

S = IntentState
HISTORY_VERSION = 7


@pytest.fixture
def store(store_url: str) -> Any:
    s = open_store(store_url)
    yield s
    s.close()


def rows_of(url: str, intent_id: str) -> tuple[int, int]:
    """How many attempts and events rows the intent has in the history tables."""
    p = (intent_id,)
    return (
        raw(url, "SELECT COUNT(*) FROM attempts WHERE intent_id = ?", p)[0][0],
        raw(url, "SELECT COUNT(*) FROM events WHERE intent_id = ?", p)[0][0],
    )


def without_ids(events: list[Event]) -> list[tuple[Any, ...]]:
    return [(e.at, e.kind, e.from_state, e.to_state, e.actor, e.detail) for e in events]


def settle(store: Store, iid: str, fence: int = 1, state: IntentState = S.COMPLETED) -> bool:
    return store.record_outcome(
        iid, fence, state, result='"ok"', error=None if state == S.COMPLETED else "boom",
        now=store.now(),
    )


def spill(store: Store, iid: str) -> None:
    """An event of its own: the first write off the happy path."""
    assert store.record_event(iid, "noted", actor="t", detail={"n": 1}, now=store.now())


@pytest.mark.parametrize("state", [S.COMPLETED, S.FAILED])
def test_the_happy_path_writes_only_the_intent_row(
    store: Store, store_url: str, state: IntentState
) -> None:
    iid = dispatch(store, effect="queryable")
    assert rows_of(store_url, iid) == (0, 0)
    [att] = store.attempts(iid)
    assert (att.number, att.fence, att.owner, att.outcome, att.ended_at) == (1, 1, A, None, None)
    [ev] = store.events(iid)
    assert (ev.kind, ev.to_state, ev.actor) == ("dispatched", "DISPATCHED", A.worker_id)
    assert settle(store, iid, state=state)
    assert rows_of(store_url, iid) == (0, 0)
    it = store.get_intent(iid)
    assert it is not None and it.state == state
    [att] = store.attempts(iid)
    outcome = "completed" if state == S.COMPLETED else "failed"
    assert att == Attempt(
        iid, 1, 1, A, it.created_at, it.updated_at, outcome, '"ok"', it.error, None, None
    )
    assert [(e.kind, e.from_state, e.to_state, e.at) for e in store.events(iid)] == [
        ("dispatched", None, "DISPATCHED", it.created_at),
        (outcome, "DISPATCHED", state.value, it.updated_at),
    ]
    # Read from the row, then from the tables once spilled: the same history.
    attempts, events = store.attempts(iid), store.events(iid)
    spill(store, iid)
    assert rows_of(store_url, iid) == (1, 3)
    assert store.attempts(iid) == attempts
    after = store.events(iid)
    assert without_ids(after[:2]) == without_ids(events)
    assert [e.kind for e in after] == ["dispatched", outcome, "noted"]
    assert after[0].id < after[1].id < after[2].id
    # Retention archives the same history, from the row or from the tables.
    other = dispatch(store)
    assert settle(store, other)
    [h1, h2] = store.histories([it, store.get_intent(other)])  # type: ignore[list-item]
    assert (h1.attempts, without_ids(h1.events)) == (attempts, without_ids(after))
    assert (h2.attempts, h2.events) == (store.attempts(other), store.events(other))


def test_a_claim_spills_attempt_one_then_opens_attempt_two(store: Store, store_url: str) -> None:
    iid = dispatch(store)
    before = store.events(iid)
    it = claim(store, iid, 1)
    assert it is not None and (it.fence, it.attempts, it.owner) == (2, 2, B)
    assert rows_of(store_url, iid) == (2, 2)
    assert [(a.number, a.fence, a.owner) for a in store.attempts(iid)] == [(1, 1, A), (2, 2, B)]
    events = store.events(iid)
    assert [e.kind for e in events] == ["dispatched", "retry"]
    assert without_ids(events[:1]) == without_ids(before)
    # The stale owner's outcome is evidence on its attempt; the new owner settles on fence 2.
    assert not settle(store, iid, 1)
    assert settle(store, iid, 2)
    [a1, a2] = store.attempts(iid)
    assert (a1.late_outcome, a2.outcome) == ("completed", "completed")
    assert [e.kind for e in store.events(iid)] == ["dispatched", "retry", "late_outcome", "completed"]


def test_every_write_off_the_happy_path_spills_first(store: Store, store_url: str) -> None:
    now = store.now()
    unknown = dispatch(store)
    assert store.record_unknown(unknown, 1, "timeout", now)
    [att] = store.attempts(unknown)
    assert (att.outcome, att.error) == ("unknown", "timeout")
    assert [e.kind for e in store.events(unknown)] == ["dispatched", "outcome_unknown"]

    deferred = dispatch(store)
    assert store.defer(deferred, 1, next_check_at=now + 5, unknown_count=1, reason="r", now=now)
    assert [e.kind for e in store.events(deferred)] == ["dispatched", "deferred"]

    lost = dispatch(store)
    assert store.mark_indeterminate(lost, 1, "unsafe_unknown_outcome", note(lost), now)
    assert [e.kind for e in store.events(lost)] == ["dispatched", "indeterminate"]
    store.resolve(lost, landed=True, result=None, operator="ann", reason="checked", now=now)
    assert [e.kind for e in store.events(lost)] == ["dispatched", "indeterminate", "resolved"]
    [att] = store.attempts(lost)
    assert (att.number, att.owner, att.outcome) == (1, A, None)

    abandoned = dispatch(store)
    store.abandon(abandoned, operator="ann", reason="stuck", now=now)
    assert [e.kind for e in store.events(abandoned)] == ["dispatched", "abandoned"]

    twice = dispatch(store)
    assert settle(store, twice)
    assert not settle(store, twice)  # a second outcome on the same fence: evidence only
    [att] = store.attempts(twice)
    assert (att.outcome, att.late_outcome) == ("completed", "completed")
    assert [e.kind for e in store.events(twice)] == ["dispatched", "completed", "late_outcome"]
    for iid in (unknown, deferred, lost, abandoned, twice):
        assert rows_of(store_url, iid)[0] == 1


def test_a_filled_version_6_log_keeps_every_row_through_migration_7(store_url: str) -> None:
    write_log_before(store_url, HISTORY_VERSION)
    tables = ("intents", "attempts", "events", "outbox", "deliveries", "denials")

    def every_row(table: str) -> str:
        # The columns of version 6 (version 10 adds the audit chain's links to some tables).
        cols = {"intents": INTENT_COLUMNS, "events": EVENT_COLUMNS,
                "denials": DENIAL_COLUMNS}.get(table, "*")
        return f"SELECT {cols} FROM {table} ORDER BY 1, 2"

    before = {t: raw(store_url, every_row(t)) for t in tables}
    assert before["attempts"] and before["events"]
    store = open_store(store_url)
    try:
        dialect = "sqlite" if store_url.startswith("sqlite") else "postgres"
        assert store.schema_version() == latest_version(dialect) >= HISTORY_VERSION
        assert {t: raw(store_url, every_row(t)) for t in tables} == before
        # Every old intent keeps its history in the tables, read as before.
        assert raw(store_url, "SELECT DISTINCT inline_history FROM intents") == [(0,)]
        assert [(t.number, t.fence, t.outcome) for t in store.attempts("in_a")] == [
            (1, 1, "unknown"),
            (2, 2, "completed"),
        ]
        assert [e.kind for e in store.events("in_a")] == ["dispatched", "retry", "completed"]
        assert [e.kind for e in store.events("in_c")] == ["dispatched", "indeterminate"]
        # The migrated log goes on working: an old unfinished intent settles on its fence
        # with its attempt and event written as before, a new call writes one row, and a
        # claim of an old intent opens attempt 2.
        assert settle(store, "in_b", 1)
        assert [(t.number, t.outcome) for t in store.attempts("in_b")] == [(1, "completed")]
        assert [e.kind for e in store.events("in_b")] == ["dispatched", "completed"]
        new = dispatch(store, "call-new")
        assert settle(store, new)
        assert rows_of(store_url, new) == (0, 0)
        assert [e.kind for e in store.events(new)] == ["dispatched", "completed"]
        [h] = store.histories([store.get_intent("in_a")])  # type: ignore[list-item]
        assert h.attempts == store.attempts("in_a") and h.events == store.events("in_a")
    finally:
        store.close()
