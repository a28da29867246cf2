"""How a kernel tells its observers what it does (the events of `poimen.events`).

A kernel without observers or hooks has `engine.observer` None and uses its store as is: each
hook below is then one attribute test. With observers, the kernel installs an `Observation`
and wraps its store in `ObservedStore` (`poimen._observed_store`), which emits each
transition after its commit; the scopes (a call, an attempt, a lookup, a recovery pass, one intent's recovery) are bracketed
by the decorators and calls here, in the caller's context, so that a span opened by an
observer is the current one while the scope runs. Hooks of `Kernel.on` run on a thread of
their own (`Hooks`), never on the caller's.

A little over 600 lines: the events, the scopes that emit them and the logging of each are
kept side by side, so that adding an event is one change in one file.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

from poimen import events as ev
from poimen._core.effects import Landed, NotLanded
from poimen._core.intents import (
    Completed,
    Failed,
    Indeterminate,
    Intent,
    Outcome,
    Pending,
    Resolved,
)
from poimen._core.present import redact_urls
from poimen.errors import PoimenError
from poimen.store._base import NewDispatch

if TYPE_CHECKING:
    from poimen._core.intents import RecoveryReport
    from poimen._engine.engine import Engine
    from poimen._engine.steps import Invoke, Lookup, Run
    from poimen._kernel import Kernel
    from poimen.store import Store

log = logging.getLogger("poimen.observe")
P = ParamSpec("P")
R = TypeVar("R")


# Outcomes as the events name them.


def outcome_kind(out: Outcome | None) -> tuple[str, str | None]:
    match out:
        case Completed():
            return "completed", None
        case Failed(error=error):
            return "failed", error
        case Indeterminate(reason=reason):
            return "indeterminate", reason
        case Resolved(landed=landed):
            return "resolved", "landed" if landed else "not_landed"
        case Pending(reason=reason):
            return "pending", reason
    return "error", None


def _raised(exc: BaseException) -> tuple[str, str]:
    import asyncio

    if isinstance(exc, asyncio.CancelledError):
        return "cancelled", "the caller was cancelled"
    return "error", f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True, slots=True)
class _Info:
    call_id: str
    tool_id: str
    effect: str
    request_id: str | None


class _Known:
    """What the events of an intent need beyond what a store call names (its call id, tool
    and class), for the intents this kernel drives; bounded, oldest first out."""

    LIMIT = 65_536

    def __init__(self) -> None:
        self._by_id: dict[str, _Info] = {}
        self._by_request: dict[str, str] = {}
        self._lock = threading.Lock()

    def put(self, intent_id: str, info: _Info) -> None:
        with self._lock:
            if len(self._by_id) >= self.LIMIT:
                old = next(iter(self._by_id))
                gone = self._by_id.pop(old)
                if gone.request_id is not None:
                    self._by_request.pop(gone.request_id, None)
            self._by_id[intent_id] = info
            if info.request_id is not None:
                self._by_request[info.request_id] = intent_id

    def intent(self, it: Intent) -> _Info:
        info = _Info(it.call_id, it.tool_id, it.effect, it.request_id)
        self.put(it.id, info)
        return info

    def get(self, intent_id: str) -> _Info | None:
        return self._by_id.get(intent_id)

    def by_request(self, request_id: str) -> str | None:
        return self._by_request.get(request_id)

    def drop(self, intent_id: str) -> None:
        with self._lock:
            info = self._by_id.pop(intent_id, None)
            if info is not None and info.request_id is not None:
                self._by_request.pop(info.request_id, None)


class Observation:
    """A kernel's observers and hooks; the engine and the store wrapper report to it."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.observers: tuple[ev.Observer, ...] = ()
        self.hooks: Hooks | None = None
        self.known = _Known()
        self._lock = threading.Lock()
        self.worker_id: str = engine.owner.worker_id  # a forked child's is set again

    def add(self, observer: ev.Observer) -> None:
        with self._lock:
            self.observers = (*self.observers, observer)

    def hook_thread(self) -> Hooks:
        with self._lock:
            if self.hooks is None:
                self.hooks = Hooks()
                self.observers = (*self.observers, self.hooks)
            return self.hooks

    def has(self, kind: type[ev.Observer]) -> bool:
        return any(type(o) is kind for o in self.observers)

    def close(self) -> None:
        for o in self.observers:
            try:
                o.close()
            except Exception:
                log.exception("poimen: an observer failed to close")

    def after_fork(self) -> None:
        self._lock = threading.Lock()
        self.known = _Known()
        self.worker_id = self._engine.owner.worker_id
        if self.hooks is not None:
            self.hooks.after_fork()

    # Reporting.

    def emit(self, event: ev.KernelEvent) -> None:
        for o in self.observers:
            try:
                o.event(event)
            except Exception:
                log.exception("poimen: observer %s failed on %s", type(o).__name__, event.kind)

    def start(self, event: ev.StartEvent) -> list[tuple[ev.Observer, object]]:
        tokens = []
        for o in self.observers:
            try:
                tokens.append((o, o.start(event)))
            except Exception:
                log.exception("poimen: observer %s failed on %s", type(o).__name__, event.kind)
        return tokens

    def finish(self, tokens: list[tuple[ev.Observer, object]], event: ev.FinishEvent) -> None:
        for o, token in reversed(tokens):  # contexts attached in order, detached in reverse
            try:
                o.finish(token, event)
            except Exception:
                log.exception("poimen: observer %s failed on %s", type(o).__name__, event.kind)

    def info(self, intent_id: str, store: Store) -> _Info:
        info = self.known.get(intent_id)
        if info is not None:
            return info
        try:
            it = store.get_intent(intent_id)
        except Exception:
            it = None
        if it is None:
            return _Info("", "", "", None)
        return _Info(it.call_id, it.tool_id, it.effect, it.request_id)

    def about(self, intent_id: str, store: Store) -> dict[str, Any]:
        i = self.info(intent_id, store)
        ids = {"intent_id": intent_id, "call_id": i.call_id, "tool_id": i.tool_id}
        return {**self._base(), **ids, "effect": i.effect}

    # Scopes.

    def _base(self) -> dict[str, Any]:
        return {"at": time.time(), "worker_id": self.worker_id}

    def call(self, d: NewDispatch, run: Callable[[], Outcome]) -> Outcome:
        with self.call_scope(d) as scope:
            out = scope.value = run()
            return out

    async def acall(self, d: NewDispatch, run: Awaitable[Outcome]) -> Outcome:
        with self.call_scope(d) as scope:
            out = scope.value = await run
            return out

    def call_scope(self, d: NewDispatch) -> Scope:
        f: dict[str, Any] = {"tool_id": d.tool_id, "call_id": d.call_id, "effect": d.effect}

        def end(common: dict[str, Any], out: Outcome | None, exc: BaseException | None) -> Any:
            outcome, reason = _raised(exc) if exc is not None else outcome_kind(out)
            intent_id = None if out is None else out.intent_id
            return ev.CallFinishedEvent(
                **common, **f, intent_id=intent_id, outcome=outcome, reason=reason
            )

        return Scope(self, ev.CallStartedEvent(**self._base(), **f), end)

    def attempt_scope(self, step: Invoke) -> Scope:
        it = step.intent
        self.known.intent(it)
        f = {**_of(it), "attempt": it.attempts, "fence": it.fence}

        def end(common: dict[str, Any], run: Run | None, exc: BaseException | None) -> Any:
            outcome, error = (
                (run.kind, run.error)
                if run is not None
                else _raised(exc)
                if exc is not None
                else ("error", None)
            )
            return ev.AttemptFinishedEvent(**common, **f, outcome=outcome, error=error)

        return Scope(self, ev.AttemptStartedEvent(**self._base(), **f), end)

    def lookup_scope(self, step: Lookup) -> Scope:
        f: dict[str, Any] = {
            "tool_id": step.tool.id,
            "request_id": step.request_id,
            "intent_id": self.known.by_request(step.request_id),
        }

        def end(common: dict[str, Any], got: object, exc: BaseException | None) -> Any:
            answer = (
                "landed"
                if isinstance(got, Landed)
                else "not_landed"
                if isinstance(got, NotLanded)
                else "unknown"
            )
            detail = getattr(got, "reason", None) if exc is None else _raised(exc)[1]
            return ev.LookupFinishedEvent(**common, **f, answer=answer, detail=detail)

        return Scope(self, ev.LookupStartedEvent(**self._base(), **f), end)

    def pass_scope(self) -> Scope:
        def end(
            common: dict[str, Any], report: RecoveryReport | None, exc: BaseException | None
        ) -> Any:
            error = None if exc is None else _raised(exc)[1]
            return ev.RecoveryPassFinishedEvent(**common, report=report, error=error)

        return Scope(self, ev.RecoveryPassStartedEvent(**self._base()), end)

    def recovery_scope(self, it: Intent) -> Scope:
        f = _of(it)

        def end(common: dict[str, Any], out: Outcome | None, exc: BaseException | None) -> Any:
            outcome, reason = _raised(exc) if exc is not None else outcome_kind(out)
            return ev.IntentRecoveryFinishedEvent(**common, **f, outcome=outcome, reason=reason)

        return Scope(self, ev.IntentRecoveryStartedEvent(**self._base(), **f), end)

    def takeover(self, it: Intent) -> None:
        self.known.intent(it)
        self.emit(
            ev.TakeoverEvent(
                **self._base(),
                **_of(it),
                fence=it.fence,
                attempt=it.attempts,
                previous_owner=None if it.owner is None else it.owner.worker_id,
                reason="approved" if it.attempts == 0 else "owner_gone",
            )
        )


def _of(it: Intent) -> dict[str, Any]:
    return {"intent_id": it.id, "call_id": it.call_id, "tool_id": it.tool_id, "effect": it.effect}


class Scope:
    """A scope's start (on entry) and finish (on exit, built by `end` from the duration, the
    `value` the scope produced, or None, and the exception that left it, if any)."""

    __slots__ = ("_began", "_end", "_obs", "_start", "_tokens", "value")

    def __init__(
        self,
        obs: Observation,
        start: ev.StartEvent,
        end: Callable[[dict[str, Any], Any, BaseException | None], ev.FinishEvent],
    ) -> None:
        self._obs = obs
        self._start = start
        self._end = end
        self._tokens: list[tuple[ev.Observer, object]] = []
        self._began = 0.0
        self.value: Any = None

    def __enter__(self) -> Scope:
        self._tokens = self._obs.start(self._start)
        self._began = time.perf_counter()
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        common = {**self._obs._base(), "duration": time.perf_counter() - self._began}
        self._obs.finish(self._tokens, self._end(common, self.value, exc))


# The hooks in the call path and recovery: each costs one attribute test without observers.


def _observed(
    scope: Callable[..., Scope],
) -> Callable[[Callable[Concatenate[Engine, P], R]], Callable[Concatenate[Engine, P], R]]:
    """A decorator running a function of the engine in the scope `scope(observation, *args)`
    makes, when the engine has observers."""

    def decorate(fn: Callable[Concatenate[Engine, P], R]) -> Callable[Concatenate[Engine, P], R]:
        @functools.wraps(fn)
        def run(e: Engine, /, *args: P.args, **kw: P.kwargs) -> R:
            if e.observer is None:
                return fn(e, *args, **kw)
            with scope(e.observer, *args, **kw) as s:
                out = s.value = fn(e, *args, **kw)
                return out

        return run

    return decorate


#: An attempt of a sync run, around the tool.
observed_invoke = _observed(lambda obs, step: obs.attempt_scope(step))
#: A lookup of a Queryable request id.
observed_lookup = _observed(lambda obs, step: obs.lookup_scope(step))
#: A recovery pass.
observed_pass = _observed(lambda obs, *args, **kw: obs.pass_scope())
#: Recovery of one intent within a pass.
observed_recovery = _observed(lambda obs, tool, it, report: obs.recovery_scope(it))


def observed_ainvoke(
    fn: Callable[[Engine, Invoke], Coroutine[Any, Any, Run]],
) -> Callable[[Engine, Invoke], Coroutine[Any, Any, Run]]:
    """An attempt of an async tool, in the caller's task."""

    @functools.wraps(fn)
    async def invoke(e: Engine, step: Invoke) -> Run:
        if e.observer is None:
            return await fn(e, step)
        with e.observer.attempt_scope(step) as scope:
            run = scope.value = await fn(e, step)
            return run

    return invoke


# Hooks of `Kernel.on`: on a thread of their own, in order.


class Hooks(ev.Observer):
    """Runs the functions registered with `Kernel.on` for each event of their type, on the
    ``poimen-hooks`` thread, one at a time, in the order the events happened. In memory
    only: the durable way to learn of an Indeterminate call is a notifier."""

    LIMIT = 100_000  # events waiting; past it new ones are dropped (and counted)

    def __init__(self) -> None:
        self._subs: tuple[tuple[type[ev.KernelEvent], Callable[[Any], object]], ...] = ()
        self._queue: queue.Queue[tuple[ev.KernelEvent, list[Callable[[Any], object]]] | None] = (
            queue.Queue(self.LIMIT)
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.dropped = 0

    def on(self, kind: type[ev.KernelEvent], fn: Callable[[Any], object]) -> None:
        with self._lock:
            self._subs = (*self._subs, (kind, fn))

    def off(self, kind: type[ev.KernelEvent], fn: Callable[[Any], object]) -> None:
        with self._lock:
            self._subs = tuple(s for s in self._subs if s != (kind, fn))

    def event(self, event: ev.KernelEvent) -> None:
        fns = [fn for kind, fn in self._subs if isinstance(event, kind)]
        if not fns or self._closed:
            return
        try:
            self._queue.put_nowait((event, fns))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning(
                    "poimen: %d events dropped: the hooks of Kernel.on are too slow",
                    self.dropped,
                )
            return
        self._ensure()

    def _ensure(self) -> None:
        th = self._thread
        if th is not None and th.is_alive():
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="poimen-hooks", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, fns = item
            for fn in fns:
                try:
                    fn(event)
                except Exception:
                    log.exception("poimen: a hook on %s raised", type(event).__name__)

    def close(self, within: float = 5.0) -> None:
        """Run the hooks still queued (for up to `within` seconds), then stop."""
        self._closed = True
        th = self._thread
        if th is None or th is threading.current_thread():
            return
        try:
            self._queue.put(None, timeout=within)
        except queue.Full:
            return
        th.join(within)
        if th.is_alive():
            log.warning("poimen: hooks still running at close")

    def after_fork(self) -> None:
        self._lock = threading.Lock()
        self._queue = queue.Queue(self.LIMIT)
        self._thread = None


# Logging: each event once, on a child of the ``poimen`` logger.

_LOGGERS = {
    "takeover": "poimen.recovery",
    "recovery_pass_finished": "poimen.recovery",
    "approval_expired": "poimen.recovery",
    "resolved": "poimen.operator",
    "abandoned": "poimen.operator",
    "approval_decided": "poimen.operator",
    "denial": "poimen.capability",
}
_LEVELS = {
    "dispatched": logging.DEBUG,
    "completed": logging.DEBUG,
    "failed": logging.DEBUG,
    "deferred": logging.DEBUG,
    "lookup_finished": logging.DEBUG,
    "unknown_outcome": logging.INFO,
    "retry": logging.INFO,
    "takeover": logging.INFO,
    "indeterminate": logging.INFO,
    "abandoned": logging.INFO,
    "resolved": logging.INFO,
    "approval_requested": logging.INFO,
    "approval_decided": logging.INFO,
    "approval_expired": logging.INFO,
    "fenced_out": logging.INFO,
    "denial": logging.WARNING,
}
LOGGER_NAMES = frozenset({"poimen.call", *_LOGGERS.values()})


@functools.cache
def _logger(kind: str) -> logging.Logger:
    return logging.getLogger(_LOGGERS.get(kind, "poimen.call"))


_WATCHED = tuple(logging.getLogger(n) for n in sorted(LOGGER_NAMES))


def logging_wanted() -> bool:
    """Whether any logger poimen's events go to would write an INFO record (the loggers'
    own cached answers: a few dictionary lookups)."""
    for logger in _WATCHED:  # noqa: SIM110 - a loop: no generator on the call path
        if logger.isEnabledFor(logging.INFO):
            return True
    return False


#: Fields that carry free text (an exception's, a provider's): URLs in them lose their
#: credentials before a record is written, as everywhere poimen shows an error.
_TEXT_FIELDS = frozenset({"error", "reason", "detail", "target"})


def _fields(event: ev.KernelEvent) -> dict[str, Any]:
    out: dict[str, Any] = {"event": event.kind}
    for f in fields(event):
        v = getattr(event, f.name)
        if f.name == "report" and v is not None:
            v = {k.name: _count(getattr(v, k.name)) for k in fields(v)}
        elif f.name in _TEXT_FIELDS and isinstance(v, str):
            v = redact_urls(v)
        out[f.name] = v
    return out


def _count(v: Any) -> Any:
    return len(v) if isinstance(v, list) else v


def _message(event: ev.KernelEvent, f: Mapping[str, Any]) -> str:
    if isinstance(event, ev.RecoveryPassFinishedEvent):
        r = f.get("report") or {}
        done = ", ".join(f"{k} {v}" for k, v in r.items() if v and k != "scanned")
        return (
            f"recovery pass: {r.get('scanned', 0)} unfinished scanned"
            + (f"; {done}" if done else "")
            + (f"; stopped: {f['error']}" if event.error else "")
            + f" ({event.duration * 1000:.0f} ms)"
        )
    if isinstance(event, ev.DenialEvent):
        return (
            f"denied: tool {event.tool_id} (intent {event.intent_id}, attempt "
            f"{event.attempt}): {event.action} {f['target']}: {f['reason']}"
        )
    subject = (
        f"{f.get('tool_id')} call {f.get('call_id')} (intent {f.get('intent_id')}, "
        f"{f.get('effect')})"
    )
    skip = {"event", "at", "worker_id", "intent_id", "call_id", "tool_id", "effect"}
    detail = ", ".join(f"{k}={v}" for k, v in f.items() if k not in skip and v is not None)
    return f"{subject}: {event.kind}" + (f": {detail}" if detail else "")


class LogObserver(ev.Observer):
    """Each transition once, through stdlib logging: DEBUG for the ordinary path, INFO for
    unknown outcomes, retries, takeovers, Indeterminate and operators' decisions, WARNING for
    denials. The event's fields go in ``extra={"poimen": {...}}``."""

    def event(self, event: ev.KernelEvent) -> None:
        level = _LEVELS.get(event.kind)
        if isinstance(event, ev.RecoveryPassFinishedEvent):
            r = event.report
            busy = r is None or any(
                (
                    r.completed,
                    r.failed,
                    r.indeterminate,
                    r.lost_race,
                    r.expired,
                    r.errors,
                    r.corrupt,
                )
            )
            level = logging.INFO if busy else logging.DEBUG
        if level is None:
            return
        logger = _logger(event.kind)
        if not logger.isEnabledFor(level):
            return
        f = _fields(event)
        logger.log(level, "%s", _message(event, f), extra={"poimen": f})

    def start(self, event: ev.StartEvent) -> object:
        return None

    def finish(self, token: object, event: ev.FinishEvent) -> None:
        if event.kind in ("lookup_finished", "recovery_pass_finished"):
            self.event(event)


# Installing, for the kernel.


def install(e: Engine, issuer: Any) -> Observation:
    """The engine's observation, made on first need: from then on its store (and the
    capability layer's, for denials) reports each transition."""
    if e.observer is None:
        from poimen._observed_store import ObservedStore  # it builds on this module

        obs = Observation(e)
        e.store = cast("Store", ObservedStore(e.store, obs))
        issuer.store = e.store
        e.observer = obs
    return e.observer


def setup(kernel: Kernel, observers: Sequence[ev.Observer] | None, log_events: bool | None) -> None:
    """The observers a kernel starts with: those given, and poimen's logging when asked for
    (`log_events=True`) or, by default, when a ``poimen`` logger would write INFO."""
    given = list(observers or ())
    for o in given:
        if not isinstance(o, ev.Observer):
            raise PoimenError(
                f"observers must be poimen.events.Observer instances, not {o!r}",
                field="observers",
            )
    if log_events is not None and not isinstance(log_events, bool):
        raise PoimenError(
            f"log_events must be True, False or None, not {log_events!r}", field="log_events"
        )
    if log_events or (log_events is None and logging_wanted()):
        given.append(LogObserver())
    for o in given:
        add(kernel, o)


def add(kernel: Kernel, observer: ev.Observer) -> None:
    install(kernel._engine, kernel._issuer).add(observer)
    observer.bind(kernel)


def watching(kernel: Kernel, log_events: bool | None) -> bool:
    """Whether the kernel must still look for logging configured later: only by default
    (`log_events` None) and while its logging is not installed."""
    obs = kernel._engine.observer
    return log_events is None and (obs is None or not obs.has(LogObserver))


def relog(kernel: Kernel) -> None:
    """Logging was configured since the kernel was made (`logging_wanted` turned true, seen
    at a call, a recovery pass or launch): from now on each record decides by its level."""
    if watching(kernel, None):
        add(kernel, LogObserver())
