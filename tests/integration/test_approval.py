"""Approval before acting: a call recorded AWAITING_APPROVAL is never dispatched until an
operator approves it, then exactly once by its class; rejected or expired, nothing is sent.
Effects are counted by the witness provider; crashes are real SIGKILLs of child processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from poimen import (
    CallbackNotifier,
    Caps,
    Completed,
    Failed,
    Indeterminate,
    IntentState,
    Kernel,
    Notification,
    Pending,
    ToolContext,
    Unsafe,
)
from poimen.errors import (
    ApprovalExpiredError,
    ArgumentError,
    CallIdMismatchError,
    NotAwaitingApprovalError,
    RegistrationError,
)
from poimen.store import open_store
from poimen.testing import ProviderClient, ProviderProcess, kill_at_pause
from tests.integration.approval_app import CHARGE, EMAIL, make_kernel
from tests.integration.test_lifecycle import intent_of

S = IntentState
ROOT = str(Path(__file__).resolve().parents[2])


def child(store_url: str, provider: str, *args: str, pause_at: str | None = None,
          pause_file: Path | None = None) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "src")]))
    if pause_at:
        env.update(POIMEN_PAUSE_AT=pause_at, POIMEN_PAUSE_FILE=str(pause_file))
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.approval_app", *args, "--db", store_url,
         "--provider", provider],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )


def finished(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    got: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return got


def sent(ledger: ProviderClient, call_id: str) -> int:
    return sum(1 for e in ledger.entries(kind="plain") if e["body"].get("call_id") == call_id)


def test_a_call_waits_for_approval_and_then_runs_exactly_once(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    seen: list[Notification] = []
    k = make_kernel(store_url, provider.url)
    k.notifiers.append(CallbackNotifier(seen.append))
    try:
        out = k.call(EMAIL, {"to": "bob"}, call_id="c1")
        assert out == Pending(out.intent_id, "awaiting_approval")
        assert "approval" in out.for_model() and not out.terminal
        assert intent_of(k, "c1").state == S.AWAITING_APPROVAL and sent(ledger, "c1") == 0
        k.deliver_notifications()
        assert [n.kind for n in seen] == ["approval_requested"]
        # Calling again with the call id, or a recovery pass, sends nothing while it waits.
        assert k.call(EMAIL, {"to": "bob"}, call_id="c1") == out
        k.recover()
        assert sent(ledger, "c1") == 0
        k.approve(out.intent_id, operator="ann", reason="customer asked")
        done = k.wait_sync("c1", timeout=30)
        assert isinstance(done, Completed) and sent(ledger, "c1") == 1
        k.recover()
        assert k.call(EMAIL, {"to": "bob"}, call_id="c1") == done and sent(ledger, "c1") == 1
        kinds = [(e.kind, e.actor) for e in k.store.events(out.intent_id)]
        assert ("approved", "ann") in kinds and kinds[0][0] == "awaiting_approval"
    finally:
        k.close()


def test_rejected_or_expired_calls_fail_and_send_nothing(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    k = make_kernel(store_url, provider.url)
    try:
        out = k.call(EMAIL, {"to": "bob"}, call_id="c1")
        k.reject(out.intent_id, operator="ann", reason="not this customer")
        failed = k.wait_sync("c1", timeout=5)
        assert isinstance(failed, Failed) and failed.error.startswith("rejected by ann")
        assert failed.retryable and sent(ledger, "c1") == 0
        # The model is told it was rejected, not invited to ask again on its own.
        assert failed.rejected and "rejected" in failed.for_model()
        assert "Do not call it again" in failed.for_model()
        assert k.call(EMAIL, {"to": "bob"}, call_id="c1").for_model() == failed.for_model()
        with pytest.raises(NotAwaitingApprovalError):
            k.approve(out.intent_id, operator="bob", reason="too late")
    finally:
        k.close()
    with Kernel(store_url, notifiers=[]) as k2:
        @k2.tool(id="t", effects=__import__("poimen").Unsafe(), caps=__import__("poimen").Caps(),
                 timeout=1, requires_approval=True, approval_ttl=0.05)
        def t(ctx: Any) -> str:
            return "ran"

        out = k2.call("t", {}, call_id="c2")
        assert isinstance(out, Pending)
        while k2.store.now() < intent_of(k2, "c2").created_at + 0.05:
            pass  # the approval window, by the log's own clock
        assert k2.recover().expired == 1
        it = intent_of(k2, "c2")
        assert (it.state, it.reason) == (S.FAILED, "approval_expired")


def test_a_predicate_on_the_arguments_decides_which_calls_wait(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    k = make_kernel(store_url, provider.url)
    try:
        assert isinstance(k.call(CHARGE, {"order": "o1", "cents": 500}, call_id="small"),
                          Completed)
        big = k.call(CHARGE, {"order": "o2", "cents": 5000}, call_id="big")
        assert isinstance(big, Pending) and ledger.count(kind="keyed") == 1
    finally:
        k.close()


def test_of_two_operators_deciding_at_once_exactly_one_wins(
    store_url: str, provider: ProviderProcess
) -> None:
    k = make_kernel(store_url, provider.url)
    try:
        out = k.call(EMAIL, {"to": "bob"}, call_id="c1")
        barrier = threading.Barrier(2)
        results: list[str] = []

        def decide(approve: bool) -> None:
            barrier.wait()
            try:
                (k.approve if approve else k.reject)(out.intent_id, operator="op", reason="r")
                results.append("won")
            except NotAwaitingApprovalError:
                results.append("refused")

        threads = [threading.Thread(target=decide, args=(a,)) for a in (True, False)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == ["refused", "won"]
        decided = [e for e in k.store.events(out.intent_id) if e.kind in ("approved", "rejected")]
        assert len(decided) == 1
    finally:
        k.close()


def test_two_approvals_queued_on_a_held_row_have_one_winner(
    postgres_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    """PostgreSQL reads take no lock: both deciders see AWAITING_APPROVAL while the row is held
    elsewhere, then queue to write it. The second to write must still lose."""
    import psycopg

    k = make_kernel(postgres_url, provider.url)
    try:
        iid = k.call(EMAIL, {"to": "bob"}, call_id="c1").intent_id
    finally:
        k.close()
    stores = [open_store(postgres_url) for _ in range(2)]
    results: list[str] = []

    def approve(store: Any, operator: str) -> None:
        try:
            store.decide_approval(iid, approve=True, operator=operator, reason="r",
                                  now=store.now())
            results.append("won")
        except NotAwaitingApprovalError:
            results.append("refused")

    queued = (
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    threads = [threading.Thread(target=approve, args=(s, f"op-{i}")) for i, s in enumerate(stores)]
    with psycopg.connect(postgres_url) as holder, psycopg.connect(
        postgres_url, autocommit=True
    ) as watch:
        holder.execute("SELECT 1 FROM intents WHERE id = %s FOR UPDATE", (iid,))
        for t in threads:
            t.start()
        give_up = time.monotonic() + 120
        while watch.execute(queued).fetchone() != (2,):
            assert time.monotonic() < give_up, "the two approvals never queued on the row"
            time.sleep(0.01)
        holder.commit()
    for t in threads:
        t.join(timeout=120)
    try:
        assert sorted(results) == ["refused", "won"]
        events = stores[0].events(iid)
        assert [e.kind for e in events].count("approved") == 1
        assert stores[0].get_intent(iid).fence == 2  # type: ignore[union-attr]
    finally:
        for s in stores:
            s.close()
    # The approved call runs once, as the provider sees it.
    k = make_kernel(postgres_url, provider.url)
    try:
        k.recover()
        assert isinstance(k.wait_sync("c1", timeout=60), Completed)
        assert sent(ledger, "c1") == 1
    finally:
        k.close()


def test_bad_approval_settings_are_refused(tmp_path: Path) -> None:
    from poimen import Caps, Unsafe

    with Kernel(f"sqlite:///{tmp_path / 'log.db'}", notifiers=[]) as k:
        for kw in ({"requires_approval": "yes"}, {"approval_ttl": 5},
                   {"requires_approval": True, "approval_ttl": -1}):
            with pytest.raises(RegistrationError):
                k.tool(id=f"t{len(kw)}{kw!s}", effects=Unsafe(), caps=Caps(), timeout=1, **kw)(
                    lambda ctx: None
                )

        @k.tool(id="boom", effects=Unsafe(), caps=Caps(), timeout=1,
                requires_approval=lambda a: a["missing"])
        def boom(ctx: Any) -> None:
            return None

        with pytest.raises(ArgumentError, match="approval rule raised KeyError"):
            k.call("boom", {}, call_id="c1")
        assert k.store.get_by_call_id("c1") is None


# Crashes at every point of the approval path.


def test_a_kill_right_after_the_request_leaves_it_awaiting_and_notified_later(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    pause = tmp_path / "pause"
    p = child(store_url, provider.url, "call", "--tool", EMAIL, "--args", '{"to": "bob"}',
              pause_at="before_notify", pause_file=pause)
    assert kill_at_pause(p, pause) == "before_notify"
    seen: list[Notification] = []
    k = make_kernel(store_url, provider.url)
    k.notifiers.append(CallbackNotifier(seen.append))
    try:
        it = intent_of(k, "c1")
        assert it.state == S.AWAITING_APPROVAL and sent(ledger, "c1") == 0
        k.deliver_notifications()
        assert [n.kind for n in seen] == ["approval_requested"]  # the outbox row survived
        k.approve(it.id, operator="ann", reason="ok")
    finally:
        k.close()
    assert finished(child(store_url, provider.url, "resume"))["type"] == "Completed"
    assert sent(ledger, "c1") == 1


@pytest.mark.parametrize("point", ["mid_call", "after_effect"])
@pytest.mark.parametrize("tool", [EMAIL, CHARGE])
def test_a_kill_while_an_approved_call_runs_recovers_it_by_its_class(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient,
    point: str, tool: str,
) -> None:
    args = {"to": "bob"} if tool == EMAIL else {"order": "o1", "cents": 5000}
    assert finished(child(store_url, provider.url, "call", "--tool", tool,
                          "--args", json.dumps(args)))["type"] == "Pending"
    with make_kernel(store_url, provider.url) as k:
        k.approve(intent_of(k, "c1").id, operator="ann", reason="ok")
    pause = tmp_path / "pause"
    p = child(store_url, provider.url, "resume", pause_at=point, pause_file=pause)
    assert kill_at_pause(p, pause) == point
    landed = sent(ledger, "c1") if tool == EMAIL else ledger.count(kind="keyed")
    assert landed == (1 if point == "after_effect" else 0)
    with make_kernel(store_url, provider.url) as k:
        k.recover()
        it = intent_of(k, "c1")
    if tool == EMAIL:  # never re-issued: an operator decides
        assert (it.state, it.reason) == (S.INDETERMINATE, "unsafe_unknown_outcome")
        assert sent(ledger, "c1") == landed
    else:  # re-issued under its key: one effect
        assert it.state == S.COMPLETED and ledger.count(kind="keyed") == 1


def test_an_approved_call_nobody_resumes_is_run_once_by_any_kernels_recovery(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    assert finished(child(store_url, provider.url, "call"))["type"] == "Pending"
    with make_kernel(store_url, provider.url) as k:
        k.approve(intent_of(k, "c1").id, operator="ann", reason="ok")
    racers = [child(store_url, provider.url, "recover") for _ in range(3)]
    assert sum(finished(p)["completed"] for p in racers) == 1
    assert sent(ledger, "c1") == 1
    with make_kernel(store_url, provider.url) as k:
        assert isinstance(k.outcome("c1"), Completed)
        assert not isinstance(k.outcome("c1"), Indeterminate)


# The approval window (`approval_ttl`): a decision, a waiting caller and a repeated call all
# apply it, whether or not a recovery pass has run since it ended.

WINDOW = 0.3
LATE = "ap.late"


def windowed_kernel(store_url: str, provider: str) -> Kernel:
    k = Kernel(store_url, notifiers=[])
    client = httpx.Client(base_url=provider, timeout=5)
    k.on_close(client.close)

    @k.tool(id=LATE, effects=Unsafe(), caps=Caps(), timeout=5, requires_approval=True,
            approval_ttl=WINDOW)
    def late(ctx: ToolContext, to: str) -> Any:
        return client.post("/plain", json={"to": to, "call_id": ctx.call_id}).json()

    return k


def past_window(k: Kernel, call_id: str) -> None:
    """Until the log's own clock is past the call's approval window."""
    ends = intent_of(k, call_id).next_check_at
    assert ends is not None
    give_up = time.monotonic() + 60
    while k.store.now() <= ends:
        assert time.monotonic() < give_up, "the log's clock never passed the window"
        time.sleep(0.02)


def expired(k: Kernel, call_id: str) -> None:
    it = intent_of(k, call_id)
    assert (it.state, it.reason) == (S.FAILED, "approval_expired"), it
    assert [e.kind for e in k.store.events(it.id)][-1] == "approval_expired"


def test_an_approval_after_its_window_is_refused_and_sends_nothing(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    with windowed_kernel(store_url, provider.url) as k:
        out = k.call(LATE, {"to": "bob"}, call_id="c1")
        assert isinstance(out, Pending)
        past_window(k, "c1")
        refused: Exception | None = None
        try:  # no recovery pass has expired it: the decision itself must see the window
            k.approve(out.intent_id, operator="ann", reason="late")
        except NotAwaitingApprovalError as exc:
            refused = exc
        done = k.wait_sync("c1", timeout=30)
        k.recover()
        assert sent(ledger, "c1") == 0
        assert isinstance(done, Failed) and done.error == "no operator approved it in time"
        assert isinstance(refused, ApprovalExpiredError) and refused.state == "FAILED"
        expired(k, "c1")
        assert "approved" not in [e.kind for e in k.store.events(out.intent_id)]


def test_poimen_approve_after_the_window_is_refused_and_sends_nothing(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    from tests.integration.operator_app import poimen

    with windowed_kernel(store_url, provider.url) as k:
        out = k.call(LATE, {"to": "bob"}, call_id="c1")
        past_window(k, "c1")
    r = poimen("approve", "c1", "--operator", "ann", "--reason", "late", db=store_url)
    assert r.returncode == 1 and "approval window" in r.stderr, r.stderr
    with windowed_kernel(store_url, provider.url) as k:
        assert isinstance(k.wait_sync("c1", timeout=30), Failed)
        k.recover()
        expired(k, "c1")
        assert k.store.get_intent(out.intent_id).fence == 2  # type: ignore[union-attr]
    assert sent(ledger, "c1") == 0


def test_the_store_refuses_an_approval_after_the_window_whoever_calls_it(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    with windowed_kernel(store_url, provider.url) as k:
        out = k.call(LATE, {"to": "bob"}, call_id="c1")
        ends = intent_of(k, "c1").next_check_at
        assert ends is not None
        # Straight to the store, with a clock just past the window: no caller checks it.
        with pytest.raises(ApprovalExpiredError):
            k.store.decide_approval(out.intent_id, approve=True, operator="ann", reason="r",
                                    now=ends + 0.001)
        expired(k, "c1")
        with pytest.raises(ApprovalExpiredError):  # and a reject says why, too
            k.store.decide_approval(out.intent_id, approve=False, operator="ann", reason="r",
                                    now=ends + 0.002)
        # Just inside the window, the same store approves.
        inside = k.call(LATE, {"to": "bob"}, call_id="c2")
        ends = intent_of(k, "c2").next_check_at
        assert ends is not None
        done = k.store.decide_approval(inside.intent_id, approve=True, operator="ann",
                                       reason="r", now=ends - 0.001)
        assert done.state == S.DISPATCHED
        assert isinstance(k.wait_sync("c2", timeout=30), Completed)
    assert sent(ledger, "c1") == 0 and sent(ledger, "c2") == 1


def test_a_waiting_caller_and_a_repeated_call_see_the_window_end(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    with windowed_kernel(store_url, provider.url) as k:
        for call_id in ("waited", "repeated"):
            assert isinstance(k.call(LATE, {"to": call_id}, call_id=call_id), Pending)
        past_window(k, "repeated")
        # No recovery pass, no upkeep: the caller itself finds the window over.
        waited = k.wait_sync("waited", timeout=10)
        assert isinstance(waited, Failed) and waited.error == "no operator approved it in time"
        again = k.call(LATE, {"to": "repeated"}, call_id="repeated")
        assert isinstance(again, Failed) and again.error == "no operator approved it in time"
        for call_id in ("waited", "repeated"):
            expired(k, call_id)
            with pytest.raises(ApprovalExpiredError):
                k.approve(intent_of(k, call_id).id, operator="ann", reason="too late")
        assert k.recover().expired == 0
    assert sent(ledger, "waited") == 0 and sent(ledger, "repeated") == 0


def test_an_approval_and_the_expiry_racing_have_one_winner(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    with windowed_kernel(store_url, provider.url) as k:
        results: dict[str, str] = {}
        for n in range(5):
            call_id = f"race-{n}"
            iid = k.call(LATE, {"to": call_id}, call_id=call_id).intent_id
            ends = intent_of(k, call_id).next_check_at
            assert ends is not None
            gate = threading.Barrier(2)

            def approve(iid: str = iid, ends: float = ends, gate: Any = gate) -> None:
                gate.wait()
                try:  # decided just inside the window, committed who knows when
                    k.store.decide_approval(iid, approve=True, operator="ann", reason="r",
                                            now=ends - 0.001)
                    results[iid] = "approved"
                except NotAwaitingApprovalError:
                    pass

            def expire(ends: float = ends, gate: Any = gate) -> None:
                gate.wait()
                k.store.expire_approvals(ends + 0.001)

            threads = [threading.Thread(target=approve), threading.Thread(target=expire)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            it = intent_of(k, call_id)
            kinds = [e.kind for e in k.store.events(iid)]
            if results.get(iid) == "approved":
                assert it.state == S.DISPATCHED and "approval_expired" not in kinds
                assert isinstance(k.wait_sync(call_id, timeout=30), Completed)
                assert sent(ledger, call_id) == 1
            else:
                assert (it.state, it.reason) == (S.FAILED, "approval_expired")
                assert "approved" not in kinds
                assert isinstance(k.wait_sync(call_id, timeout=30), Failed)
                assert sent(ledger, call_id) == 0
            assert it.fence == 2


def test_a_call_id_awaiting_approval_names_that_call_only(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    k = make_kernel(store_url, provider.url)
    try:
        first = k.call(EMAIL, {"to": "bob"}, call_id="c1")
        big = k.call(CHARGE, {"order": "o1", "cents": 5000}, call_id="c2")
        assert isinstance(first, Pending) and isinstance(big, Pending)
        # Other arguments (which would wait too), another tool, arguments that would not wait:
        # never "awaiting approval" for arguments nobody is asked about.
        for tool, args, call_id in (
            (EMAIL, {"to": "eve"}, "c1"),
            (CHARGE, {"order": "o1", "cents": 5000}, "c1"),
            (CHARGE, {"order": "o1", "cents": 9000}, "c2"),
            (CHARGE, {"order": "o1", "cents": 5}, "c2"),
        ):
            with pytest.raises(CallIdMismatchError):
                k.call(tool, args, call_id=call_id)
        for out in (first, big):
            it = k.store.get_intent(out.intent_id)
            assert it is not None and (it.state, it.fence) == (S.AWAITING_APPROVAL, 1)
        # Approved, each runs once, with the arguments the operator was asked about.
        k.approve(first.intent_id, operator="ann", reason="ok")
        k.approve(big.intent_id, operator="ann", reason="ok")
        assert isinstance(k.wait_sync("c1", timeout=30), Completed)
        assert isinstance(k.wait_sync("c2", timeout=30), Completed)
    finally:
        k.close()
    assert [e["body"]["to"] for e in ledger.entries(kind="plain")] == ["bob"]
    assert [e["body"]["cents"] for e in ledger.entries(kind="keyed")] == [5000]
