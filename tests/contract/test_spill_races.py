"""A spill racing the writes and reads beside it (issue 20, defects 11 and 12): the first write
off the happy path moves an intent's history from its row into the tables while another
connection settles the intent or reads its history. Each interleaving is forced, not hoped for."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from poimen._core.intents import IntentState
from poimen.store import open_store
from tests.contract.test_history_in_row import settle, spill
from tests.contract.test_store_contract import dispatch
from tests.integration.test_lifecycle import wait_for

S = IntentState


@pytest.mark.postgres
def test_a_settle_queued_behind_a_spilling_deferral_ends_attempt_one(postgres_url: str) -> None:
    """The settle's statement takes its snapshot, then waits for the row while a deferral on
    the same fence spills attempt 1 and commits: the settle must still end that attempt.
    (SQLite's one writer runs one after the other: no statement there spans another's commit.)"""
    import psycopg

    store = open_store(postgres_url)
    try:
        iid = dispatch(store, effect="queryable")
        now = store.now()
        done: list[bool] = []
        deferral = threading.Thread(target=lambda: done.append(store.defer(
            iid, 1, next_check_at=now + 5, unknown_count=1, reason="lookup_unknown", now=now
        )))  # fmt: skip
        settling = threading.Thread(target=lambda: done.append(settle(store, iid)))
        queued = (
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        with psycopg.connect(postgres_url) as holder, psycopg.connect(
            postgres_url, autocommit=True
        ) as watch:
            holder.execute("SELECT 1 FROM intents WHERE id = %s FOR UPDATE", (iid,))
            deferral.start()  # first in the row's queue: it spills, defers and commits first
            wait_for(lambda: watch.execute(queued).fetchone() == (1,), "the deferral queued")
            settling.start()
            wait_for(lambda: watch.execute(queued).fetchone() == (2,), "the settle queued")
            holder.rollback()
        for t in (deferral, settling):
            t.join(timeout=120)
        assert done == [True, True]
        it = store.get_intent(iid)
        assert it is not None and it.state == S.COMPLETED
        [att] = store.attempts(iid)
        assert (att.number, att.outcome, att.ended_at) == (1, "completed", it.updated_at)
        assert [e.kind for e in store.events(iid)] == ["dispatched", "deferred", "completed"]
    finally:
        store.close()


@contextlib.contextmanager
def spill_before_second_read(store: Any, url: str, iid: str) -> Iterator[list[str]]:
    """On this thread, just before the store's second SELECT (a reader's second read), another
    store spills `iid` and commits. Yields the statements the spill came before."""
    other = open_store(url)
    me = threading.get_ident()
    seen: list[str] = []

    def before(sql: str) -> None:
        if len(seen) == 2 or threading.get_ident() != me:
            return  # the spill's own statements run on this thread too
        if not sql.lstrip().upper().startswith("SELECT"):
            return
        seen.append(sql)
        if len(seen) == 2:
            spill(other, iid)

    try:
        if url.startswith("sqlite"):
            store.get_intent(iid)  # opens the reader connection the next read takes
            for conn in list(store._conns):
                conn.set_trace_callback(before)  # called as a statement starts, before it reads
            try:
                yield seen
            finally:
                for conn in list(store._conns):
                    conn.set_trace_callback(None)
        else:
            import psycopg

            execute = psycopg.Cursor.execute

            def traced(cur: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
                before(query if isinstance(query, str) else "")
                return execute(cur, query, *args, **kwargs)

            psycopg.Cursor.execute = traced  # type: ignore[method-assign]
            try:
                yield seen
            finally:
                psycopg.Cursor.execute = execute  # type: ignore[method-assign]
    finally:
        other.close()


@pytest.mark.parametrize("reader", ["events", "attempts", "histories"])
def test_a_history_read_across_a_spill_is_the_whole_history(
    store_url: str, reader: str
) -> None:
    """A spill commits between a reader's two reads (the tables, then the row): the reader
    still sees the settled call's history, from one snapshot of the log."""
    store = open_store(store_url)
    try:
        iid = dispatch(store)
        assert settle(store, iid)
        before = (store.attempts(iid), [e.kind for e in store.events(iid)])
        intent = store.get_intent(iid)
        with spill_before_second_read(store, store_url, iid) as seen:
            if reader == "histories":  # retention's reader, for the archive
                (history,) = store.histories([intent])
                got = (history.attempts, history.events)
            else:
                got = getattr(store, reader)(iid)
        assert len(seen) == 2, seen  # the spill came between the reader's two reads
        if reader == "histories":
            assert got[0] == before[0] and [e.kind for e in got[1]] == before[1]
        elif reader == "events":
            assert [e.kind for e in got] == before[1] == ["dispatched", "completed"]
        else:
            assert got == before[0] and [a.outcome for a in got] == ["completed"]
        # It did spill: read again, the history comes from the tables, with the new event.
        assert [e.kind for e in store.events(iid)] == ["dispatched", "completed", "noted"]
    finally:
        store.close()
