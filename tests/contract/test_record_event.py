"""`Store.record_event`: an audit event that changes no state (who asked for an undo, which
intent undid a call), written once even when it is written again or its COMMIT's answer is
lost. Both backends."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from poimen._core.intents import IntentState
from poimen.errors import (
    AlreadyUndoneError,
    IntentNotFoundError,
    ReadOnlyStoreError,
    StoreError,
)
from poimen.store import Store, open_store
from poimen.store.postgres import PostgresStore
from tests.contract import test_store_contract
from tests.contract.test_store_contract import dispatch
from tests.integration.test_postgres_lost_commit import CommitCutter, cutter  # noqa: F401

S = IntentState
store = test_store_contract.store  # the conformance suite's fixture


def test_an_event_is_appended_once_and_changes_nothing_else(
    store: Store, store_url: str
) -> None:
    iid = dispatch(store, "c1")
    before = store.get_intent(iid)
    detail = {"undo_call_id": "undo/c1", "operator": "ann", "reason": None}
    assert store.record_event(iid, "undo_requested", actor="ann", detail=detail, now=1.0)
    assert not store.record_event(iid, "undo_requested", actor="ann", detail=detail, now=2.0)
    assert store.record_event(iid, "undo_requested", actor="bob", detail=detail, now=3.0)
    events = [e for e in store.events(iid) if e.kind == "undo_requested"]
    assert [(e.actor, e.at, e.from_state, e.to_state) for e in events] == [
        ("ann", 1.0, None, None), ("bob", 3.0, None, None)]
    assert json.loads(events[0].detail or "") == {"undo_call_id": "undo/c1", "operator": "ann"}
    assert store.get_intent(iid) == before  # state, fence, lease: untouched
    with pytest.raises(IntentNotFoundError):
        store.record_event("in_nope", "undone", actor="ann", detail={}, now=1.0)

    ro = open_store(store_url, readonly=True)
    try:
        with pytest.raises((ReadOnlyStoreError, StoreError)):
            ro.record_event(iid, "undone", actor="ann", detail={}, now=4.0)
    finally:
        ro.close()
    assert len(store.events(iid)) == len(events) + 1  # + dispatched


@pytest.mark.postgres
def test_a_lost_commit_of_an_event_is_not_written_twice(
    cutter: tuple[CommitCutter, str],  # noqa: F811
) -> None:
    proxy, url = cutter
    store = PostgresStore(url, retry_for=10.0)
    try:
        iid = dispatch(store, "c1")
        proxy.arm(skip=0)  # the event's COMMIT reaches the server, its answer does not
        store.record_event(iid, "undone", actor="ann", detail={"undo_intent_id": "x"}, now=1.0)
        assert proxy.cuts == 1
        assert [e.kind for e in store.events(iid)] == ["dispatched", "undone"]
    finally:
        store.close()


def _held(url: str, intent_id: str) -> Any:
    """PostgreSQL: a transaction of its own holding the intent's row, so that writers that
    lock it queue up behind it and are all let go at once. SQLite: None (one writer)."""
    if not url.startswith("postgresql"):
        return None
    import psycopg

    conn = psycopg.connect(url)
    conn.execute("SELECT 1 FROM intents WHERE id = %s FOR UPDATE", (intent_id,))
    return conn


def _waiting(url: str) -> int:
    import psycopg

    with psycopg.connect(url, autocommit=True) as c:
        row = c.execute(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        ).fetchone()
        return int(row[0]) if row else 0


@pytest.mark.parametrize("kind", ["undo_requested", "undone"])
@pytest.mark.parametrize("spilled", [False, True])
def test_an_equal_event_written_at_once_by_two_connections_is_written_once(
    store_url: str, spilled: bool, kind: str
) -> None:
    """Two `undo` runs of one call meet in `record_event`; each has its own connection. On
    PostgreSQL both are let go at the same moment from behind a lock on the intent's row, so
    each has read "not there yet" unless the check itself is made under that lock."""
    n = 4
    stores = [open_store(store_url) for _ in range(n)]
    try:
        iid = dispatch(stores[0], "c1")
        if spilled:  # the history is in the tables: no spill takes the row for the writer
            stores[0].record_event(iid, "note", actor="x", detail={}, now=0.5)
        detail = {"undo_intent_id": "in_u1", "undo_call_id": "undo/c1", "operator": "ann"}
        holder = _held(store_url, iid)
        barrier = threading.Barrier(n)
        written: list[bool] = []
        errors: list[BaseException] = []

        def write(s: Store) -> None:
            try:
                barrier.wait()
                written.append(s.record_event(iid, kind, actor="ann", detail=detail, now=1.0))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(s,)) for s in stores]
        for t in threads:
            t.start()
        if holder is not None:
            deadline = time.monotonic() + 60
            while _waiting(store_url) + len(written) + len(errors) < n:  # all queued up
                assert time.monotonic() < deadline, "the writers never reached the row"
                time.sleep(0.01)
            holder.commit()
            holder.close()
        for t in threads:
            t.join(timeout=60)
        assert not errors and sorted(written) == [False] * (n - 1) + [True]
        assert [e.kind for e in stores[0].events(iid)].count(kind) == 1
    finally:
        for s in stores:
            s.close()


def test_an_undone_call_takes_no_new_undo(store: Store) -> None:
    """docs/design.md section 9: an original with an `undone` event is undone. The store
    refuses to record a new undo request for it, and names the undo that reversed it once."""
    iid = dispatch(store, "c1")
    asked = {"undo_call_id": "undo/c1", "operator": "ann"}
    assert store.record_event(iid, "undo_requested", actor="ann", detail=asked, now=1.0)
    done = {"undo_intent_id": "in_u1", "undo_call_id": "undo/c1", "operator": "ann"}
    assert store.record_event(iid, "undone", actor="ann", detail=done, now=2.0)
    # Another run, another operator: the same undo intent is not named twice.
    assert not store.record_event(iid, "undone", actor="bob", detail={**done, "operator": "bob"},
                                  now=3.0)
    for who in ("ann", "bob"):
        with pytest.raises(AlreadyUndoneError, match="undone already") as caught:
            store.record_event(iid, "undo_requested", actor=who,
                               detail={"undo_call_id": "undo#2/c1", "operator": who}, now=4.0)
        assert caught.value.undo_intent_id == "in_u1"
    assert [(e.kind, e.actor) for e in store.events(iid)] == [
        ("dispatched", "worker-a"), ("undo_requested", "ann"), ("undone", "ann")]
