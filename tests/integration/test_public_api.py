"""What agent frameworks use of poimen: specs under safe names, typed calls, outcomes and
waiting for an operator's decision, a read-only class, call ids that survive a restart."""

from __future__ import annotations

import asyncio
import threading
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
    Landed,
    Pending,
    Queryable,
    ReadOnly,
    Resolved,
    ToolContext,
    Unsafe,
    call_ids,
)
from poimen.errors import CapabilityDeniedError, PoimenError, RegistrationError, UnknownToolError
from poimen.testing import ProviderClient, ProviderProcess
from tests.integration.test_lifecycle import intent_of, orphan

S = IntentState


def test_specs_give_every_tool_a_name_a_model_provider_accepts(store_url: str) -> None:
    with Kernel(store_url, notifiers=[]) as k:
        @k.tool(id="billing.charge", effects=Idempotent(key=KeyDerivation.fields("order")),
                caps=Caps(), timeout=5)
        def charge(ctx: ToolContext, order: str, cents: int = 0) -> str:
            """Charge an order."""
            return order

        def other(ctx: ToolContext) -> None:
            return None

        # An id that is another tool's name would name two tools: refused.
        with pytest.raises(RegistrationError, match=r"'billing_charge'.*'billing\.charge'"):
            k.tool(id="billing_charge", effects=Unsafe(), caps=Caps(), timeout=5)(other)
        # The other way round, the later tool's name steps aside.
        k.tool(id="billing_refund", effects=Unsafe(), caps=Caps(), timeout=5,
               description="Another tool whose id is the next one's alias.")(other)
        k.tool(id="billing.refund", effects=Unsafe(), caps=Caps(), timeout=5)(other)

        first, second, third = k.specs()
        assert (first.id, first.name, first.description, first.effect) == (
            "billing.charge", "billing_charge", "Charge an order.", "idempotent")
        assert second.name == "billing_refund"
        assert third.name != "billing_refund" and third.name.startswith("billing_refund")
        assert second.description == "Another tool whose id is the next one's alias."
        assert first.parameters["required"] == ["order"]
        assert set(first.parameters["properties"]) == {"order", "cents"}
        assert k.tool_id("billing_charge") == "billing.charge"
        assert k.tool_id("billing_refund") == "billing_refund"
        assert k.tool_id(third.name) == "billing.refund"
        assert k.spec("billing.charge") == first == charge.spec
        with pytest.raises(UnknownToolError):
            k.tool_id("nope")


def test_a_typed_handle_calls_through_the_log_and_stays_the_function(store_url: str) -> None:
    with Kernel(store_url, notifiers=[]) as k:
        @k.tool(id="add", effects=Unsafe(), caps=Caps(), timeout=5)
        def add(ctx: ToolContext, a: int, b: int) -> int:
            return a + b

        out = add.call("c1", a=2, b=3)
        assert out == Completed(out.intent_id, 5)
        assert asyncio.run(add.acall("c2", a=1, b=1)).result == 2  # type: ignore[union-attr]
        assert add(None, a=1, b=2) == 3  # type: ignore[arg-type]
        with pytest.raises(PoimenError, match="by name"):
            add.call("c3", 1, 2)  # type: ignore[call-arg]
        assert intent_of(k, "c1").state == S.COMPLETED


def test_outcome_and_wait_resume_a_caller_after_an_operator_decides(store_url: str) -> None:
    with Kernel(store_url, notifiers=[]) as k:
        @k.tool(id="send", effects=Unsafe(), caps=Caps(), timeout=5)
        def send(ctx: ToolContext, to: str) -> str:
            raise ConnectionResetError("reset by peer")

        assert k.outcome("c1") is None
        out = k.call("send", {"to": "bob"}, call_id="c1")
        assert isinstance(out, Indeterminate) and k.outcome("c1") == out
        assert not out.terminal and not out.retryable
        assert "Do NOT call it again" in out.for_model()
        # A short wait returns what is there; a long one returns the operator's decision.
        assert asyncio.run(k.wait("c1", timeout=0.05)) == out
        decided = threading.Timer(
            0.2, k.resolve, args=(out.intent_id,),
            kwargs={"landed": True, "result": {"id": 9}, "operator": "ann", "reason": "seen"},
        )
        decided.start()
        got = asyncio.run(k.wait("c1", timeout=30))
        decided.join()
        assert got == Resolved(out.intent_id, True, {"id": 9})
        assert got.terminal and not got.retryable and "took effect" in got.for_model()
        assert k.wait_sync("c1", timeout=1) == got
        with pytest.raises(PoimenError):
            k.wait_sync("never-called", timeout=0)


def test_every_outcome_says_what_a_model_should_do() -> None:
    texts: list[tuple[Any, str, bool, bool]] = [
        (Completed("i", {"a": 1}), '{"a": 1}', True, False),
        (Failed("i", "card declined"), "had no effect: card declined", True, True),
        (Indeterminate("i", "unsafe_unknown_outcome"), "Do NOT call it again", False, False),
        (Resolved("i", False, None), "did not take effect", True, True),
        (Pending("i", "in_flight"), "Do NOT call it again", False, False),
        (Pending("i", "awaiting_approval"), "approval", False, False),
    ]
    for out, text, terminal, retryable in texts:
        assert text in out.for_model()
        assert (out.terminal, out.retryable) == (terminal, retryable), out


def test_async_parity(store_url: str) -> None:
    with Kernel(store_url, notifiers=[]) as k:
        landed: list[str] = []

        async def lookup(request_id: str) -> Any:
            return Landed({"rid": request_id})

        @k.tool(id="q", effects=Queryable(lookup=lookup), caps=Caps(), timeout=0.2)
        def q(ctx: ToolContext) -> str:
            landed.append("ran")
            return "ok"

        orphan(k, "q", "queryable", {}, "c1", request_id="rq_1")
        report = asyncio.run(k.arecover())
        assert report.completed == 1 and landed == []  # an async lookup said it landed
        assert k.outcome("c1") == Completed(intent_of(k, "c1").id, {"rid": "rq_1"})
        assert asyncio.run(k.alaunch(background=False)).scanned == 0


def test_a_read_only_tool_is_rerun_freely_and_every_write_is_denied(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient, tmp_path: Path
) -> None:
    port = httpx.URL(provider.url).port
    hosts = (f"127.0.0.1:{port}",)
    with Kernel(store_url, notifiers=[]) as k:
        runs: list[int] = []

        @k.tool(id="look", effects=ReadOnly(), caps=Caps(hosts=hosts), timeout=2)
        def look(ctx: ToolContext, write: str) -> Any:
            runs.append(ctx.attempt)
            if write == "http":
                return ctx.http.post(f"{provider.url}/plain", json={"x": 1}).json()
            if write == "file":
                (tmp_path / "out.txt").write_text("x")
            return ctx.http.get(f"{provider.url}/ledger").json()

        assert isinstance(k.call("look", {"write": ""}, call_id="read"), Completed)
        for what in ("http", "file"):
            out = k.call("look", {"write": what}, call_id=f"w-{what}")
            assert isinstance(out, Failed) and "read_only" in out.error, out
        assert ledger.count(kind="plain") == 0 and not (tmp_path / "out.txt").exists()
        assert {d.reason.split(":")[0] for d in k.denials("look")} == {"read_only"}
        # After a crash it is simply run again: it has no effect to double.
        orphan(k, "look", "readonly", {"write": ""}, "orphan")
        k.recover()
        assert intent_of(k, "orphan").state == S.COMPLETED and runs[-1] == 2
        with pytest.raises(CapabilityDeniedError):
            raise CapabilityDeniedError("type exported")


def test_derived_call_ids_repeat_across_a_restart_and_count_occurrences() -> None:
    first = call_ids.CallIds("conv-7")
    ids = [first.next("send", {"to": "bob", "n": 1}), first.next("send", {"n": 1, "to": "bob"}),
           first.next("send", {"to": "ann", "n": 1})]
    assert ids[0].endswith("/1") and ids[1].endswith("/2") and ids[0][:-2] == ids[1][:-2]
    again = call_ids.CallIds("conv-7")  # the restarted run, same scope
    assert [again.next("send", {"to": "bob", "n": 1}), again.next("send", {"to": "bob", "n": 1}),
            again.next("send", {"to": "ann", "n": 1})] == ids
    assert call_ids.CallIds("conv-8").next("send", {"to": "bob", "n": 1}) != ids[0]
    assert call_ids.framework_id("thread-1", "call_abc") == "thread-1/call_abc"
    for bad in ("", None):
        with pytest.raises(PoimenError):
            call_ids.CallIds(bad)  # type: ignore[arg-type]


def test_the_key_is_derived_from_the_recorded_arguments_not_the_raw_ones(
    store_url: str,
) -> None:
    # Recovery derives the key again from the recorded (validated, defaults filled) arguments:
    # the call path must have used the same, or every recovery would be key drift.
    with Kernel(store_url, notifiers=[]) as k:
        @k.tool(id="pay", effects=Idempotent(key=KeyDerivation.all_args()), caps=Caps(),
                timeout=5)
        def pay(ctx: ToolContext, order: str, cents: int, currency: str = "EUR") -> str:
            return order

        k.call("pay", {"order": "o1", "cents": "1200"}, call_id="c1")  # coerced, default added
        it = intent_of(k, "c1")
        recorded = __import__("json").loads(it.args)
        assert recorded == {"order": "o1", "cents": 1200, "currency": "EUR"}
        assert it.key == KeyDerivation.all_args().derive("pay", recorded)
