"""A kernel's observers behind the hooks the engine calls (`poimen._engine.hooks`).

`Observation` is all of them at once: it calls each observer only for what the observer
wants, and logs an observer's exception instead of letting it reach the caller. poimen's own
observers implement the hooks themselves (its logging below, `poimen.otel`) and are handed
what the call has; any other `poimen.events.Observer` gets typed events (`_Events`). The
functions of `Kernel.on` run on a thread of their own (`Hooks`), never on the caller's.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, TypeVar, cast

from poimen import events as ev
from poimen._core.present import redact_urls
from poimen._engine import hooks as _hooks
from poimen._engine.hooks import CALLS, EVERYTHING, RECOVERY, TRANSITIONS, ObserverHooks, ids
from poimen.errors import PoimenError

if TYPE_CHECKING:
    from poimen._core.intents import Intent, Outcome
    from poimen._engine.engine import Engine
    from poimen._engine.steps import Run
    from poimen.store._base import NewDispatch

log = logging.getLogger("poimen.observe")
E = TypeVar("E", bound=ev.KernelEvent)


class Observation:
    """A kernel's observers, as the engine's `Observers`."""

    # Each bound by `_sort` to the one guarded observer that wants it, else to the fan-out.
    calls: tuple[Callable[..., object], Callable[..., None]]
    attempts: tuple[Callable[..., object], Callable[..., None]]
    dispatched: Callable[[NewDispatch, Intent], None]
    settled: Callable[[Intent, bool, str | None], None]

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.observers: tuple[ev.Observer, ...] = ()  # as given
        self.hooks: Hooks | None = None
        self._all: tuple[ObserverHooks, ...] = ()
        self._calls: tuple[ObserverHooks, ...] = ()
        self._recovery: tuple[ObserverHooks, ...] = ()
        self._transitions: tuple[ObserverHooks, ...] = ()
        self._watched: tuple[ObserverHooks, ...] = ()
        self.wants = 0
        self.watching = False
        self._lock = threading.Lock()
        self._sort()

    def add(self, observer: ev.Observer) -> None:
        hooks = (
            observer
            if isinstance(observer, ObserverHooks)
            else _Events(observer, self._engine)
        )
        with self._lock:
            self.observers = (*self.observers, observer)
            self._all = (*self._all, hooks)
            self._sort()

    def hook_thread(self) -> Hooks:
        with self._lock:
            if self.hooks is None:
                self.hooks = Hooks()
                self.observers = (*self.observers, self.hooks)
                self._all = (*self._all, _Events(self.hooks, self._engine))
        return self.hooks

    def subscribe(self, kind: type[ev.KernelEvent], fn: Callable[[Any], object]) -> None:
        self.hook_thread().on(kind, fn)
        self.resort()

    def unsubscribe(self, kind: type[ev.KernelEvent], fn: Callable[[Any], object]) -> None:
        if self.hooks is not None:
            self.hooks.off(kind, fn)
            self.resort()

    def resort(self) -> None:
        with self._lock:
            self._sort()

    def _sort(self) -> None:
        for o in self._all:
            if isinstance(o, _Events) and isinstance(o.observer, Hooks):
                o.wants = o.observer.wanted()
        everyone = self._all
        self._calls = tuple(o for o in everyone if o.wants & CALLS)
        self._recovery = tuple(o for o in everyone if o.wants & RECOVERY)
        self._transitions = tuple(o for o in everyone if o.wants & TRANSITIONS)
        self._watched = tuple(o for o in everyone if o.watching)
        self.wants = functools.reduce(lambda a, o: a | o.wants, everyone, 0)
        self.watching = bool(self._watched)
        one = _alone(self._calls)
        if one is None:
            self.calls = (self.call_started, self.call_finished)
            self.attempts = (self.attempt_started, self.attempt_finished)
        else:
            self.calls = (one.call_started, one.call_finished)
            self.attempts = (one.attempt_started, one.attempt_finished)
        one = _alone(self._transitions)
        self.dispatched = self._dispatched if one is None else one.dispatched
        self.settled = self._settled if one is None else one.settled

    def refresh(self) -> None:
        changed = False
        for o in self._watched:
            before = o.wants
            try:
                o.refresh()
            except Exception:
                _failed(o, "refresh")
            changed = changed or o.wants != before or not o.watching
        if changed:
            self.resort()

    def has(self, kind: type[ev.Observer]) -> bool:
        return any(type(o) is kind for o in self.observers)

    def close(self) -> None:
        for o in self._all:
            try:
                o.close()
            except Exception:
                log.exception("poimen: an observer failed to close")

    def after_fork(self) -> None:
        self._lock = threading.Lock()
        if self.hooks is not None:
            self.hooks.after_fork()

    # The hooks, each to the observers that want it (in order; finishes in reverse, as
    # contexts attached in order are detached), where `_sort` bound none directly. A start's
    # token is (observer, its token) when one observer wants the hook, else a list of such
    # pairs; the engine takes a start and its finish together (`calls`, `attempts`), so a
    # finish goes where its start went, whatever was sorted since.

    def call_started(self, d: NewDispatch) -> object:
        return _start(self._calls, "call_started", d)

    def call_finished(
        self,
        token: object,
        d: NewDispatch,
        out: Outcome | None,
        exc: BaseException | None,
        duration: float,
    ) -> None:
        for o, t in (token,) if type(token) is tuple else _reversed(token):
            try:
                o.call_finished(t, d, out, exc, duration)
            except Exception:
                _failed(o, "call_finished")

    def attempt_started(self, it: Intent) -> object:
        return _start(self._calls, "attempt_started", it)

    def attempt_finished(
        self, token: object, it: Intent, run: Run | None, exc: BaseException | None, duration: float
    ) -> None:
        for o, t in (token,) if type(token) is tuple else _reversed(token):
            try:
                o.attempt_finished(t, it, run, exc, duration)
            except Exception:
                _failed(o, "attempt_finished")

    def start(self, event: ev.StartEvent) -> object:
        tokens = []
        for o in self._recovery:
            try:
                tokens.append((o, o.start(event)))
            except Exception:
                _failed(o, event.kind)
        return tokens

    def finish(self, token: object, event: ev.FinishEvent) -> None:
        for o, t in reversed(cast("list[tuple[ObserverHooks, object]]", token)):
            try:
                o.finish(t, event)
            except Exception:
                _failed(o, event.kind)

    def _dispatched(self, d: NewDispatch, intent: Intent) -> None:
        for o in self._transitions:
            try:
                o.dispatched(d, intent)
            except Exception:
                _failed(o, "dispatched")

    def _settled(self, it: Intent, completed: bool, error: str | None) -> None:
        for o in self._transitions:
            try:
                o.settled(it, completed, error)
            except Exception:
                _failed(o, "completed" if completed else "failed")

    def event(self, event: ev.KernelEvent) -> None:
        for o in self._transitions:
            try:
                o.event(event)
            except Exception:
                _failed(o, event.kind)


def _alone(observers: tuple[ObserverHooks, ...]) -> ObserverHooks | None:
    """The one observer of `observers`, if there is one and it guards its own hooks."""
    if len(observers) == 1 and getattr(observers[0], "guarded", False):
        return observers[0]
    return None


def _start(observers: tuple[ObserverHooks, ...], hook: str, arg: Any) -> object:
    """Hook `hook` of each observer: the start's token."""
    if len(observers) == 1:
        o = observers[0]
        try:
            return (o, getattr(o, hook)(arg))
        except Exception:
            _failed(o, hook)
            return []
    tokens = []
    for o in observers:
        try:
            tokens.append((o, getattr(o, hook)(arg)))
        except Exception:
            _failed(o, hook)
    return tokens


def _reversed(token: object) -> Iterator[tuple[ObserverHooks, object]]:
    return reversed(cast("list[tuple[ObserverHooks, object]]", token))


def _failed(o: ObserverHooks, what: str) -> None:
    _hooks.failed(o.observer if isinstance(o, _Events) else o, what)


# The happy path's transitions as events, for the observers that take events.


def dispatched_event(worker_id: str, intent: Intent) -> ev.DispatchedEvent:
    return ev.DispatchedEvent(at=time.time(), worker_id=worker_id, **ids(intent), fence=intent.fence)


def settled_event(
    worker_id: str, it: Intent, completed: bool, error: str | None
) -> ev.CompletedEvent | ev.FailedEvent:
    if completed:
        return ev.CompletedEvent(
            at=time.time(), worker_id=worker_id, **ids(it), fence=it.fence, via="call"
        )
    return ev.FailedEvent(at=time.time(), worker_id=worker_id, **ids(it), fence=it.fence, error=error)


class _Events:
    """Any `poimen.events.Observer`: every hook as the events of `poimen.events`."""

    watching = False

    def __init__(self, observer: ev.Observer, engine: Engine) -> None:
        self.observer = observer
        self._engine = engine
        self.wants = EVERYTHING

    def refresh(self) -> None:
        pass

    def _base(self) -> dict[str, Any]:
        return {"at": time.time(), "worker_id": self._engine.owner.worker_id}

    def call_started(self, d: NewDispatch) -> object:
        f: dict[str, Any] = {"tool_id": d.tool_id, "call_id": d.call_id, "effect": d.effect}
        return self.observer.start(ev.CallStartedEvent(**self._base(), **f))

    def call_finished(
        self,
        token: object,
        d: NewDispatch,
        out: Outcome | None,
        exc: BaseException | None,
        duration: float,
    ) -> None:
        outcome, reason = _hooks.raised(exc) if exc is not None else _hooks.outcome_kind(out)
        finished = ev.CallFinishedEvent(
            **self._base(),
            duration=duration,
            tool_id=d.tool_id,
            call_id=d.call_id,
            effect=d.effect,
            intent_id=None if out is None else out.intent_id,
            outcome=outcome,
            reason=reason,
        )
        self.observer.finish(token, finished)

    def attempt_started(self, it: Intent) -> object:
        f = {**ids(it), "attempt": it.attempts, "fence": it.fence}
        return self.observer.start(ev.AttemptStartedEvent(**self._base(), **f))

    def attempt_finished(
        self, token: object, it: Intent, run: Run | None, exc: BaseException | None, duration: float
    ) -> None:
        outcome, error = (
            (run.kind, run.error)
            if run is not None
            else _hooks.raised(exc)
            if exc is not None
            else ("error", None)
        )
        finished = ev.AttemptFinishedEvent(
            **self._base(),
            duration=duration,
            **ids(it),
            attempt=it.attempts,
            fence=it.fence,
            outcome=outcome,
            error=error,
        )
        self.observer.finish(token, finished)

    def start(self, event: ev.StartEvent) -> object:
        return self.observer.start(event)

    def finish(self, token: object, event: ev.FinishEvent) -> None:
        self.observer.finish(token, event)

    def dispatched(self, d: NewDispatch, intent: Intent) -> None:
        self.observer.event(dispatched_event(self._engine.owner.worker_id, intent))

    def settled(self, it: Intent, completed: bool, error: str | None) -> None:
        self.observer.event(settled_event(self._engine.owner.worker_id, it, completed, error))

    def event(self, event: ev.KernelEvent) -> None:
        self.observer.event(event)

    def close(self) -> None:
        self.observer.close()


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

    def wanted(self) -> int:
        """The hooks the subscribed kinds need (nothing is built for the others)."""
        out = 0
        for kind, _ in self._subs:
            for cls, group in _GROUPS.items():
                if issubclass(cls, kind):
                    out |= group
        return out

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



def _group(cls: type[ev.KernelEvent]) -> int:
    if cls in (
        ev.CallStartedEvent, ev.CallFinishedEvent, ev.AttemptStartedEvent, ev.AttemptFinishedEvent
    ):
        return CALLS
    if issubclass(cls, ev.StartEvent | ev.FinishEvent):
        return RECOVERY
    return TRANSITIONS


#: Each event class poimen emits, and the hooks that bring it.
_GROUPS: dict[type[ev.KernelEvent], int] = {
    cls: _group(cls)
    for cls in (getattr(ev, name) for name in ev.__all__)
    if isinstance(cls, type) and issubclass(cls, ev.KernelEvent) and "kind" in vars(cls)
}


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
_CALL_LOG = logging.getLogger("poimen.call")  # the happy path's two transitions


#: Kept in a watched logger's level cache while none of poimen's loggers would write INFO
#: (a key no level is): the logging module empties every logger's cache at each change of a
#: level (`setLevel`, `disable`, `basicConfig`, `dictConfig`), so while it is there, the
#: answer stands, as each logger's own cached answer would.
_NO_INFO = "poimen: no INFO"
_LOGGING_LOCK = getattr(logging, "_lock", None)  # the lock the caches are cleared under


def logging_wanted() -> bool:
    """Whether any logger poimen's events go to would write an INFO record: at each call of
    a kernel that looks for logging configured later, so one dictionary lookup while no
    level changed since it last said no."""
    cache = _CALL_LOG._cache  # type: ignore[attr-defined]
    if _NO_INFO in cache:
        return False
    if _LOGGING_LOCK is None:  # pragma: no cover - another logging module
        return any(logger.isEnabledFor(logging.INFO) for logger in _WATCHED)
    with _LOGGING_LOCK:  # no cache is cleared between the answer and its mark
        for logger in _WATCHED:
            if logger.isEnabledFor(logging.INFO):
                return True
        # A disabled logger may be enabled again without a level changing: not kept then.
        if not any(logger.disabled for logger in _WATCHED):
            cache[_NO_INFO] = False
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
    denials. The event's fields go in ``extra={"poimen": {...}}``. An event is built only
    when its logger would write it."""

    wants = TRANSITIONS | RECOVERY  # the lookups' and passes' ends are logged
    watching = False
    guarded = True  # its happy path's hooks log their own exceptions

    def __init__(self, engine: Engine) -> None:
        self._engine = engine  # its owner (new after a fork) names each event's worker

    def refresh(self) -> None:
        pass

    def _worker(self) -> str:
        return self._engine.owner.worker_id

    def call_started(self, d: NewDispatch) -> object:
        return None

    def call_finished(
        self,
        token: object,
        d: NewDispatch,
        out: Outcome | None,
        exc: BaseException | None,
        duration: float,
    ) -> None:
        pass

    def attempt_started(self, it: Intent) -> object:
        return None

    def attempt_finished(
        self, token: object, it: Intent, run: Run | None, exc: BaseException | None, duration: float
    ) -> None:
        pass

    def dispatched(self, d: NewDispatch, intent: Intent) -> None:
        if _CALL_LOG.isEnabledFor(logging.DEBUG):
            try:
                self.event(dispatched_event(self._worker(), intent))
            except Exception:
                _hooks.failed(self, "dispatched")

    def settled(self, it: Intent, completed: bool, error: str | None) -> None:
        if _CALL_LOG.isEnabledFor(logging.DEBUG):
            try:
                self.event(settled_event(self._worker(), it, completed, error))
            except Exception:
                _hooks.failed(self, "completed" if completed else "failed")

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


def install(e: Engine) -> Observation:
    """The engine's observation, made on first need (the capability layer reports its
    denials to it from then on)."""
    if e.observer is None:
        obs = Observation(e)
        e.issuer.denied = lambda data: _hooks.point(
            e, lambda base: ev.DenialEvent(**base, **data)
        )
        e.observer = obs
    return cast("Observation", e.observer)


def after_fork(e: Engine) -> None:
    if e.observer is not None:
        cast(Observation, e.observer).after_fork()


def setup(
    e: Engine, kernel: object, observers: Sequence[ev.Observer] | None, log_events: bool | None
) -> None:
    """The observers a kernel (on engine `e`) starts with: those given, and poimen's logging when asked for
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
        given.append(LogObserver(e))
    for o in given:
        add(e, kernel, o)


def add(e: Engine, kernel: object, observer: ev.Observer) -> None:
    install(e).add(observer)
    observer.bind(kernel)


def watching(e: Engine, log_events: bool | None) -> bool:
    """Whether the kernel must still look for logging configured later: only by default
    (`log_events` None) and while its logging is not installed."""
    obs = e.observer
    return log_events is None and (obs is None or not cast(Observation, obs).has(LogObserver))


def relog(e: Engine, kernel: object) -> None:
    """Logging was configured since the kernel was made (`logging_wanted` turned true, seen
    at a call, a recovery pass or launch): from now on each record decides by its level."""
    if watching(e, None):
        add(e, kernel, LogObserver(e))


def check_kind(kind: object) -> None:
    if not (isinstance(kind, type) and issubclass(kind, ev.KernelEvent)):
        raise PoimenError(f"on() takes an event class of poimen.events, not {kind!r}", field="kind")


def subscribe(e: Engine, kind: type[E], fn: Callable[[E], object]) -> Callable[[E], object]:
    """`kernel.on(kind, fn)`."""
    check_kind(kind)
    if not callable(fn):
        raise PoimenError(f"on() needs a function to call, not {fn!r}", field="fn")
    install(e).subscribe(kind, fn)
    return fn


def unsubscribe(e: Engine, kind: type[E], fn: Callable[[E], object]) -> None:
    """`kernel.off(kind, fn)`."""
    if e.observer is not None:
        install(e).unsubscribe(kind, fn)
