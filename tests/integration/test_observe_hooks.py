"""Observation through the engine's hooks (poimen._engine.hooks): nothing wraps the store, each
write is reported once by the code that made it, an observer gets only what it asks for, and
OpenTelemetry without an SDK asks for nothing until one is configured (docs/observability.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from poimen import Caps, Completed, Failed, Kernel, Pending, Queryable, ToolContext, Unknown, Unsafe
from poimen._core.intents import Owner
from poimen._engine.hooks import CALLS, RECOVERY, TRANSITIONS
from poimen.events import (
    CallFinishedEvent,
    DenialEvent,
    FencedOutEvent,
    IndeterminateEvent,
    KernelEvent,
    Observer,
)
from poimen.otel import OpenTelemetry
from tests.integration.test_observability import Telemetry, add_tools, events_of, sdk_telemetry

ROOT = Path(__file__).resolve().parents[2]


class Recorder(Observer):
    """Every event, in the order the kernel's threads reported them."""

    def __init__(self) -> None:
        self.seen: list[KernelEvent] = []
        self._lock = threading.Lock()

    def event(self, event: KernelEvent) -> None:
        with self._lock:
            self.seen.append(event)

    def of(self, intent_id: str) -> list[str]:
        with self._lock:
            return [e.kind for e in self.seen if getattr(e, "intent_id", None) == intent_id]


def test_the_kernel_with_observers_uses_its_store_as_is(store_url: str) -> None:
    rec = Recorder()
    with Kernel(store_url, notifiers=[], observers=[rec]) as k:
        add_tools(k)
        assert k._engine.store is k.store and k._issuer.store is k.store
        out = k.call("t.ok", {"n": 1}, call_id="as-is")
        assert isinstance(out, Completed)
    assert rec.of(out.intent_id) == [
        "dispatched",
        "attempt_started",
        "attempt_finished",
        "completed",
        "call_finished",
    ]


def test_approvals_abandons_deferrals_and_fenced_writes_are_reported_once(
    store_url: str,
) -> None:
    rec = Recorder()
    with Kernel(store_url, notifiers=[], observers=[rec], worker_id="obs-w") as k:

        @k.tool(id="t.ask", effects=Unsafe(), caps=Caps(), timeout=5, requires_approval=True)
        def ask(ctx: ToolContext, n: int) -> int:
            return n

        @k.tool(
            id="t.brief",
            effects=Unsafe(),
            caps=Caps(),
            timeout=5,
            requires_approval=True,
            approval_ttl=0.05,
        )
        def brief(ctx: ToolContext, n: int) -> int:
            return n

        @k.tool(
            id="t.query",
            effects=Queryable(lookup=lambda request_id: Unknown("the provider is down")),
            caps=Caps(),
            timeout=5,
        )
        def query(ctx: ToolContext, n: int) -> int:
            raise TimeoutError("no answer in time")

        @k.tool(id="t.lost", effects=Unsafe(), caps=Caps(), timeout=5)
        def lost(ctx: ToolContext, n: int) -> int:
            # Another owner takes the intent over while the tool runs: its outcome loses.
            now = k.store.now()
            other = Owner("w-other", "other-host", 1, "1")
            taken = k.store.claim(ctx.intent_id, 1, other, lease_expires_at=now + 60,
                                  new_attempt=True, deadline_at=None, now=now)
            assert taken is not None
            return n

        yes = k.call("t.ask", {"n": 1}, call_id="ap-yes")
        no = k.call("t.ask", {"n": 2}, call_id="ap-no")
        late = k.call("t.brief", {"n": 3}, call_id="ap-late")
        assert all(isinstance(o, Pending) for o in (yes, no, late))
        k.approve(yes.intent_id, operator="ana", reason="fine")
        k.reject(no.intent_id, operator="ana", reason="no")
        until = k.store.now() + 0.06  # past the approval window, on the log's clock
        while k.store.now() < until:
            time.sleep(0.01)
        k.recover()

        deferred = k.call("t.query", {"n": 1}, call_id="q-1")
        assert isinstance(deferred, Pending)
        fenced = k.call("t.lost", {"n": 1}, call_id="f-1")

        now = k.store.now()
        gone = k.store.record_dispatch(_orphan_dispatch(k, "gone-1", now))[0]
        k.abandon(gone.id, operator="ana", reason="its worker is gone")

    asked = ["approval_requested", "call_finished"]
    assert rec.of(yes.intent_id) == [
        *asked,
        "approval_decided",
        # recovery runs the approved call
        "intent_recovery_started",
        "takeover",
        "retry",
        "attempt_started",
        "attempt_finished",
        "completed",
        "intent_recovery_finished",
    ]
    assert rec.of(no.intent_id) == [*asked, "approval_decided"]
    decided = [e for e in rec.seen if e.kind == "approval_decided"]
    assert [getattr(e, "approved", None) for e in decided] == [True, False]
    assert rec.of(late.intent_id) == [*asked, "approval_expired"]
    assert rec.of(deferred.intent_id) == [
        "dispatched",
        "attempt_started",
        "attempt_finished",
        "unknown_outcome",
        "lookup_started",
        "lookup_finished",
        "deferred",
        "call_finished",
    ]
    assert rec.of(fenced.intent_id) == [
        "dispatched",
        "attempt_started",
        "attempt_finished",
        "fenced_out",
        "call_finished",
    ]
    (fence_event,) = [e for e in rec.seen if isinstance(e, FencedOutEvent)]
    assert fence_event.write == "outcome" and fence_event.fence == 1
    assert rec.of(gone.id) == ["abandoned"]
    assert all(e.worker_id == "obs-w" for e in rec.seen)


def _orphan_dispatch(k: Kernel, call_id: str, now: float) -> Any:
    from poimen._core.keys import args_digest, canonical
    from poimen.store._base import NewDispatch

    text = canonical({"n": 1})
    return NewDispatch(
        intent_id=f"in_{call_id}",
        call_id=call_id,
        tool_id="t.gone",
        effect="unsafe",
        args=text,
        args_hash=args_digest(text),
        key=None,
        request_id=None,
        owner=Owner("w-gone", "gone-host", 1, "1"),
        lease_expires_at=now - 1,
        timeout_s=5,
        deadline_at=now - 1,
        now=now - 1,
    )


def test_an_observer_gets_only_the_hooks_it_asks_for(store_url: str) -> None:
    with Kernel(store_url, notifiers=[]) as k:
        add_tools(k)
        finished: list[str] = []
        k.on(IndeterminateEvent, lambda e: None)
        obs = k._engine.observer
        assert obs is not None and obs.wants == TRANSITIONS  # no call scope is timed for it
        k.on(CallFinishedEvent, lambda e: finished.append(e.call_id))
        assert obs.wants == TRANSITIONS | CALLS and not obs.wants & RECOVERY
        assert isinstance(k.call("t.ok", {"n": 1}, call_id="only"), Completed)
        k.off(CallFinishedEvent, finished.append)  # not the function given: nothing changes
        assert obs.wants == TRANSITIONS | CALLS
    assert finished == ["only"]  # close() ran the queued hooks


def test_opentelemetry_without_an_sdk_asks_for_nothing(store_url: str) -> None:
    with Kernel(store_url, notifiers=[], observers=[OpenTelemetry()]) as k:
        add_tools(k)
        obs = k._engine.observer
        assert obs is not None and obs.wants == 0 and obs.watching
        assert isinstance(k.call("t.ok", {"n": 1}, call_id="no-sdk"), Completed)


def test_opentelemetry_made_before_the_sdk_records_from_the_next_call(tmp_path: Path) -> None:
    """The global providers set after the kernel was made (as an application's main does):
    spans and points from the next call on. In a child: a global provider is set once."""
    code = f"""
import json
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from poimen import Caps, Kernel, Unsafe
from poimen.otel import OpenTelemetry

k = Kernel("sqlite:///{tmp_path / 'late.db'}", notifiers=[], observers=[OpenTelemetry()])

@k.tool(id="t", effects=Unsafe(), caps=Caps(), timeout=5)
def t(ctx, n: int) -> int:
    return n

k.call("t", {{"n": 0}}, call_id="before")
exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
tp = TracerProvider()
tp.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(tp)
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
k.call("t", {{"n": 1}}, call_id="after")
calls = [
    (dict(p.attributes), p.value)
    for rm in reader.get_metrics_data().resource_metrics
    for sm in rm.scope_metrics for m in sm.metrics if m.name == "poimen.calls"
    for p in m.data.data_points
]
obs = k._engine.observer
print(json.dumps([[s.name for s in exporter.get_finished_spans()], calls, obs.watching]))
k.close()
"""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    spans, calls, watching = json.loads(r.stdout)
    assert spans == ["execute_tool t"]  # the happy path: the call's span alone
    assert calls == [[{"poimen.tool_id": "t", "poimen.outcome": "completed"}, 1]]
    assert watching is False  # both globals set: never looked at again


def test_two_opentelemetry_observers_each_get_the_call(store_url: str) -> None:
    made = [sdk_telemetry() for _ in range(2)]
    tel: list[Telemetry] = [next(m) for m in made]
    with Kernel(store_url, notifiers=[], observers=[t.observer() for t in tel]) as k:
        add_tools(k)
        assert isinstance(k.call("t.ok", {"n": 1}, call_id="two"), Completed)
        assert isinstance(k.call("t.refused", {"n": 1}, call_id="two-refused"), Failed)
    for t in tel:
        names = ["execute_tool t.ok", "poimen.attempt t.refused", "execute_tool t.refused"]
        assert [s.name for s in t.spans()] == names
        # Each observer's transitions are events on its own span, not on the current one.
        call = t.one("execute_tool t.refused")
        assert events_of(call) == ["poimen.dispatched", "poimen.failed"]
        assert [s.name for s in t.children(call)] == ["poimen.attempt t.refused"]
    for m in made:
        next(m, None)  # shut the providers down


def test_kernels_sharing_a_meter_provider_count_into_the_same_counters(tmp_path: Path) -> None:
    """The calls and attempts counters are registered once per meter: a second registration
    of the name would be given the first instrument and lose its own callback."""
    made = sdk_telemetry()
    telemetry = next(made)
    kernels = [
        Kernel(f"sqlite:///{tmp_path / f'{n}.db'}", notifiers=[], observers=[telemetry.observer()])
        for n in range(2)
    ]
    for n, k in enumerate(kernels):
        add_tools(k)
        assert isinstance(k.call("t.ok", {"n": n}, call_id=f"shared-{n}"), Completed)
        assert isinstance(k.call("t.refused", {"n": n}, call_id=f"refused-{n}"), Failed)
    completed = frozenset({("poimen.tool_id", "t.ok"), ("poimen.outcome", "completed")})
    failed = frozenset({("poimen.tool_id", "t.refused"), ("poimen.outcome", "failed")})
    assert telemetry.points("poimen.calls") == {completed: 2, failed: 2}
    assert telemetry.points("poimen.attempts") == {completed: 2, failed: 2}
    for k in kernels:
        k.close()
    next(made, None)  # shut the providers down


def test_a_sandbox_denial_of_an_unsafe_tool_is_reported(tmp_path: Path) -> None:
    """Shadow and replay record a denial for every Unsafe call they refuse: observers get it, as
    they get the capability layer's denials."""
    live = f"sqlite:///{tmp_path / 'live.db'}"
    with Kernel(live, notifiers=[]) as k:
        add_tools(k)
    for mode, source in (
        ("shadow", {"live": live}),
        ("replay", {"recording": live, "on_divergence": "record"}),
    ):
        rec = Recorder()
        url = f"sqlite:///{tmp_path / f'{mode}.db'}"
        with Kernel(url, mode=mode, notifiers=[], observers=[rec], **source) as k:  # type: ignore[arg-type]
            add_tools(k)
            k.call("t.boom", {"n": 1}, call_id=f"{mode}/1")
            denials = [e for e in rec.seen if isinstance(e, DenialEvent)]
            recorded = [d.reason for d in k.denials()]
        assert recorded == [f"unsafe tool in {mode} mode"]
        assert [(e.tool_id, e.target, e.reason) for e in denials] == [
            ("t.boom", f"{mode}/1", f"unsafe tool in {mode} mode")
        ]
