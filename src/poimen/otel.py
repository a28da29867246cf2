"""OpenTelemetry traces and metrics for a kernel (extra ``poimen[otel]``, the API only).

    from poimen.otel import OpenTelemetry
    kernel = Kernel("sqlite:///agent.db", observers=[OpenTelemetry()])

Spans: ``execute_tool <tool>`` for each `call`/`acall`, a child of the caller's active span,
as the OpenTelemetry GenAI conventions name a tool's execution (``gen_ai.operation.name``,
``gen_ai.tool.name``, ``gen_ai.tool.call.id``, ``gen_ai.tool.type``, ``error.type``);
``poimen.attempt <tool>`` for a run of the tool off the happy path (a first attempt that did
not complete, made when it ends; each later one while it runs: the tool's own spans, and the
``traceparent`` that `ctx.http` sends, are children of the span it runs under);
``poimen.lookup <tool>``; ``poimen.recovery`` for a recovery pass with ``poimen.recover
<tool>`` for each intent it drives (a background pass that drove nothing leaves no span).
Transitions (dispatched, unknown outcome, retry, takeover, Indeterminate, ...) are events on
the span current when they happen, except on the happy path: a call dispatched, run once and
completed is its span alone. poimen's own attributes are named ``poimen.*`` (tool id,
effect, call id, intent id, attempt, fence, outcome, reason).

Metrics (docs/observability.md lists them): calls by tool and outcome and their duration,
attempts, Indeterminate transitions, takeovers, lease renewals, denials, recovery pass
duration; with ``log_gauges=True`` (in one process per log), gauges read from the log: open
Indeterminate intents and the oldest one's age, unfinished intents, the outbox backlog.

The global tracer and meter providers are used unless others are given; without an SDK
configured they record nothing.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib.metadata
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

from poimen import events as ev
from poimen._core.intents import Completed, IntentState
from poimen._core.present import redact_store_url, redact_urls
from poimen._engine.hooks import EVERYTHING, failed, outcome_kind, raised
from poimen._runtime import engine_of
from poimen.errors import MissingExtraError
from poimen.operator import _metrics

try:
    from opentelemetry import context as otel_context
    from opentelemetry import metrics as otel_metrics
    from opentelemetry import propagate as otel_propagate
    from opentelemetry import trace as otel_trace
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.trace import ProxyTracerProvider, SpanKind, Status, StatusCode
except ImportError as exc:  # the extra is missing: say which one
    raise MissingExtraError.of("poimen.otel", "otel", exc) from exc

if TYPE_CHECKING:
    from poimen._core.intents import Intent, Outcome
    from poimen._engine.steps import Run
    from poimen._kernel import Kernel
    from poimen.store import Store
    from poimen.store._base import NewDispatch

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


# The global providers, None while unset. Asked at each call until both are set: the API's
# getters also look at the environment each time, so the values are read where the API keeps
# them once the getters have had their one look (at import); the getters are the fallback.

otel_trace.get_tracer_provider()
otel_metrics.get_meter_provider()
# Where the metrics API keeps its global (`get_meter_provider.__module__` names the package
# that re-exports it, which has no such attribute).
_METRICS_API = sys.modules.get("opentelemetry.metrics._internal") or sys.modules[
    otel_metrics.get_meter_provider.__module__
]


def _global_tracer_provider() -> Any:
    tp = getattr(otel_trace, "_TRACER_PROVIDER", _UNKNOWN)
    if tp is _UNKNOWN:  # pragma: no cover - another API version
        tp = otel_trace.get_tracer_provider()
        return None if isinstance(tp, ProxyTracerProvider) else tp
    return tp


def _global_meter_provider() -> Any:
    mp = getattr(_METRICS_API, "_METER_PROVIDER", _UNKNOWN)
    if mp is _UNKNOWN:  # pragma: no cover - another API version
        mp = otel_metrics.get_meter_provider()
        return None if type(mp).__name__ == "_ProxyMeterProvider" else mp
    return mp


_UNKNOWN = object()
#: Whether the API keeps its globals where `refresh` reads them (else it asks each time).
_KEPT = hasattr(otel_trace, "_TRACER_PROVIDER") and hasattr(_METRICS_API, "_METER_PROVIDER")


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
    context (W3C ``traceparent``) with every request of `ctx.http` and `ctx.ahttp`.

    `log_gauges` exports the gauges read from the log (open Indeterminate intents, ...).
    They describe the whole log, whichever process reads it: turn them on in one process
    per log (or scrape the console's ``/metrics``), so that summing them does not count the
    log once per kernel. Each observation names its log in ``poimen.log``.

    A call is one span, opened from what the call has (the attributes of a tool are built
    once); attempt spans and transitions' events are added off the happy path only. Metric
    points: the duration histogram directly, the calls and attempts counted here (read when
    the SDK collects). With neither an SDK's tracer nor its meter, the observer asks for
    nothing and the kernel calls none of its hooks (it looks again at each call until global
    providers are set)."""

    #: Its hooks log their own exceptions: the engine may call them with no fan-out between.
    guarded = True

    def __init__(
        self,
        *,
        tracer_provider: Any = None,
        meter_provider: Any = None,
        propagate: bool = True,
        log_gauges: bool = False,
    ) -> None:
        version = _version()
        self._tracer = otel_trace.get_tracer("poimen", version, tracer_provider=tracer_provider)
        meter = otel_metrics.get_meter("poimen", version, meter_provider=meter_provider)
        self._counts = _counts_of(meter_provider, meter)
        self._call_duration = meter.create_histogram(
            "poimen.call.duration",
            "s",
            "Duration of calls, by tool and outcome",
            explicit_bucket_boundaries_advisory=BUCKETS,
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
        if log_gauges:
            _gauges_of(meter).add(self)
        self._kernels: list[weakref.ref[Kernel]] = []
        self._lock = threading.Lock()
        self._propagate = propagate
        self._providers = (tracer_provider, meter_provider)
        self._tools: dict[str, _Tool] = {}
        self._tracing = False
        # This observer's innermost open span: transitions are events on it (another
        # observer's span may be the current one).
        self._open: contextvars.ContextVar[Any] = contextvars.ContextVar(
            "poimen_otel_open", default=None
        )
        self.wants = 0
        self.watching = True
        self._seen: tuple[Any, Any] = (_UNKNOWN, _UNKNOWN)
        self.refresh()

    def refresh(self) -> None:
        """What to ask for: everything if an SDK traces or measures, else nothing; looked
        at again while the global tracer provider may still be set."""
        # Asked at each call while watching: the same global providers as last time, the
        # same answer.
        if _KEPT:  # read where the API keeps them: no function call
            seen = (otel_trace._TRACER_PROVIDER, _METRICS_API._METER_PROVIDER)
            if seen[0] is self._seen[0] and seen[1] is self._seen[1]:
                return
            self._seen = seen
        tp, mp = self._providers
        tp = _global_tracer_provider() if tp is None else tp
        mp = _global_meter_provider() if mp is None else mp
        self._tracing = tp is not None and not isinstance(tp, otel_trace.NoOpTracerProvider)
        measuring = mp is not None and not isinstance(mp, otel_metrics.NoOpMeterProvider)
        self.wants = EVERYTHING if self._tracing or measuring else 0
        # A global meter provider set later changes nothing here (the instruments made from
        # the API's stand-in pass their points on to it); a tracer provider does.
        self.watching = tp is None

    def _tool(self, tool_id: str, effect: str) -> _Tool:
        t = self._tools.get(tool_id)
        if t is None or t.effect != effect:
            if len(self._tools) >= 4096:  # ids seen in a log, not only registered ones
                self._tools.clear()
            t = self._tools[tool_id] = _Tool(tool_id, effect)
        return t

    # A call and its attempts, from what the call has.

    def call_started(self, d: NewDispatch) -> object:
        """A call begins: its span (``execute_tool``), made current for the caller's code
        and, while its first attempt runs, for the tool's."""
        if not self._tracing:
            return None
        try:
            t = self._tools.get(d.tool_id)
            if t is None or t.effect != d.effect:
                t = self._tool(d.tool_id, d.effect)
            attrs = t.call.copy()
            attrs["poimen.call_id"] = attrs["gen_ai.tool.call.id"] = d.call_id
            span = self._tracer.start_span(t.call_name, kind=SpanKind.INTERNAL, attributes=attrs)
            call = _Call(span, t)
            # `_opened`, written out: this runs once a call.
            call.ctx_token = otel_context.attach(otel_trace.set_span_in_context(span))
            call.open_token = self._open.set(call)
            return call
        except Exception:
            failed(self, "call_started")
            return None

    def _opened(self, scope: _S) -> _S:
        """`scope`'s span made current, for the caller's code and for this observer's events."""
        scope.ctx_token = otel_context.attach(otel_trace.set_span_in_context(scope.span))
        scope.open_token = self._open.set(scope)
        return scope

    def _closed(self, scope: _Scope) -> None:
        self._open.reset(scope.open_token)
        if scope.ctx_token is not None:
            otel_context.detach(scope.ctx_token)
        scope.span.end()

    def call_finished(
        self,
        token: object,
        d: NewDispatch,
        out: Outcome | None,
        exc: BaseException | None,
        duration: float,
    ) -> None:
        """A call ends: its span's outcome, and its calls and duration points."""
        try:
            if type(token) is _Call and exc is None and type(out) is Completed and not token.told:
                # The happy path: the outcome on the span, the call and its first attempt
                # counted under one lock, the duration point; nothing built but the attributes.
                counts = self._counts
                span = token.span
                try:
                    span.set_attributes(
                        {"poimen.outcome": "completed", "poimen.intent_id": out.intent_id}
                    )
                finally:
                    self._open.reset(token.open_token)
                    otel_context.detach(token.ctx_token)
                    span.end()
                t, tried = token.tool, token.attempted
                cells = t.happy or t.count_happy(counts)
                # Its first attempt, if it ran under the call's span and completed (or committed).
                if tried is None or tried == "completed":
                    counts.add(cells[0], None if tried is None else cells[1])
                else:
                    counts.add(cells[0], t.attempts(counts, tried))
                self._call_duration.record(duration, cells[2])
            else:
                outcome, reason = raised(exc) if exc is not None else outcome_kind(out)
                self._call_ended(token, d, out, (outcome, reason), duration)
        except Exception:
            failed(self, "call_finished")

    def _call_ended(
        self, token: object, d: NewDispatch, out: Outcome | None, how: tuple[str, str | None],
        duration: float,
    ) -> None:  # fmt: skip
        """A call off the happy path ends: `how` is its outcome and reason."""
        counts = self._counts
        outcome, reason = how
        if type(token) is _Call:
            span = token.span
            if outcome != "completed":
                self._tell(token)  # e.g. an exception that left the intent DISPATCHED
            try:
                if span.is_recording():
                    attrs: dict[str, Any] = {"poimen.outcome": outcome}
                    if out is not None:
                        attrs["poimen.intent_id"] = out.intent_id
                    if reason is not None:
                        attrs["poimen.reason"] = reason
                    if outcome in _CALL_ERRORS:
                        attrs["error.type"] = _error_type(outcome, reason)
                        span.set_status(Status(StatusCode.ERROR, _shown(reason)))
                    span.set_attributes(attrs)
            finally:
                self._closed(token)
            t = token.tool
            if token.attempted is not None:  # its first attempt completed: counted with it
                counts.add(t.calls(counts, outcome), t.attempts(counts, token.attempted))
            else:
                counts.add(t.calls(counts, outcome))
        else:
            t = self._tool(d.tool_id, d.effect)
            counts.add(t.calls(counts, outcome))
        self._call_duration.record(duration, t.points(outcome))

    def attempt_started(self, it: Intent) -> object:
        """An attempt begins: its span, under the call's (or the recovery's); the intent's
        first attempt, run by its call, has none yet (the call's span is current while it
        runs): one is made when it ends, if it did not complete."""
        try:
            if _PASS.get() is not None:
                self._materialize()
            if not self._tracing:
                return None
            scope = self._open.get()
            if type(scope) is _Call and scope.attempt_ns == 0 and it.attempts == 1:
                scope.attempt_ns = time.time_ns()
                return scope
            span = self._tracer.start_span(
                self._tool(it.tool_id, it.effect).attempt_name, attributes=self._attempt_attrs(it)
            )
            return self._opened(_Scope(span))
        except Exception:
            failed(self, "attempt_started")
            return None

    def _attempt_attrs(self, it: Intent) -> dict[str, Any]:
        attrs = self._tool(it.tool_id, it.effect).ids.copy()
        attrs["poimen.call_id"] = it.call_id
        attrs["poimen.intent_id"] = it.id
        attrs["poimen.attempt"] = it.attempts
        attrs["poimen.fence"] = it.fence
        return attrs

    def attempt_finished(
        self, token: object, it: Intent, run: Run | None, exc: BaseException | None, duration: float
    ) -> None:
        """An attempt ends: its span's outcome, and its attempts point."""
        if type(token) is _Call and run is not None and run.kind in _DONE:
            token.attempted = run.kind  # the happy path: counted with the call, under one lock
            return
        try:
            self._attempt_ended(token, it, run, exc)
        except Exception:
            failed(self, "attempt_finished")

    def _attempt_ended(
        self, token: object, it: Intent, run: Run | None, exc: BaseException | None
    ) -> None:
        outcome, error = (
            (run.kind, run.error)
            if run is not None
            else raised(exc)
            if exc is not None
            else ("error", None)
        )
        done = outcome in _DONE
        if type(token) is _Call:  # not done (attempt_finished counted that with the call)
            self._tell(token)
            if token.span.is_recording():
                # The call's first attempt did not complete: its span, from its start.
                attrs = self._attempt_attrs(it)
                attrs["poimen.outcome"] = attrs["error.type"] = outcome
                span = self._tracer.start_span(
                    self._tool(it.tool_id, it.effect).attempt_name,
                    otel_trace.set_span_in_context(token.span),
                    attributes=attrs,
                    start_time=token.attempt_ns,
                )
                span.set_status(Status(StatusCode.ERROR, _shown(error)))
                span.end()
        elif token is not None:
            scope = cast("_Scope", token)
            span = scope.span
            try:
                if span.is_recording():
                    if done:
                        span.set_attribute("poimen.outcome", outcome)
                    else:
                        span.set_attributes({"poimen.outcome": outcome, "error.type": outcome})
                        span.set_status(Status(StatusCode.ERROR, _shown(error)))
            finally:
                self._closed(scope)
        self._counts.add(self._tool(it.tool_id, it.effect).attempts(self._counts, outcome))

    def dispatched(self, d: NewDispatch, intent: Intent) -> None:
        """The intent is recorded: an event on the call's span, unless the call completes
        with nothing else to tell (kept until then)."""
        if not self._tracing:
            return
        scope = self._open.get()
        if type(scope) is _Call and not scope.told:
            scope.dispatched = (intent, time.time_ns())
            return
        try:
            self._transition("poimen.dispatched", intent, intent.fence, None)
        except Exception:
            failed(self, "dispatched")

    def settled(self, it: Intent, completed: bool, error: str | None) -> None:
        """The intent is settled by its call: an event on the call's span, unless it is the
        happy path's end (dispatched, then completed, nothing between)."""
        try:
            if _PASS.get() is not None:
                self._materialize()
            if not self._tracing:
                return
            if completed:
                scope = self._open.get()
                if type(scope) is _Call and not scope.told:
                    scope.dispatched = None
                    return
                self._transition("poimen.completed", it, it.fence, ("poimen.via", "call"))
            else:
                shown = None if error is None else ("poimen.error", redact_urls(error))
                self._transition("poimen.failed", it, it.fence, shown)
        except Exception:
            failed(self, "settled")

    def _target(self) -> Any:
        """The span a transition's event goes on: this observer's innermost, whose call's
        kept ``poimen.dispatched`` is added first (at the time it happened)."""
        scope = self._open.get()
        if scope is None:
            return otel_trace.get_current_span()
        if type(scope) is _Call:
            self._tell(scope)
        return scope.span

    def _tell(self, call: _Call) -> None:
        """The call left the happy path: its kept ``poimen.dispatched``, at its own time."""
        if call.told:
            return
        call.told = True
        kept, call.dispatched = call.dispatched, None
        if kept is not None and call.span.is_recording():
            it, at = kept
            call.span.add_event("poimen.dispatched", self._transition_attrs(it, it.fence, None), at)

    def _transition(
        self, name: str, it: Intent, fence: int, extra: tuple[str, Any] | None
    ) -> None:
        span = self._target()
        if span.is_recording():
            span.add_event(name, self._transition_attrs(it, fence, extra))

    def _transition_attrs(
        self, it: Intent, fence: int, extra: tuple[str, Any] | None
    ) -> dict[str, Any]:
        attrs = self._tool(it.tool_id, it.effect).ids.copy()
        attrs["poimen.call_id"] = it.call_id
        attrs["poimen.intent_id"] = it.id
        attrs["poimen.fence"] = fence
        if extra is not None:
            attrs[extra[0]] = extra[1]
        return attrs

    def bind(self, kernel: Kernel) -> None:
        with self._lock:
            self._kernels.append(weakref.ref(kernel))
        if self._propagate:
            engine_of(kernel).issuer.propagate = _inject

    # Spans.

    def start(self, event: ev.StartEvent) -> object:
        if isinstance(event, ev.RecoveryPassStartedEvent) and not _has_parent():
            # A background pass: its span is made once it drives something (_materialize).
            lazy = _LazyPass(time.time_ns(), _attrs(event))
            return lazy, _PASS.set(lazy)
        self._materialize()
        scope = _Scope(self._tracer.start_span(_span_name(event), attributes=_attrs(event)))
        if not scope.span.get_span_context().is_valid:  # no SDK: nothing to make current
            scope.open_token = self._open.set(scope)
            return scope
        return self._opened(scope)

    def _materialize(self) -> None:
        """Open the span of the background pass this runs in, if it has none yet."""
        lazy = _PASS.get()
        if lazy is None or lazy.span is not None:
            return
        lazy.span = self._tracer.start_span(
            "poimen.recovery", attributes=lazy.attrs, start_time=lazy.started_ns
        )
        if lazy.span.get_span_context().is_valid:
            lazy.ctx_token = otel_context.attach(otel_trace.set_span_in_context(lazy.span))

    def finish(self, token: object, event: ev.FinishEvent) -> None:
        if isinstance(token, tuple):
            self._finish_pass(token[0], token[1], event)
            return
        scope = cast("_Scope", token)
        span = scope.span
        try:
            if span.is_recording():
                span.set_attributes(_attrs(event, _FINISH_ATTRS))
                self._ended(span, event)
        finally:
            self._closed(scope)
        self._measure(event)

    def _finish_pass(self, lazy: _LazyPass, pass_token: Any, event: ev.FinishEvent) -> None:
        try:
            if lazy.span is None and isinstance(event, ev.RecoveryPassFinishedEvent):
                if event.error is None and not _did_something(event.report):
                    return  # nothing driven, nothing to tell: no span
                self._materialize()
            span = lazy.span
            if span is not None:
                try:
                    if span.is_recording():
                        self._ended(span, event)
                finally:
                    if lazy.ctx_token is not None:
                        otel_context.detach(lazy.ctx_token)
                    span.end()
        finally:
            _PASS.reset(pass_token)
            self._measure(event)

    def _ended(self, span: Any, event: ev.FinishEvent) -> None:
        match event:
            case ev.LookupFinishedEvent(answer=answer, detail=detail):
                span.set_attribute("poimen.answer", answer)
                if detail:
                    span.set_attribute("poimen.reason", redact_urls(detail))
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
                    span.set_attribute("error.type", "recovery_pass_failed")
                    span.set_status(Status(StatusCode.ERROR, _shown(error)))

    # Point events: on the current span, and counted.

    def event(self, event: ev.KernelEvent) -> None:
        if _PASS.get() is not None and not isinstance(event, ev.LeasesRenewedEvent):
            self._materialize()
        if isinstance(event, ev.ResolvedEvent | ev.AbandonedEvent | ev.ApprovalDecidedEvent):
            # An operator's decision is an act of its own: a span, a child of the caller's.
            name = f"poimen.{_DECISIONS[type(event)]} {event.tool_id}"
            self._tracer.start_span(name, attributes=_event_attrs(event)).end()
            self._measure(event)
            return
        if isinstance(event, ev.AuditHeadEvent):
            # Published by a duty, outside any call: a span of its own carries the event.
            attrs: dict[str, Any] = {"poimen.log_id": event.log_id,
                                     "poimen.audit.seq": event.seq,
                                     "poimen.audit.hash": event.hash}
            span = self._tracer.start_span("poimen.audit_head", attributes=attrs)
            span.add_event("poimen.audit_head", attrs)
            span.end()
            return
        if type(event) is ev.CompletedEvent:  # via a transaction or a lookup
            scope = self._open.get()
            if type(scope) is _Call and not scope.told:  # the happy path: no events
                scope.dispatched = None
                return
        span = self._target()
        if span.is_recording():
            span.add_event(f"poimen.{event.kind}", _event_attrs(event))
        self._measure(event)

    def _measure(self, event: ev.KernelEvent) -> None:
        if type(event) not in _MEASURED:
            return
        match event:
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

    def _stores(self) -> Iterator[Store]:
        with self._lock:
            refs = list(self._kernels)
        for ref in refs:
            k = ref()
            if k is not None and not engine_of(k).closed:
                yield k.store


class _Scope:
    """A span this observer opened and made current: its transitions' events go on it (the
    current span may be another observer's)."""

    __slots__ = ("ctx_token", "open_token", "span")

    def __init__(self, span: Any) -> None:
        self.span = span
        self.ctx_token: Any = None
        self.open_token: Any = None


_S = TypeVar("_S", bound=_Scope)


class _Call(_Scope):
    """A call's scope. Its first attempt runs under it (no span unless it does not complete,
    made when it ends); its ``poimen.dispatched`` event is kept until something else is told
    (a retry, a failure, ...): a call dispatched and completed with nothing between has no
    events."""

    __slots__ = ("attempt_ns", "attempted", "dispatched", "told", "tool")

    def __init__(self, span: Any, tool: _Tool) -> None:
        self.span = span
        self.ctx_token: Any = None
        self.open_token: Any = None
        self.tool = tool
        self.attempt_ns = 0  # when its first attempt started (0: not yet)
        self.attempted: str | None = None  # how its first attempt ended, if it completed
        self.dispatched: tuple[Intent, int] | None = None  # the kept event: intent, time
        self.told = False  # an event was added


class _Cell:
    __slots__ = ("attrs", "n")

    def __init__(self, attrs: dict[str, str]) -> None:
        self.attrs = attrs
        self.n = 0


class _Counts:
    """The ``poimen.calls`` and ``poimen.attempts`` counters of one meter provider, counted
    here and read by the SDK when it collects (observable counters): a count on the call
    path is an increment under a lock, where a synchronous counter's ``add`` costs about as
    much as a span event (a measurement made, its attributes hashed, an exemplar offered)."""

    def __init__(self, meter: Any) -> None:
        self._lock = threading.Lock()
        self.calls: dict[tuple[str, str], _Cell] = {}
        self.attempts: dict[tuple[str, str], _Cell] = {}
        meter.create_observable_counter(
            "poimen.calls",
            [lambda options: self._read(self.calls)],
            "{call}",
            "Calls returned, by tool and outcome",
        )
        meter.create_observable_counter(
            "poimen.attempts",
            [lambda options: self._read(self.attempts)],
            "{attempt}",
            "Runs of a tool, by tool and how they ended",
        )

    def cell(self, table: dict[tuple[str, str], _Cell], attrs: dict[str, str]) -> _Cell:
        key = (attrs["poimen.tool_id"], attrs["poimen.outcome"])
        with self._lock:
            got = table.get(key)
            if got is None:
                got = table[key] = _Cell(attrs)
            return got

    def add(self, cell: _Cell, other: _Cell | None = None) -> None:
        with self._lock:
            cell.n += 1
            if other is not None:
                other.n += 1

    def _read(self, table: dict[tuple[str, str], _Cell]) -> list[Observation]:
        with self._lock:
            return [Observation(c.n, c.attrs) for c in table.values() if c.n]


# One per meter provider, shared by its observers: an instrument is registered once per
# meter (a second registration of the name is given the first's, and its callbacks are
# dropped). The global provider's is one, whether it was set before or after the observers
# were made. (A provider given to some observers and made the global one later, with
# observers of the global made before: two registrations, one lost. Not worth more code.)
_COUNTS: weakref.WeakKeyDictionary[Any, _Counts] = weakref.WeakKeyDictionary()
_GLOBAL_COUNTS: list[_Counts] = []
_COUNTS_LOCK = threading.Lock()


def _counts_of(meter_provider: Any, meter: Any) -> _Counts:
    with _COUNTS_LOCK:
        if meter_provider is None or meter_provider is _global_meter_provider():
            if not _GLOBAL_COUNTS:
                _GLOBAL_COUNTS.append(_Counts(meter))
            return _GLOBAL_COUNTS[0]
        try:
            got = _COUNTS.get(meter_provider)
        except TypeError:  # not weakly referenceable: counts of its own
            return _Counts(meter)
        if got is None:
            got = _COUNTS[meter_provider] = _Counts(meter)
        return got


class _Tool:
    """What a tool's spans and points share, built once: names, attributes, and the metric
    attributes of each outcome."""

    __slots__ = (
        "attempt_name",
        "call",
        "call_name",
        "counted",
        "effect",
        "happy",
        "ids",
        "outcomes",
        "tool_id",
    )

    def __init__(self, tool_id: str, effect: str) -> None:
        self.tool_id = tool_id
        self.effect = effect
        self.call_name = f"execute_tool {tool_id}"
        self.attempt_name = f"poimen.attempt {tool_id}"
        self.ids: dict[str, Any] = {"poimen.tool_id": tool_id, "poimen.effect": effect}
        self.call = {
            **self.ids,
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": tool_id,
            "gen_ai.tool.type": "function",  # run by the application, not the model's provider
        }
        self.outcomes: dict[str, dict[str, str]] = {}
        self.counted: dict[tuple[bool, str], _Cell] = {}
        # The happy path's: its calls cell, its attempts cell, its points' attributes.
        self.happy: tuple[_Cell, _Cell, dict[str, str]] | None = None

    def count_happy(self, counts: _Counts) -> tuple[_Cell, _Cell, dict[str, str]]:
        self.happy = (
            self.calls(counts, "completed"),
            self.attempts(counts, "completed"),
            self.points("completed"),
        )
        return self.happy

    def points(self, outcome: str) -> dict[str, str]:
        a = self.outcomes.get(outcome)
        if a is None:
            a = self.outcomes[outcome] = {"poimen.tool_id": self.tool_id, "poimen.outcome": outcome}
        return a

    def calls(self, counts: _Counts, outcome: str) -> _Cell:
        c = self.counted.get((True, outcome))
        if c is None:
            c = self.counted[(True, outcome)] = counts.cell(counts.calls, self.points(outcome))
        return c

    def attempts(self, counts: _Counts, outcome: str) -> _Cell:
        c = self.counted.get((False, outcome))
        if c is None:
            c = self.counted[(False, outcome)] = counts.cell(counts.attempts, self.points(outcome))
        return c


#: The events a metric counts (the others pass by at the cost of one set lookup); calls
#: and attempts are counted by their hooks.
_MEASURED = frozenset(
    {
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
        case ev.LookupStartedEvent(tool_id=tool):
            return f"poimen.lookup {tool}"
        case ev.IntentRecoveryStartedEvent(tool_id=tool):
            return f"poimen.recover {tool}"
        case ev.RecoveryPassStartedEvent():
            return "poimen.recovery"
    return f"poimen.{event.kind}"


# GenAI conventions.

#: The attempt outcomes that are no error ("committed": completed, the outcome written in
#: the tool's own transaction).
_DONE = frozenset({"completed", "committed"})

#: The call outcomes that are errors to a tracing backend.
_CALL_ERRORS = frozenset({"failed", "indeterminate", "error"})


def _error_type(outcome: str, reason: str | None) -> str:
    """A low-cardinality class of the error: the exception's type for a raise, the
    Indeterminate reason, else the outcome."""
    if outcome == "error" and reason:
        return reason.partition(":")[0] or "_OTHER"
    if outcome == "indeterminate" and reason:
        return reason
    return outcome


def _shown(text: str | None) -> str | None:
    # Error texts quote URLs, and URLs carry credentials (user:pass@, ?token=).
    return None if text is None else redact_urls(text)


def _event_attrs(event: ev.KernelEvent) -> dict[str, Any]:
    out = _attrs(event, _SPAN_EVENT_FIELDS)
    for name in ("poimen.error", "poimen.target", "poimen.reason"):
        if isinstance(out.get(name), str):
            out[name] = redact_urls(out[name])
    return out


# Recovery passes without a parent: a span only once they drive something.


@dataclasses.dataclass(slots=True)
class _LazyPass:
    started_ns: int
    attrs: dict[str, Any]
    span: Any = None
    ctx_token: Any = None


_PASS: contextvars.ContextVar[_LazyPass | None] = contextvars.ContextVar(
    "poimen_otel_pass", default=None
)


def _has_parent() -> bool:
    return bool(otel_trace.get_current_span().get_span_context().is_valid)


def _did_something(report: Any) -> bool:
    if report is None:
        return False
    return any(
        (
            report.completed,
            report.failed,
            report.indeterminate,
            report.lost_race,
            report.expired,
            report.errors,
            report.corrupt,
        )
    )


# Gauges read from the log: one set per meter, each log read once per collection.


class _LogGauges:
    def __init__(self, meter: Any) -> None:
        self._observers: weakref.WeakSet[OpenTelemetry] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._snap: tuple[float, list[tuple[str, _metrics.Snapshot]]] = (0.0, [])
        meter.create_observable_gauge(
            "poimen.indeterminate.open",
            [self._open_indeterminate],
            "{intent}",
            "INDETERMINATE intents waiting for an operator, by log and tool",
        )
        meter.create_observable_gauge(
            "poimen.indeterminate.oldest_age",
            [self._oldest_age],
            "s",
            "Age of the oldest INDETERMINATE intent, by log",
        )
        meter.create_observable_gauge(
            "poimen.intents.unfinished",
            [self._unfinished],
            "{intent}",
            "DISPATCHED intents (running, or waiting for recovery), by log and tool",
        )
        meter.create_observable_gauge(
            "poimen.outbox.backlog",
            [self._backlog],
            "{notification}",
            "Notifications not yet delivered, by log",
        )

    def add(self, observer: OpenTelemetry) -> None:
        with self._lock:
            self._observers.add(observer)

    def _snapshots(self) -> list[tuple[str, _metrics.Snapshot]]:
        """(log, snapshot) for each distinct log of the live kernels, at most once a second."""
        with self._lock:
            at, snaps = self._snap
            if time.monotonic() - at < 1.0:
                return snaps
            observers = list(self._observers)
        stores: dict[str, Store] = {}
        for o in observers:
            for store in o._stores():
                stores.setdefault(redact_store_url(store.url), store)
        snaps = []
        for name, store in sorted(stores.items()):
            try:
                snaps.append((name, _metrics.snapshot(store)))
            except Exception:  # a closed or unreachable store: no reading this time
                continue
        with self._lock:
            self._snap = (time.monotonic(), snaps)
        return snaps

    def _per_tool(self, state: IntentState) -> Iterable[Observation]:
        return [
            Observation(n, {"poimen.log": log, "poimen.tool_id": t})
            for log, s in self._snapshots()
            for t, n in sorted(s.by_tool(state).items())
        ]

    def _open_indeterminate(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._per_tool(IntentState.INDETERMINATE)

    def _unfinished(self, options: CallbackOptions) -> Iterable[Observation]:
        return self._per_tool(IntentState.DISPATCHED)

    def _oldest_age(self, options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(s.oldest_indeterminate_age, {"poimen.log": log})
            for log, s in self._snapshots()
        ]

    def _backlog(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(s.outbox_backlog, {"poimen.log": log}) for log, s in self._snapshots()]


_GAUGES: weakref.WeakKeyDictionary[Any, _LogGauges] = weakref.WeakKeyDictionary()
_GAUGES_LOCK = threading.Lock()


def _gauges_of(meter: Any) -> _LogGauges:
    """The gauges registered on `meter` (an instrument is registered once per meter)."""
    with _GAUGES_LOCK:
        gauges = _GAUGES.get(meter)
        if gauges is None:
            gauges = _GAUGES[meter] = _LogGauges(meter)
        return gauges
