"""The hooks the engine calls to be observed (docs/observability.md), and the helpers that
call them. The engine knows observation only as `ObserverHooks`: it imports nothing of the
observers (`poimen._observe` installs them, `poimen.otel` is one).

An observer says what it `wants`, and the engine calls only those hooks:

- `CALLS`: a call's and its attempts' start and finish, in the caller's context (where a span
  is opened and made current), from what the call has: its dispatch, intent, run, outcome;
- `RECOVERY`: lookups, recovery passes and each intent's recovery, as `poimen.events` scopes;
- `TRANSITIONS`: each state change after its commit, and the kernel's other point events.
  A happy-path call's two (dispatched, then completed or failed) come through `dispatched`
  and `settled`, from what the call has; every other one as an event of `poimen.events`.

Nothing wraps the store: the engine reports each of its writes itself, after the commit, in
the caller's context. Without observers `engine.observer` is None, and each hook below costs
one attribute test. A call's hooks go straight to the one observer that wants them when it
is `guarded` (it logs its own exceptions, as poimen's do): no fan-out between.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar, runtime_checkable

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

if TYPE_CHECKING:
    from poimen._core.intents import RecoveryReport
    from poimen._engine.engine import Engine
    from poimen._engine.steps import Invoke, Lookup, Run
    from poimen.store._base import NewDispatch

P = ParamSpec("P")
R = TypeVar("R")

#: What an observer wants (plain ints: tested on every call).
CALLS = 1
RECOVERY = 2
TRANSITIONS = 4
EVERYTHING = CALLS | RECOVERY | TRANSITIONS


@runtime_checkable
class ObserverHooks(Protocol):
    """One observer as the engine sees it (`poimen._observe.Observation` is all of a
    kernel's at once). A hook must be quick and must not raise."""

    #: CALLS | RECOVERY | TRANSITIONS: the hooks it is called for.
    wants: int
    #: `wants` may change (an SDK or logging configured later): `refresh` is called at each
    #: call and recovery pass while this is true.
    watching: bool

    def refresh(self) -> None: ...

    # CALLS: the value a start returns is given back to its finish.
    def call_started(self, d: NewDispatch) -> object: ...
    def call_finished(
        self,
        token: object,
        d: NewDispatch,
        out: Outcome | None,
        exc: BaseException | None,
        duration: float,
    ) -> None: ...
    def attempt_started(self, it: Intent) -> object: ...
    def attempt_finished(
        self, token: object, it: Intent, run: Run | None, exc: BaseException | None, duration: float
    ) -> None: ...

    # RECOVERY: scopes as events.
    def start(self, event: ev.StartEvent) -> object: ...
    def finish(self, token: object, event: ev.FinishEvent) -> None: ...

    # TRANSITIONS: the happy path's two, then any other event.
    def dispatched(self, d: NewDispatch, intent: Intent) -> None: ...
    def settled(self, it: Intent, completed: bool, error: str | None) -> None: ...
    def event(self, event: ev.KernelEvent) -> None: ...

    def close(self) -> None: ...


class Observers(ObserverHooks, Protocol):
    """A kernel's observers as the engine calls them (`poimen._observe.Observation`): the
    start and finish of a call and of an attempt as pairs, taken together at the start (the
    finish goes where its start went), each bound to the one observer that wants it when
    that observer is guarded, else to the fan-out; `dispatched` and `settled` likewise."""

    calls: tuple[
        Callable[[NewDispatch], object],
        Callable[[object, NewDispatch, Outcome | None, BaseException | None, float], None],
    ]
    attempts: tuple[
        Callable[[Intent], object],
        Callable[[object, Intent, Run | None, BaseException | None, float], None],
    ]


log = logging.getLogger("poimen.observe")


def failed(observer: object, what: str) -> None:
    """An observer's hook raised: logged, never the caller's."""
    log.exception("poimen: observer %s failed on %s", type(observer).__name__, what)


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


def raised(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled", "the caller was cancelled"
    return "error", f"{type(exc).__name__}: {exc}"


def ids(it: Intent) -> dict[str, Any]:
    return {"intent_id": it.id, "call_id": it.call_id, "tool_id": it.tool_id, "effect": it.effect}


# Calls.


def calls_wanted(obs: Observers) -> bool:
    """At a call's start: whether an observer wants calls (looked at again first, while what
    one wants may change)."""
    if obs.watching:
        obs.refresh()
    return bool(obs.wants & CALLS)


def observed_call(
    obs: Observers, d: NewDispatch, run: Callable[P, Outcome], *args: P.args, **kw: P.kwargs
) -> Outcome:
    """`run(*args)` as a call's scope, for the observers that want calls."""
    started, finished = obs.calls
    token = started(d)
    began = time.perf_counter()
    try:
        out = run(*args, **kw)
    except BaseException as exc:
        finished(token, d, None, exc, time.perf_counter() - began)
        raise
    finished(token, d, out, None, time.perf_counter() - began)
    return out


async def observed_acall(obs: Observers, d: NewDispatch, run: Awaitable[Outcome]) -> Outcome:
    started, finished = obs.calls
    token = started(d)
    began = time.perf_counter()
    try:
        out = await run
    except BaseException as exc:
        finished(token, d, None, exc, time.perf_counter() - began)
        raise
    finished(token, d, out, None, time.perf_counter() - began)
    return out


def observed_invoke(fn: Callable[[Engine, Invoke], Run]) -> Callable[[Engine, Invoke], Run]:
    """An attempt of a sync run, around the tool."""

    @functools.wraps(fn)
    def invoke(e: Engine, step: Invoke) -> Run:
        obs = e.observer
        if obs is None or not obs.wants & CALLS:
            return fn(e, step)
        it = step.intent
        started, finished = obs.attempts
        token = started(it)
        began = time.perf_counter()
        try:
            run = fn(e, step)
        except BaseException as exc:
            finished(token, it, None, exc, time.perf_counter() - began)
            raise
        finished(token, it, run, None, time.perf_counter() - began)
        return run

    return invoke


def observed_ainvoke(
    fn: Callable[[Engine, Invoke], Coroutine[Any, Any, Run]],
) -> Callable[[Engine, Invoke], Coroutine[Any, Any, Run]]:
    """An attempt of an async tool, in the caller's task."""

    @functools.wraps(fn)
    async def invoke(e: Engine, step: Invoke) -> Run:
        obs = e.observer
        if obs is None or not obs.wants & CALLS:
            return await fn(e, step)
        it = step.intent
        started, finished = obs.attempts
        token = started(it)
        began = time.perf_counter()
        try:
            run = await fn(e, step)
        except BaseException as exc:
            finished(token, it, None, exc, time.perf_counter() - began)
            raise
        finished(token, it, run, None, time.perf_counter() - began)
        return run

    return invoke


# Recovery's scopes, as events.


def _scoped(
    started: Callable[..., ev.StartEvent],
    finished: Callable[..., ev.FinishEvent],
    *,
    refresh: bool = False,
) -> Callable[[Callable[Concatenate[Engine, P], R]], Callable[Concatenate[Engine, P], R]]:
    """A function of the engine run as a scope: `started(e, *args)` makes its start event,
    `finished(common, value, exc, *args)` its finish (`common`: at, worker id, duration)."""

    def decorate(fn: Callable[Concatenate[Engine, P], R]) -> Callable[Concatenate[Engine, P], R]:
        @functools.wraps(fn)
        def run(e: Engine, /, *args: P.args, **kw: P.kwargs) -> R:
            obs = e.observer
            if obs is not None and refresh and obs.watching:
                obs.refresh()
            if obs is None or not obs.wants & RECOVERY:
                return fn(e, *args, **kw)
            token = obs.start(started(e, *args))
            began = time.perf_counter()
            value: Any = None
            exc: BaseException | None = None
            try:
                value = fn(e, *args, **kw)
                return value  # type: ignore[no-any-return]
            except BaseException as err:
                exc = err
                raise
            finally:
                common = {
                    "at": time.time(),
                    "worker_id": e.owner.worker_id,
                    "duration": time.perf_counter() - began,
                }
                obs.finish(token, finished(common, value, exc, *args))

        return run

    return decorate


def _base(e: Engine) -> dict[str, Any]:
    return {"at": time.time(), "worker_id": e.owner.worker_id}


def _lookup_finished(
    common: dict[str, Any], got: object, exc: BaseException | None, step: Lookup
) -> ev.LookupFinishedEvent:
    answer = (
        "landed"
        if isinstance(got, Landed)
        else "not_landed"
        if isinstance(got, NotLanded)
        else "unknown"
    )
    detail = getattr(got, "reason", None) if exc is None else raised(exc)[1]
    return ev.LookupFinishedEvent(
        **common,
        tool_id=step.tool.id,
        request_id=step.request_id,
        intent_id=None if step.intent is None else step.intent.id,
        answer=answer,
        detail=detail,
    )


#: A lookup of a Queryable request id.
observed_lookup = _scoped(
    lambda e, step: ev.LookupStartedEvent(
        **_base(e),
        tool_id=step.tool.id,
        request_id=step.request_id,
        intent_id=None if step.intent is None else step.intent.id,
    ),
    _lookup_finished,
)


def _pass_finished(
    common: dict[str, Any], report: RecoveryReport | None, exc: BaseException | None
) -> ev.RecoveryPassFinishedEvent:
    error = None if exc is None else raised(exc)[1]
    return ev.RecoveryPassFinishedEvent(**common, report=report, error=error)


#: A recovery pass.
observed_pass = _scoped(
    lambda e: ev.RecoveryPassStartedEvent(**_base(e)), _pass_finished, refresh=True
)


def _recovery_finished(
    common: dict[str, Any],
    out: Outcome | None,
    exc: BaseException | None,
    tool: Any,
    it: Intent,
    report: Any,
) -> ev.IntentRecoveryFinishedEvent:
    outcome, reason = raised(exc) if exc is not None else outcome_kind(out)
    return ev.IntentRecoveryFinishedEvent(**common, **ids(it), outcome=outcome, reason=reason)


#: Recovery of one intent within a pass.
observed_recovery = _scoped(
    lambda e, tool, it, report: ev.IntentRecoveryStartedEvent(**_base(e), **ids(it)),
    _recovery_finished,
)


# Transitions, each reported after its commit.


def dispatched(e: Engine, d: NewDispatch, intent: Intent) -> None:
    """A new intent's dispatch committed: the happy path's first transition."""
    obs = e.observer
    if obs is not None and obs.wants & TRANSITIONS:
        obs.dispatched(d, intent)


def report(e: Engine, kind: type[ev.IntentEvent], it: Intent, **fields: Any) -> None:
    """An event of intent `it`, made only if an observer wants transitions."""
    obs = e.observer
    if obs is not None and obs.wants & TRANSITIONS:
        obs.event(kind(**_base(e), **ids(it), **fields))


def fenced(e: Engine, it: Intent, fence: int, write: str) -> None:
    """A write on `fence` changed nothing: another owner drives the intent now."""
    report(e, ev.FencedOutEvent, it, fence=fence, write=write)


def expired(e: Engine, intent_ids: list[str], known: Intent | None = None) -> None:
    """Approvals that expired (FAILED): their intents are read only if someone listens."""
    obs = e.observer
    if obs is None or not obs.wants & TRANSITIONS:
        return
    for intent_id in intent_ids:
        it = known if known is not None and known.id == intent_id else _read(e, intent_id)
        if it is not None:
            obs.event(ev.ApprovalExpiredEvent(**_base(e), **ids(it)))


def _read(e: Engine, intent_id: str) -> Intent | None:
    try:
        return e.store.get_intent(intent_id)
    except Exception:  # an event is not worth failing the caller for
        return None


def point(e: Engine, make: Callable[[dict[str, Any]], ev.KernelEvent]) -> None:
    """An event that is no intent's (a renewal, a denial), made only if someone listens."""
    obs = e.observer
    if obs is not None and obs.wants & TRANSITIONS:
        obs.event(make(_base(e)))


# The seam with the store (tests/unit/test_observe_store.py).

#: The store writes that change an intent's state, each reported after its commit by the
#: function that called it (through the helpers above), and the store methods that change
#: none; a store method in neither list, or a call of a reported write whose function
#: reports nothing, fails tests/unit/test_observe_store.py.
OBSERVED_WRITES = frozenset(
    {
        "record_dispatch",
        "arecord_dispatch",
        "record_outcome",
        "arecord_outcome",
        "commit_outcome_in",  # a Transactional outcome, in the tool's transaction
        "record_unknown",
        "claim",
        "complete_landed",
        "mark_indeterminate",
        "defer",
        "renew_leases",
        "seize",
        "resolve",
        "abandon",
        "record_awaiting",
        "decide_approval",
        "expire_approvals",
        "record_denial",
    }
)
UNOBSERVED = frozenset(
    {
        "migrate",
        "schema_version",
        "integrity",  # `poimen verify`'s reads
        "server_facts",  # `poimen doctor`'s reads
        "now",
        "close",
        "after_fork",
        "extend_deadline",  # the same attempt's deadline, later: no transition
        "list_unfinished",
        "get_intent",
        "get_by_call_id",
        "unsettled_call",
        "take_answer",  # an answer owed, given: no transition
        "list_intents",
        "search_call_id",
        "attempts",
        "events",
        "counts",
        "add_notification",
        "due_notifications",
        "due_deliveries",
        "notifications",
        "deliveries",
        "mark_delivered",
        "mark_delivery_failed",
        "denials",
        "record_event",  # an undo's note on the original: no transition
        "prune_candidates",
        "histories",
        "prune",  # removes settled intents and their history: no transition
        "prune_denials",
        "audit_head",  # the audit chain, read (its links are made by the database)
        "audit_chain",
    }
)
