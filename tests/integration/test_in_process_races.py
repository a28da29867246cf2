"""Recovery in the same process never takes over a call that is still being driven.

The windows (after the dispatch commit, before the tool runs; after the tool returns, before
the outcome commit) are opened deterministically by running a recovery pass inside them; the
effects are counted outside the log, by the tools themselves.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from poimen import (
    Caps,
    Completed,
    Idempotent,
    IntentState,
    Kernel,
    KeyDerivation,
    Landed,
    LookupAnswer,
    NotLanded,
    Queryable,
    ToolContext,
    Unsafe,
)
from poimen._runtime import engine_of

S = IntentState


def _recover_now(k: Kernel) -> None:
    # Another thread of the same process, as the upkeep thread's periodic pass would be.
    t = threading.Thread(target=k.recover)
    t.start()
    t.join()


@pytest.fixture
def kernel(store_url: str) -> Any:
    k = Kernel(store_url, notifiers=[])
    yield k
    k.close()


def test_a_pass_between_the_tool_and_its_outcome_commit_leaves_the_call_alone(
    kernel: Kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    effects: list[str] = []

    @kernel.tool(id="send", effects=Unsafe(), caps=Caps(), timeout=5)
    def send(ctx: ToolContext, to: str) -> str:
        effects.append(to)
        return "sent"

    real = kernel.store.record_outcome

    def outcome_after_a_pass(*a: Any, **kw: Any) -> bool:
        _recover_now(kernel)
        return real(*a, **kw)

    monkeypatch.setattr(kernel.store, "record_outcome", outcome_after_a_pass)
    out = kernel.call("send", {"to": "bob"}, call_id="c1")
    assert isinstance(out, Completed)
    assert effects == ["bob"]
    assert kernel.store.notifications() == []


def test_a_pass_between_the_dispatch_commit_and_the_tool_leaves_the_call_alone(
    kernel: Kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, S]] = []

    @kernel.tool(id="send", effects=Unsafe(), caps=Caps(), timeout=5)
    def send(ctx: ToolContext, to: str) -> str:
        intent = kernel.store.get_intent(ctx.intent_id)
        assert intent is not None
        seen.append((to, intent.state))
        return "sent"

    from poimen._engine import runners as _runners

    real = _runners.invoke_sync

    def pass_first(*a: Any) -> Any:
        _recover_now(kernel)
        return real(*a)

    monkeypatch.setattr(_runners, "invoke_sync", pass_first)
    assert isinstance(kernel.call("send", {"to": "bob"}, call_id="c1"), Completed)
    assert seen == [("bob", S.DISPATCHED)]


def test_an_idempotent_call_runs_once_when_a_pass_hits_its_window(
    kernel: Kernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[int] = []

    @kernel.tool(id="pay", effects=Idempotent(key=KeyDerivation.fields("order")), caps=Caps(),
                 timeout=5)
    def pay(ctx: ToolContext, order: str) -> str:
        runs.append(ctx.attempt)
        return "ok"

    real = kernel.store.record_outcome
    monkeypatch.setattr(kernel.store, "record_outcome",
                        lambda *a, **kw: (_recover_now(kernel), real(*a, **kw))[1])
    out = kernel.call("pay", {"order": "o1"}, call_id="c1")
    assert isinstance(out, Completed)
    assert runs == [1]


def test_periodic_recovery_beside_many_live_calls_changes_no_outcome(sqlite_url: str) -> None:
    with Kernel(sqlite_url, notifiers=[], recover_interval=0.01) as k:
        sent: list[int] = []

        @k.tool(id="send", effects=Unsafe(), caps=Caps(), timeout=5)
        def send(ctx: ToolContext, n: int) -> int:
            sent.append(n)
            return n

        k.launch()
        with ThreadPoolExecutor(16) as pool:
            outs = list(pool.map(lambda i: k.call("send", {"n": i}, call_id=f"c{i}"),
                                 range(1500)))
        assert Counter(type(o).__name__ for o in outs) == {"Completed": 1500}
        assert sorted(sent) == list(range(1500))


def test_acall_waits_for_a_sync_queryable_tool_that_overruns_its_timeout(
    kernel: Kernel,
) -> None:
    landed: list[str] = []
    lock = threading.Lock()

    def lookup(request_id: str) -> LookupAnswer:
        with lock:
            return Landed(request_id) if request_id in landed else NotLanded()

    @kernel.tool(id="q", effects=Queryable(lookup=lookup), caps=Caps(), timeout=0.2)
    def q(ctx: ToolContext, x: int) -> str:
        time.sleep(0.8)  # a slow provider: the request is in flight past the deadline
        with lock:
            assert ctx.request_id is not None
            landed.append(ctx.request_id)
        return "ok"

    async def main() -> Any:
        return await kernel.acall("q", {"x": 1}, call_id="c1")

    out = asyncio.run(main())
    # A thread cannot be preempted: acall waited, so the outcome is known, nothing to retry.
    assert isinstance(out, Completed)
    kernel.recover()
    assert len(landed) == 1


def test_recorded_arguments_that_no_longer_validate_become_indeterminate(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    calls: list[str] = []
    # A new deployment whose tool changed its signature: the recorded arguments do not fit.
    from poimen._core.intents import Owner
    from tests.integration.test_call_path import _orphan

    with Kernel(url, notifiers=[]) as k:
        @k.tool(id="pay", effects=Idempotent(key=KeyDerivation.fields("order")), caps=Caps(),
                timeout=5)
        def pay2(ctx: ToolContext, order: str, amount: str, currency: str) -> str:
            calls.append(order)
            return "ok"

        key = KeyDerivation.fields("order").derive("pay", {"order": "o2"})
        dead = Owner("w-dead", "another-host", 1, "1")
        iid = _orphan(k, "pay", {"order": "o2", "amount": 5}, "c2", key=key, request_id=None,
                      dead=dead)
        _expire_lease(k, iid)
        for _ in range(3):
            k.recover()
        it = k.store.get_intent(iid)
        assert it is not None
        assert (it.state, it.reason) == (S.INDETERMINATE, "arguments_no_longer_valid")
        assert it.attempts == 2  # one claim for the retry that could not run, no more
    assert calls == []


def test_a_landed_answer_that_does_not_encode_still_completes(kernel: Kernel) -> None:
    @kernel.tool(id="q", effects=Queryable(lookup=lambda rid: Landed(b"raw provider body")),
                 caps=Caps(), timeout=5)
    def q(ctx: ToolContext, x: int) -> str:
        raise TimeoutError("read timed out")  # the outcome is unknown; the lookup decides

    out = kernel.call("q", {"x": 1}, call_id="c1")
    assert out == Completed(out.intent_id, None)
    it = kernel.store.get_intent(out.intent_id)
    assert it is not None and it.state == S.COMPLETED and it.result is None


def _expire_lease(k: Kernel, intent_id: str) -> None:
    """The owner on another host stopped renewing: its lease is over."""
    import sqlite3

    from poimen.store.sqlite import SqliteStore

    assert isinstance(k.store, SqliteStore)
    with sqlite3.connect(k.store.path) as conn:
        conn.execute("UPDATE intents SET lease_expires_at = 0 WHERE id = ?", (intent_id,))


def test_two_threads_taking_over_one_intent_run_it_once(kernel: Kernel) -> None:
    """Two threads of one kernel find the same orphan claimable at once. Only one may hold
    it: otherwise the loser (whose seize fails) releases the winner's hold while the tool
    still runs, and the kernel's next pass takes the running call again."""
    import dataclasses
    import queue

    from poimen import Pending
    from poimen._core.intents import Owner
    from poimen._engine.steps import Holds

    runs: list[str] = []  # the application's own record of its effects
    started, release = threading.Event(), threading.Event()

    @kernel.tool(id="slow", effects=Idempotent(key=KeyDerivation.fields("order")), caps=Caps(),
                 timeout=300)
    def slow(ctx: ToolContext, order: str) -> str:
        runs.append(order)
        if len(runs) == 1:
            started.set()
            assert release.wait(300)
        return "charged"

    # A call whose owner, on another host, stopped renewing its lease.
    _, d, _ = engine_of(kernel).prepare("slow", {"order": "o1"}, "c1")
    gone = Owner("w-gone", "another-host", 4242, "1")
    kernel.store.record_dispatch(
        dataclasses.replace(d, owner=gone, lease_expires_at=d.now - 1)
    )
    both_judged = threading.Barrier(2, timeout=120)

    class RacingHolds(Holds):
        """Both threads judged the intent claimable before either takes its hold."""

        __slots__ = ("racers",)

        def __init__(self) -> None:
            super().__init__()
            self.racers = 2

        def take(self, intent_id: str) -> bool:
            with self._lock:
                racing, self.racers = self.racers > 0, self.racers - 1
            if racing:
                both_judged.wait()
            return super().take(intent_id)

    kernel._engine.holds = RacingHolds()
    answers: queue.Queue[Any] = queue.Queue()
    threads = [
        threading.Thread(target=lambda: answers.put(kernel.wait_sync("c1", timeout=0)))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    try:
        assert started.wait(120), "neither thread ran the tool"
        assert isinstance(answers.get(timeout=120), Pending)  # the one that did not run it
        _recover_now(kernel)  # the kernel's next pass, while the tool still runs
    finally:
        release.set()
        for t in threads:
            t.join(timeout=120)
    assert runs == ["o1"]
    assert isinstance(answers.get(timeout=120), Completed)
    # The gone owner's attempt and the takeover's: no third.
    assert kernel.store.get_by_call_id("c1").attempts == 2  # type: ignore[union-attr]
