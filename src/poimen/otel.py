"""OpenTelemetry traces and metrics for a kernel (extra ``poimen[otel]``, the API only).

    from poimen.otel import OpenTelemetry
    kernel = Kernel("sqlite:///agent.db", observers=[OpenTelemetry()])

Spans: ``poimen.call <tool>`` for each `call`/`acall`, a child of the caller's active span;
``poimen.attempt <tool>`` for each run of the tool (its own spans, and the ``traceparent``
that `ctx.http` sends, are children of it); ``poimen.lookup <tool>``; ``poimen.recovery``
for a recovery pass with ``poimen.recover <tool>`` for each intent it drives. Transitions
(dispatched, unknown outcome, retry, takeover, Indeterminate, ...) are events on the span
current when they happen. Attributes are named ``poimen.*`` (tool id, effect class, call id,
intent id, attempt, fence, outcome, reason).

Metrics (docs/observability.md lists them): calls by tool and outcome and their duration,
attempts, Indeterminate transitions, takeovers, lease renewals, denials, recovery pass
duration; gauges read from the log: open Indeterminate intents and the oldest one's age,
unfinished intents, the outbox backlog.

The global tracer and meter providers are used unless others are given; without an SDK
configured they record nothing.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

from poimen import _metrics
from poimen import events as ev
from poimen._intents import IntentState
from poimen.errors import MissingExtraError

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics as otel_metrics
    from opentelemetry import propagate as otel_propagate
    from opentelemetry import trace as otel_trace
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.trace import Status, StatusCode
except ImportError as exc:  # the extra is missing: say which one
    raise MissingExtraError.of("poimen.otel", "otel", exc) from exc

if TYPE_CHECKING:
    from poimen._kernel import Kernel
    from poimen.store import Store

__all__ = ["OpenTelemetry"]

#: Durations of calls, attempts and passes, in seconds.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_ATTRS = ("tool_id", "effect", "call_id", "intent_id", "attempt", "fence", "outcome", "reason")
# What a scope learns by its end (the rest was set at its start).
_FINISH_ATTRS = ("intent_id", "outcome", "reason")
_SPAN_EVENT_FIELDS = (
    *_ATTRS,
    *("error", "via", "operator", "landed", "approved", "until", "previous_owner", "write"),
    *("action", "target", "request_id"),
)


def _version() -> str:
    try:
        return importlib.metadata.version("poimen")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        return ""


def _attrs(event: ev.KernelEvent, names: tuple[str, ...] = _ATTRS) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n, key in _present(type(event), names):
        v = getattr(event, n)
        if v is not None:
            out[key] = v
    return out


_PRESENT: dict[tuple[type[ev.KernelEvent], tuple[str, ...]], tuple[tuple[str, str], ...]] = {}


def _present(kind: type[ev.KernelEvent], names: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """The fields of `names` that events of `kind` have, with their attribute names."""
    got = _PRESENT.get((kind, names))
    if got is None:
        have = {f.name for f in dataclasses.fields(kind)}
        got = _PRESENT[(kind, names)] = tuple((n, f"poimen.{n}") for n in names if n in have)
    return got


def _inject(headers: dict[str, str]) -> None:
    carrier: dict[str, str] = {}
    otel_propagate.inject(carrier)
    present = {k.lower() for k in headers}
    for k, v in carrier.items():
        if k.lower() not in present:
            headers[k] = v


class OpenTelemetry(ev.Observer):
    """Spans and metrics through the OpenTelemetry API. `tracer_provider` and
    `meter_provider` default to the global ones; `propagate` sends the current trace
    context (W3C ``traceparent``) with every request of `ctx.http` and `ctx.ahttp`."""

    def __init__(
        self,
        *,
        tracer_provider: Any = None,
        meter_provider: Any = None,
        propagate: bool = True,
    ) -> None:
        version = _version()
        self._tracer = otel_trace.get_tracer("poimen", version, tracer_provider=tracer_provider)
        meter = otel_metrics.get_meter("poimen", version, meter_provider=meter_provider)
        self._calls = meter.create_counter(
            "poimen.calls", "{call}", "Calls returned, by tool and outcome"
        )
        self._call_duration = meter.create_histogram(
            "poimen.call.duration",
            "s",
            "Duration of calls, by tool and outcome",
            explicit_bucket_boundaries_advisory=BUCKETS,
        )
        self._attempts = meter.create_counter(
            "poimen.attempts", "{attempt}", "Runs of a tool, by tool and how they ended"
        )
        self._indeterminate = meter.create_counter(
            "poimen.indeterminate", "{intent}", "Intents made INDETERMINATE, by tool and reason"
        )
        self._takeovers = meter.create_counter(
            "poimen.takeovers", "{intent}", "Unfinished intents taken over, by tool"
        )
        self._renewals = meter.create_counter(
            "poimen.lease.renewals", "{lease}", "Leases renewed by the renewal duty"
        )
        self._denials = meter.create_counter(
            "poimen.denials", "{denial}", "Writes the capability layer denied, by tool"
        )
        self._pass_duration = meter.create_histogram(
            "poimen.recovery.duration",
            "s",
            "Duration of recovery passes",
            explicit_bucket_boundaries_advisory=BUCKETS,
        )
        meter.create_observable_gauge(
            "poimen.indeterminate.open",
            [self._open_indeterminate],
            "{intent}",
            "INDETERMINATE intents waiting for an operator, by tool",
        )
        meter.create_observable_gauge(
            "poimen.indeterminate.oldest_age",
            [self._oldest_age],
            "s",
            "Age of the oldest INDETERMINATE intent",
        )
        meter.create_observable_gauge(
            "poimen.intents.unfinished",
            [self._unfinished],
            "{intent}",
            "DISPATCHED intents (running, or waiting for recovery), by tool",
        )
        meter.create_observable_gauge(
            "poimen.outbox.backlog",
            [self._backlog],
            "{notification}",
            "Notifications not yet delivered",
        )
        self._kernels: list[weakref.ref[Kernel]] = []
        self._snap: tuple[float, list[_metrics.Snapshot]] = (0.0, [])
        self._lock = threading.Lock()
        self._propagate = propagate

    def bind(self, kernel: Kernel) -> None:
        with self._lock:
            self._kernels.append(weakref.ref(kernel))
        if self._propagate:
            kernel._issuer.propagate = _inject

    # Spans.

    def start(self, event: ev.StartEvent) -> object:
        span = self._tracer.start_span(_span_name(event), attributes=_attrs(event))
        if not span.get_span_context().is_valid:  # no SDK: nothing to make current
            return span, None
        return span, otel_context.attach(otel_trace.set_span_in_context(span))

    def finish(self, token: object, event: ev.FinishEvent) -> None:
        span, ctx_token = cast("tuple[Any, Any]", token)
        try:
            if span.is_recording():
                span.set_attributes(_attrs(event, _FINISH_ATTRS))
                self._ended(span, event)
        finally:
            if ctx_token is not None:
                otel_context.detach(ctx_token)
            span.end()
        self._measure(event)

    def _ended(self, span: Any, event: ev.FinishEvent) -> None:
        match event:
            case ev.CallFinishedEvent(outcome=outcome, reason=reason) if outcome in (
                "failed",
                "error",
            ):
                span.set_status(Status(StatusCode.ERROR, reason))
            case ev.AttemptFinishedEvent(outcome=outcome, error=error) if outcome != "completed":
                span.set_status(Status(StatusCode.ERROR, error))
            case ev.LookupFinishedEvent(answer=answer, detail=detail):
                span.set_attribute("poimen.answer", answer)
                if detail:
                    span.set_attribute("poimen.reason", detail)
            case ev.RecoveryPassFinishedEvent(report=report, error=error):
                if report is not None:
                    for k in (
                        "scanned",
                        "completed",
                        "failed",
                        "indeterminate",
                        "pending",
                        "busy",
                        "lost_race",
                        "expired",
                    ):
                        span.set_attribute(f"poimen.recovery.{k}", getattr(report, k))
                    span.set_attribute("poimen.recovery.errors", len(report.errors))
                if error:
                    span.set_status(Status(StatusCode.ERROR, error))

    # Point events: on the current span, and counted.

    def event(self, event: ev.KernelEvent) -> None:
        if isinstance(event, ev.ResolvedEvent | ev.AbandonedEvent | ev.ApprovalDecidedEvent):
            # An operator's decision is an act of its own: a span, a child of the caller's.
            name = f"poimen.{_DECISIONS[type(event)]} {event.tool_id}"
            self._tracer.start_span(name, attributes=_attrs(event, _SPAN_EVENT_FIELDS)).end()
            self._measure(event)
            return
        span = otel_trace.get_current_span()
        if span.is_recording():
            span.add_event(f"poimen.{event.kind}", _attrs(event, _SPAN_EVENT_FIELDS))
        self._measure(event)

    def _measure(self, event: ev.KernelEvent) -> None:
        if type(event) not in _MEASURED:
            return
        match event:
            case ev.CallFinishedEvent(tool_id=tool, outcome=outcome, duration=duration):
                a = {"poimen.tool_id": tool, "poimen.outcome": outcome}
                self._calls.add(1, a)
                self._call_duration.record(duration, a)
            case ev.AttemptFinishedEvent(tool_id=tool, outcome=outcome):
                self._attempts.add(1, {"poimen.tool_id": tool, "poimen.outcome": outcome})
            case ev.IndeterminateEvent(tool_id=tool, reason=reason):
                self._indeterminate.add(1, {"poimen.tool_id": tool, "poimen.reason": reason})
            case ev.TakeoverEvent(tool_id=tool):
                self._takeovers.add(1, {"poimen.tool_id": tool})
            case ev.LeasesRenewedEvent(renewed=n):
                self._renewals.add(n)
            case ev.DenialEvent(tool_id=tool, action=action):
                self._denials.add(1, {"poimen.tool_id": tool, "poimen.action": action})
            case ev.RecoveryPassFinishedEvent(duration=duration):
                self._pass_duration.record(duration)

    # Gauges, read from the log (at most once a second).

    def _snapshots(self) -> list[_metrics.Snapshot]:
        with self._lock:
            at, snaps = self._snap
            if time.monotonic() - at < 1.0:
                return snaps
            snaps = []
            seen: set[str] = set()
            for store in self._stores():
                if store.url in seen:
                    continue
                seen.add(store.url)
                try:
                    snaps.append(_metrics.snapshot(store))
                except Exception:  # a closed or unreachable store: no reading this time
                    continue
            self._snap = (time.monotonic(), snaps)
            return snaps

    def _stores(self) -> Iterator[Store]:
        for ref in self._kernels:
            k = ref()
            if k is not None and not k._closed:
                yield k.store

    def _per_tool(self, state: IntentState) -> Iterable[Observation]:
        totals: dict[str, int] = {}
        for s in self._snapshots():
            for tool, n in s.by_tool(state).items():
                totals[tool] = totals.get(tool, 0) + n
        return [Observation(n, {"poimen.tool_id": t}) for t, n in sorted(totals.items())]

    def _open_indeterminate(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._per_tool(IntentState.INDETERMINATE)

    def _unfinished(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._per_tool(IntentState.DISPATCHED)

    def _oldest_age(self, options: CallbackOptions) -> Iterable[Observation]:
        snaps = self._snapshots()
        if not snaps:
            return []
        return [Observation(max(s.oldest_indeterminate_age for s in snaps))]

    def _backlog(self, options: CallbackOptions) -> Iterable[Observation]:
        snaps = self._snapshots()
        if not snaps:
            return []
        return [Observation(sum(s.outbox_backlog for s in snaps))]


#: The events a metric counts (the others pass by at the cost of one set lookup).
_MEASURED = frozenset(
    {
        ev.CallFinishedEvent,
        ev.AttemptFinishedEvent,
        ev.IndeterminateEvent,
        ev.AbandonedEvent,
        ev.TakeoverEvent,
        ev.LeasesRenewedEvent,
        ev.DenialEvent,
        ev.RecoveryPassFinishedEvent,
    }
)

_DECISIONS: dict[type[ev.KernelEvent], str] = {
    ev.ResolvedEvent: "resolve",
    ev.AbandonedEvent: "abandon",
    ev.ApprovalDecidedEvent: "decide_approval",
}


def _span_name(event: ev.StartEvent) -> str:
    match event:
        case ev.CallStartedEvent(tool_id=tool):
            return f"poimen.call {tool}"
        case ev.AttemptStartedEvent(tool_id=tool):
            return f"poimen.attempt {tool}"
        case ev.LookupStartedEvent(tool_id=tool):
            return f"poimen.lookup {tool}"
        case ev.IntentRecoveryStartedEvent(tool_id=tool):
            return f"poimen.recover {tool}"
        case ev.RecoveryPassStartedEvent():
            return "poimen.recovery"
    return f"poimen.{event.kind}"
