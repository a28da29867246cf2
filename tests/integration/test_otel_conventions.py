"""The OpenTelemetry observer speaks the conventions backends read: a tool call is an
``execute_tool`` span with the GenAI attributes and ``error.type``; an idle background
recovery pass leaves no span; gauges that describe the whole log are exported once per log.
Read back from the SDK's in-memory exporter and reader (docs/observability.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.trace import SpanKind, StatusCode

from poimen import Completed, Failed, Indeterminate, Kernel
from poimen.events import RecoveryPassFinishedEvent
from poimen.operator import _ops as op
from poimen.otel import OpenTelemetry
from tests.integration.test_observability import (
    Telemetry,
    add_tools,
    attr,
    orphan,
    sdk_telemetry,
)


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    yield from sdk_telemetry()


def gen_ai(span: object) -> dict[str, object]:
    return {
        k: v
        for k, v in (getattr(span, "attributes", None) or {}).items()
        if k.startswith("gen_ai.") or k == "error.type"
    }


def test_a_tool_call_is_an_execute_tool_span_with_the_genai_attributes(
    store_url: str, telemetry: Telemetry
) -> None:
    with Kernel(store_url, notifiers=[], observers=[telemetry.observer()]) as k:
        add_tools(k)
        assert isinstance(k.call("t.ok", {"n": 1}, call_id="g-ok"), Completed)
        assert isinstance(k.call("t.refused", {"n": 1}, call_id="g-no"), Failed)
        assert isinstance(k.call("t.boom", {"n": 1}, call_id="g-boom"), Indeterminate)

    ok = telemetry.one("execute_tool t.ok")
    assert ok.kind == SpanKind.INTERNAL
    assert gen_ai(ok) == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "t.ok",
        "gen_ai.tool.call.id": "g-ok",
        "gen_ai.tool.type": "function",
    }
    assert ok.status.status_code == StatusCode.UNSET
    assert attr(ok, "call_id") == "g-ok"  # poimen's own attributes stay

    refused = telemetry.one("execute_tool t.refused")
    assert gen_ai(refused)["error.type"] == "failed"
    assert refused.status.status_code == StatusCode.ERROR

    boom = telemetry.one("execute_tool t.boom")
    assert gen_ai(boom)["error.type"] == "unsafe_unknown_outcome"
    assert boom.status.status_code == StatusCode.ERROR
    (attempt,) = telemetry.children(boom)
    assert (attempt.attributes or {})["error.type"] == "unknown"
    # Exactly one execute_tool span per call: attempts and recoveries are poimen's own.
    assert sorted(s.name for s in telemetry.spans("execute_tool")) == [
        "execute_tool t.boom",
        "execute_tool t.ok",
        "execute_tool t.refused",
    ]


def test_an_idle_background_recovery_pass_leaves_no_span(
    store_url: str, telemetry: Telemetry
) -> None:
    passes = threading.Semaphore(0)
    k = Kernel(
        store_url, notifiers=[], observers=[telemetry.observer()], recover_interval=0.05
    )
    try:
        add_tools(k)
        k.on(RecoveryPassFinishedEvent, lambda e: passes.release())
        k.launch(background=True)
        for _ in range(4):  # the launch's pass and three background ones, all idle
            assert passes.acquire(timeout=60)
        assert telemetry.spans("poimen.recovery") == []

        # A pass that drives something is a span, with its intent's span under it.
        orphan(k, "g-orphan", "t.ok", {"n": 3}, "idempotent")
        end = time.monotonic() + 60
        while not telemetry.spans("poimen.recover t.ok"):
            assert time.monotonic() < end, [s.name for s in telemetry.spans()]
            passes.acquire(timeout=1)
    finally:
        k.close()
    (recover,) = telemetry.spans("poimen.recover t.ok")
    (pass_span,) = [s for s in telemetry.spans("poimen.recovery") if s.name == "poimen.recovery"]
    assert pass_span.parent is None
    assert recover.parent is not None and pass_span.context is not None
    assert recover.parent.span_id == pass_span.context.span_id
    assert attr(pass_span, "recovery.completed") == 1
    assert pass_span.start_time is not None and recover.start_time is not None
    assert pass_span.start_time <= recover.start_time  # it began when the pass began


def test_a_pass_the_caller_asked_for_is_a_child_even_when_idle(
    store_url: str, telemetry: Telemetry
) -> None:
    tracer = telemetry.tracer_provider.get_tracer("the operator")
    with (
        Kernel(store_url, notifiers=[], observers=[telemetry.observer()]) as k,
        tracer.start_as_current_span("nightly check") as parent,
    ):
        k.recover()
    (pass_span,) = telemetry.spans("poimen.recovery")
    assert pass_span.parent is not None
    assert pass_span.parent.span_id == parent.get_span_context().span_id


def _gauge(reader: InMemoryMetricReader, name: str) -> list[tuple[dict[str, object], float]]:
    data = reader.get_metrics_data()
    out = []
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    out += [(dict(p.attributes or {}), p.value) for p in m.data.data_points]
    return out


def test_whole_log_gauges_are_exported_once_per_log_not_once_per_kernel(
    tmp_path: Path,
) -> None:
    url, other = f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"
    # Three kernels on one log, as three processes would be, each with its own exporter;
    # the one told to export the log's gauges does.
    readers = [InMemoryMetricReader() for _ in range(3)]
    providers = [MeterProvider(metric_readers=[r]) for r in readers]
    kernels = [
        Kernel(url, notifiers=[], worker_id=f"w{i}", observers=[
            OpenTelemetry(meter_provider=mp, log_gauges=i == 0)
        ])
        for i, mp in enumerate(providers)
    ]
    try:
        for k in kernels:
            add_tools(k)
        assert isinstance(kernels[1].call("t.boom", {"n": 1}, call_id="one"), Indeterminate)
        seen = [_gauge(r, "poimen.indeterminate.open") for r in readers]
        total = sum(v for points in seen for _, v in points)
        assert total == 1, seen  # summed over every exporter: the log's one intent
        assert seen[0] == [({"poimen.log": op.redact_store_url(url), "poimen.tool_id": "t.boom"}, 1)]

        # In one process, kernels on two logs sharing a meter: one series per log.
        reader = InMemoryMetricReader()
        mp = MeterProvider(metric_readers=[reader])
        here = [
            Kernel(u, notifiers=[], worker_id=f"x{i}", observers=[
                OpenTelemetry(meter_provider=mp, log_gauges=True)
            ])
            for i, u in enumerate((url, url, other))
        ]
        try:
            backlog = sorted(_gauge(reader, "poimen.outbox.backlog"), key=lambda p: str(p[0]))
            assert [p[0]["poimen.log"] for p in backlog] == sorted(
                [op.redact_store_url(url), op.redact_store_url(other)]
            )
            open_ = _gauge(reader, "poimen.indeterminate.open")
            assert [v for _, v in open_] == [1]
        finally:
            for k in here:
                k.close()
            mp.shutdown()
    finally:
        for k in kernels:
            k.close()
        for mp in providers:
            mp.shutdown()
