"""An identical call in a scope is never a second dispatch while the first is unsettled
(docs/design.md section 4): it gets the first call's outcome, whatever its call id, and its
call id answers with that call from then on. Effects are counted by the witness provider;
the race is run by real processes on both backends."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from poimen import (
    Caps,
    Completed,
    Indeterminate,
    Kernel,
    Pending,
    Resolved,
    ToolContext,
    Unsafe,
    call_ids,
)
from poimen._core.intents import Owner
from poimen.errors import ArgumentError
from poimen.testing import ProviderClient, ProviderProcess

ROOT = Path(__file__).resolve().parents[2]
LOST, SEND, REPEAT, GATED = "mail.lost", "mail.send", "mail.repeat", "mail.gated"
BOB = {"to": "bob"}


def make_kernel(store_url: str, provider: str) -> Kernel:
    k = Kernel(store_url, notifiers=[], wait_bound=0.2)
    client = httpx.Client(base_url=provider, timeout=5)
    k.on_close(client.close)

    def post(ctx: ToolContext, to: str) -> Any:
        return client.post("/plain", json={"to": to, "call_id": ctx.call_id}).json()

    @k.tool(id=LOST, effects=Unsafe(), caps=Caps(), timeout=5)
    def lost(ctx: ToolContext, to: str) -> Any:
        """Sends, then the connection breaks before the answer."""
        post(ctx, to)
        raise ConnectionResetError("the connection broke after the request was sent")

    @k.tool(id=SEND, effects=Unsafe(), caps=Caps(), timeout=5)
    def send(ctx: ToolContext, to: str) -> Any:
        return post(ctx, to)

    @k.tool(id=REPEAT, effects=Unsafe(), caps=Caps(), timeout=5, coalesce=False)
    def repeat(ctx: ToolContext, to: str) -> Any:
        post(ctx, to)
        raise ConnectionResetError("the connection broke after the request was sent")

    @k.tool(id=GATED, effects=Unsafe(), caps=Caps(), timeout=5, requires_approval=True)
    def gated(ctx: ToolContext, to: str) -> Any:
        return post(ctx, to)

    return k


@pytest.fixture
def kernel(store_url: str, provider: ProviderProcess) -> Iterator[Kernel]:
    k = make_kernel(store_url, provider.url)
    try:
        yield k
    finally:
        k.close()


def sent(ledger: ProviderClient) -> int:
    return ledger.count(kind="plain")


def test_an_identical_call_while_the_first_is_indeterminate_gets_its_outcome(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    first = kernel.call(LOST, BOB, call_id="thread-1/call_a", scope="thread-1")
    assert isinstance(first, Indeterminate) and sent(ledger) == 1
    # The model asked again, under a new tool-call id: the same call, not a second send.
    again = kernel.call(LOST, BOB, call_id="thread-1/call_b", scope="thread-1")
    assert again == first and sent(ledger) == 1
    assert kernel.outcome("thread-1/call_b") == first
    # Settled: the alias answers with the decision, and is never dispatched.
    kernel.resolve(first.intent_id, landed=True, result={"id": 7}, operator="ann",
                   reason="in the sent folder")
    decided = kernel.call(LOST, BOB, call_id="thread-1/call_b", scope="thread-1")
    assert decided == Resolved(first.intent_id, True, {"id": 7}) and sent(ledger) == 1
    assert kernel.outcome("thread-1/call_b") == decided
    # Once the first is settled, an identical call is a new call, as before.
    later = kernel.call(LOST, BOB, call_id="thread-1/call_c", scope="thread-1")
    assert later.intent_id != first.intent_id and sent(ledger) == 2
    events = [e.kind for e in kernel.store.events(first.intent_id)]
    assert events.count("coalesced") == 1


def test_other_scopes_other_arguments_and_calls_without_a_scope_are_new_calls(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    first = kernel.call(LOST, BOB, call_id="a/1", scope="a")
    assert kernel.call(LOST, BOB, call_id="b/1", scope="b").intent_id != first.intent_id
    assert kernel.call(LOST, {"to": "eve"}, call_id="a/2", scope="a").intent_id != first.intent_id
    assert kernel.call(LOST, BOB, call_id="plain-1").intent_id != first.intent_id
    assert sent(ledger) == 4


def test_a_rule_2_call_id_carries_its_scope(kernel: Kernel, ledger: ProviderClient) -> None:
    ids = call_ids.CallIds("conv-1")
    first = kernel.call(LOST, BOB, call_id=ids.next(LOST, BOB))
    second = kernel.call(LOST, BOB, call_id=ids.next(LOST, BOB))  # occurrence 2
    assert second == first and sent(ledger) == 1
    assert call_ids.scope_of(call_ids.derived("conv/x", LOST, BOB, 3), LOST, BOB) == "conv/x"
    assert call_ids.scope_of(call_ids.derived("conv", LOST, BOB, 3), LOST, {"to": "x"}) is None
    assert call_ids.scope_of("conv/thread-1/call_a", LOST, BOB) is None


def test_a_tool_registered_with_coalesce_false_repeats(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    first = kernel.call(REPEAT, BOB, call_id="r/1", scope="r")
    second = kernel.call(REPEAT, BOB, call_id="r/2", scope="r")
    assert first.intent_id != second.intent_id and sent(ledger) == 2


def test_a_pending_or_indeterminate_answer_is_not_counted_as_a_result() -> None:
    ids = call_ids.CallIds("conv-1")
    one = ids.next(SEND, BOB)
    ids.answered(one, Pending("in_1", "in_flight"))
    assert ids.next(SEND, BOB) == one  # asked again: the same call
    ids.answered(one, Indeterminate("in_1", "unsafe_unknown_outcome"))
    assert ids.next(SEND, BOB) == one
    ids.answered(one, Completed("in_1", {}))
    assert ids.next(SEND, BOB) == call_ids.derived("conv-1", SEND, BOB, 2)


def test_an_identical_call_awaiting_approval_is_the_same_call(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    first = kernel.call(GATED, BOB, call_id="g/1", scope="g")
    assert first == Pending(first.intent_id, "awaiting_approval")
    assert kernel.call(GATED, BOB, call_id="g/2", scope="g") == first
    kernel.approve(first.intent_id, operator="ann", reason="fine")
    done = kernel.wait_sync("g/2", timeout=30)
    assert isinstance(done, Completed) and done.intent_id == first.intent_id
    assert kernel.wait_sync("g/1", timeout=30) == done and sent(ledger) == 1


def test_a_bad_scope_is_refused_before_anything_is_recorded(kernel: Kernel) -> None:
    with pytest.raises(ArgumentError, match="scope"):
        kernel.call(SEND, BOB, call_id="x/1", scope="")
    assert kernel.outcome("x/1") is None


def child(store_url: str, provider: str, release: Path, call_id: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]))
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.unsettled_app", "--db", store_url,
         "--provider", provider, "--release", str(release), "--call-id", call_id,
         "--scope", "race"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )


@pytest.mark.timeout(300)
def test_processes_racing_with_one_call_under_many_call_ids_send_once(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient, tmp_path: Path
) -> None:
    # Whichever process records the call first holds it unsettled (its tool waits for the
    # release file); every other one, whenever it comes, must find it and not send.
    release = tmp_path / "release"
    procs = [child(store_url, provider.url, release, f"race/call_{n}") for n in range(4)]
    answers: list[dict[str, Any]] = []
    waiting = list(procs)
    end = time.monotonic() + 240
    while len(answers) < 3 and time.monotonic() < end:
        for p in list(waiting):
            if p.poll() is not None:
                out, err = p.communicate()
                assert p.returncode == 0, err
                answers.append(json.loads(out.strip().splitlines()[-1]))
                waiting.remove(p)
        time.sleep(0.05)
    assert len(answers) == 3 and len(waiting) == 1
    assert sent(ledger) == 1
    assert {a["type"] for a in answers} == {"Pending"}
    assert len({a["intent_id"] for a in answers}) == 1
    release.touch()
    out, err = waiting[0].communicate(timeout=120)
    assert waiting[0].returncode == 0, err
    last = json.loads(out.strip().splitlines()[-1])
    assert last["type"] == "Completed" and last["intent_id"] == answers[0]["intent_id"]
    assert sent(ledger) == 1


def test_threads_racing_with_one_call_under_many_call_ids_send_once(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    # Released together, each thread's first commit races the others' (on PostgreSQL, each
    # in a transaction of its own): one records the call, every other one finds it. Each
    # round is one call (its own arguments); the rounds make a lost race likely to show.
    import threading

    k = make_kernel(store_url, provider.url)
    rounds, width = 12, 8
    got: dict[tuple[int, int], Any] = {}

    def one(r: int, n: int, start: threading.Barrier) -> None:
        start.wait(timeout=60)
        try:
            got[r, n] = k.call(LOST, {"to": f"bob{r}"}, call_id=f"t/{r}/{n}", scope="t")
        except Exception as exc:  # reported below
            got[r, n] = exc

    try:
        for r in range(rounds):
            start = threading.Barrier(width)
            threads = [threading.Thread(target=one, args=(r, n, start)) for n in range(width)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
    finally:
        k.close()
    assert len(got) == rounds * width
    assert [v for v in got.values() if isinstance(v, Exception)] == []
    for r in range(rounds):
        assert len({got[r, n].intent_id for n in range(width)}) == 1
    assert sent(ledger) == rounds


# A call recovery settled: its caller never got the answer (it died, or was told Pending). The
# first identical call in the scope takes that answer instead of a second dispatch; only one.

SHIPMENT = {"order_id": "o-1", "address": "x"}


@pytest.fixture
def recovering(store_url: str, provider: ProviderProcess) -> Iterator[Kernel]:
    from poimen.testing import register_test_tools

    k = Kernel(store_url, notifiers=[], deadline_margin=0.0, wait_bound=0.2)
    register_test_tools(k, provider.url, timeout=1.0)
    try:
        yield k
    finally:
        k.close()


def recovered(k: Kernel, call_id: str, tool: str, args: dict[str, Any], state: str) -> str:
    """A call in scope `conv` whose process died before its request left, driven to `state`
    by recovery passes; nobody asks for it by call id. Its intent id."""
    from poimen._core.keys import args_digest, canonical
    from poimen._engine.liveness import default_host
    from poimen.store._base import NewDispatch
    from poimen.testing import SHIP

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    now = k.store.now()
    text = canonical(args)
    d = NewDispatch(
        intent_id=f"in_{call_id.replace('/', '_')}", call_id=call_id, tool_id=tool,
        effect="queryable" if tool == SHIP else "unsafe", args=text,
        args_hash=args_digest(text), key=None,
        request_id="rq_" + call_id.replace("/", "_") if tool == SHIP else None,
        owner=Owner("w-gone", default_host(), int(gone.stdout), "1"),
        lease_expires_at=now + 300, timeout_s=1.0, deadline_at=now - 1, now=now, scope="conv",
    )
    intent, created = k.store.record_dispatch(d)
    assert created
    end = time.monotonic() + 60
    while (it := k.store.get_intent(intent.id)) is None or it.state != state:
        assert time.monotonic() < end, it
        k.recover()
        time.sleep(0.05)
    return intent.id


def shipped_by_recovery(k: Kernel, call_id: str) -> str:
    from poimen.testing import SHIP

    return recovered(k, call_id, SHIP, SHIPMENT, "COMPLETED")


def test_an_identical_call_after_recovery_settled_the_first_takes_its_answer_once(
    recovering: Kernel, ledger: ProviderClient
) -> None:
    from poimen.testing import SHIP

    k = recovering
    first = shipped_by_recovery(k, "conv/call_a")
    assert ledger.count() == 1
    # The model asked again under a new id (a restart that re-prompted it): the answer.
    again = k.call(SHIP, SHIPMENT, call_id="conv/call_b", scope="conv")
    assert isinstance(again, Completed) and again.intent_id == first
    assert ledger.count() == 1
    coalesced = [e for e in k.store.events(first) if e.kind == "coalesced"]
    assert [json.loads(e.detail or "{}") for e in coalesced] == [
        {"call_id": "conv/call_b", "answer_taken": True}]
    # Taken once: an identical call later is a new one; its call ids still answer with it.
    later = k.call(SHIP, SHIPMENT, call_id="conv/call_c", scope="conv")
    assert isinstance(later, Completed) and later.intent_id != first
    assert ledger.count() == 2
    assert k.call(SHIP, SHIPMENT, call_id="conv/call_a", scope="conv") == again
    assert k.call(SHIP, SHIPMENT, call_id="conv/call_b", scope="conv") == again


@pytest.mark.parametrize("given", ["call", "outcome", "wait"])
def test_an_answer_given_by_call_id_is_given_once(
    given: str, recovering: Kernel, ledger: ProviderClient
) -> None:
    from poimen.testing import SHIP

    k = recovering
    first = shipped_by_recovery(k, "conv/call_a")
    # The caller resumes with its call id and gets the answer: a second shipment asked for
    # after that is a new call, never swallowed by the first's answer.
    match given:
        case "call":
            out = k.call(SHIP, SHIPMENT, call_id="conv/call_a", scope="conv")
        case "outcome":
            out = k.outcome("conv/call_a")
        case _:
            out = k.wait_sync("conv/call_a", timeout=0)
    assert isinstance(out, Completed) and out.intent_id == first
    later = k.call(SHIP, SHIPMENT, call_id="conv/call_b", scope="conv")
    assert isinstance(later, Completed) and later.intent_id != first
    assert ledger.count() == 2


def test_a_call_made_after_an_operator_decided_a_recovered_call_is_a_new_call(
    recovering: Kernel, ledger: ProviderClient
) -> None:
    from poimen.testing import EMAIL

    k = recovering
    mail = {"to": "bob@example.com", "subject": "hi"}
    first = recovered(k, "conv/call_a", EMAIL, mail, "INDETERMINATE")
    # Asked again while Indeterminate: the same call. Decided by an operator, the decision
    # is the application's to tell; a call it makes after that, knowingly, is a new call.
    assert k.call(EMAIL, mail, call_id="conv/call_b", scope="conv").intent_id == first
    k.resolve(first, landed=False, operator="ann", reason="not in the sent folder")
    later = k.call(EMAIL, mail, call_id="conv/call_c", scope="conv")
    assert isinstance(later, Completed) and later.intent_id != first
    assert ledger.count(kind="plain") == 1


# The lease-expiry edge: a live caller whose lease ran out (its renewal starved) is taken
# over by a recovery pass, whose seize marks the answer owed; the caller's own outcome
# commit still wins (same fence) and hands the model its answer. The answer is given: an
# identical call the model makes after that is a new call, not swallowed by the mark.

SLOW = "ship.slow"


def slow_kernel(store_url: str, provider: str, started: threading.Event,
                release: threading.Event, *, asynchronous: bool = False) -> Kernel:
    from poimen import Queryable
    from poimen.testing import provider_lookup

    k = Kernel(store_url, notifiers=[], lease_ttl=1.0, deadline_margin=0.0, wait_bound=0.2)
    client = httpx.Client(base_url=provider, timeout=5)
    k.on_close(client.close)
    register = k.tool(id=SLOW, effects=Queryable(lookup=provider_lookup(provider, client)),
                      caps=Caps(), timeout=5)

    def post(ctx: ToolContext, order_id: str) -> Any:
        assert ctx.request_id is not None
        return client.post("/requests", json={"order_id": order_id},
                           headers={"X-Request-Id": ctx.request_id}).json()

    if asynchronous:  # `acall` of an async tool takes the async flat path
        @register
        async def aslow(ctx: ToolContext, order_id: str) -> Any:
            started.set()
            # Blocks the loop: the caller paused as a whole (its timeout cannot fire either).
            assert release.wait(30)
            return post(ctx, order_id)
    else:
        @register
        def slow(ctx: ToolContext, order_id: str) -> Any:
            started.set()
            assert release.wait(30)
            return post(ctx, order_id)

    return k


# Both of Kernel.call's paths: the flat one and the generator protocol (docs/design.md §4).
@pytest.mark.parametrize("asynchronous", [False, True], ids=["call", "acall"])
@pytest.mark.parametrize("flat_path", [True, False], ids=["flat", "protocol"])
def test_a_caller_that_settled_its_call_after_a_recovery_seize_owes_no_answer(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient,
    monkeypatch: pytest.MonkeyPatch, flat_path: bool, asynchronous: bool,
) -> None:
    started, release = threading.Event(), threading.Event()
    monkeypatch.setattr(Kernel, "_renew", lambda self: None)  # renewals starved: a pause
    caller = slow_kernel(store_url, provider.url, started, release, asynchronous=asynchronous)
    caller._engine.flat = flat_path
    recoverer = slow_kernel(store_url, provider.url, threading.Event(), threading.Event(),
                            asynchronous=asynchronous)
    got: list[Any] = []
    order = {"order_id": "o-9"}

    def first_call() -> Any:
        if asynchronous:
            return asyncio.run(caller.acall(SLOW, order, call_id="conv/call_a", scope="conv"))
        return caller.call(SLOW, order, call_id="conv/call_a", scope="conv")

    t = threading.Thread(target=lambda: got.append(first_call()))
    try:
        t.start()
        assert started.wait(30)
        it = recoverer.store.get_by_call_id("conv/call_a")
        assert it is not None
        end = time.monotonic() + 30
        while (it.lease_expires_at or 0) > recoverer.store.now():
            assert time.monotonic() < end
            time.sleep(0.05)
            it = recoverer.store.get_intent(it.id) or it
        # The recovery pass takes it over: nothing has landed yet, so it defers.
        recoverer.recover()
        it = recoverer.store.get_intent(it.id) or it
        assert it.state == "DISPATCHED" and it.next_check_at is not None
        release.set()
        t.join(30)
        first = got[0]
        assert isinstance(first, Completed) and ledger.count() == 1
        # The model got its answer and asks for a second shipment, knowingly.
        later = caller.call(SLOW, order, call_id="conv/call_b", scope="conv")
        assert isinstance(later, Completed) and later.intent_id != first.intent_id
        assert ledger.count() == 2
    finally:
        release.set()
        t.join(30)
        recoverer.close()
        caller.close()


def test_the_audit_chain_holds_after_an_owed_answer_is_taken_from_a_settled_row(
    recovering: Kernel, ledger: ProviderClient
) -> None:
    # answer_owed is not hashed: clearing it on a settled, chained row breaks no link, and
    # the chain records the take (the alias's `coalesced` event).
    from poimen.operator._audit import verify
    from poimen.testing import SHIP

    k = recovering
    first = shipped_by_recovery(k, "conv/call_a")
    before = verify(k.store)
    assert before.ok, before.line()
    assert k.call(SHIP, SHIPMENT, call_id="conv/call_b", scope="conv").intent_id == first
    after = verify(k.store)
    assert after.ok, after.line()
    assert ledger.count() == 1


@pytest.mark.postgres
def test_an_owed_answer_taken_by_its_call_id_meanwhile_is_not_recorded_taken_twice(
    postgres_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    # PostgreSQL: an identical call reads the answer owed, and its take waits on the row
    # while the call id's own take (`Store.take_answer`, outside the triple's lock) commits.
    # The identical call is still answered (it asked before the answer was given), but the
    # chained `coalesced` event must not say it took the answer: its take changed nothing.
    import psycopg

    from poimen.testing import SHIP, register_test_tools

    k = Kernel(postgres_url, notifiers=[], deadline_margin=0.0, wait_bound=0.2)
    register_test_tools(k, provider.url, timeout=1.0)
    got: list[Any] = []
    try:
        first = shipped_by_recovery(k, "conv/call_a")
        with psycopg.connect(postgres_url) as taker, psycopg.connect(
            postgres_url, autocommit=True
        ) as watch:
            # The call id's take, in flight: the row is locked until it commits.
            taker.execute("UPDATE intents SET answer_owed = 0 WHERE id = %s", (first,))
            t = threading.Thread(target=lambda: got.append(
                k.call(SHIP, SHIPMENT, call_id="conv/call_b", scope="conv")))
            t.start()
            end = time.monotonic() + 30
            while not watch.execute(
                "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query LIKE 'UPDATE intents SET answer_owed%%'"
            ).fetchone():
                assert time.monotonic() < end and t.is_alive()
                time.sleep(0.02)
            taker.commit()
            t.join(30)
        assert isinstance(got[0], Completed) and got[0].intent_id == first
        assert ledger.count() == 1
        coalesced = [json.loads(e.detail or "{}") for e in k.store.events(first)
                     if e.kind == "coalesced"]
        assert coalesced == [{"call_id": "conv/call_b"}]
    finally:
        k.close()


def test_a_call_made_after_a_recovered_call_was_undone_is_a_new_call(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    # An undo is an operator's decision, as `resolve` is: it owes no answer. The shipment
    # recovery made is cancelled; the model asking for it again must ship, not be told the
    # cancelled shipment stands.
    from poimen import Idempotent, KeyDerivation, Queryable
    from poimen._core.keys import args_digest, canonical
    from poimen._engine.liveness import default_host
    from poimen.store._base import NewDispatch
    from poimen.testing import provider_lookup

    k = Kernel(store_url, notifiers=[], deadline_margin=0.0, wait_bound=0.2)
    client = httpx.Client(base_url=provider.url, timeout=5)
    k.on_close(client.close)
    cancelled: list[str] = []

    @k.tool(id="ship.u", effects=Queryable(lookup=provider_lookup(provider.url, client)),
            caps=Caps(), timeout=1, undo="ship.cancel",
            undo_args=lambda a, r: {"order_id": a["order_id"]})
    def ship(ctx: ToolContext, order_id: str) -> Any:
        assert ctx.request_id is not None
        return client.post("/requests", json={"order_id": order_id},
                           headers={"X-Request-Id": ctx.request_id}).json()

    @k.tool(id="ship.cancel", effects=Idempotent(key=KeyDerivation.all_args()), caps=Caps(),
            timeout=1)
    def cancel(ctx: ToolContext, order_id: str) -> None:
        cancelled.append(order_id)

    try:
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
        now = k.store.now()
        text = canonical({"order_id": "o-1"})
        d = NewDispatch(
            intent_id="in_undo_a", call_id="conv/call_a", tool_id="ship.u", effect="queryable",
            args=text, args_hash=args_digest(text), key=None, request_id="rq_undo_a",
            owner=Owner("w-gone", default_host(), int(gone.stdout), "1"),
            lease_expires_at=now + 300, timeout_s=1.0, deadline_at=now - 1, now=now,
            scope="conv",
        )
        assert k.store.record_dispatch(d)[1]
        end = time.monotonic() + 60
        while (it := k.store.get_intent("in_undo_a")) is None or it.state != "COMPLETED":
            assert time.monotonic() < end, it
            k.recover()
            time.sleep(0.05)
        assert ledger.count() == 1
        assert k.undo("conv/", operator="ann", reason="the user cancelled").complete
        assert cancelled == ["o-1"]
        later = k.call("ship.u", {"order_id": "o-1"}, call_id="conv/call_b", scope="conv")
        assert isinstance(later, Completed) and later.intent_id != "in_undo_a"
        assert ledger.count() == 2
    finally:
        k.close()
