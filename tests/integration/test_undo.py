"""`Kernel.undo`: a scope's landed calls reversed newest first, each exactly once, counted by
the witness provider's ledger; calls without an undo listed, Indeterminate calls waiting for
an operator, a failing undo stopping the sequence and saying where. Both backends."""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from poimen import Completed, Intent, IntentState, Kernel, UndoReport
from poimen._core.intents import Owner
from poimen._core.keys import args_digest
from poimen.call_ids import undo_of
from poimen.errors import ReservedCallIdError, UndoError, UnknownToolError
from poimen.store import NewDispatch
from poimen.testing import ProviderClient, ProviderProcess, kill_at_pause
from tests.integration.undo_app import (
    BOOK,
    CHARGE,
    EMAIL,
    NOTE,
    cancels,
    charges,
    emails,
    make_kernel,
    refunds,
    retractions,
    spawn,
)

S = IntentState


def statuses(report: UndoReport) -> list[tuple[str, str]]:
    return [(s.call_id, s.status) for s in report.steps]


def intent_of(k: Kernel, call_id: str) -> Intent:
    it = k.store.get_by_call_id(call_id)
    assert it is not None
    return it


def state_of(k: Kernel, call_id: str) -> S:
    return intent_of(k, call_id).state


def events_of(k: Kernel, call_id: str) -> list[Any]:
    return k.store.events(intent_of(k, call_id).id)


def make_run(k: Kernel, scope: str = "run-1/") -> None:
    """Oldest first: a charge, an email, a note (no undo), a refused charge (no effect)."""
    assert isinstance(k.call(CHARGE, {"order": "o1", "cents": 500}, call_id=f"{scope}1"),
                      Completed)
    assert isinstance(k.call(EMAIL, {"to": "bob"}, call_id=f"{scope}2"), Completed)
    assert isinstance(k.call(NOTE, {"text": "hi"}, call_id=f"{scope}3"), Completed)
    assert isinstance(k.call(CHARGE, {"order": "o4", "cents": 700}, call_id=f"{scope}4"),
                      Completed)


def test_a_scope_is_undone_newest_first_each_effect_exactly_once(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    with make_kernel(store_url, provider.url) as k:
        make_run(k)
        k.call(CHARGE, {"order": "other", "cents": 1}, call_id="run-2/1")  # another scope
        plan = k.undo("run-1/", dry_run=True)
        assert statuses(plan) == [("run-1/4", "to_undo"), ("run-1/3", "no_undo"),
                                  ("run-1/2", "to_undo"), ("run-1/1", "to_undo")]
        assert k.store.get_by_call_id("undo/run-1/4") is None  # a dry run changes nothing
        assert all(e.kind not in ("undo_requested", "undone") for e in events_of(k, "run-1/4"))

        report = k.undo("run-1/", operator="ann", reason="customer cancelled")
        assert statuses(report) == [("run-1/4", "undone"), ("run-1/3", "no_undo"),
                                    ("run-1/2", "undone"), ("run-1/1", "undone")]
        assert report.complete and report.stopped_at is None and not report.waiting
        assert [s.call_id for s in report.without_undo] == ["run-1/3"]
        assert [s.undo_call_id for s in report.undone] == [
            "undo/run-1/4", "undo/run-1/2", "undo/run-1/1"]
        # Newest first: the undo intents were made in that order.
        made = [k.store.get_by_call_id(f"undo/run-1/{n}") for n in (4, 2, 1)]
        assert [m.created_at for m in made if m] == sorted(m.created_at for m in made if m)
        assert (refunds(ledger, "o1"), refunds(ledger, "o4"), retractions(ledger, "bob")) == (
            1, 1, 1)
        assert refunds(ledger, "other") == 0

        # The history: who asked, and which intent undid it.
        ev = events_of(k, "run-1/1")
        asked = [e for e in ev if e.kind == "undo_requested"]
        undone = [e for e in ev if e.kind == "undone"]
        assert len(asked) == len(undone) == 1 and undone[0].actor == asked[0].actor == "ann"
        assert json.loads(asked[0].detail)["reason"] == "customer cancelled"
        assert json.loads(undone[0].detail)["undo_intent_id"] == report.steps[3].undo_intent_id
        assert state_of(k, "run-1/1") == S.COMPLETED  # its state stays

        # Again: everything is found undone, nothing is sent, no event doubles.
        again = k.undo("run-1/", operator="bob")
        assert [s.status for s in again.steps] == [
            "already_undone", "no_undo", "already_undone", "already_undone"]
        assert (refunds(ledger, "o1"), refunds(ledger, "o4"), retractions(ledger, "bob")) == (
            1, 1, 1)
        assert len([e for e in events_of(k, "run-1/1") if e.kind == "undone"]) == 1


def test_a_failing_undo_stops_the_sequence_and_says_where(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with make_kernel(store_url, provider.url) as k:
        make_run(k)
        monkeypatch.setenv("UNDO_APP_REFUSE", "retract")
        report = k.undo("run-1/", operator="ann")
        assert statuses(report) == [("run-1/4", "undone"), ("run-1/3", "no_undo"),
                                    ("run-1/2", "stopped"), ("run-1/1", "not_reached")]
        stop = report.stopped_at
        assert stop is not None and stop.call_id == "run-1/2" and not report.complete
        assert stop.undo_call_id == "undo/run-1/2" and "provider refused retract" in str(
            stop.reason)
        assert "STOPPED at run-1/2" in report.summary()
        assert refunds(ledger, "o1") == 0 and retractions(ledger, "bob") == 0

        # The cause fixed, undo again: a new undo (the failed one had no effect) and on.
        monkeypatch.delenv("UNDO_APP_REFUSE")
        again = k.undo("run-1/", operator="ann")
        assert again.complete and [s.status for s in again.steps] == [
            "already_undone", "no_undo", "undone", "undone"]
        assert again.steps[2].undo_call_id == undo_of("run-1/2", 2) == "undo#2/run-1/2"
        assert (refunds(ledger, "o1"), refunds(ledger, "o4"), retractions(ledger, "bob")) == (
            1, 1, 1)


def test_an_indeterminate_call_is_not_undone_blindly(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    """An Unsafe email killed after its effect is Indeterminate: its Unsafe undo waits for an
    operator; a booking in the same state is cancelled at once, its undo being Idempotent."""
    with make_kernel(store_url, provider.url) as k:
        k.call(CHARGE, {"order": "o1", "cents": 500}, call_id="run-1/1")
    for tool, args, cid in ((EMAIL, {"to": "bob"}, "run-1/2"), (BOOK, {"room": "7"}, "run-1/3")):
        pause = tmp_path / f"pause-{cid.replace('/', '_')}"
        p = spawn(store_url, provider.url, ["call", "--tool", tool, "--args", json.dumps(args),
                                            "--call-id", cid],
                  POIMEN_PAUSE_AT="after_effect", POIMEN_PAUSE_FILE=str(pause))
        assert kill_at_pause(p, pause) == "after_effect"
    with make_kernel(store_url, provider.url) as k:
        k.recover()
        assert state_of(k, "run-1/2") == S.INDETERMINATE
        report = k.undo("run-1/", operator="ann")
        assert statuses(report) == [("run-1/3", "undone"), ("run-1/2", "waiting"),
                                    ("run-1/1", "undone")]
        assert "not Idempotent" in str(report.waiting[0].reason) and not report.complete
        assert report.stopped_at is None
        assert (cancels(ledger, "7"), retractions(ledger, "bob"), refunds(ledger, "o1")) == (
            1, 0, 1)
        assert k.store.get_by_call_id("undo/run-1/2") is None

        k.resolve(intent_of(k, "run-1/2").id, landed=True, operator="ann",
                  reason="bob got the email")
        again = k.undo("run-1/", operator="ann")
        assert again.complete and [s.status for s in again.steps] == [
            "already_undone", "undone", "already_undone"]
        assert (cancels(ledger, "7"), retractions(ledger, "bob"), refunds(ledger, "o1")) == (
            1, 1, 1)
        assert emails(ledger, "bob") == 1


def test_a_call_still_in_flight_waits(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    pause = tmp_path / "pause"
    p = spawn(store_url, provider.url, ["call", "--tool", CHARGE, "--args",
                                        '{"order": "o9", "cents": 5}', "--call-id", "run-1/9"],
              POIMEN_PAUSE_AT="after_effect", POIMEN_PAUSE_FILE=str(pause))
    try:
        with make_kernel(store_url, provider.url) as k:
            while not pause.exists():  # the child holds its call, alive
                assert p.poll() is None, p.communicate()
                threading.Event().wait(0.01)
            report = k.undo("run-1/", operator="ann")
            assert statuses(report) == [("run-1/9", "waiting")]
            assert "in flight" in str(report.steps[0].reason) and refunds(ledger, "o9") == 0
    finally:
        kill_at_pause(p, pause)


def test_two_undos_at_once_reverse_each_effect_once(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    with make_kernel(store_url, provider.url) as k:
        make_run(k)
        barrier = threading.Barrier(2)
        reports: list[UndoReport] = []

        def run(who: str) -> None:
            barrier.wait()
            reports.append(k.undo("run-1/", operator=who))

        threads = [threading.Thread(target=run, args=(w,)) for w in ("ann", "bob")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(reports) == 2 and any(r.complete for r in reports)
        assert (refunds(ledger, "o1"), refunds(ledger, "o4"), retractions(ledger, "bob")) == (
            1, 1, 1)
        assert k.undo("run-1/", operator="cy").complete


def test_bad_requests_are_refused_before_anything_is_undone(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    with make_kernel(store_url, provider.url) as k:
        make_run(k)
        for scope in ("", "undo/run-1/", "undo#2/run-1/", 7):
            with pytest.raises(UndoError):
                k.undo(scope)  # type: ignore[arg-type]
        from poimen.operator._ops import OperatorInputError

        with pytest.raises(OperatorInputError):
            k.undo("run-1/", operator="  ")
    # A kernel that names an undo tool it never registered.
    k2 = Kernel(store_url, notifiers=[])
    try:
        from poimen import Caps, Unsafe

        @k2.tool(id=CHARGE, effects=Unsafe(), caps=Caps(), timeout=1, undo="u.missing")
        def charge(ctx: Any, order: str, cents: int) -> None:
            return None

        with pytest.raises(UnknownToolError, match=r"u\.missing"):
            k2.undo("run-1/", operator="ann")
    finally:
        k2.close()
    with make_kernel(store_url, provider.url) as k:
        assert k.store.get_by_call_id("undo/run-1/4") is None
        assert refunds(ledger, "o4") == 0 and charges(ledger, "o4") == 1


def test_an_undo_whose_arguments_cannot_be_derived_stops_and_sends_nothing(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    from poimen import Caps, Idempotent, KeyDerivation, Unsafe

    with Kernel(store_url, notifiers=[]) as k:
        sent: list[str] = []

        @k.tool(id="t.a", effects=Unsafe(), caps=Caps(), timeout=1, undo="t.undo",
                undo_args=lambda a, r: {"x": r["missing"]})
        def a(ctx: Any) -> dict[str, int]:
            return {}

        made: list[object] = []

        @k.tool(id="t.b", effects=Unsafe(), caps=Caps(), timeout=1, undo="t.undo",
                undo_args=lambda a, r: {"x": len(made.append(0) or made)})  # type: ignore[func-returns-value]
        def b(ctx: Any) -> dict[str, int]:
            return {}

        @k.tool(id="t.undo", effects=Idempotent(key=KeyDerivation.all_args()), caps=Caps(),
                timeout=1)
        def undo(ctx: Any, x: int) -> None:
            sent.append(ctx.call_id)

        k.call("t.a", {}, call_id="s/1")
        k.call("t.b", {}, call_id="s/2")
        report = k.undo("s/", operator="ann")
        assert statuses(report) == [("s/2", "stopped"), ("s/1", "not_reached")]
        assert "two sets of arguments" in str(report.steps[0].reason)
        assert sent == [] and k.store.get_by_call_id("undo/s/2") is None
        assert all(e.kind != "undo_requested" for e in events_of(k, "s/2"))

        report = k.undo("s/1", operator="ann")  # the older one as a scope of its own
        assert statuses(report) == [("s/1", "stopped")]
        assert "KeyError" in str(report.steps[0].reason) and sent == []

        @k.tool(id="t.c", effects=Unsafe(), caps=Caps(), timeout=1, undo="t.undo",
                undo_args=lambda a, r: {"y": 1})
        def c(ctx: Any) -> None:
            return None

        k.call("t.c", {}, call_id="s3/1")
        report = k.undo("s3/", operator="ann")  # arguments the undo tool does not take
        assert statuses(report) == [("s3/1", "stopped")]
        assert "argument 'x'" in str(report.steps[0].reason) and sent == []
        assert k.store.get_by_call_id("undo/s3/1") is None
        assert all(e.kind != "undo_requested" for e in events_of(k, "s3/1"))


def test_an_indeterminate_call_whose_undo_needs_its_result_waits_for_the_operators(
    store_url: str,
) -> None:
    """The operator's landed resolution supplies the result the undo's arguments need."""
    from poimen import Caps, Idempotent, Indeterminate, KeyDerivation, Unsafe

    with Kernel(store_url, notifiers=[]) as k:
        refunded: list[int] = []

        @k.tool(id="t.pay", effects=Unsafe(), caps=Caps(), timeout=1, undo="t.refund",
                undo_args=lambda a, r: {"payment": r["id"]})
        def pay(ctx: Any) -> None:
            raise ConnectionResetError("the answer was lost")

        @k.tool(id="t.refund", effects=Idempotent(key=KeyDerivation.all_args()), caps=Caps(),
                timeout=1)
        def refund(ctx: Any, payment: int) -> None:
            refunded.append(payment)

        assert isinstance(k.call("t.pay", {}, call_id="p/1"), Indeterminate)
        report = k.undo("p/", operator="ann")
        assert statuses(report) == [("p/1", "waiting")] and report.stopped_at is None
        assert "outcome is unknown" in str(report.steps[0].reason) and refunded == []
        k.resolve(intent_of(k, "p/1").id, landed=True, result={"id": 42}, operator="ann",
                  reason="the provider shows payment 42")
        assert k.undo("p/", operator="ann").complete and refunded == [42]


def test_a_call_id_with_the_last_code_point_after_the_scope_is_undone(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    """An MCP client chooses its ids (``mcp/<value>``); U+10FFFF right after the scope is a
    call of the scope like any other, never skipped with the scope reported complete."""
    with make_kernel(store_url, provider.url) as k:
        k.call(CHARGE, {"order": "o1", "cents": 500}, call_id="mcp/\U0010ffff")
        k.call(CHARGE, {"order": "o2", "cents": 500}, call_id="mcp/\U0010ffff\U0010ffff")
        report = k.undo("mcp/", operator="ann")
        assert statuses(report) == [("mcp/\U0010ffff\U0010ffff", "undone"),
                                    ("mcp/\U0010ffff", "undone")]
        assert report.complete and (refunds(ledger, "o1"), refunds(ledger, "o2")) == (1, 1)


def _foreign(k: Kernel, call_id: str, tool: str, args: dict[str, Any]) -> None:
    """A COMPLETED intent under `call_id` written straight into the log, as a log written
    before call ids under undo's prefix were refused may hold one."""
    text = json.dumps(args, sort_keys=True, separators=(",", ":"))
    now = k.store.now()
    it, _ = k.store.record_dispatch(NewDispatch(
        intent_id=f"in_{uuid.uuid4().hex}", call_id=call_id, tool_id=tool, effect="unsafe",
        args=text, args_hash=args_digest(text), key=None, request_id=None,
        owner=Owner("app", "host", 1, "1"), lease_expires_at=now + 30, timeout_s=1,
        deadline_at=now + 2, now=now))
    assert k.store.record_outcome(it.id, 1, S.COMPLETED, result="{}", error=None, now=now)


@pytest.mark.parametrize(("tool", "args"), [
    (NOTE, {"text": "mine"}),  # another tool
    ("u.refund", {"order": "o1", "entry": 99}),  # the undo tool, other arguments
])
def test_an_application_call_under_undos_prefix_is_refused_and_never_taken_as_the_undo(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient, tool: str,
    args: dict[str, Any],
) -> None:
    with make_kernel(store_url, provider.url) as k:
        k.call(CHARGE, {"order": "o1", "cents": 500}, call_id="run-1/1")
        for cid in ("undo/run-1/1", "undo#2/run-1/1", "undo#7/x"):
            with pytest.raises(ReservedCallIdError, match="reserved"):
                k.call(tool, args, call_id=cid)
            assert k.store.get_by_call_id(cid) is None
        assert charges(ledger, "o1") == 1 and refunds(ledger, "o1") == 0

        _foreign(k, "undo/run-1/1", tool, args)
        for dry_run in (True, False):
            report = k.undo("run-1/", operator="ann", dry_run=dry_run)
            assert statuses(report) == [("run-1/1", "stopped")], report.summary()
            assert "not this call's undo" in str(report.steps[0].reason)
        assert refunds(ledger, "o1") == 0 and not report.complete
        assert all(e.kind not in ("undone", "undo_requested") for e in events_of(k, "run-1/1"))


def test_an_undo_whose_outcome_is_unknown_stops_the_scope_and_is_never_run_past(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    """Issue 29, rule 4: a previous undo of a call is Indeterminate: `undo` stops there and
    names it, however often it runs; a second undo would reverse twice if the first landed."""
    from poimen import Caps, Indeterminate, Unsafe

    with Kernel(store_url, notifiers=[]) as k:
        u = httpx.URL(provider.url)
        caps = Caps(hosts=(f"{u.host}:{u.port}",))

        @k.tool(id="t.send", effects=Unsafe(), caps=caps, timeout=10, undo="t.unsend")
        def send(ctx: Any, to: str) -> Any:
            return ctx.http.post(f"{provider.url}/plain", json={"send": to}).json()

        @k.tool(id="t.unsend", effects=Unsafe(), caps=caps, timeout=10)
        def unsend(ctx: Any, to: str) -> Any:
            ctx.http.post(f"{provider.url}/plain", json={"unsend": to})
            raise ConnectionResetError("the answer was lost")  # it landed; nobody knows

        def unsent(to: str) -> int:
            return sum(1 for e in ledger.entries(kind="plain") if e["body"].get("unsend") == to)

        k.call("t.send", {"to": "bob"}, call_id="s/1")
        k.call("t.send", {"to": "cy"}, call_id="s/2")
        first = k.undo("s/", operator="ann")
        assert statuses(first) == [("s/2", "stopped"), ("s/1", "not_reached")]
        unknown = k.store.get_by_call_id("undo/s/2")
        assert unknown is not None and unknown.state == S.INDETERMINATE
        assert (unsent("cy"), unsent("bob")) == (1, 0)
        for dry_run in (True, False, False):
            again = k.undo("s/", operator="bob", dry_run=dry_run)
            assert statuses(again) == [("s/2", "stopped"), ("s/1", "not_reached")]
            stop = again.stopped_at
            assert stop is not None and stop.undo_intent_id == unknown.id
            assert "outcome is unknown" in str(stop.reason) and unknown.id in again.summary()
        assert (unsent("cy"), unsent("bob")) == (1, 0)  # never reversed twice, never run past
        assert k.store.get_by_call_id("undo#2/s/2") is None
        assert isinstance(k.outcome("undo/s/2"), Indeterminate)
