"""The call path on a real intent log: replay by call id, refusals, outcomes by class."""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from poimen import (
    CallbackNotifier,
    Caps,
    Completed,
    DefiniteFailure,
    Failed,
    Idempotent,
    Indeterminate,
    IntentState,
    Kernel,
    KeyDerivation,
    Notification,
    NotLanded,
    Pending,
    Queryable,
    Resolved,
    ToolContext,
    Unsafe,
)
from poimen._core.intents import Owner
from poimen.errors import (
    ArgumentEncodingError,
    ArgumentError,
    ArgumentTooLargeError,
    CallIdMismatchError,
    CorruptRowError,
    NotIndeterminateError,
    PoimenError,
    SchemaTooNewError,
    UnknownToolError,
)
from poimen.store import NewDispatch
from poimen.testing import CHARGE, EMAIL, ProviderClient, ProviderProcess

S = IntentState


class Witness:
    """Counts invocations and the keys tools saw, outside the log."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str | None, int]] = []
        self.fail_first = 0
        self.lock = threading.Lock()

    def hit(self, ctx: ToolContext) -> None:
        with self.lock:
            self.calls.append((ctx.tool_id, ctx.key or ctx.request_id, ctx.attempt))
            if self.fail_first > 0:
                self.fail_first -= 1
                raise ConnectionResetError("connection reset mid-call")


@pytest.fixture
def witness() -> Witness:
    return Witness()


@pytest.fixture
def notes() -> list[Notification]:
    return []


@pytest.fixture
def kernel(store_url: str, witness: Witness, notes: list[Notification]) -> Iterator[Kernel]:
    k = Kernel(store_url, notifiers=[CallbackNotifier(notes.append)], max_attempts=3,
               deadline_margin=0.05)

    @k.tool(id="pay", effects=Idempotent(key=KeyDerivation.fields("order_id")), caps=Caps(),
            timeout=5)
    def pay(ctx: ToolContext, order_id: str, amount_cents: int) -> dict[str, Any]:
        witness.hit(ctx)
        if amount_cents < 0:
            raise DefiniteFailure("negative amounts are refused")
        return {"paid": amount_cents, "key": ctx.key}

    @k.tool(id="mail", effects=Unsafe(), caps=Caps(), timeout=5)
    def mail(ctx: ToolContext, to: str) -> str:
        witness.hit(ctx)
        return "sent"

    @k.tool(id="ship", effects=Queryable(lookup=lambda rid: NotLanded()), caps=Caps(),
            timeout=0.2)
    def ship(ctx: ToolContext, order_id: str) -> str:
        witness.hit(ctx)
        return "shipped"

    @k.tool(id="slow", effects=Unsafe(), caps=Caps(), timeout=0.1)
    async def slow(ctx: ToolContext, seconds: float) -> str:
        witness.hit(ctx)
        await asyncio.sleep(seconds)
        return "late"

    yield k
    k.close()


def table_counts(k: Kernel) -> tuple[int, int, int]:
    intents = k.store.list_intents(limit=10_000)
    events = sum(len(k.store.events(i.id)) for i in intents)
    attempts = sum(len(k.store.attempts(i.id)) for i in intents)
    return len(intents), events, attempts


def test_a_call_is_journalled_twice_and_its_call_id_replays_without_dispatch(
    kernel: Kernel, witness: Witness
) -> None:
    out = kernel.call("pay", {"order_id": "o1", "amount_cents": 5}, call_id="c1")
    assert isinstance(out, Completed) and out.result["paid"] == 5
    again = kernel.call("pay", {"amount_cents": 5, "order_id": "o1"}, call_id="c1")
    assert again == out
    assert len(witness.calls) == 1
    intent = kernel.store.get_intent(out.intent_id)
    assert intent is not None and intent.state == S.COMPLETED
    assert [e.kind for e in kernel.store.events(intent.id)] == ["dispatched", "completed"]
    [attempt] = kernel.store.attempts(intent.id)
    assert attempt.outcome == "completed" and attempt.owner == kernel.owner


@pytest.mark.parametrize(
    ("tool", "args"),
    [("pay", {"order_id": "o1", "amount_cents": 6}), ("mail", {"to": "o1"})],
    ids=["other-args", "other-tool"],
)
def test_a_reused_call_id_with_other_arguments_is_refused_and_changes_nothing(
    kernel: Kernel, witness: Witness, tool: str, args: dict[str, Any]
) -> None:
    kernel.call("pay", {"order_id": "o1", "amount_cents": 5}, call_id="c1")
    before = table_counts(kernel)
    with pytest.raises(CallIdMismatchError, match="'c1'"):
        kernel.call(tool, args, call_id="c1")
    assert table_counts(kernel) == before
    assert len(witness.calls) == 1


@pytest.mark.parametrize(
    ("args", "error", "named"),
    [
        ({"order_id": "o", "amount_cents": math.nan}, ArgumentEncodingError, "amount_cents"),
        ({"order_id": b"o", "amount_cents": 1}, ArgumentEncodingError, "order_id"),
        ({"order_id": object(), "amount_cents": 1}, ArgumentEncodingError, "order_id"),
        ({"order_id": "o" * (1 << 20), "amount_cents": 1}, ArgumentTooLargeError, "order_id"),
        ({"order_id": "o"}, ArgumentError, "amount_cents"),
        ({"order_id": "o", "amount_cents": "many"}, ArgumentError, "amount_cents"),
        ({"order_id": "o", "amount_cents": 1, "tip": 2}, ArgumentError, "tip"),
    ],
    ids=["nan", "bytes", "object", "oversized", "missing", "wrong-type", "unknown-arg"],
)
def test_bad_arguments_are_refused_before_anything_is_recorded(
    kernel: Kernel, witness: Witness, args: dict[str, Any], error: type[ArgumentError],
    named: str,
) -> None:
    with pytest.raises(error) as err:
        kernel.call("pay", args, call_id="bad")
    assert err.value.argument == named
    assert named in str(err.value)
    assert kernel.store.get_by_call_id("bad") is None
    assert table_counts(kernel) == (0, 0, 0)
    assert witness.calls == []


def test_an_unknown_tool_is_refused(kernel: Kernel) -> None:
    with pytest.raises(UnknownToolError, match="'refund'"):
        kernel.call("refund", {}, call_id="x")
    assert table_counts(kernel) == (0, 0, 0)


def test_definite_failure_is_failed_and_replays_as_failed(kernel: Kernel, witness: Witness) -> None:
    out = kernel.call("pay", {"order_id": "o", "amount_cents": -1}, call_id="f")
    assert isinstance(out, Failed) and "refused" in out.error
    assert kernel.call("pay", {"order_id": "o", "amount_cents": -1}, call_id="f") == out
    assert len(witness.calls) == 1
    intent = kernel.store.get_intent(out.intent_id)
    assert intent is not None and intent.state == S.FAILED


def test_an_idempotent_error_retries_with_the_same_key(kernel: Kernel, witness: Witness) -> None:
    witness.fail_first = 1
    out = kernel.call("pay", {"order_id": "o", "amount_cents": 1}, call_id="r")
    assert isinstance(out, Completed)
    keys = {key for _, key, _ in witness.calls}
    assert len(witness.calls) == 2 and len(keys) == 1
    assert [a for _, _, a in witness.calls] == [1, 2]
    assert [a.outcome for a in kernel.store.attempts(out.intent_id)] == ["unknown", "completed"]


def test_idempotent_retries_stop_at_the_bound(kernel: Kernel, witness: Witness) -> None:
    witness.fail_first = 99
    out = kernel.call("pay", {"order_id": "o", "amount_cents": 1}, call_id="r")
    assert out == Indeterminate(out.intent_id, "retries_exhausted")
    assert len(witness.calls) == kernel.max_attempts


def test_an_unsafe_error_is_indeterminate_notified_and_replayed_not_retried(
    kernel: Kernel, witness: Witness, notes: list[Notification]
) -> None:
    witness.fail_first = 1
    out = kernel.call("mail", {"to": "a"}, call_id="m")
    assert isinstance(out, Indeterminate) and out.reason == "unsafe_unknown_outcome"
    assert kernel.call("mail", {"to": "a"}, call_id="m") == out
    kernel.recover()
    assert len(witness.calls) == 1
    assert [json.loads(n.payload)["intent_id"] for n in notes] == [out.intent_id]


def test_queryable_not_landed_waits_for_the_deadline_then_retries_once(
    kernel: Kernel, witness: Witness
) -> None:
    witness.fail_first = 1
    out = kernel.call("ship", {"order_id": "o"}, call_id="q")
    assert out == Pending(out.intent_id, "awaiting_deadline")
    intent = kernel.store.get_intent(out.intent_id)
    assert intent is not None and intent.state == S.DISPATCHED
    assert intent.deadline_at is not None
    import time

    time.sleep(max(0.0, intent.deadline_at - time.time()) + 0.05)
    report = kernel.recover()
    assert report.completed == 1
    assert len(witness.calls) == 2
    assert len({rid for _, rid, _ in witness.calls}) == 1  # same request id on the retry


def test_acall_runs_async_tools_and_a_timeout_is_an_unknown_outcome(
    kernel: Kernel, witness: Witness
) -> None:
    async def main() -> list[Any]:
        return await asyncio.gather(
            kernel.acall("slow", {"seconds": 0.0}, call_id="fast"),
            kernel.acall("slow", {"seconds": 1.0}, call_id="late"),
            *(kernel.acall("pay", {"order_id": f"o{i}", "amount_cents": i}, call_id=f"p{i}")
              for i in range(20)),
        )

    fast, late, *paid = asyncio.run(main())
    assert fast == Completed(fast.intent_id, "late")
    assert late == Indeterminate(late.intent_id, "unsafe_unknown_outcome")
    assert all(isinstance(p, Completed) for p in paid)
    assert len(witness.calls) == 22


def test_resolve_moves_only_indeterminate_and_is_audited(kernel: Kernel, witness: Witness) -> None:
    witness.fail_first = 1
    out = kernel.call("mail", {"to": "a"}, call_id="m")
    with pytest.raises(PoimenError, match="reason"):
        kernel.resolve(out.intent_id, landed=True, operator="ann", reason=" ")
    done = kernel.resolve(out.intent_id, landed=True, result={"msg": "seen in outbox"},
                          operator="ann", reason="found in the provider's console")
    assert done.state == S.RESOLVED_LANDED
    last = kernel.store.events(out.intent_id)[-1]
    assert last.kind == "resolved" and last.actor == "ann"
    assert json.loads(last.detail or "{}")["reason"] == "found in the provider's console"
    assert kernel.call("mail", {"to": "a"}, call_id="m") == Resolved(
        out.intent_id, True, {"msg": "seen in outbox"}
    )
    with pytest.raises(NotIndeterminateError, match="RESOLVED_LANDED"):
        kernel.resolve(out.intent_id, landed=False, operator="bob", reason="again")
    ok = kernel.call("mail", {"to": "b"}, call_id="m2")
    with pytest.raises(NotIndeterminateError, match="COMPLETED"):
        kernel.resolve(ok.intent_id, landed=False, operator="bob", reason="no")


def test_shadow_mode_denies_unsafe_tools_outright(store_url: str, witness: Witness) -> None:
    with Kernel(store_url, mode="shadow") as k:
        @k.tool(id="mail", effects=Unsafe(), caps=Caps(), timeout=1)
        def mail(ctx: ToolContext, to: str) -> None:
            witness.hit(ctx)

        # Never dispatched, audited, and answered so that the shadow run goes on.
        assert k.call("mail", {"to": "a"}, call_id="s").reason == "would_have_called"  # type: ignore[union-attr]
        assert k.store.get_by_call_id("s") is None
        [denial] = k.store.denials(tool_id="mail")
        assert denial.reason == "unsafe tool in shadow mode"
    assert witness.calls == []


def _orphan(k: Kernel, tool: str, args: dict[str, Any], call_id: str, *, key: str | None,
            request_id: str | None, dead: Owner, timeout: float = 0.2) -> str:
    """An intent whose owner process is gone, recorded through the store's own API."""
    from poimen._core.keys import args_digest, canonical

    now = k.store.now()
    d = NewDispatch(
        intent_id=f"in_{call_id}", call_id=call_id, tool_id=tool, effect="idempotent"
        if key else ("queryable" if request_id else "unsafe"), args=canonical(args),
        args_hash=args_digest(canonical(args)), key=key, request_id=request_id, owner=dead,
        lease_expires_at=now + 300, timeout_s=timeout, deadline_at=now - 1, now=now,
    )
    intent, created = k.store.record_dispatch(d)
    assert created
    return intent.id


@pytest.fixture
def dead_owner() -> Owner:
    import subprocess
    import sys

    from poimen._engine.liveness import default_host

    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True, check=True)
    return Owner("w-dead", default_host(), int(p.stdout), "1")


def test_two_recovery_passes_racing_retry_each_intent_once(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient, dead_owner: Owner
) -> None:
    from poimen.testing import SHIP, register_test_tools

    kernels = [Kernel(store_url, notifiers=[], deadline_margin=0.0) for _ in range(2)]
    for k in kernels:
        register_test_tools(k, provider.url, timeout=2.0)
    ids = [_orphan(kernels[0], SHIP, {"order_id": f"o{i}", "address": "a"}, f"q{i}", key=None,
                   request_id=f"rq_{i}", dead=dead_owner) for i in range(30)]
    barrier = threading.Barrier(2)

    def settled() -> bool:
        return all(i.state != S.DISPATCHED for i in map(kernels[0].store.get_intent, ids) if i)

    def run(k: Kernel) -> None:
        # A dead owner's request may land until its tool timeout after it is found dead:
        # "not landed" is trusted only then, so the passes go on until every intent settles.
        barrier.wait()
        end = time.monotonic() + 60
        while not settled() and time.monotonic() < end:
            k.recover()

    threads = [threading.Thread(target=run, args=(k,)) for k in kernels]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        for i, intent_id in enumerate(ids):
            intent = kernels[0].store.get_intent(intent_id)
            assert intent is not None and intent.state == S.COMPLETED
            assert ledger.count(kind="request", request_id=f"rq_{i}") == 1
            # One retry per intent; a further one only ever follows an unknown outcome.
            _first, *retries = kernels[0].store.attempts(intent_id)
            assert retries[-1].outcome == "completed"
            assert all(a.outcome == "unknown" for a in retries[:-1])
    finally:
        for k in kernels:
            k.close()


def test_a_live_owner_is_left_alone_and_a_dead_one_is_claimed_at_once(
    tmp_path: Path, sqlite_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    from poimen.testing import spawn_call
    from tests.helpers import TIMEOUT, recovering_kernel

    pause = tmp_path / "pause"
    proc = spawn_call(sqlite_url, provider.url, CHARGE, {"order_id": "o", "amount_cents": 1},
                      "live", pause_at="mid_call", pause_file=pause, timeout=TIMEOUT)
    try:
        with recovering_kernel(sqlite_url, provider.url) as k:
            import time

            while not pause.exists():
                time.sleep(0.01)
            report = k.recover()
            assert report.busy == 1 and report.completed == 0
            assert ledger.count() == 0
            proc.kill()
            proc.wait()
            report = k.recover()
            assert report.completed == 1
            assert ledger.count(kind="keyed") == 1
    finally:
        proc.kill()
        proc.communicate()


def test_key_drift_is_indeterminate_and_not_retried(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient, dead_owner: Owner
) -> None:
    with Kernel(store_url, notifiers=[]) as k:
        old_key = KeyDerivation.fields("order_id", "amount_cents").derive(
            CHARGE, {"order_id": "o", "amount_cents": 1})
        _orphan(k, CHARGE, {"order_id": "o", "amount_cents": 1, "note": ""}, "d", key=old_key,
                request_id=None, dead=dead_owner)

        @k.tool(id=CHARGE, effects=Idempotent(key=KeyDerivation.fields("order_id", version=2)),
                caps=Caps(), timeout=1)
        def charge(ctx: ToolContext, order_id: str, amount_cents: int, note: str = "") -> None:
            ProviderClient(provider.url).keyed_write(ctx.key, {"order_id": order_id})

        report = k.recover()
        intent = k.store.get_by_call_id("d")
        assert intent is not None
        assert (intent.state, intent.reason) == (S.INDETERMINATE, "key_drift")
        assert report.indeterminate == 1
    assert ledger.count() == 0


def test_an_unregistered_tool_stays_dispatched_and_is_reported(
    store_url: str, dead_owner: Owner
) -> None:
    with Kernel(store_url, notifiers=[]) as k:
        iid = _orphan(k, EMAIL, {"to": "a", "subject": "s"}, "u", key=None, request_id=None,
                      dead=dead_owner)
        report = k.recover()
        assert report.unregistered == [iid]
        intent = k.store.get_intent(iid)
        assert intent is not None and intent.state == S.DISPATCHED


def test_a_newer_schema_is_refused_and_left_untouched(sqlite_url: str) -> None:
    Kernel(sqlite_url).close()
    path = sqlite_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO poimen_schema (version, applied_at) VALUES (99, 0)")
    with pytest.raises(SchemaTooNewError, match="schema version 99") as err:
        Kernel(sqlite_url)
    assert err.value.found == 99
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT MAX(version) FROM poimen_schema").fetchone() == (99,)


def test_a_corrupt_row_is_named_and_recovery_goes_on(
    sqlite_url: str, dead_owner: Owner, witness: Witness
) -> None:
    with Kernel(sqlite_url, notifiers=[]) as k:
        @k.tool(id="mail", effects=Unsafe(), caps=Caps(), timeout=1)
        def mail(ctx: ToolContext, to: str) -> None:
            witness.hit(ctx)

        ids = [_orphan(k, "mail", {"to": str(i)}, f"m{i}", key=None, request_id=None,
                       dead=dead_owner) for i in range(3)]
        with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as db:
            db.execute("UPDATE intents SET fence = 'garbage' WHERE id = ?", (ids[1],))
        with pytest.raises(CorruptRowError, match=ids[1]):
            k.store.get_intent(ids[1])
        report = k.recover()
        assert report.corrupt == [ids[1]]
        assert report.indeterminate == 2
        states = [k.store.get_intent(i) for i in (ids[0], ids[2])]
        assert all(s is not None and s.state == S.INDETERMINATE for s in states)
    assert witness.calls == []


def test_the_log_survives_a_closed_store_with_a_clear_error(sqlite_url: str) -> None:
    k = Kernel(sqlite_url)
    k.close()
    from poimen.errors import StoreUnavailableError

    with pytest.raises(StoreUnavailableError, match="closed"):
        k.store.list_intents()


def test_the_happy_path_is_two_durable_commits(sqlite_url: str, witness: Witness) -> None:
    with Kernel(sqlite_url) as k:
        @k.tool(id="mail", effects=Unsafe(), caps=Caps(), timeout=1)
        def mail(ctx: ToolContext, to: str) -> None:
            witness.hit(ctx)

        k.call("mail", {"to": "warm-up"}, call_id="w")
        statements: list[str] = []
        k.store._writer._conn.set_trace_callback(statements.append)  # type: ignore[attr-defined]
        out = k.call("mail", {"to": "a"}, call_id="m")
        k.store._writer._conn.set_trace_callback(None)  # type: ignore[attr-defined]
        assert isinstance(out, Completed)
        assert [s for s in statements if s in ("BEGIN IMMEDIATE", "COMMIT")] == [
            "BEGIN IMMEDIATE", "COMMIT", "BEGIN IMMEDIATE", "COMMIT"
        ]
        path = sqlite_url.removeprefix("sqlite:///")
        with sqlite3.connect(path) as db:
            assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert k.store._writer._conn.execute("PRAGMA synchronous").fetchone() == (2,)  # type: ignore[attr-defined]


def test_a_call_id_held_by_a_live_owner_waits_then_is_recovered_once_the_owner_dies(
    tmp_path: Path, sqlite_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    import time

    from poimen.testing import register_test_tools, spawn_call
    from tests.helpers import TIMEOUT

    args = {"order_id": "o", "amount_cents": 1}
    pause = tmp_path / "pause"
    proc = spawn_call(sqlite_url, provider.url, CHARGE, args, "same", pause_at="mid_call",
                      pause_file=pause, timeout=TIMEOUT)
    try:
        while not pause.exists():
            time.sleep(0.01)
        with Kernel(sqlite_url, notifiers=[], wait_bound=0.3) as k:
            register_test_tools(k, provider.url, timeout=TIMEOUT)
            waiting = k.call(CHARGE, args, call_id="same")
            assert waiting == Pending(waiting.intent_id, "in_flight")
            assert ledger.count() == 0
            proc.kill()
            proc.wait()
            done = k.call(CHARGE, args, call_id="same")
            assert isinstance(done, Completed) and done.intent_id == waiting.intent_id
            assert ledger.count(kind="keyed") == 1
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize(
    ("setting", "value"),
    [("lease_ttl", 0), ("recover_interval", -1.0), ("deadline_margin", float("nan")),
     ("max_attempts", 0), ("lookup_limit", 1.5), ("wait_bound", True)],
)
def test_kernel_settings_are_checked_naming_the_setting(
    sqlite_url: str, setting: str, value: Any
) -> None:
    with pytest.raises(PoimenError, match=setting) as err:
        Kernel(sqlite_url, **{setting: value})
    assert err.value.field == setting
