"""Transactional tools on SQLite and PostgreSQL, on the log's own database and on another one:
each write lands exactly once, counted in the application's own table (the witness); the
marker answers recovery; every other write is denied; bad input fails clearly."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from poimen import (
    Caps,
    Completed,
    Failed,
    Indeterminate,
    IntentState,
    Kernel,
    Landed,
    NotLanded,
    Pending,
    ToolContext,
    ToolRegistration,
    Transactional,
)
from poimen import events as ev
from poimen.errors import RegistrationError, TransactionControlError
from tests.integration.transactional_app import (
    NOTE,
    app_sql,
    databases,
    dbs,
    make_kernel,
    make_notes,
    marker,
    rows,
)

__all__ = ["dbs"]  # the fixture, imported for this module's tests
S = IntentState


def _own(log: str, app: str) -> bool:
    return log == app


def _q(ctx: ToolContext, sql: str) -> str:
    return sql if ctx.tx.paramstyle == "qmark" else sql.replace("?", "%s")


def _insert(ctx: ToolContext) -> None:
    ctx.tx.execute(_q(ctx, "INSERT INTO notes (call_id, text) VALUES (?, ?)"),
                   (ctx.call_id, "x"))


def tx_tool(
    k: Kernel, app: str, tool_id: str, body: Callable[..., Any], *, timeout: float = 10.0,
    caps: Caps | None = None, **kw: Any,
) -> None:
    reg = ToolRegistration(id=tool_id, effects=Transactional(database=app), caps=caps or Caps(),
                           timeout=timeout)
    k.register(reg, body, **kw)


# The call path.


def test_each_call_writes_once_and_commits_with_its_marker_or_its_outcome(
    dbs: tuple[str, str],
) -> None:
    log, app = dbs
    seen: list[ev.CompletedEvent] = []
    with make_kernel(log, app, observers=[_Collect(seen)]) as k:
        first = k.call(NOTE, {"text": "a"}, call_id="c1")
        assert isinstance(first, Completed) and first.result == {"rows": 1, "attempt": 1}
        assert k.call(NOTE, {"text": "a"}, call_id="c1") == first  # answered from the log
        k.call(NOTE, {"text": "b"}, call_id="c2")
        intent = k.store.get_by_call_id("c1")
        assert intent is not None and intent.state == S.COMPLETED
        assert [e.kind for e in k.store.events(intent.id)] == ["dispatched", "completed"]
    assert rows(app, "c1") == rows(app, "c2") == 1
    if _own(log, app):
        # The outcome committed with the tool's transaction: no marker, no outcome commit.
        assert marker(app, intent.id) is None
        assert {e.via for e in seen} == {"transaction"}
    else:
        assert marker(app, intent.id) == (1, 1, '{"attempt":1,"rows":1}')
        assert {e.via for e in seen} == {"call"}


class _Collect(ev.Observer):
    def __init__(self, into: list[ev.CompletedEvent]) -> None:
        self.into = into

    def event(self, event: ev.KernelEvent) -> None:
        if isinstance(event, ev.CompletedEvent):
            self.into.append(event)


def test_a_tool_that_raises_writes_nothing_and_runs_again(dbs: tuple[str, str]) -> None:
    log, app = dbs
    with make_kernel(log, app) as k:

        def flaky(ctx: ToolContext) -> int:
            _insert(ctx)
            if ctx.attempt == 1:
                raise RuntimeError("lost the thread")
            return ctx.attempt

        tx_tool(k, app, "tx.flaky", flaky)
        assert k.call("tx.flaky", {}, call_id="f1") == Completed(_id(k, "f1"), 2)
        if not _own(log, app):
            # Asking fenced attempt 1 out before attempt 2 ran; attempt 2 landed over it.
            assert marker(app, _id(k, "f1"))[:2] == (2, 1)  # type: ignore[index]
    assert rows(app, "f1") == 1


def _id(k: Kernel, call_id: str) -> str:
    it = k.store.get_by_call_id(call_id)
    assert it is not None
    return it.id


def test_a_tool_that_always_raises_ends_failed_with_nothing_written(
    dbs: tuple[str, str],
) -> None:
    log, app = dbs
    with make_kernel(log, app, max_attempts=3) as k:

        def broken(ctx: ToolContext) -> None:
            _insert(ctx)
            raise ValueError("no such customer")

        tx_tool(k, app, "tx.broken", broken)
        out = k.call("tx.broken", {}, call_id="b1")
        assert out == Failed(_id(k, "b1"), "retries_exhausted")
        assert k.store.get_by_call_id("b1").attempts == 3  # type: ignore[union-attr]
    assert rows(app, "b1") == 0


def test_a_write_through_a_handle_is_denied_and_rolls_the_transaction_back(
    dbs: tuple[str, str],
) -> None:
    log, app = dbs
    with make_kernel(log, app) as k:

        def leaky(ctx: ToolContext) -> None:
            _insert(ctx)
            ctx.http.post("http://127.0.0.1:9/hook", json={"x": 1})

        tx_tool(k, app, "tx.leaky", leaky, caps=Caps(hosts=("127.0.0.1:9",)))
        out = k.call("tx.leaky", {}, call_id="l1")
        assert isinstance(out, Failed) and "send refused: transactional" in out.error
        [denial] = k.denials(tool_id="tx.leaky")
        assert denial.reason.startswith("transactional: a Transactional tool writes only")
        assert denial.intent_id == _id(k, "l1")
    assert rows(app, "l1") == 0


def test_an_out_of_band_write_is_denied_and_rolls_the_transaction_back(
    dbs: tuple[str, str], tmp_path: Path,
) -> None:
    log, app = dbs
    target = tmp_path / "side-effect.txt"
    with make_kernel(log, app) as k:

        def sneaky(ctx: ToolContext) -> str:
            _insert(ctx)
            try:
                target.write_text("x")
            except Exception as exc:  # caught: the attempt is still over
                return type(exc).__name__
            return "wrote"

        tx_tool(k, app, "tx.sneaky", sneaky)
        out = k.call("tx.sneaky", {}, call_id="s1")
        assert isinstance(out, Failed) and "denied" in out.error
        [denial] = k.denials(tool_id="tx.sneaky")
        assert denial.action == "file_write" and denial.reason.startswith("transactional:")
    assert not target.exists()
    assert rows(app, "s1") == 0


@pytest.mark.parametrize("action", ["commit", "rollback", "close"])
def test_a_tool_may_not_end_its_transaction(
    tmp_path: Path, action: str,
) -> None:
    with databases("sqlite-other", tmp_path) as (log, app), make_kernel(log, app) as k:

        def ender(ctx: ToolContext) -> None:
            _insert(ctx)
            getattr(ctx.tx, action)()

        tx_tool(k, app, "tx.ender", ender)
        out = k.call("tx.ender", {}, call_id="e1")
        assert isinstance(out, Failed)
        assert f"ctx.tx.{action}()" in out.error and "poimen commits" in out.error
        assert k.store.get_by_call_id("e1").attempts == 1  # type: ignore[union-attr]
        assert rows(app, "e1") == 0


def test_sql_that_ends_the_transaction_is_refused_or_made_indeterminate(
    dbs: tuple[str, str],
) -> None:
    log, app = dbs
    with make_kernel(log, app) as k:

        def committer(ctx: ToolContext) -> str:
            _insert(ctx)
            try:
                ctx.tx.execute("COMMIT")
            except Exception as exc:
                return f"refused: {exc}"
            return "committed"

        tx_tool(k, app, "tx.committer", committer)
        out = k.call("tx.committer", {}, call_id="m1")
        if app.startswith("sqlite"):
            # SQLite refuses the statement itself: nothing was committed.
            assert isinstance(out, Failed) and "tried to COMMIT its transaction" in out.error
            assert rows(app, "m1") == 0
        else:
            # PostgreSQL ran it: the write went in without a marker; an operator decides.
            assert out == Indeterminate(_id(k, "m1"), "transaction_ended_by_tool")
            assert rows(app, "m1") == 1


def test_ctx_tx_is_closed_once_the_call_is_over(tmp_path: Path) -> None:
    kept: list[Any] = []
    with databases("sqlite-other", tmp_path) as (log, app), make_kernel(log, app) as k:

        def keeper(ctx: ToolContext) -> None:
            kept.append(ctx.tx)
            kept.append(ctx.tx.execute("SELECT 1"))

        tx_tool(k, app, "tx.keeper", keeper)
        assert isinstance(k.call("tx.keeper", {}, call_id="k1"), Completed)
    tx, cur = kept
    with pytest.raises(TransactionControlError, match="is closed: the call has ended"):
        tx.execute("INSERT INTO notes (call_id, text) VALUES ('k1', 'late')")
    with pytest.raises(TransactionControlError):
        cur.fetchone()
    assert rows(app, "k1") == 0


def test_a_transaction_that_outlives_the_timeout_is_rolled_back(dbs: tuple[str, str]) -> None:
    log, app = dbs
    with make_kernel(log, app) as k:
        done = threading.Event()

        def slow(ctx: ToolContext) -> int:
            _insert(ctx)
            if ctx.attempt == 1:
                done.wait(0.6)  # past the timeout: a sync tool is not stopped, its commit is
            return ctx.attempt

        tx_tool(k, app, "tx.slow", slow, timeout=0.5)
        assert k.call("tx.slow", {}, call_id="t1") == Completed(_id(k, "t1"), 2)
        [first, _] = k.store.attempts(_id(k, "t1"))
        # Seen by poimen before it commits, or on PostgreSQL by the server, which ends a
        # session left idle in its transaction past the timeout.
        assert "outlived the tool's timeout" in (first.error or "") or (
            app.startswith("postgresql") and "idle-in-transaction timeout" in (first.error or "")
        )
    assert rows(app, "t1") == 1


@pytest.mark.parametrize("flat_path", [True, False], ids=["flat", "protocol"])
@pytest.mark.parametrize("setup", ["sqlite-own", "sqlite-other"])
def test_an_interrupt_out_of_a_sync_tool_rolls_its_transaction_back(
    tmp_path: Path, setup: str, flat_path: bool
) -> None:
    """KeyboardInterrupt out of the tool (on either path of `Kernel.call`): the interrupt
    reaches the caller and the attempt's transaction is rolled back at once, as a cancelled
    async tool's is; left open, it would hold SQLite's write lock (on the log's own database:
    every write of the log) until the kernel closed."""
    with databases(setup, tmp_path) as (log, app), make_kernel(log, app) as k:
        k._engine.flat = flat_path

        def interrupted(ctx: ToolContext) -> None:
            _insert(ctx)
            raise KeyboardInterrupt

        tx_tool(k, app, "tx.interrupted", interrupted)
        with pytest.raises(KeyboardInterrupt):
            k.call("tx.interrupted", {}, call_id="i1")
        free = sqlite3.connect(app[len("sqlite:///"):], timeout=0, isolation_level=None)
        try:
            free.execute("BEGIN IMMEDIATE")  # no transaction of the tool holds the lock
            free.execute("ROLLBACK")
        finally:
            free.close()
        assert rows(app, "i1") == 0
        assert isinstance(k.call(NOTE, {"text": "next"}, call_id="i2"), Completed)


def test_an_async_tool_writes_once(tmp_path: Path) -> None:
    with databases("sqlite-other", tmp_path) as (log, app), make_kernel(log, app) as k:

        async def anote(ctx: ToolContext) -> int:
            await asyncio.sleep(0)
            _insert(ctx)
            return 7

        tx_tool(k, app, "tx.anote", anote)
        assert asyncio.run(k.acall("tx.anote", {}, call_id="a1")) == Completed(_id(k, "a1"), 7)
        assert rows(app, "a1") == 1


# The marker: the lookup fences, the unique key lets one attempt land.


@pytest.mark.parametrize(
    "setup", ["sqlite-other", pytest.param("postgres-other", marks=pytest.mark.postgres)]
)
def test_a_lookup_fences_out_the_attempts_it_answers_for(tmp_path: Path, setup: str) -> None:
    with databases(setup, tmp_path) as (log, app), make_kernel(log, app) as k:
        db = k._engine.databases[NOTE]
        k.call(NOTE, {"text": "seed"}, call_id="seed")
        it = dataclasses.replace(
            k.store.get_by_call_id("seed"), id="in_fenced", call_id="f", attempts=1  # type: ignore[arg-type]
        )
        first = db.begin(it, 10, live=True)
        if setup.startswith("sqlite"):
            # SQLite: attempt 1 holds the database's write lock; the lookup comes first.
            first._abort("test")
            assert db.lookup(it, k.store, 5, live=True) == NotLanded()
            first = db.begin(it, 10, live=True)
            first.execute("INSERT INTO notes (call_id, text) VALUES ('f', '1')")
        else:
            first.execute("INSERT INTO notes (call_id, text) VALUES ('f', '1')")
            assert db.lookup(it, k.store, 5, live=True) == NotLanded()
        from poimen._engine.steps import Run

        # Attempt 1 returns after the lookup: its marker is refused, its write rolled back.
        late = first._finish(Run("completed", value=1), k.store)
        assert late.kind == "unknown" and "fenced this attempt out" in (late.error or "")
        assert rows(app, "f") == 0
        # The retry lands; a lookup now says so, with its result; a third is refused.
        second = db.begin(dataclasses.replace(it, attempts=2), 10, live=True)
        second.execute("INSERT INTO notes (call_id, text) VALUES ('f', '2')")
        assert second._finish(Run("completed", value={"n": 2}), k.store) == Run(
            "completed", value={"n": 2}
        )
        assert db.lookup(dataclasses.replace(it, attempts=2), k.store, 5, live=True) == Landed(
            {"n": 2}
        )
        third = db.begin(dataclasses.replace(it, attempts=3), 10, live=True)
        third.execute("INSERT INTO notes (call_id, text) VALUES ('f', '3')")
        # Refused by the landed marker: the call's result is the one that landed.
        assert third._finish(Run("completed", value=3), k.store) == Run(
            "completed", value={"n": 2}
        )
        assert app_sql(app, "SELECT text FROM notes WHERE call_id = 'f'") == [("2",)]


@pytest.mark.postgres
def test_two_open_attempts_on_postgres_cannot_both_land(tmp_path: Path) -> None:
    from poimen._engine.steps import Run

    with databases("postgres-other", tmp_path) as (log, app), make_kernel(log, app) as k:
        db = k._engine.databases[NOTE]
        k.call(NOTE, {"text": "seed"}, call_id="seed")
        it = dataclasses.replace(k.store.get_by_call_id("seed"), id="in_race", call_id="r")  # type: ignore[arg-type]
        one = db.begin(dataclasses.replace(it, attempts=1), 10, live=True)
        two = db.begin(dataclasses.replace(it, attempts=2), 10, live=True)
        one.execute("INSERT INTO notes (call_id, text) VALUES ('r', '1')")
        two.execute("INSERT INTO notes (call_id, text) VALUES ('r', '2')")
        # Attempt 1 lands first; attempt 2's marker waits on it, then is refused.
        assert one._finish(Run("completed", value="one"), k.store) == Run("completed", value="one")
        assert two._finish(Run("completed", value="two"), k.store) == Run("completed", value="one")
        assert app_sql(app, "SELECT text FROM notes WHERE call_id = 'r'") == [("1",)]


# Bad input.


def test_a_database_that_cannot_be_opened_fails_the_call_clearly(tmp_path: Path) -> None:
    log = f"sqlite:///{tmp_path / 'log.db'}"
    with Kernel(log, notifiers=[]) as k:
        tx_tool(k, f"sqlite:///{tmp_path / 'no' / 'such' / 'app.db'}", "tx.nowhere",
                lambda ctx: 1)
        tx_tool(k, "postgresql://app:hunter2@127.0.0.1:9/shop", "tx.down", lambda ctx: 1)
        out = k.call("tx.nowhere", {}, call_id="n1")
        assert isinstance(out, Failed)
        assert out.error.startswith(f"not sent: cannot open the database sqlite:///{tmp_path}")
        assert "unable to open database file" in out.error
        down = k.call("tx.down", {}, call_id="n2")
        assert isinstance(down, Failed) and "cannot open the database postgresql://" in down.error
        assert "hunter2" not in down.error
        assert k.store.get_by_call_id("n1").state == S.FAILED  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", ["mysql://x/y", "sqlite:///", "", 42])
def test_a_database_that_is_no_url_or_function_is_refused_at_registration(bad: Any) -> None:
    with pytest.raises(RegistrationError, match=r"Transactional\(database=...\) must be"):
        Transactional(database=bad)


def test_a_transactional_registration_is_one_record_kept_whole_or_not_at_all(
    tmp_path: Path,
) -> None:
    log, app = f"sqlite:///{tmp_path / 'log.db'}", f"sqlite:///{tmp_path / 'app.db'}"
    make_notes(app)
    with Kernel(log, notifiers=[]) as k:
        with pytest.raises(RegistrationError, match="description must be text"):
            tx_tool(k, app, "tx.bad", _insert, description=42)
        e = k._engine
        assert "tx.bad" not in e.records and "tx.bad" not in e.databases
        tx_tool(k, app, "tx.good", _insert)
        db = e.records["tx.good"].database
        assert db is not None and e.databases["tx.good"] is db and not db.own
        assert isinstance(k.call("tx.good", {}, call_id="r1"), Completed)
        assert rows(app, "r1") == 1


def test_a_function_may_give_the_connection_and_must_give_a_usable_one(tmp_path: Path) -> None:
    log, path = f"sqlite:///{tmp_path / 'log.db'}", tmp_path / "app.db"
    make_notes(f"sqlite:///{path}")

    def inside_a_transaction() -> sqlite3.Connection:
        conn = sqlite3.connect(path)
        conn.execute("INSERT INTO notes (call_id, text) VALUES ('zz', 'open')")
        return conn

    with Kernel(log, notifiers=[]) as k:
        for tool_id, factory in [
            ("tx.fine", lambda: sqlite3.connect(path, check_same_thread=False)),
            ("tx.thing", lambda: object()),
            ("tx.open", inside_a_transaction),
            ("tx.raises", lambda: 1 / 0),
        ]:
            k.register(ToolRegistration(id=tool_id, effects=Transactional(database=factory),
                                        caps=Caps(), timeout=5), _insert)
        assert isinstance(k.call("tx.fine", {}, call_id="g1"), Completed)
        thing = k.call("tx.thing", {}, call_id="g2")
        assert isinstance(thing, Failed)
        assert "gave a builtins.object: a Transactional tool runs on a sqlite3 or a psycopg 3" \
            in thing.error
        opened = k.call("tx.open", {}, call_id="g3")
        assert isinstance(opened, Failed) and "inside a transaction" in opened.error
        raised = k.call("tx.raises", {}, call_id="g4")
        assert isinstance(raised, Failed) and "ZeroDivisionError" in raised.error
        assert marker(f"sqlite:///{path}", _id(k, "g1"))[1] == 1  # type: ignore[index]
    assert rows(f"sqlite:///{path}", "g1") == 1
    assert rows(f"sqlite:///{path}", "g3") == 0 and rows(f"sqlite:///{path}", "zz") == 0


def test_migrate_makes_the_marker_table(tmp_path: Path) -> None:
    from poimen.cli import main

    app = f"sqlite:///{tmp_path / 'app.db'}"
    assert main(["migrate", "--transactional", app]) == 0
    assert app_sql(app, "SELECT COUNT(*) FROM poimen_tx_markers") == [(0,)]
    assert main(["migrate", "--transactional", "mysql://x/y"]) == 2
    assert main(["migrate", "--transactional", f"sqlite:///{tmp_path / 'no' / 'x.db'}"]) == 3


# Sandbox modes, approvals, undo.


def test_a_shadow_kernel_runs_the_tool_and_rolls_it_back(tmp_path: Path) -> None:
    with databases("sqlite-other", tmp_path) as (_, app):
        shadow = f"sqlite:///{tmp_path / 'shadow.db'}"
        with Kernel(shadow, mode="shadow", notifiers=[]) as k:
            tx_tool(k, app, NOTE, lambda ctx, text: (_insert(ctx), "would write")[1])
            out = k.call(NOTE, {"text": "a"}, call_id="sh1")
            assert isinstance(out, Completed) and out.result == "would write"
        assert rows(app, "sh1") == 0
        with pytest.raises(Exception, match="no such table"):  # not even the marker table
            app_sql(app, "SELECT 1 FROM poimen_tx_markers")


def test_a_replay_kernel_answers_from_the_recording(tmp_path: Path) -> None:
    with databases("sqlite-other", tmp_path) as (log, app):
        with make_kernel(log, app) as k:
            live = k.call(NOTE, {"text": "a"}, call_id="r1")
        replay = f"sqlite:///{tmp_path / 'replay.db'}"
        with Kernel(replay, mode="replay", recording=log, notifiers=[]) as r:
            tx_tool(r, app, NOTE, lambda ctx, text: pytest.fail("a replay runs no tool"))
            again = r.call(NOTE, {"text": "a"}, call_id="r1")
            assert isinstance(again, Completed) and again.result == live.result  # type: ignore[union-attr]
        assert rows(app, "r1") == 1


def test_an_approved_call_writes_once(dbs: tuple[str, str]) -> None:
    log, app = dbs
    with make_kernel(log, app) as k:
        tx_tool(k, app, "tx.gated", _insert, requires_approval=True)
        waiting = k.call("tx.gated", {}, call_id="g1")
        assert isinstance(waiting, Pending) and waiting.reason == "awaiting_approval"
        assert rows(app, "g1") == 0
        k.approve(waiting.intent_id, operator="ann", reason="fine")
        assert isinstance(k.wait_sync("g1", timeout=30), Completed)
        assert isinstance(k.call("tx.gated", {}, call_id="g1"), Completed)
    assert rows(app, "g1") == 1


def test_a_transactional_undo_reverses_the_write_once(dbs: tuple[str, str]) -> None:
    log, app = dbs
    with make_kernel(log, app) as k:

        def unnote(ctx: ToolContext, call: str) -> int:
            return ctx.tx.execute(_q(ctx, "DELETE FROM notes WHERE call_id = ?"), (call,)).rowcount

        tx_tool(k, app, "tx.unnote", unnote)
        tx_tool(k, app, "tx.noted", _insert, undo="tx.unnote",
                undo_args=lambda args, result: {"call": "run-1/1"})
        k.call("tx.noted", {}, call_id="run-1/1")
        assert rows(app, "run-1/1") == 1
        report = k.undo("run-1/", operator="ann", reason="bad run")
        assert report.complete and [s.status for s in report.steps] == ["undone"]
        assert k.undo("run-1/", operator="ann", reason="again").steps[0].status == "already_undone"
        undo = k.store.get_by_call_id("undo/run-1/1")
        assert undo is not None and undo.result == "1"
    assert rows(app, "run-1/1") == 0


# The outcome on the log's own database: it commits with the writes, on its fence only.


def test_the_outcome_commits_with_the_tools_writes_only_on_its_fence(store_url: str) -> None:
    from poimen._engine.transactional import Database
    from poimen.store import open_store
    from tests.contract.test_store_contract import claim, dispatch

    make_notes(store_url)
    store = open_store(store_url)
    try:
        db = Database(Transactional(database=store_url), store.url)
        assert db.own
        iid = dispatch(store, "own-1", effect="transactional")
        claim(store, iid, 1)  # taken over: the first attempt's fence (1) is stale now
        for fence, lands in ((1, False), (2, True)):
            s = db.connect()
            s.begin(5)
            s.execute(s.q("INSERT INTO notes (call_id, text) VALUES (?, ?)"), ("own-1", "x"))
            ok = store.commit_outcome_in(
                s, iid, fence, result='"done"', error=None, now=store.now()
            )
            s.close()
            assert ok is lands
            assert rows(store_url, "own-1") == int(lands)  # rolled back with the stale fence
        it = store.get_intent(iid)
        assert it is not None and (it.state, it.fence, it.result) == (S.COMPLETED, 2, '"done"')
        assert [e.kind for e in store.events(iid)][-1] == "completed"
    finally:
        store.close()
