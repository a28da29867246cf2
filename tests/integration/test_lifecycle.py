"""The call protocol under real process conditions: cancellation, a stuck webhook, a failing
background pass, slow commits, fork, a class changed between crash and restart, provider key
windows, connections that never opened.

Effects are counted outside the log: by the provider process's ledger, or by a test HTTP server
that records how many requests it serves at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from poimen import (
    Caps,
    Completed,
    Failed,
    Idempotent,
    Indeterminate,
    IntentState,
    Kernel,
    KeyDerivation,
    NotLanded,
    NotSent,
    Pending,
    Queryable,
    ToolContext,
    Unknown,
    Unsafe,
    WebhookNotifier,
)
from poimen import events as ev
from poimen._core.intents import Intent, Owner
from poimen._core.keys import args_digest, canonical
from poimen._engine.recovery import drive_orphan
from poimen.errors import PoimenError
from poimen.store._base import NewDispatch
from poimen.testing import ProviderClient, ProviderProcess, provider_lookup

S = IntentState


def wait_for(pred: Callable[[], object], what: str, within: float = 30.0) -> None:
    """Wait for an event in the log or the world, polling; fail naming it."""
    end = time.monotonic() + within
    while not pred():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {within}s waiting for: {what}")
        time.sleep(0.01)


def intent_of(k: Kernel, call_id: str) -> Intent:
    it = k.store.get_by_call_id(call_id)
    assert it is not None, f"no intent for {call_id!r}"
    return it


def settled(k: Kernel, call_id: str) -> bool:
    it = k.store.get_by_call_id(call_id)
    return it is not None and it.state != S.DISPATCHED


def orphan(
    k: Kernel,
    tool: str,
    effect: str,
    args: dict[str, Any],
    call_id: str,
    *,
    key: str | None = None,
    request_id: str | None = None,
    raw_args: str | None = None,
    age: float = 0.0,
    timeout: float = 0.2,
) -> str:
    """An intent left DISPATCHED by an owner on a host that is gone (its lease expired)."""
    now = k.store.now()
    text = raw_args if raw_args is not None else canonical(args)
    d = NewDispatch(
        intent_id=f"in_{call_id}",
        call_id=call_id,
        tool_id=tool,
        effect=effect,
        args=text,
        args_hash=args_digest(text),
        key=key,
        request_id=request_id,
        owner=Owner("w-gone", "gone-host", 1, "1"),
        lease_expires_at=now - 1,
        timeout_s=timeout,
        deadline_at=now - age - 1,
        now=now - age,
    )
    intent, created = k.store.record_dispatch(d)
    assert created
    return intent.id


class _Slow(BaseHTTPRequestHandler):
    server: SlowServer

    def do_POST(self) -> None:
        srv = self.server
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with srv.lock:
            srv.inflight += 1
            srv.served += 1
            srv.most = max(srv.most, srv.inflight)
        time.sleep(srv.delay)
        with srv.lock:
            srv.inflight -= 1
        body = b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class SlowServer(ThreadingHTTPServer):
    """Answers each POST after `delay` seconds and counts requests served at once."""

    daemon_threads = True

    def __init__(self, delay: float) -> None:
        super().__init__(("127.0.0.1", 0), _Slow)
        self.delay = delay
        self.lock = threading.Lock()
        self.inflight = self.most = self.served = 0


@contextmanager
def slow_server(delay: float) -> Iterator[SlowServer]:
    srv = SlowServer(delay)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def closed_port() -> int:
    """A local port nothing listens on: a connection to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# 1. A cancelled acall.


def test_a_cancelled_acall_holds_its_sync_tool_until_it_returns_then_settles(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    gate, started, cancelled = threading.Event(), threading.Event(), threading.Event()
    runs: list[int] = []
    client = httpx.Client(base_url=provider.url, timeout=10)
    k = Kernel(store_url, notifiers=[], deadline_margin=0.0)
    k.on_close(client.close)

    @k.tool(id="ship", effects=Queryable(lookup=provider_lookup(provider.url)), caps=Caps(),
            timeout=0.2)
    def ship(ctx: ToolContext, order: str) -> dict[str, Any]:
        runs.append(ctx.attempt)
        if len(runs) == 1:  # the first run is slow: its caller gives up meanwhile
            started.set()
            gate.wait(30)
        assert ctx.request_id is not None
        r = client.post("/requests", json={"order": order},
                        headers={"X-Request-Id": ctx.request_id})
        return dict(r.json())

    errors: list[BaseException] = []

    async def caller() -> None:
        task = asyncio.create_task(k.acall("ship", {"order": "o1"}, call_id="c1"))
        await asyncio.to_thread(started.wait, 30)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            cancelled.set()

    def loop() -> None:
        try:
            asyncio.run(caller())
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=loop)
    th.start()
    try:
        wait_for(cancelled.is_set, "the caller to get CancelledError")
        it = intent_of(k, "c1")
        assert it.deadline_at is not None
        # Past the deadline a "not landed" answer would be trusted: this kernel's own pass
        # must still leave the call alone, its tool is running.
        wait_for(lambda: k.store.now() > it.deadline_at + 0.05, "the deadline to pass")  # type: ignore[operator]
        report = k.recover()
        assert report.completed == 0
        gate.set()
        wait_for(lambda: settled(k, "c1"), "the cancelled call to settle")
        th.join(30)
        assert not errors
        final = intent_of(k, "c1")
        assert final.state == S.COMPLETED
        assert final.attempts == 1
        assert runs == [1]
        assert ledger.count(kind="request", request_id=final.request_id) == 1
    finally:
        gate.set()
        th.join(30)
        k.close()


async def _told_once_committed(task: asyncio.Task[Any], blocker: sqlite3.Connection) -> None:
    """A cancelled task whose commit `blocker` holds up is not done, however many turns the
    loop takes; once the commit goes through, it raises CancelledError."""
    for _ in range(20):  # turns of the loop, in which a caller not waiting would end
        await asyncio.sleep(0)
    assert not task.done()
    blocker.execute("COMMIT")
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("commit", ["dispatch", "outcome"])
def test_a_cancelled_acall_waits_for_its_commit_in_flight(tmp_path: Path, commit: str) -> None:
    """The answer of a commit in flight decides what comes next: a caller cancelled while
    its commit waits for the database gets CancelledError only once that commit is done,
    and the call is settled (never left DISPATCHED for recovery)."""
    db = tmp_path / "log.db"
    k = Kernel(f"sqlite:///{db}", notifiers=[])
    blocker = sqlite3.connect(db, isolation_level=None)
    runs: list[int] = []
    ran = asyncio.Event()

    @k.tool(id="t.noop", effects=Idempotent(key=KeyDerivation.fields("n")), caps=Caps(),
            timeout=10)
    async def noop(ctx: ToolContext, n: int) -> int:
        runs.append(n)
        if commit == "outcome" and n == 1:  # hold the database: its outcome's commit waits
            blocker.execute("BEGIN IMMEDIATE")
            ran.set()
        return n

    seen_at_end: list[S | None] = []

    def state() -> S | None:  # read beside the writer, which the blocker holds up
        with sqlite3.connect(db) as conn:
            row = conn.execute("SELECT state FROM intents WHERE call_id = 'c1'").fetchone()
        return None if row is None else S(row[0])

    async def caller() -> None:
        await k.acall("t.noop", {"n": 0}, call_id="warm")  # the writer thread runs
        if commit == "dispatch":
            blocker.execute("BEGIN IMMEDIATE")
        task = asyncio.create_task(k.acall("t.noop", {"n": 1}, call_id="c1"))
        task.add_done_callback(lambda _: seen_at_end.append(state()))
        if commit == "outcome":
            await ran.wait()  # the task went on to its outcome's commit in the same step
        else:
            await asyncio.sleep(0)  # the task's first step: its dispatch is submitted
        task.cancel()
        await _told_once_committed(task, blocker)

    try:
        asyncio.run(caller())
        final = intent_of(k, "c1")
        if commit == "dispatch":  # cancelled before its tool ran: FAILED, the tool never ran
            assert final.state == S.FAILED
            assert runs == [0]
        else:
            assert final.state == S.COMPLETED
            assert runs == [0, 1]
        assert seen_at_end == [final.state]
    finally:
        blocker.close()
        k.close()


class _CancelAtStart(ev.Observer):
    """Cancels the caller's task as its call starts: the cancel lands at the call's first
    await, its dispatch commit (nothing of a call awaits before it)."""

    def event(self, event: ev.KernelEvent) -> None:
        if isinstance(event, ev.CallStartedEvent) and event.call_id == "c1":
            task = asyncio.current_task()
            assert task is not None
            task.cancel()


@pytest.mark.parametrize("flat_path", [True, False], ids=["flat", "protocol"])
@pytest.mark.parametrize("point", ["before_dispatch", "dispatch", "tool", "outcome"])
def test_an_acall_cancelled_at_each_await_leaves_the_log_settled_and_one_effect(
    tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient, point: str,
    flat_path: bool,
) -> None:
    """A cancel landing at each await of an async tool's call, on the flat path
    (`flat_acall`) and on the generator protocol: the caller gets CancelledError only once
    the commit in flight is done, the hold is released, and the log says what happened: the
    tool never ran (FAILED), its write landed once (COMPLETED), or its outcome is unknown
    (DISPATCHED, for recovery, which settles it under the same key: one effect)."""
    db = tmp_path / "log.db"
    observers = [_CancelAtStart()] if point == "before_dispatch" else []
    k = Kernel(f"sqlite:///{db}", notifiers=[], lease_ttl=0.2, observers=observers,
               log_events=False)
    k._engine.flat = flat_path
    blocker = sqlite3.connect(db, isolation_level=None)
    sent, release = asyncio.Event(), asyncio.Event()
    port = httpx.URL(provider.url).port

    @k.tool(id="pay", effects=Idempotent(key=KeyDerivation.fields("order")),
            caps=Caps(hosts=(f"127.0.0.1:{port}",)), timeout=0.5)
    async def pay(ctx: ToolContext, order: str) -> Any:
        r = await ctx.ahttp.post(f"{provider.url}/keyed", json={"order": order})
        if order == "o1" and ctx.attempt == 1:
            if point == "outcome":  # hold the database: its outcome's commit waits
                blocker.execute("BEGIN IMMEDIATE")
            sent.set()
            if point == "tool":
                await release.wait()  # cancelled here, its write landed
        return r.json()

    async def caller() -> None:
        await k.acall("pay", {"order": "warm"}, call_id="warm")  # the writer thread runs
        if point == "dispatch":
            blocker.execute("BEGIN IMMEDIATE")
        task = asyncio.create_task(k.acall("pay", {"order": "o1"}, call_id="c1"))
        if point == "dispatch":
            await asyncio.sleep(0)  # the task's first step: its dispatch is submitted
            task.cancel()
        elif point in ("tool", "outcome"):
            await sent.wait()
            task.cancel()
        if point in ("dispatch", "outcome"):
            await _told_once_committed(task, blocker)
        else:
            with pytest.raises(asyncio.CancelledError):
                await task

    try:
        asyncio.run(caller())
        it = intent_of(k, "c1")
        assert it.id not in k._engine.holds
        if point in ("before_dispatch", "dispatch"):  # the tool never ran
            assert (it.state, it.error) == (S.FAILED, "cancelled before the tool ran")
            assert ledger.count(kind="keyed") == 1  # the warm call's
            return
        if point == "outcome":
            assert it.state == S.COMPLETED
        else:  # its outcome unknown: recovery settles it once the lease has run out
            assert (it.state, it.attempts) == (S.DISPATCHED, 1)
            wait_for(lambda: k.store.now() > it.lease_expires_at, "the lease to run out")
            k.recover()
            it = intent_of(k, "c1")
            assert (it.state, it.attempts) == (S.COMPLETED, 2)
        assert ledger.count(kind="keyed") == 2  # the warm call's and c1's, once
    finally:
        blocker.close()
        k.close()


def test_a_timed_out_async_tool_is_retried_only_after_its_request_returned(
    store_url: str,
) -> None:
    # The tool gives up after 0.15 s; its ctx.ahttp request (its own timeout 5 s) takes 0.6 s
    # in its thread. A retry sent while that request still runs would double it.
    with slow_server(0.6) as srv:
        url = f"http://127.0.0.1:{srv.server_address[1]}/pay"
        k = Kernel(store_url, notifiers=[], max_attempts=3)
        try:
            @k.tool(id="pay", effects=Idempotent(key=KeyDerivation.fields("order")),
                    caps=Caps(hosts=(f"127.0.0.1:{srv.server_address[1]}",)), timeout=0.15)
            async def pay(ctx: ToolContext, order: str) -> Any:
                r = await ctx.ahttp.post(url, json={"order": order}, timeout=5)
                return r.json()

            out = asyncio.run(k.acall("pay", {"order": "o1"}, call_id="c1"))
            assert isinstance(out, Indeterminate) and out.reason == "retries_exhausted"
            assert srv.served == 3
            assert srv.most == 1, f"{srv.most} requests of one call ran side by side"
        finally:
            k.close()


# 2. Background recovery survives a bad intent; a result the log cannot store.


def test_background_recovery_goes_on_after_intents_it_cannot_settle(store_url: str) -> None:
    k = Kernel(store_url, notifiers=[], recover_interval=0.1, deadline_margin=0.0)
    done: list[str] = []

    @k.tool(id="q", effects=Queryable(lookup=lambda rid: NotLanded()), caps=Caps(), timeout=0.2)
    def q(ctx: ToolContext, x: int) -> int:
        return x

    @k.tool(id="pay", effects=Idempotent(key=KeyDerivation.custom(lambda a: a["missing"])),
            caps=Caps(), timeout=1)
    def pay(ctx: ToolContext, order: str) -> str:
        return order

    @k.tool(id="ok", effects=Idempotent(key=KeyDerivation.fields("order")), caps=Caps(),
            timeout=1)
    def ok(ctx: ToolContext, order: str) -> str:
        done.append(order)
        return order

    try:
        k.launch(background=True)
        # Recorded Unsafe, registered Queryable now; a derivation that raises KeyError;
        # recorded arguments that are not JSON.
        orphan(k, "q", "unsafe", {"x": 1}, "bad-class")
        orphan(k, "pay", "idempotent", {"order": "o"}, "bad-key", key="pk1_x")
        orphan(k, "q", "queryable", {}, "bad-json", request_id="rq_1", raw_args="{not json")
        wait_for(lambda: all(settled(k, c) for c in ("bad-class", "bad-key", "bad-json")),
                 "the background pass to settle the bad intents")
        assert (intent_of(k, "bad-class").reason, intent_of(k, "bad-key").reason,
                intent_of(k, "bad-json").reason) == (
            "effect_changed", "key_derivation_failed", "arguments_no_longer_valid")
        key = KeyDerivation.fields("order").derive("ok", {"order": "o9"})
        orphan(k, "ok", "idempotent", {"order": "o9"}, "good", key=key)
        wait_for(lambda: settled(k, "good"), "background recovery of a later intent")
        assert intent_of(k, "good").state == S.COMPLETED and done == ["o9"]
    finally:
        k.close()


def test_an_intent_whose_recovery_raises_does_not_stop_the_others(sqlite_url: str) -> None:
    """A row the database refuses to change (a trigger here, a damaged page in real life): its
    recovery raises, is reported, and the other intents of the pass are still recovered."""
    k = Kernel(sqlite_url, notifiers=[], deadline_margin=0.0)
    done: list[str] = []
    by_order = KeyDerivation.fields("order")

    @k.tool(id="ok", effects=Idempotent(key=by_order), caps=Caps(), timeout=1)
    def ok(ctx: ToolContext, order: str) -> str:
        done.append(order)
        return order

    try:
        for c in ("a-stuck", "b-good"):
            orphan(k, "ok", "idempotent", {"order": c}, c, key=by_order.derive("ok", {"order": c}))
        conn = sqlite3.connect(sqlite_url[len("sqlite:///"):], isolation_level=None)
        conn.execute(
            "CREATE TRIGGER stuck BEFORE UPDATE ON intents WHEN OLD.call_id = 'a-stuck' "
            "BEGIN SELECT RAISE(ABORT, 'this row cannot be changed'); END"
        )
        conn.close()
        report = k.recover()
        assert report.errors == [intent_of(k, "a-stuck").id]
        assert intent_of(k, "a-stuck").state == S.DISPATCHED  # left for the next pass
        assert intent_of(k, "b-good").state == S.COMPLETED and done == ["b-good"]
    finally:
        k.close()


def test_a_result_the_log_cannot_store_completes_with_the_error_recorded(
    store_url: str,
) -> None:
    with Kernel(store_url, notifiers=[]) as k:
        @k.tool(id="read", effects=Unsafe(), caps=Caps(), timeout=1)
        def read(ctx: ToolContext) -> dict[str, str]:
            return {"text": "half a pair: \ud800"}

        out = k.call("read", {}, call_id="c1")
        assert isinstance(out, Completed)
        assert out.result == {"text": "half a pair: \ud800"}
        it = intent_of(k, "c1")
        assert it.state == S.COMPLETED and it.result is None
        assert it.error is not None and it.error.startswith("result not recorded")


# 3. Lease renewal.


def test_a_webhook_that_never_answers_does_not_stop_lease_renewal(store_url: str) -> None:
    # A receiver that accepts connections and never answers: delivery hangs for its timeout.
    sink = socket.socket()
    sink.bind(("127.0.0.1", 0))
    sink.listen(16)
    hook = WebhookNotifier(f"http://127.0.0.1:{sink.getsockname()[1]}/hook", secret="s",
                           timeout=20)
    gate, running = threading.Event(), threading.Event()
    a = Kernel(store_url, host="host-a", lease_ttl=1.5, notifiers=[hook])
    b = Kernel(store_url, host="host-b", notifiers=[])

    for k in (a, b):
        @k.tool(id="slow", effects=Unsafe(), caps=Caps(), timeout=0.5)
        def slow(ctx: ToolContext) -> str:
            running.set()
            gate.wait(60)
            return "done"

        @k.tool(id="boom", effects=Unsafe(), caps=Caps(), timeout=0.5)
        def boom(ctx: ToolContext) -> str:
            raise RuntimeError("connection reset")

    th = threading.Thread(target=a.call, args=("slow", {}), kwargs={"call_id": "long"})
    try:
        th.start()
        wait_for(running.is_set, "the long call to start")
        first = intent_of(a, "long").lease_expires_at
        assert first is not None
        # An Indeterminate call: its notification goes to the receiver that never answers.
        assert isinstance(a.call("boom", {}, call_id="boom"), Indeterminate)
        conn, _ = sink.accept()  # delivery is now stuck in the receiver
        try:
            wait_for(lambda: (intent_of(a, "long").lease_expires_at or 0) > first + 1.5,
                     "the lease of the running call to be renewed while delivery hangs",
                     within=10)
            report = b.recover()
            assert report.busy >= 1
            assert intent_of(a, "long").state == S.DISPATCHED
        finally:
            conn.close()
        gate.set()
        th.join(30)
        assert intent_of(a, "long").state == S.COMPLETED
    finally:
        gate.set()
        th.join(30)
        a.close()
        b.close()
        sink.close()
        hook.close()


def test_renewal_never_shortens_a_long_tools_lease(store_url: str) -> None:
    gate, running = threading.Event(), threading.Event()
    with Kernel(store_url, notifiers=[], lease_ttl=0.6) as k:
        @k.tool(id="long", effects=Unsafe(), caps=Caps(), timeout=60)
        def long(ctx: ToolContext) -> str:
            running.set()
            gate.wait(60)
            return "done"

        th = threading.Thread(target=k.call, args=("long", {}), kwargs={"call_id": "c1"})
        th.start()
        try:
            wait_for(running.is_set, "the tool to start")
            first = intent_of(k, "c1").lease_expires_at
            assert first is not None
            k._renew()  # a renewal round, as the renewal duty runs it every lease_ttl / 3
            assert (intent_of(k, "c1").lease_expires_at or 0) >= first
        finally:
            gate.set()
            th.join(30)


def test_a_renewal_applied_after_a_recoverer_judged_the_lease_run_out_keeps_its_call(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    # The trace of docs/verification.md, finding 5, in its order: the owner reads its clock,
    # its lease runs out, a recoverer reads the row and judges it claimable, the owner's
    # renewal applies (by its clock, the lease had not run out), the recoverer takes over.
    owner = Owner("w-a", "host-a", 1, "1")
    with Kernel(store_url, host="host-b", notifiers=[]) as b:
        runs: list[int] = []

        @b.tool(id="pay", effects=Unsafe(), caps=Caps(), timeout=2)
        def pay(ctx: ToolContext) -> None:
            runs.append(ctx.attempt)

        owners_clock = b.store.now()
        text = canonical({})
        it, created = b.store.record_dispatch(NewDispatch(
            intent_id="in_c1", call_id="c1", tool_id="pay", effect="unsafe", args=text,
            args_hash=args_digest(text), key=None, request_id=None, owner=owner,
            lease_expires_at=owners_clock + 0.3, timeout_s=2, deadline_at=owners_clock + 3,
            now=owners_clock,
        ))
        assert created and it.lease_expires_at is not None
        lease = it.lease_expires_at
        wait_for(lambda: b.store.now() > lease, "the owner's lease to run out")
        read_at = b.store.now()
        judged = intent_of(b, "c1")
        assert b._engine.claimable(judged, read_at) == "claimable"
        assert b.store.renew_leases("w-a", [it.id], owners_clock + 30, owners_clock) == 1

        out = drive_orphan(b._engine, b._engine.tools["pay"], judged)
        # The owner goes on with its call: it invokes the tool and records the outcome.
        httpx.post(f"{provider.url}/plain", json={"n": 1}, timeout=10)
        recorded = b.store.record_outcome(
            it.id, 1, S.COMPLETED, result=None, error=None, now=b.store.now()
        )
        assert isinstance(out, Pending) and runs == []
        assert recorded and intent_of(b, "c1").state == S.COMPLETED
        assert intent_of(b, "c1").owner == owner and b.store.notifications() == []
        assert ledger.count(kind="plain") == 1


# 4. A Queryable deadline counts from when the attempt starts.


@contextmanager
def write_lock_held(store_url: str, seconds: float) -> Iterator[threading.Event]:
    """Another writer holds the log's write lock for `seconds`; the event is set once it holds it."""
    held = threading.Event()

    def hold() -> None:
        if store_url.startswith("sqlite"):
            conn = sqlite3.connect(store_url[len("sqlite:///"):], isolation_level=None)
            conn.execute("BEGIN IMMEDIATE")
            held.set()
            time.sleep(seconds)
            conn.execute("COMMIT")
            conn.close()
        else:
            import psycopg

            with psycopg.connect(store_url) as conn:
                conn.execute("LOCK TABLE intents IN SHARE ROW EXCLUSIVE MODE")
                held.set()
                time.sleep(seconds)

    th = threading.Thread(target=hold)
    th.start()
    try:
        yield held
    finally:
        th.join(60)


def test_a_slow_dispatch_commit_does_not_eat_the_queryable_deadline(store_url: str) -> None:
    started: list[float] = []
    with Kernel(store_url, notifiers=[], deadline_margin=0.4) as k:
        @k.tool(id="q", effects=Queryable(lookup=lambda rid: NotLanded()), caps=Caps(),
                timeout=0.5)
        def q(ctx: ToolContext) -> str:
            started.append(k.store.now())
            return "ok"

        k.call("q", {}, call_id="warm")  # the log exists and is migrated before the lock
        with write_lock_held(store_url, 1.5) as held:
            held.wait(30)
            assert isinstance(k.call("q", {}, call_id="c1"), Completed)
        it = intent_of(k, "c1")
        assert it.deadline_at is not None
        # Whatever the attempt sent can land until its start + timeout: the margin stands.
        assert it.deadline_at >= started[-1] + 0.5 + 0.4 * 0.75, (it.deadline_at, started[-1])


def test_an_unknown_outcome_moves_the_deadline_past_the_attempts_end(store_url: str) -> None:
    ended: list[float] = []
    with Kernel(store_url, notifiers=[], deadline_margin=0.1) as k:
        @k.tool(id="q", effects=Queryable(lookup=lambda rid: NotLanded()), caps=Caps(),
                timeout=0.2)
        def q(ctx: ToolContext) -> str:
            time.sleep(0.5)  # a sync tool overruns its timeout: it cannot be preempted
            ended.append(k.store.now())
            raise TimeoutError("read timed out")

        out = k.call("q", {}, call_id="c1")
        assert isinstance(out, Pending) and out.reason == "awaiting_deadline"
        it = intent_of(k, "c1")
        assert it.deadline_at is not None and it.deadline_at >= ended[0] + 0.2 + 0.1


def test_a_dead_owners_queryable_call_waits_a_timeout_before_not_landed_is_trusted(
    store_url: str,
) -> None:
    with Kernel(store_url, notifiers=[], deadline_margin=0.1) as k:
        runs: list[int] = []

        @k.tool(id="q", effects=Queryable(lookup=lambda rid: NotLanded()), caps=Caps(),
                timeout=0.5)
        def q(ctx: ToolContext) -> str:
            runs.append(ctx.attempt)
            return "ok"

        # Its recorded deadline passed long ago, but the owner was only now found gone: a
        # request it sent just before it died may still land.
        orphan(k, "q", "queryable", {}, "c1", request_id="rq_1", age=60, timeout=0.5)
        found = k.store.now()
        k.recover()
        it = intent_of(k, "c1")
        assert runs == []
        assert it.state == S.DISPATCHED and it.reason == "awaiting_deadline"
        assert it.next_check_at is not None and it.next_check_at >= found + 0.5 + 0.1
        wait_for(lambda: k.store.now() >= it.next_check_at, "the extended deadline")  # type: ignore[operator]
        k.recover()
        assert intent_of(k, "c1").state == S.COMPLETED and runs == [2]


# 5. Identity after fork; one identity per kernel.


def test_a_forked_child_is_a_new_owner_and_its_calls_are_not_taken_over(
    tmp_path: Path, store_url: str
) -> None:
    gate = tmp_path / "gate"
    k = Kernel(store_url, notifiers=[], worker_id="api")

    @k.tool(id="slow", effects=Unsafe(), caps=Caps(), timeout=1)
    def slow(ctx: ToolContext) -> str:
        while not gate.exists():
            time.sleep(0.01)
        return "done"

    try:
        parent = k.owner
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            code = 1
            try:
                me = k.owner
                assert me.pid == os.getpid() and me.worker_id != parent.worker_id, me
                assert me.worker_id.startswith("api")
                out = k.call("slow", {}, call_id="child-call")
                assert isinstance(out, Completed), out
                assert k._upkeep.renewal.running()
                code = 0
            except BaseException as exc:
                print("child failed:", repr(exc), flush=True)
            finally:
                os._exit(code)
        wait_for(lambda: k.store.get_by_call_id("child-call") is not None,
                 "the child's call to be recorded")
        child_intent = intent_of(k, "child-call")
        assert child_intent.owner is not None and child_intent.owner.pid == pid
        report = k.recover()  # the parent's pass: the child is alive, its call is live
        assert report.busy == 1 and report.indeterminate == 0
        gate.touch()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert intent_of(k, "child-call").state == S.COMPLETED
        # The parent's own connections were left alone by the child.
        assert isinstance(k.call("slow", {}, call_id="parent-call"), Completed)
    finally:
        gate.touch()
        k.close()


def test_a_second_live_kernel_with_the_same_worker_id_is_refused(tmp_path: Path) -> None:
    from poimen.errors import DuplicateWorkerError

    url = f"sqlite:///{tmp_path / 'log.db'}"
    first = Kernel(url, notifiers=[], worker_id="w1")
    try:
        with pytest.raises(DuplicateWorkerError, match="w1"):
            Kernel(url, notifiers=[], worker_id="w1")
    finally:
        first.close()
    Kernel(url, notifiers=[], worker_id="w1").close()  # free again once the first is closed


# 9. An async tool through Kernel.call inside a running loop.


def test_call_of_an_async_tool_inside_a_running_loop_is_refused_before_recording(
    store_url: str,
) -> None:
    with Kernel(store_url, notifiers=[]) as k:
        @k.tool(id="a", effects=Unsafe(), caps=Caps(), timeout=1)
        async def a(ctx: ToolContext) -> str:
            return "ok"

        async def inside() -> None:
            with pytest.raises(PoimenError, match="acall"):
                k.call("a", {}, call_id="c1")

        asyncio.run(inside())
        assert k.store.get_by_call_id("c1") is None
        assert k.store.notifications() == []


# 10. The recorded class decides; a changed class is an operator's call.


@pytest.mark.parametrize(
    ("recorded", "now_registered"),
    [("unsafe", "queryable"), ("queryable", "unsafe"), ("unsafe", "idempotent"),
     ("idempotent", "unsafe")],
)
def test_a_class_changed_between_crash_and_restart_is_indeterminate(
    store_url: str, recorded: str, now_registered: str
) -> None:
    runs: list[int] = []
    effects: Any = {
        "unsafe": Unsafe(),
        "queryable": Queryable(lookup=lambda rid: NotLanded()),
        "idempotent": Idempotent(key=KeyDerivation.fields("x")),
    }[now_registered]
    with Kernel(store_url, notifiers=[], deadline_margin=0.0) as k:
        @k.tool(id="t", effects=effects, caps=Caps(), timeout=0.2)
        def t(ctx: ToolContext, x: int) -> int:
            runs.append(x)
            return x

        key = KeyDerivation.fields("x").derive("t", {"x": 1}) if recorded == "idempotent" else None
        orphan(k, "t", recorded, {"x": 1}, "c1", key=key,
               request_id="rq_1" if recorded == "queryable" else None)
        k.recover()
        it = intent_of(k, "c1")
        assert (it.state, it.reason) == (S.INDETERMINATE, "effect_changed")
        assert runs == []


def test_a_changed_key_derivation_is_key_drift(store_url: str) -> None:
    with Kernel(store_url, notifiers=[]) as k:
        @k.tool(id="t", effects=Idempotent(key=KeyDerivation.fields("x", version=2)),
                caps=Caps(), timeout=0.2)
        def t(ctx: ToolContext, x: int) -> int:
            return x

        old = KeyDerivation.fields("x").derive("t", {"x": 1})
        orphan(k, "t", "idempotent", {"x": 1}, "c1", key=old)
        k.recover()
        it = intent_of(k, "c1")
        assert (it.state, it.reason) == (S.INDETERMINATE, "key_drift")


# 11. Provider key windows.


def test_an_orphan_older_than_its_key_window_is_not_retried(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    with Kernel(store_url, notifiers=[]) as k:
        @k.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("order"), key_ttl=60),
                caps=Caps(hosts=(f"127.0.0.1:{httpx.URL(provider.url).port}",)), timeout=2)
        def charge(ctx: ToolContext, order: str) -> Any:
            return ctx.http.post(f"{provider.url}/keyed", json={"order": order}).json()

        derive = KeyDerivation.fields("order").derive
        orphan(k, "charge", "idempotent", {"order": "old"}, "old", key=derive("charge", {"order": "old"}), age=120)
        orphan(k, "charge", "idempotent", {"order": "new"}, "new", key=derive("charge", {"order": "new"}), age=10)
        k.recover()
        assert (intent_of(k, "old").state, intent_of(k, "old").reason) == (
            S.INDETERMINATE, "key_expired")
        assert intent_of(k, "new").state == S.COMPLETED
        assert ledger.count(kind="keyed") == 1


# 12. A connection that never opened is not an unknown outcome.


def test_a_refused_connection_fails_an_unsafe_call_after_spaced_retries(store_url: str) -> None:
    from poimen import Retry

    port = closed_port()
    runs: list[float] = []
    seen: list[Any] = []
    from poimen import CallbackNotifier

    with Kernel(store_url, notifiers=[CallbackNotifier(seen.append)]) as k:
        @k.tool(id="send", effects=Unsafe(), caps=Caps(), timeout=1,
                retry=Retry(attempts=3, initial=0.05, maximum=0.05, budget=30))
        def send(ctx: ToolContext) -> Any:
            runs.append(time.monotonic())
            return ctx.http.post(f"http://127.0.0.1:{port}/send", json={}).json()

        out = k.call("send", {}, call_id="c1")
        assert isinstance(out, Failed) and out.error.startswith("not sent")
        assert len(runs) == 3
        it = intent_of(k, "c1")
        assert it.state == S.FAILED and it.attempts == 1
        k.deliver_notifications()
        assert seen == [] and k.store.notifications() == []


def test_a_call_never_sent_records_why_once(store_url: str) -> None:
    from poimen import NotSent, Retry

    port = closed_port()
    raised: list[str] = []
    with Kernel(store_url, notifiers=[]) as k:
        @k.tool(id="send", effects=Unsafe(), caps=Caps(), timeout=1, retry=Retry(attempts=1))
        def send(ctx: ToolContext) -> Any:
            try:
                return ctx.http.post(f"http://127.0.0.1:{port}/send", json={}).json()
            except NotSent as exc:
                raised.append(str(exc))
                raise

        out = k.call("send", {}, call_id="c1")
        assert isinstance(out, Failed) and out.error == intent_of(k, "c1").error
        assert out.error.startswith("not sent: ConnectError: ") and out.error.count("not sent") == 1
        assert raised == [out.error.removeprefix("not sent: ")]  # NotSent says it by its class


def test_a_refused_connection_after_a_write_went_out_stays_unknown(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    port = closed_port()
    seen: list[type[BaseException]] = []
    with Kernel(store_url, notifiers=[]) as k:
        @k.tool(id="send", effects=Unsafe(), caps=Caps(), timeout=2)
        def send(ctx: ToolContext) -> Any:
            ctx.http.post(f"{provider.url}/plain", json={"n": 1})  # this one lands
            try:
                return ctx.http.post(f"http://127.0.0.1:{port}/audit", json={}).json()
            except Exception as exc:
                seen.append(type(exc))
                raise

        out = k.call("send", {}, call_id="c1")
        assert isinstance(out, Indeterminate) and out.reason == "unsafe_unknown_outcome"
        assert ledger.count(kind="plain") == 1
        assert seen == [httpx.ConnectError]  # not NotSent: a write of the attempt went out


def test_a_tools_own_not_sent_after_a_write_went_out_stays_unknown(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    """A tool may raise NotSent for its own client; it says nothing of what ctx.http sent
    before it. Retried in place, the provider would see the write again."""
    with Kernel(store_url, notifiers=[]) as k:
        @k.tool(id="send", effects=Unsafe(), caps=Caps(), timeout=2)
        def send(ctx: ToolContext) -> Any:
            ctx.http.post(f"{provider.url}/plain", json={"n": 1})  # this one lands
            raise NotSent("the audit client could not connect")

        out = k.call("send", {}, call_id="c1")
        assert isinstance(out, Indeterminate) and out.reason == "unsafe_unknown_outcome"
        assert ledger.count(kind="plain") == 1


def test_the_retry_budget_bounds_the_call_path(store_url: str) -> None:
    from poimen import Retry

    port = closed_port()
    runs: list[int] = []
    with Kernel(store_url, notifiers=[]) as k:
        @k.tool(id="send", effects=Unsafe(), caps=Caps(), timeout=1,
                retry=Retry(attempts=10, initial=5.0, maximum=5.0, budget=0.0))
        def send(ctx: ToolContext) -> Any:
            runs.append(1)
            return ctx.http.post(f"http://127.0.0.1:{port}/send", json={}).json()

        out = k.call("send", {}, call_id="c1")
        assert isinstance(out, Failed) and runs == [1]


def test_retry_policy_values_are_checked() -> None:
    from poimen import Retry
    from poimen.errors import RegistrationError

    for bad in ({"attempts": 0}, {"attempts": True}, {"initial": -1.0},
                {"budget": float("nan")}, {"maximum": "1"}):
        with pytest.raises(RegistrationError):
            Retry(**bad)
    with pytest.raises(RegistrationError, match="key_ttl"):
        Idempotent(key=KeyDerivation.fields("x"), key_ttl=0)


def test_json_of_retry_events_round_trips(store_url: str) -> None:
    # The history shows why a deadline moved: the event carries the new deadline.
    with Kernel(store_url, notifiers=[], deadline_margin=0.1) as k:
        @k.tool(id="q", effects=Queryable(lookup=lambda rid: NotLanded()), caps=Caps(),
                timeout=0.2)
        def q(ctx: ToolContext) -> str:
            raise TimeoutError("read timed out")

        k.call("q", {}, call_id="c1")
        kinds = {e.kind: json.loads(e.detail or "{}") for e in k.store.events(intent_of(k, "c1").id)}
        assert "deadline_at" in kinds["outcome_unknown"]


# What the model check of the protocol found (docs/verification.md), against real stores.


def test_a_not_landed_answer_read_before_the_deadline_is_not_trusted_after_it(
    store_url: str,
) -> None:
    runs: list[int] = []
    deadline: list[float] = []
    asked: list[float] = []

    with Kernel(store_url, notifiers=[], deadline_margin=0.0) as k:
        def slow_lookup(rid: str) -> Any:
            # The provider reads its ledger at once; its answer arrives after the deadline.
            asked.append(k.store.now())
            while k.store.now() <= deadline[0] + 0.05:
                time.sleep(0.01)
            return NotLanded()

        @k.tool(id="q", effects=Queryable(lookup=slow_lookup), caps=Caps(), timeout=30.0)
        def q(ctx: ToolContext) -> str:
            runs.append(ctx.attempt)
            return "ok"

        # A deferred intent (its owner finished its attempt) whose deadline is 3 s away.
        orphan(k, "q", "queryable", {}, "c1", request_id="rq_1", timeout=30.0)
        now = k.store.now()
        assert k.store.defer("in_c1", 1, next_check_at=now - 1, unknown_count=0,
                             reason="awaiting_deadline", now=now)
        deadline.append(now + 3.0)
        raw_deadline(store_url, "c1", deadline[0])
        k.recover()
        assert asked and asked[0] < deadline[0], "the lookup was not asked before the deadline"
        # Asked before the deadline: "not landed" may be stale by the time it arrives.
        it = intent_of(k, "c1")
        assert (it.state, it.reason) == (S.DISPATCHED, "awaiting_deadline")
        assert runs == []


def raw_deadline(store_url: str, call_id: str, at: float) -> None:
    from tests.contract.test_store_contract import raw

    raw(store_url, "UPDATE intents SET deadline_at = ? WHERE call_id = ?", (at, call_id))


def test_a_refused_retry_after_an_unknown_outcome_is_not_failed(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    from poimen import DefiniteFailure

    host = f"127.0.0.1:{httpx.URL(provider.url).port}"
    with Kernel(store_url, notifiers=[]) as k:
        @k.tool(id="pay", effects=Idempotent(key=KeyDerivation.fields("order")),
                caps=Caps(hosts=(host,)), timeout=2)
        def pay(ctx: ToolContext, order: str) -> Any:
            if ctx.attempt == 1:
                ctx.http.post(f"{provider.url}/keyed", json={"order": order})  # lands
                raise ConnectionResetError("the reply was lost")
            raise DefiniteFailure("409: a request with this key is still being processed")

        out = k.call("pay", {"order": "o1"}, call_id="c1")
        # The charge landed in attempt 1: the retry's refusal must not make it FAILED.
        assert isinstance(out, Indeterminate) and out.reason == "refused_after_unknown"
        assert ledger.count(kind="keyed") == 1


def test_a_takeover_deadline_survives_a_deferral(store_url: str) -> None:
    answers = iter([Unknown("503"), NotLanded()])
    with Kernel(store_url, notifiers=[], deadline_margin=0.1, lookup_backoff=0.01) as k:
        runs: list[int] = []

        @k.tool(id="q", effects=Queryable(lookup=lambda rid: next(answers)), caps=Caps(),
                timeout=0.5)
        def q(ctx: ToolContext) -> str:
            runs.append(ctx.attempt)
            return "ok"

        orphan(k, "q", "queryable", {}, "c1", request_id="rq_1", age=60, timeout=0.5)
        found = k.store.now()
        k.recover()  # taken over; the lookup cannot say: deferred
        it = intent_of(k, "c1")
        assert it.reason is not None and it.reason.startswith("lookup_unknown")
        # The deadline the takeover set is in the log, for whoever asks next.
        assert it.deadline_at is not None and it.deadline_at >= found + 0.5 + 0.1
        wait_for(lambda: k.store.now() > (intent_of(k, "c1").next_check_at or 0), "next check")
        k.recover()  # "not landed", but before that deadline: not trusted yet
        assert runs == [] and intent_of(k, "c1").state == S.DISPATCHED
