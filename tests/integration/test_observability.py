"""Traces, metrics, logs and hooks of a kernel, on both backends (docs/observability.md).

Spans are read from the OpenTelemetry SDK's in-memory exporter, metrics from its in-memory
reader, the console's ``/metrics`` from a real `poimen console` over HTTP, the
``traceparent`` from a real local HTTP server, crashes are real SIGKILLed children.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from poimen import (
    Caps,
    Completed,
    DefiniteFailure,
    Failed,
    Idempotent,
    Indeterminate,
    IntentState,
    Kernel,
    KeyDerivation,
    Retry,
    ToolContext,
    Unsafe,
)
from poimen._core.intents import Owner
from poimen._core.keys import args_digest, canonical
from poimen.errors import NotSent, PoimenError
from poimen.events import (
    CallFinishedEvent,
    IndeterminateEvent,
    KernelEvent,
    LeasesRenewedEvent,
    Observer,
)
from poimen.operator import _ops as op
from poimen.otel import OpenTelemetry
from poimen.store._base import NewDispatch
from poimen.testing import CHARGE, EMAIL, SHIP, ProviderClient, ProviderProcess
from tests.helpers import crash_call, recover_until_settled, recovering_kernel

S = IntentState
ROOT = Path(__file__).resolve().parents[2]


# Telemetry read back from the SDK.


@dataclass
class Telemetry:
    exporter: InMemorySpanExporter
    tracer_provider: TracerProvider
    reader: InMemoryMetricReader
    meter_provider: MeterProvider

    def observer(self, **kw: Any) -> OpenTelemetry:
        return OpenTelemetry(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider, **kw
        )

    def spans(self, prefix: str = "") -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name.startswith(prefix)]

    def one(self, name: str, **attrs: Any) -> ReadableSpan:
        found = [
            s
            for s in self.spans(name)
            if s.name == name
            and all((s.attributes or {}).get(f"poimen.{k}") == v for k, v in attrs.items())
        ]
        assert len(found) == 1, (name, attrs, [(s.name, s.attributes) for s in self.spans()])
        return found[0]

    def children(self, parent: ReadableSpan) -> list[ReadableSpan]:
        assert parent.context is not None
        return [
            s
            for s in self.spans()
            if s.parent is not None and s.parent.span_id == parent.context.span_id
        ]

    def points(self, name: str) -> dict[frozenset[tuple[str, Any]], float]:
        """The metric's data points: attributes -> value (a histogram: its count)."""
        data = self.reader.get_metrics_data()
        out: dict[frozenset[tuple[str, Any]], float] = {}
        assert data is not None
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name != name:
                        continue
                    for p in m.data.data_points:
                        value = getattr(p, "value", None)
                        out[frozenset((p.attributes or {}).items())] = (
                            p.count if value is None else value  # type: ignore[union-attr]
                        )
        return out


def sdk_telemetry() -> Iterator[Telemetry]:
    """An SDK tracer and meter provider with in-memory exporters, shut down at the end."""
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    yield Telemetry(exporter, tp, reader, mp)
    tp.shutdown()
    mp.shutdown()


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    yield from sdk_telemetry()


def events_of(span: ReadableSpan) -> list[str]:
    return [e.name for e in span.events]


def attr(span: ReadableSpan, name: str) -> Any:
    return (span.attributes or {}).get(f"poimen.{name}")


def key(**attrs: Any) -> frozenset[tuple[str, Any]]:
    return frozenset((f"poimen.{k}", v) for k, v in attrs.items())


# Tools used below.


def add_tools(k: Kernel) -> None:
    @k.tool(id="t.ok", effects=Idempotent(key=KeyDerivation.all_args()), caps=Caps(), timeout=5)
    def ok(ctx: ToolContext, n: int) -> int:
        return n

    @k.tool(id="t.refused", effects=Unsafe(), caps=Caps(), timeout=5)
    def refused(ctx: ToolContext, n: int) -> int:
        raise DefiniteFailure("the provider said no")

    @k.tool(id="t.boom", effects=Unsafe(), caps=Caps(), timeout=5)
    def boom(ctx: ToolContext, n: int) -> int:
        raise TimeoutError("no answer in time")

    @k.tool(
        id="t.rogue", effects=Idempotent(key=KeyDerivation.all_args()), caps=Caps(), timeout=5
    )
    def rogue(ctx: ToolContext, n: int) -> int:
        ctx.http.get("http://127.0.0.1:9/")  # not in caps: denied, recorded
        return n


def orphan(k: Kernel, call_id: str, tool: str, args: dict[str, Any], effect: str) -> str:
    """An intent left DISPATCHED by an owner on a host that is gone (its lease expired)."""
    now = k.store.now()
    text = canonical(args)
    d = NewDispatch(
        intent_id=f"in_{call_id}",
        call_id=call_id,
        tool_id=tool,
        effect=effect,
        args=text,
        args_hash=args_digest(text),
        key=KeyDerivation.all_args().derive(tool, args) if effect == "idempotent" else None,
        request_id=None,
        owner=Owner("w-gone", "gone-host", 1, "1"),
        lease_expires_at=now - 1,
        timeout_s=5,
        deadline_at=now - 1,
        now=now - 1,
    )
    intent, created = k.store.record_dispatch(d)
    assert created
    return intent.id


def scripted(k: Kernel) -> dict[str, str]:
    """A sequence with a known count of everything: two completed calls, one refused, one
    Indeterminate, one denied write, a held call whose lease is renewed, an orphan taken over
    and completed, one left DISPATCHED (its tool is not registered), one recovery pass."""
    renewed = threading.Event()
    # A round may run before a held call's dispatch commit (nothing to renew yet): wait for
    # one that renewed a lease.
    k.on(LeasesRenewedEvent, lambda e: e.renewed and renewed.set())

    @k.tool(id="t.slow", effects=Unsafe(), caps=Caps(), timeout=30)
    def slow(ctx: ToolContext, n: int) -> int:
        assert renewed.wait(30), "the lease was never renewed"
        return n

    add_tools(k)
    assert isinstance(k.call("t.ok", {"n": 1}, call_id="s-ok-1"), Completed)
    assert isinstance(k.call("t.ok", {"n": 2}, call_id="s-ok-2"), Completed)
    assert isinstance(k.call("t.refused", {"n": 1}, call_id="s-refused"), Failed)
    boom = k.call("t.boom", {"n": 1}, call_id="s-boom")
    assert isinstance(boom, Indeterminate)
    rogue = k.call("t.rogue", {"n": 1}, call_id="s-rogue")
    assert isinstance(rogue, Failed) and "denied" in rogue.error
    assert isinstance(k.call("t.slow", {"n": 1}, call_id="s-slow"), Completed)
    taken = orphan(k, "s-orphan", "t.ok", {"n": 3}, "idempotent")
    orphan(k, "s-stray", "gone.tool", {"n": 4}, "unsafe")
    report = k.recover()
    assert report.completed == 1 and report.unregistered == ["in_s-stray"]
    return {"boom": boom.intent_id, "orphan": taken}


# 1. Tracing.


def test_a_call_is_one_span_under_the_callers_span_and_its_attempts_off_the_happy_path(
    store_url: str, telemetry: Telemetry
) -> None:
    tracer = telemetry.tracer_provider.get_tracer("the agent")
    with Kernel(store_url, notifiers=[], observers=[telemetry.observer()]) as k:
        add_tools(k)
        failures = [TimeoutError("no answer in time")]

        @k.tool(id="t.flaky", effects=Idempotent(key=KeyDerivation.all_args()), caps=Caps(),
                timeout=5, retry=Retry(attempts=2, initial=0.01, maximum=0.01, budget=30))
        def flaky(ctx: ToolContext, n: int) -> int:
            with tracer.start_as_current_span("the tool's own"):
                if failures:
                    raise failures.pop()
            return n

        with tracer.start_as_current_span("agent step") as step:
            out = k.call("t.ok", {"n": 7}, call_id="c-happy")
        assert isinstance(out, Completed)
        call = telemetry.one("execute_tool t.ok")
        assert call.parent is not None and call.parent.span_id == step.get_span_context().span_id
        assert call.context is not None
        assert call.context.trace_id == step.get_span_context().trace_id
        assert attr(call, "tool_id") == "t.ok" and attr(call, "effect") == "idempotent"
        assert attr(call, "call_id") == "c-happy" and attr(call, "intent_id") == out.intent_id
        assert attr(call, "outcome") == "completed"
        # The happy path (dispatched, one attempt, completed) is the call's span alone.
        assert events_of(call) == [] and telemetry.children(call) == []
        # An Unsafe tool that times out: the attempt is an error, the call Indeterminate.
        boom = k.call("t.boom", {"n": 1}, call_id="c-boom")
        span = telemetry.one("execute_tool t.boom")
        assert attr(span, "outcome") == "indeterminate"
        assert attr(span, "reason") == "unsafe_unknown_outcome"
        assert events_of(span) == [
            "poimen.dispatched",
            "poimen.unknown_outcome",
            "poimen.indeterminate",
        ]
        (failed_attempt,) = telemetry.children(span)
        assert failed_attempt.name == "poimen.attempt t.boom"
        assert attr(failed_attempt, "attempt") == 1 and attr(failed_attempt, "fence") == 1
        assert attr(failed_attempt, "intent_id") == boom.intent_id
        assert attr(failed_attempt, "outcome") == "unknown"
        assert failed_attempt.status.description == "TimeoutError: no answer in time"
        assert attr(span, "intent_id") == boom.intent_id
        # Told late, each at the time it happened: dispatched, the attempt, what followed.
        assert span.start_time is not None and failed_attempt.start_time is not None
        times = [e.timestamp for e in span.events]
        assert span.start_time <= times[0] <= failed_attempt.start_time <= times[1] <= times[2]
        # A retry: the first attempt's span and the second's, the tool's spans under each.
        assert isinstance(k.call("t.flaky", {"n": 2}, call_id="c-flaky"), Completed)
        flaky_call = telemetry.one("execute_tool t.flaky")
        assert events_of(flaky_call) == [
            "poimen.dispatched",
            "poimen.unknown_outcome",
            "poimen.retry",
            "poimen.completed",
        ]
        under = telemetry.children(flaky_call)
        first, second = sorted(
            (s for s in under if s.name == "poimen.attempt t.flaky"),
            key=lambda s: attr(s, "attempt"),
        )
        assert [s.name for s in under if s not in (first, second)] == ["the tool's own"]
        assert (attr(first, "attempt"), attr(first, "outcome")) == (1, "unknown")
        assert (attr(second, "attempt"), attr(second, "outcome")) == (2, "completed")
        assert [s.name for s in telemetry.children(second)] == ["the tool's own"]
        # An operator's decision is a span of its own, under the caller's.
        with tracer.start_as_current_span("operator") as op:
            k.resolve(boom.intent_id, landed=False, operator="ana", reason="not sent")
        decision = telemetry.one("poimen.resolve t.boom")
        assert decision.parent is not None
        assert decision.parent.span_id == op.get_span_context().span_id
        assert attr(decision, "intent_id") == boom.intent_id and attr(decision, "landed") is False
        assert attr(decision, "operator") == "ana"


def test_a_call_off_the_happy_path_keeps_its_dispatch_event_whatever_ends_it(
    store_url: str, telemetry: Telemetry
) -> None:
    """The dispatch event, held back while a call may still be the happy path, is told as
    soon as the call leaves it: an attempt that did not complete, or a call ended by an
    exception that leaves its intent DISPATCHED."""
    with Kernel(store_url, notifiers=[], observers=[telemetry.observer()]) as k:
        refusals = [NotSent("connection refused")]

        @k.tool(id="t.notsent", effects=Unsafe(), caps=Caps(), timeout=5,
                retry=Retry(attempts=3, initial=0.01, maximum=0.01, budget=30))
        def notsent(ctx: ToolContext, n: int) -> int:
            if refusals:
                raise refusals.pop()
            return n

        @k.tool(id="t.exit", effects=Unsafe(), caps=Caps(), timeout=5)
        def leaves(ctx: ToolContext, n: int) -> int:
            raise SystemExit(3)

        assert isinstance(k.call("t.notsent", {"n": 1}, call_id="c-notsent"), Completed)
        call = telemetry.one("execute_tool t.notsent")
        assert events_of(call) == ["poimen.dispatched", "poimen.completed"]
        attempts = sorted(telemetry.children(call), key=lambda s: attr(s, "attempt"))
        assert [attr(s, "outcome") for s in attempts] == ["not_sent", "completed"]
        with pytest.raises(SystemExit):
            k.call("t.exit", {"n": 1}, call_id="c-exit")
        left = telemetry.one("execute_tool t.exit")
        assert events_of(left) == ["poimen.dispatched"]


def test_a_transactional_call_committed_with_its_outcome_is_the_happy_path(
    tmp_path: Path, telemetry: Telemetry
) -> None:
    """Its attempt ends "committed" (the outcome written in the tool's own transaction): a
    completed attempt, not an error, and no span or event beside the call's."""
    from tests.integration.transactional_app import NOTE, databases, make_kernel

    with (
        databases("sqlite-own", tmp_path) as (log, app),
        make_kernel(log, app, observers=[telemetry.observer()]) as k,
    ):
        assert isinstance(k.call(NOTE, {"text": "a"}, call_id="tx-1"), Completed)
    call = telemetry.one(f"execute_tool {NOTE}")
    assert attr(call, "outcome") == "completed" and call.status.is_ok
    assert events_of(call) == [] and telemetry.children(call) == []


def test_acall_spans_have_each_tasks_own_span_as_parent(
    store_url: str, telemetry: Telemetry
) -> None:
    with Kernel(store_url, notifiers=[], observers=[telemetry.observer()]) as k:
        add_tools(k)

        tracer = telemetry.tracer_provider.get_tracer("the agent")

        @k.tool(id="t.aok", effects=Unsafe(), caps=Caps(), timeout=5)
        async def aok(ctx: ToolContext, n: int) -> int:
            with tracer.start_as_current_span(f"tool {n}"):
                await asyncio.sleep(0.01)
            return n

        async def one(tool: str, n: int) -> tuple[int, int]:
            with tracer.start_as_current_span(f"task {n}") as parent:
                out = await k.acall(tool, {"n": n}, call_id=f"a-{n}")
                assert isinstance(out, Completed)
                ctx = parent.get_span_context()
                return ctx.span_id, n

        async def main() -> list[tuple[int, int]]:
            return await asyncio.gather(one("t.aok", 1), one("t.ok", 2), one("t.aok", 3))

        for parent_id, n in asyncio.run(main()):
            call = telemetry.one(f"execute_tool {'t.ok' if n == 2 else 't.aok'}", call_id=f"a-{n}")
            assert call.parent is not None and call.parent.span_id == parent_id
            # The tool runs under the call's span (no attempt span on the happy path), the
            # sync one in a pool thread alike.
            mine = [] if n == 2 else [f"tool {n}"]
            assert [s.name for s in telemetry.children(call)] == mine
            assert events_of(call) == []


def test_crash_and_recover_is_a_recovery_pass_with_takeovers(
    tmp_path: Path,
    store_url: str,
    provider: ProviderProcess,
    ledger: ProviderClient,
    telemetry: Telemetry,
) -> None:
    order = {"order_id": "o-1", "amount_cents": 100}
    crash_call(tmp_path, store_url, provider.url, CHARGE, order, "r-charge", "mid_call")
    crash_call(tmp_path, store_url, provider.url, EMAIL, {"to": "a@b.c", "subject": "s"},
               "r-mail", "after_effect")
    crash_call(tmp_path, store_url, provider.url, SHIP, {"order_id": "o", "address": "x"},
               "r-ship", "after_effect")
    with recovering_kernel(store_url, provider.url, observers=[telemetry.observer()]) as k:
        report = k.recover()
        assert recover_until_settled(k, "r-ship").state == S.COMPLETED
        assert report.completed >= 1 and report.indeterminate == 1

        passes = telemetry.spans("poimen.recovery")
        assert passes and passes[0].parent is None
        assert attr(passes[0], "recovery.indeterminate") == 1

        charge = telemetry.one("poimen.recover test.charge")
        assert charge.parent is not None and charge.parent.span_id == passes[0].context.span_id  # type: ignore[union-attr]
        assert events_of(charge) == ["poimen.takeover", "poimen.retry", "poimen.completed"]
        assert attr(charge, "outcome") == "completed"
        (attempt,) = telemetry.children(charge)
        assert attempt.name == "poimen.attempt test.charge"
        assert attr(attempt, "attempt") == 2 and attr(attempt, "fence") == 2
        assert attr(attempt, "outcome") == "completed"
        takeover = charge.events[0].attributes or {}
        assert takeover["poimen.previous_owner"] != k.worker_id
        assert takeover["poimen.intent_id"] == attr(charge, "intent_id")

        mail = telemetry.one("poimen.recover test.email")
        assert events_of(mail) == ["poimen.takeover", "poimen.indeterminate"]
        assert attr(mail, "outcome") == "indeterminate"
        assert attr(mail, "reason") == "unsafe_unknown_outcome"
        assert telemetry.children(mail) == []  # never run again

        ship = telemetry.one("poimen.recover test.ship", outcome="completed")
        (lookup,) = telemetry.children(ship)
        assert lookup.name == "poimen.lookup test.ship" and attr(lookup, "answer") == "landed"
        assert events_of(ship)[-1] == "poimen.completed"
        assert ship.events[-1].attributes["poimen.via"] == "lookup"  # type: ignore[index]

        assert telemetry.points("poimen.takeovers") == {
            key(tool_id=CHARGE): 1,
            key(tool_id=EMAIL): 1,
            key(tool_id=SHIP): 1,
        }
    assert ledger.count(kind="plain") == 1  # the Unsafe call was not sent again


class _Headers(BaseHTTPRequestHandler):
    server: _HeaderServer

    def _any(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with self.server.lock:
            self.server.seen.append(dict(self.headers.items()))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = _any

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _HeaderServer(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Headers)
        self.seen: list[dict[str, str]] = []
        self.lock = threading.Lock()


@pytest.fixture
def header_server() -> Iterator[_HeaderServer]:
    srv = _HeaderServer()
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    th.join()


def test_ctx_http_sends_the_traceparent_of_the_span_the_tool_runs_under(
    store_url: str, telemetry: Telemetry, header_server: _HeaderServer
) -> None:
    """A call's first attempt runs under the call's span, a later one under its own."""
    port = header_server.server_address[1]
    url = f"http://127.0.0.1:{port}/x"
    caps = Caps(hosts=(f"127.0.0.1:{port}",))
    tracer = telemetry.tracer_provider.get_tracer("the agent")

    def tools(k: Kernel) -> None:
        @k.tool(id="h.keyed", effects=Idempotent(key=KeyDerivation.all_args()), caps=caps,
                timeout=5)
        def keyed(ctx: ToolContext, n: int) -> int:
            ctx.http.post(url, json={"n": n})
            with httpx.Client(transport=ctx.http.transport) as lib:  # a client library
                lib.post(url, json={"n": n})
            return n

        @k.tool(id="h.plain", effects=Unsafe(), caps=Caps(), timeout=5)
        async def plain(ctx: ToolContext, n: int) -> int:
            await ctx.ahttp.post(url, json={"n": n}, headers={"X-Mine": "1"})
            return n

        @k.tool(id="h.again", effects=Idempotent(key=KeyDerivation.all_args()), caps=caps,
                timeout=5, retry=Retry(attempts=2, initial=0.01, maximum=0.01, budget=30))
        def again(ctx: ToolContext, n: int) -> int:
            ctx.http.post(url, json={"n": n})
            if len(header_server.seen) == 4:  # the first attempt: no answer, then a retry
                raise TimeoutError("no answer in time")
            return n

    with Kernel(store_url, notifiers=[], observers=[telemetry.observer()]) as k:
        tools(k)
        with tracer.start_as_current_span("agent"):
            assert isinstance(k.call("h.keyed", {"n": 1}, call_id="tp-1"), Completed)

        async def main() -> None:
            with tracer.start_as_current_span("agent async"):
                assert isinstance(await k.acall("h.plain", {"n": 2}, call_id="tp-2"), Completed)

        asyncio.run(main())
        assert isinstance(k.call("h.again", {"n": 3}, call_id="tp-again"), Completed)
        keyed = telemetry.one("execute_tool h.keyed")
        plain = telemetry.one("execute_tool h.plain")
        again = telemetry.one("execute_tool h.again")
        retried = telemetry.one("poimen.attempt h.again", attempt=2)
        want = [
            f"00-{s.context.trace_id:032x}-{s.context.span_id:016x}"  # type: ignore[union-attr]
            for s in (keyed, keyed, plain, again, retried)
        ]
        sent = [h.get("traceparent", "") for h in header_server.seen]
        assert [t[:-3] for t in sent] == want
        assert all(int(t[-2:], 16) & 1 for t in sent)  # sampled
        assert header_server.seen[0]["Idempotency-Key"]  # the key still goes with the write
        assert header_server.seen[2]["X-Mine"] == "1"

    # A kernel without the observer sends no trace context, even inside a span.
    header_server.seen.clear()
    with Kernel(store_url, notifiers=[], worker_id="plain") as k2:
        tools(k2)
        with tracer.start_as_current_span("agent"):
            assert isinstance(k2.call("h.keyed", {"n": 3}, call_id="tp-3"), Completed)
    assert len(header_server.seen) == 2
    assert all("traceparent" not in h for h in header_server.seen)


# 2. Metrics.


def test_metrics_count_a_scripted_sequence(store_url: str, telemetry: Telemetry) -> None:
    with Kernel(
        store_url, notifiers=[], lease_ttl=0.3, observers=[telemetry.observer(log_gauges=True)]
    ) as k:
        ids = scripted(k)
        log = op.redact_store_url(k.store.url)
        calls = telemetry.points("poimen.calls")
        assert calls == {
            key(tool_id="t.ok", outcome="completed"): 2,
            key(tool_id="t.refused", outcome="failed"): 1,
            key(tool_id="t.boom", outcome="indeterminate"): 1,
            key(tool_id="t.rogue", outcome="failed"): 1,
            key(tool_id="t.slow", outcome="completed"): 1,
        }
        assert telemetry.points("poimen.call.duration") == calls  # one duration per call
        attempts = telemetry.points("poimen.attempts")
        assert attempts[key(tool_id="t.ok", outcome="completed")] == 3  # the orphan's retry
        assert attempts[key(tool_id="t.boom", outcome="unknown")] == 1
        assert telemetry.points("poimen.indeterminate") == {
            key(tool_id="t.boom", reason="unsafe_unknown_outcome"): 1
        }
        assert telemetry.points("poimen.takeovers") == {key(tool_id="t.ok"): 1}
        assert telemetry.points("poimen.denials") == {key(tool_id="t.rogue", action="http"): 1}
        assert telemetry.points("poimen.lease.renewals")[frozenset()] >= 1
        assert telemetry.points("poimen.recovery.duration") == {frozenset(): 1}
        assert telemetry.points("poimen.indeterminate.open") == {key(log=log, tool_id="t.boom"): 1}
        unfinished = telemetry.points("poimen.intents.unfinished")
        assert unfinished == {key(log=log, tool_id="gone.tool"): 1}
        assert telemetry.points("poimen.outbox.backlog") == {key(log=log): 1}
        age = telemetry.points("poimen.indeterminate.oldest_age")[key(log=log)]
        boom = k.store.get_intent(ids["boom"])
        assert boom is not None and 0 < age <= k.store.now() - boom.created_at + 1


def parse_prometheus(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        assert m, f"not a Prometheus sample line: {line!r}"
        assert m.group(1) in types, f"{m.group(1)} has no # TYPE"
        labels = re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or "")
        out[(m.group(1), frozenset(labels))] = float(m.group(3))
    return out


def test_console_metrics_endpoint_serves_prometheus_text_to_its_token_only(
    store_url: str,
) -> None:
    from tests.integration.test_console import TOKEN, serve_console

    with Kernel(store_url, notifiers=[], lease_ttl=0.3) as k:
        ids = scripted(k)
    metrics_token = "metrics-token-5b1e0f2a9c"
    with (
        serve_console(store_url, "--metrics-token", metrics_token) as url,
        httpx.Client(base_url=url, timeout=30) as c,
    ):
        assert c.get("/metrics").status_code == 401
        r = c.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 401  # the operators' token opens no metrics
        assert c.get(f"/?token={TOKEN}").status_code == 303  # an operator's session
        r = c.get("/metrics")
        assert r.status_code == 401 and "poimen_" not in r.text
        r = c.get("/metrics", headers={"Authorization": f"Bearer {metrics_token}"})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        # The metrics token opens nothing of the console.
        with httpx.Client(base_url=url, timeout=30) as other:
            page = other.get("/", headers={"Authorization": f"Bearer {metrics_token}"})
            assert page.status_code == 401
    got = parse_prometheus(r.text)

    def v(name: str, **labels: str) -> float:
        return got[(name, frozenset(labels.items()))]

    assert v("poimen_intents", tool="t.ok", state="COMPLETED") == 3
    assert v("poimen_intents", tool="t.refused", state="FAILED") == 1
    assert v("poimen_intents", tool="t.rogue", state="FAILED") == 1
    assert v("poimen_intents", tool="t.boom", state="INDETERMINATE") == 1
    assert v("poimen_indeterminate_open", tool="t.boom") == 1
    assert v("poimen_intents_unfinished", tool="gone.tool") == 1
    assert v("poimen_outbox_backlog") == 1
    assert v("poimen_denials_total", tool="t.rogue") == 1
    assert v("poimen_indeterminate_oldest_age_seconds") > 0
    # One Indeterminate call: its tool's oldest is the oldest, read at the same moment.
    assert v("poimen_indeterminate_oldest_seconds", tool="t.boom") == v(
        "poimen_indeterminate_oldest_age_seconds")
    assert ids["boom"] not in r.text  # counts, never intents

    # Without --metrics-token there is no such page.
    with serve_console(store_url) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.get("/metrics", headers={"Authorization": f"Bearer {metrics_token}"})
        assert r.status_code == 404


def test_console_refuses_a_metrics_token_that_is_the_console_token(store_url: str) -> None:
    from tests.integration.operator_app import POIMEN
    from tests.integration.test_console import TOKEN

    for bad, why in ((TOKEN, "must differ"), ("short", "at least 16")):
        r = subprocess.run(
            [str(POIMEN), "console", "--db", store_url, "--port", "0", "--token", TOKEN,
             "--metrics-token", bad],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )
        assert r.returncode == 2 and why in r.stderr, r.stderr


def test_the_denial_counter_reads_only_new_denials(store_url: str) -> None:
    from poimen.operator._metrics import DenialCounter
    from poimen.store import open_store

    store = open_store(store_url)
    try:
        counter = DenialCounter()
        counter.PAGE = 2  # pages of two: the paging is exercised
        for i in range(5):
            store.record_denial(tool_id=f"t{i % 2}", intent_id=None, attempt=None,
                                action="http", target="x", reason="r", now=store.now())
        assert counter.read(store) == {"t0": 3, "t1": 2}
        assert counter.read(store) == {"t0": 3, "t1": 2}  # nothing counted twice
        store.record_denial(tool_id="t1", intent_id=None, attempt=None, action="sink",
                            target="y", reason="r", now=store.now())
        assert counter.read(store) == {"t0": 3, "t1": 3}
    finally:
        store.close()


# 3. Logs.


def poimen_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if isinstance(getattr(r, "poimen", None), dict)]


def test_each_transition_is_logged_once_at_its_level(
    tmp_path: Path,
    store_url: str,
    provider: ProviderProcess,
    caplog: pytest.LogCaptureFixture,
) -> None:
    crash_call(tmp_path, store_url, provider.url, EMAIL, {"to": "a@b.c", "subject": "s"},
               "l-mail", "after_effect")
    caplog.set_level(logging.DEBUG, logger="poimen")
    with recovering_kernel(store_url, provider.url) as k:
        add_tools(k)
        ok = k.call("t.ok", {"n": 1}, call_id="l-ok")
        aok = asyncio.run(k.acall("t.ok", {"n": 2}, call_id="l-aok"))
        boom = k.call("t.boom", {"n": 1}, call_id="l-boom")
        k.resolve(boom.intent_id, landed=False, operator="ana", reason="no mail in the outbox")
        k.recover()
        mail = k.store.get_by_call_id("l-mail")
        assert mail is not None and mail.state == S.INDETERMINATE

    records = poimen_records(caplog)
    by_intent: dict[str, list[tuple[str, str, int]]] = {}
    for r in records:
        f: dict[str, Any] = r.poimen  # type: ignore[attr-defined]
        if "intent_id" in f:
            by_intent.setdefault(f["intent_id"], []).append((f["event"], r.name, r.levelno))
    D, I = logging.DEBUG, logging.INFO  # noqa: E741
    happy = [("dispatched", "poimen.call", D), ("completed", "poimen.call", D)]
    assert by_intent[ok.intent_id] == happy
    assert by_intent[aok.intent_id] == happy  # acall's own commit path, once each too
    assert by_intent[boom.intent_id] == [
        ("dispatched", "poimen.call", D),
        ("unknown_outcome", "poimen.call", I),
        ("indeterminate", "poimen.call", I),
        ("resolved", "poimen.operator", I),
    ]
    assert by_intent[mail.id] == [
        ("takeover", "poimen.recovery", I),
        ("indeterminate", "poimen.call", I),
    ]
    (resolved,) = [r for r in records if r.poimen["event"] == "resolved"]  # type: ignore[attr-defined]
    f = resolved.poimen  # type: ignore[attr-defined]
    assert f["tool_id"] == "t.boom" and f["effect"] == "unsafe" and f["call_id"] == "l-boom"
    assert f["operator"] == "ana" and f["landed"] is False
    assert "t.boom" in resolved.getMessage() and boom.intent_id in resolved.getMessage()
    (indet,) = [
        r
        for r in records
        if r.poimen["event"] == "indeterminate"  # type: ignore[attr-defined]
        and r.poimen["intent_id"] == mail.id  # type: ignore[attr-defined]
    ]
    assert indet.poimen["reason"] == "unsafe_unknown_outcome"  # type: ignore[attr-defined]
    passes = [r for r in records if r.poimen["event"] == "recovery_pass_finished"]  # type: ignore[attr-defined]
    assert [r.levelno for r in passes] == [I]  # it settled one intent
    assert passes[0].poimen["report"]["indeterminate"] == 1  # type: ignore[attr-defined]


def test_without_logging_or_observers_the_kernel_uses_its_store_as_is(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="poimen")  # as configured by default
    assert not logging.getLogger("poimen.call").isEnabledFor(logging.INFO)
    with Kernel(store_url, notifiers=[]) as k:
        add_tools(k)
        assert k._engine.observer is None
        assert k._engine.store is k.store and k._issuer.store is k.store
        k.call("t.boom", {"n": 1}, call_id="q-1")
        k.launch(background=False)
        assert k._engine.observer is None
    assert poimen_records(caplog) == []
    with Kernel(store_url, notifiers=[], log_events=True, worker_id="forced") as k:
        add_tools(k)
        assert k._engine.observer is not None  # installed; the loggers' levels still decide
        k.call("t.boom", {"n": 1}, call_id="q-2")
        assert poimen_records(caplog) == []
        caplog.set_level(logging.INFO, logger="poimen")
        k.call("t.boom", {"n": 1}, call_id="q-3")
    assert [r.poimen["event"] for r in poimen_records(caplog)] == [  # type: ignore[attr-defined]
        "unknown_outcome",
        "indeterminate",
    ]
    caplog.set_level(logging.DEBUG, logger="poimen")
    with Kernel(store_url, notifiers=[], log_events=False, worker_id="quiet") as k:
        assert k._engine.observer is None
    # Logging configured after the kernel was made: launch notices.
    caplog.clear()
    logging.getLogger("poimen").setLevel(logging.WARNING)
    with Kernel(store_url, notifiers=[], worker_id="late") as k:
        add_tools(k)
        assert k._engine.observer is None
        logging.getLogger("poimen").setLevel(logging.DEBUG)
        k.launch(background=False)
        k.call("t.ok", {"n": 9}, call_id="q-4")
    assert [r.poimen["event"] for r in poimen_records(caplog)][-2:] == [  # type: ignore[attr-defined]
        "dispatched",
        "completed",
    ]


def test_the_json_formatter_of_the_docs_writes_one_object_per_record(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- json-logging -->\s*```python\n(.*?)```", doc, re.S)
    assert m, "docs/observability.md lost its JSON logging example"
    logger = logging.getLogger("poimen")
    before = (list(logger.handlers), logger.level, logger.propagate)
    try:
        exec(compile(m.group(1), "docs/observability.md", "exec"), {"__name__": "docs"})
        with Kernel(store_url, notifiers=[]) as k:
            add_tools(k)
            out = k.call("t.boom", {"n": 1}, call_id="j-1")
    finally:
        for h in logger.handlers[:]:
            if h not in before[0]:
                logger.removeHandler(h)
        logger.setLevel(before[1])
        logger.propagate = before[2]
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]
    mine = [x for x in lines if x.get("intent_id") == out.intent_id]
    assert [x["event"] for x in mine] == ["unknown_outcome", "indeterminate"]  # INFO and up
    assert mine[-1]["level"] == "INFO" and mine[-1]["reason"] == "unsafe_unknown_outcome"
    assert mine[-1]["logger"] == "poimen.call" and mine[-1]["tool_id"] == "t.boom"


# 4. Hooks.


def test_a_hook_gets_the_typed_event_off_the_callers_thread(store_url: str) -> None:
    got: list[tuple[KernelEvent, threading.Thread]] = []
    done = threading.Event()
    seen_all: list[str] = []

    with Kernel(store_url, notifiers=[]) as k:
        add_tools(k)

        def on_indeterminate(e: IndeterminateEvent) -> None:
            got.append((e, threading.current_thread()))
            done.set()

        k.on(IndeterminateEvent, on_indeterminate)

        @k.on(CallFinishedEvent)
        def broken(e: CallFinishedEvent) -> None:
            raise RuntimeError("a hook's bug must not reach the caller")

        k.on(KernelEvent, lambda e: seen_all.append(e.kind))
        happy = k.call("t.ok", {"n": 1}, call_id="h-ok")
        assert isinstance(happy, Completed)
        out = k.call("t.boom", {"n": 1}, call_id="h-boom")
        assert isinstance(out, Indeterminate)
        assert done.wait(30)
        with pytest.raises(PoimenError, match="event class"):
            k.on(str, print)  # type: ignore[call-overload]
        with pytest.raises(PoimenError, match="function"):
            k.on(IndeterminateEvent, 3)  # type: ignore[call-overload]
    # close() ran the hooks still queued.
    ((event, thread),) = got
    assert thread is not threading.current_thread() and thread.name == "poimen-hooks"
    assert type(event) is IndeterminateEvent
    assert event.intent_id == out.intent_id and event.call_id == "h-boom"
    assert event.tool_id == "t.boom" and event.effect == "unsafe"
    assert event.reason == "unsafe_unknown_outcome" and event.worker_id == k.worker_id
    assert seen_all[:6] == [
        "call_started",
        "dispatched",
        "attempt_started",
        "attempt_finished",
        "completed",
        "call_finished",
    ]


def test_an_observer_that_raises_does_not_break_a_call(store_url: str) -> None:
    class Broken(Observer):
        def event(self, event: KernelEvent) -> None:
            raise RuntimeError("observer bug")

    with Kernel(store_url, notifiers=[], observers=[Broken()]) as k:
        add_tools(k)
        assert isinstance(k.call("t.ok", {"n": 1}, call_id="b-1"), Completed)
        assert isinstance(k.call("t.boom", {"n": 1}, call_id="b-2"), Indeterminate)
    with pytest.raises(PoimenError, match="Observer"):
        Kernel(store_url, observers=[object()])  # type: ignore[list-item]


def test_a_slow_hook_does_not_slow_the_caller(store_url: str) -> None:
    release = threading.Event()
    ran = threading.Event()

    def slow(e: KernelEvent) -> None:
        ran.set()
        release.wait(30)

    with Kernel(store_url, notifiers=[]) as k:
        add_tools(k)
        k.on(CallFinishedEvent, slow)
        for i in range(5):
            assert isinstance(k.call("t.ok", {"n": i}, call_id=f"s-{i}"), Completed)
        assert ran.wait(30)
        # The calls returned while the first hook still waited.
        assert not release.is_set()
        release.set()


def test_a_forked_child_reports_as_its_own_worker_on_its_own_hook_thread(
    store_url: str, tmp_path: Path
) -> None:
    import os

    out = tmp_path / "child.json"
    with Kernel(store_url, notifiers=[], worker_id="api") as k:
        add_tools(k)
        seen: list[CallFinishedEvent] = []
        k.on(CallFinishedEvent, seen.append)
        assert isinstance(k.call("t.ok", {"n": 1}, call_id="f-parent"), Completed)
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            code = 1
            try:
                got = threading.Event()
                k.on(CallFinishedEvent, lambda e: got.set())
                assert isinstance(k.call("t.ok", {"n": 2}, call_id="f-child"), Completed)
                assert got.wait(30), "the child's hook never ran"
                last = seen[-1]
                out.write_text(json.dumps([last.call_id, last.worker_id, k.worker_id]))
                code = 0
            except BaseException as exc:
                print("child failed:", repr(exc), flush=True)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        call_id, worker, child_worker = json.loads(out.read_text())
        assert call_id == "f-child" and worker == child_worker == f"api.{pid}"
        assert [e.call_id for e in seen] == ["f-parent"]  # the parent saw its own call only
