"""SQLite merged writes: a batch of dispatch or outcome commits written in a few statements
decides each call exactly as writing them one by one would (a real file, real threads), and
async callers are served by the writer thread without a thread of their own."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from poimen._core.intents import IntentState, Owner
from poimen.errors import StoreUnavailableError
from poimen.store import NewDispatch
from poimen.store.sqlite import SqliteStore
from tests.helpers import held_leader

S = IntentState
A = Owner("worker-a", "host-a", 101, "1000")
B = Owner("worker-b", "host-b", 202, "2000")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    s = SqliteStore(tmp_path / "log.db")
    try:
        yield s
    finally:
        s.close()


def new(store: SqliteStore, call_id: str, intent_id: str | None = None) -> NewDispatch:
    now = store.now()
    return NewDispatch(
        intent_id=intent_id or f"in_{uuid.uuid4().hex}",
        call_id=call_id,
        tool_id="t.tool",
        effect="idempotent",
        args='{"x":1}',
        args_hash="h1",
        key="k_" + call_id,
        request_id=None,
        owner=A,
        lease_expires_at=now + 30,
        timeout_s=1.0,
        deadline_at=now + 2,
        now=now,
    )


def one_batch(store: SqliteStore, calls: list[Callable[[], Any]]) -> tuple[list[Any], list[str]]:
    """Run `calls` on threads queued behind a held leader, so that they commit as one batch;
    returns each call's result (or exception) and the writer's statements."""
    writer = store._writer
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as exc:  # the test inspects it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    statements: list[str] = []
    with held_leader(writer):
        for t in threads:
            t.start()
        while len(writer._queue) < len(calls):
            threading.Event().wait(0.005)
        writer._conn.set_trace_callback(statements.append)
    for t in threads:
        t.join(10)
    writer._conn.set_trace_callback(None)
    # A statement that fires a trigger (the audit chain's) is reported again at the start of
    # the trigger's program, once per row: one statement, however many rows.
    return results, [s for i, s in enumerate(statements) if not i or s != statements[i - 1]]


def inserts_into(statements: list[str], table: str) -> list[str]:
    return [s for s in statements if s.startswith(f"INSERT INTO {table} ")]


def test_a_batch_of_dispatches_is_one_insert_and_each_call_id_is_one_intent(
    store: SqliteStore,
) -> None:
    old, _ = store.record_dispatch(new(store, "old"))
    batch = [new(store, f"c{i}") for i in range(20)]
    twin = new(store, "c3")  # the same call id twice in one batch
    again = new(store, "old")  # a call id already in the log
    ds = [*batch, twin, again]
    results, statements = one_batch(store, [lambda d=d: store.record_dispatch(d) for d in ds])

    created = {d.call_id: r[1] for d, r in zip(ds, results, strict=True) if r[1]}
    assert sorted(created) == sorted(f"c{i}" for i in range(20))
    assert results[20][1] is False and results[20][0].id == batch[3].intent_id
    assert results[21][1] is False and results[21][0].id == old.id
    # One insert for the batch, of intent rows only (their attempt 1 and event are in the row);
    # the two repeats ran their own insert and read.
    assert inserts_into(statements, "attempts") == inserts_into(statements, "events") == []
    assert len(inserts_into(statements, "intents")) == 3
    assert statements.count("BEGIN IMMEDIATE") == 1  # one transaction for the batch
    for d in batch:
        it = store.get_intent(d.intent_id)
        assert it is not None and results[batch.index(d)][0] == it
        assert [(a.number, a.fence, a.owner) for a in store.attempts(d.intent_id)] == [(1, 1, A)]
        assert [e.kind for e in store.events(d.intent_id)] == ["dispatched"]
    assert store.get_intent(twin.intent_id) is None


def test_a_batch_of_outcomes_settles_on_the_fence_and_keeps_a_stale_one_as_evidence(
    store: SqliteStore,
) -> None:
    ids = [store.record_dispatch(new(store, f"c{i}"))[0].id for i in range(10)]
    now = store.now()
    # ids[0] was claimed by another owner: its first owner's fence is stale.
    assert store.claim(
        ids[0], 1, B, lease_expires_at=now + 30, new_attempt=True, deadline_at=None, now=now
    )
    outcomes = [(i, S.COMPLETED if n % 2 else S.FAILED) for n, i in enumerate(ids)]
    results, statements = one_batch(
        store,
        [
            lambda i=i, st=st: store.record_outcome(
                i,
                1,
                st,
                result='"r"' if st == S.COMPLETED else None,
                error=None if st == S.COMPLETED else "no",
                now=now,
            )
            for i, st in outcomes
        ],
    )
    assert results == [False] + [True] * 9
    # Merged, then the stale one's two tries (as the happy path's, then with its history in
    # the tables): it is kept as evidence with the only event written.
    assert sum(s.startswith("UPDATE intents SET state") for s in statements) == 3
    assert [s.split("VALUES")[1].count("late_outcome") for s in inserts_into(statements, "events")] == [1]
    assert not [s for s in statements if s.startswith("UPDATE attempts SET ended_at")]
    for n, (i, st) in enumerate(outcomes[1:], start=1):
        it = store.get_intent(i)
        assert it is not None and it.state == st
        [att] = store.attempts(i)
        assert att.outcome == ("completed" if n % 2 else "failed")
        assert [e.kind for e in store.events(i)] == ["dispatched", att.outcome]
    stale = store.get_intent(ids[0])
    assert stale is not None and (stale.state, stale.fence) == (S.DISPATCHED, 2)
    first, second = store.attempts(ids[0])
    assert (first.late_outcome, second.outcome) == ("failed", None)
    assert store.events(ids[0])[-1].kind == "late_outcome"


def test_one_intents_two_outcomes_in_one_batch_settle_once(store: SqliteStore) -> None:
    iid = store.record_dispatch(new(store, "c"))[0].id
    now = store.now()
    results, _ = one_batch(
        store,
        [
            lambda: store.record_outcome(iid, 1, S.COMPLETED, result="1", error=None, now=now),
            lambda: store.record_outcome(iid, 1, S.FAILED, result=None, error="x", now=now),
        ],
    )
    assert sorted(results) == [False, True]
    it = store.get_intent(iid)
    assert it is not None and it.state == (S.COMPLETED if results[0] else S.FAILED)


def test_a_refused_row_fails_its_own_call_and_the_batch_commits_the_rest(
    store: SqliteStore,
) -> None:
    taken, _ = store.record_dispatch(new(store, "first"))
    ds = [new(store, "a"), new(store, "clash", intent_id=taken.id), new(store, "b")]
    results, statements = one_batch(store, [lambda d=d: store.record_dispatch(d) for d in ds])
    assert isinstance(results[1], sqlite3.IntegrityError)
    assert results[0][1] is True and results[2][1] is True
    assert store.get_intent(ds[0].intent_id) is not None
    assert store.get_intent(ds[2].intent_id) is not None
    assert store.get_by_call_id("clash") is None
    assert "SAVEPOINT op" in statements  # the merged try was undone, then one by one


def test_async_callers_commit_without_threads_of_their_own(store: SqliteStore) -> None:
    path = store.path
    seen: list[int] = []

    async def caller(n: int) -> None:
        for i in range(10):
            d = new(store, f"a{n}-{i}")
            intent, created = await store.arecord_dispatch(d)
            assert created and intent.id == d.intent_id
            other = sqlite3.connect(path)  # durable before the future resolved
            try:
                seen.append(
                    other.execute(
                        "SELECT COUNT(*) FROM intents WHERE id = ?", (d.intent_id,)
                    ).fetchone()[0]
                )
            finally:
                other.close()
            ok = await store.arecord_outcome(
                d.intent_id, 1, S.COMPLETED, result="1", error=None, now=store.now()
            )
            assert ok

    async def main() -> None:
        before = threading.active_count()
        await asyncio.gather(*(caller(n) for n in range(32)))
        assert threading.active_count() <= before + 1  # the one writer thread at most

    asyncio.run(main())
    assert seen == [1] * 320
    assert store.counts() == {("t.tool", "COMPLETED"): 320}


def test_closing_the_store_waits_for_the_write_in_flight_and_fails_queued_async_writes(
    tmp_path: Path,
) -> None:
    store = SqliteStore(tmp_path / "log.db")
    held, release = threading.Event(), threading.Event()

    def hold(conn: sqlite3.Connection) -> str:
        conn.execute("CREATE TABLE marker (x)")
        held.set()
        assert release.wait(10)
        return "committed"

    leader_got: list[object] = []

    async def main() -> None:
        leader = threading.Thread(target=lambda: leader_got.append(store._writer.run(hold)))
        leader.start()
        assert held.wait(10)
        fut = store.arecord_dispatch(new(store, "late"))
        closing = threading.Thread(target=store.close)
        closing.start()
        closing.join(0.3)
        assert closing.is_alive()  # close waits for the batch in flight
        with pytest.raises(StoreUnavailableError, match="closed"):
            store.record_dispatch(new(store, "after"))  # nothing new is taken meanwhile
        release.set()
        await asyncio.to_thread(leader.join, 10)
        await asyncio.to_thread(closing.join, 10)
        assert not closing.is_alive()
        with pytest.raises(StoreUnavailableError, match="closed"):
            await asyncio.wait_for(fut, 10)

    asyncio.run(main())
    assert leader_got == ["committed"]
    with sqlite3.connect(tmp_path / "log.db") as db:  # the write in flight is durable
        assert db.execute("SELECT COUNT(*) FROM marker").fetchone() == (0,)
        assert db.execute("SELECT COUNT(*) FROM intents").fetchone() == (0,)


def test_closing_the_store_with_its_writer_thread_running_leaves_no_caller_waiting(
    tmp_path: Path,
) -> None:
    store = SqliteStore(tmp_path / "log.db")
    held, release = threading.Event(), threading.Event()

    def hold(conn: sqlite3.Connection) -> None:
        held.set()
        assert release.wait(10)

    async def main() -> None:
        await store.arecord_dispatch(new(store, "first"))  # the writer thread now exists
        leader = threading.Thread(target=store._writer.run, args=(hold,))
        leader.start()
        assert held.wait(10)
        queued = [store.arecord_dispatch(new(store, f"q{i}")) for i in range(3)]
        closing = threading.Thread(target=store.close)
        closing.start()
        release.set()
        await asyncio.to_thread(leader.join, 10)
        await asyncio.to_thread(closing.join, 10)
        for fut in queued:
            with pytest.raises(StoreUnavailableError, match="closed"):
                await asyncio.wait_for(fut, 10)
        assert store._writer._thread is not None
        await asyncio.to_thread(store._writer._thread.join, 10)
        assert not store._writer._thread.is_alive()

    asyncio.run(main())


_CLOSE_UNDER_WRITERS = """
import random, sys, threading, time, uuid
from poimen._core.intents import Owner
from poimen.errors import StoreUnavailableError
from poimen.store import NewDispatch
from poimen.store.sqlite import SqliteStore
owner = Owner("w", "h", 1, "1")
path, trials = sys.argv[1], int(sys.argv[2])
for trial in range(trials):
    store = SqliteStore(f"{path}.{trial}", synchronous="OFF")
    done = []
    def writer():
        for _ in range(300):
            now = time.time()
            d = NewDispatch(f"in_{uuid.uuid4().hex}", uuid.uuid4().hex, "t", "idempotent", "{}",
                            "h", "k", None, owner, now + 30, 1.0, now + 2, now)
            try:
                store.record_dispatch(d)
            except StoreUnavailableError:
                return
            done.append(d.intent_id)
    def reader():
        while True:
            try:
                store.list_intents(limit=50)
            except StoreUnavailableError:
                return
    threads = [threading.Thread(target=f) for f in [writer] * 6 + [reader] * 3]
    for t in threads:
        t.start()
    time.sleep(random.uniform(0.005, 0.05))
    store.close()
    for t in threads:
        t.join()
    again = SqliteStore(f"{path}.{trial}")
    missing = [i for i in done if again.get_intent(i) is None]
    again.close()
    assert not missing, missing[:3]
print("ok")
"""


def test_closing_the_store_under_busy_writers_and_readers_loses_nothing_and_does_not_crash(
    tmp_path: Path,
) -> None:
    # In a child process: a connection closed under a running statement kills the interpreter.
    proc = subprocess.run(
        [sys.executable, "-c", _CLOSE_UNDER_WRITERS, str(tmp_path / "log.db"), "15"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok"


def test_a_batch_of_claims_takes_each_intent_once_on_its_fence(store: SqliteStore) -> None:
    ids = [store.record_dispatch(new(store, f"c{i}"))[0].id for i in range(8)]
    now = store.now()
    store.record_outcome(ids[7], 1, S.COMPLETED, result="1", error=None, now=now)  # settled

    def claim(i: str, fence: int = 1, *, new_attempt: bool = True) -> Any:
        return lambda: store.claim(
            i,
            fence,
            B,
            lease_expires_at=now + 30,
            new_attempt=new_attempt,
            deadline_at=now + 60 if new_attempt else None,
            now=now,
        )

    calls = [
        *(claim(i) for i in ids[:5]),
        claim(ids[5], new_attempt=False),  # a Queryable check: no new attempt
        claim(ids[6], fence=7),  # a stale fence
        claim(ids[7]),  # settled already
        claim(ids[0]),  # the same intent twice: the second loses the race
    ]
    results, statements = one_batch(store, calls)
    assert [r is None for r in results] == [False] * 6 + [True] * 3
    # One merged claim; the twin ran its own compare-and-set, which found the fence moved.
    assert sum(s.startswith("UPDATE intents SET fence") for s in statements) == 2
    assert "SAVEPOINT op" not in statements
    for n, i in enumerate(ids[:6]):
        got = results[n]
        assert got == store.get_intent(i)  # what the claim returned is what the log holds
        assert (got.fence, got.owner, got.state) == (2, B, S.DISPATCHED)
        if n < 5:
            assert got.attempts == 2 and got.deadline_at == now + 60
            assert [(a.number, a.fence, a.owner) for a in store.attempts(i)][-1] == (2, 2, B)
            assert [e.kind for e in store.events(i)] == ["dispatched", "retry"]
        else:
            assert got.attempts == 1 and len(store.attempts(i)) == 1
            assert [e.kind for e in store.events(i)] == ["dispatched", "claimed"]
    untouched = store.get_intent(ids[6])
    assert untouched is not None and (untouched.fence, untouched.owner) == (1, A)
    done = store.get_intent(ids[7])
    assert done is not None and (done.state, done.fence) == (S.COMPLETED, 1)
