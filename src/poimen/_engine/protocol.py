"""The call protocol, written once: hold → dispatch commit → invoke → outcome commit → release.

Every path an intent takes (a first call, a call id seen again, a retry, recovery of an
orphan) is a generator that yields the steps it needs done (`Block`: a commit or a read;
`Invoke`: run the tool; `Lookup`: ask the provider; `Sleep`) and receives their results.
Two runners (`poimen._engine.runners`) execute the steps: `run_sync` for `Kernel.call` and recovery,
`run_async` for `Kernel.acall`. What to decide lives in `poimen._core.decide`; what a step costs lives in the
runners. See docs/design.md §3 to §5.

A cancelled async caller never abandons the protocol: a commit in flight is waited for, a sync
tool's thread is followed by a continuation thread that settles the intent when the tool
returns, and no new attempt, lookup or back-off starts after the cancellation. The intent
stays held (never claimable by this kernel's recovery) until nothing of it runs any more.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from poimen import events as ev
from poimen._core.approval import approval_due
from poimen._core.decide import (
    Answer,
    Ask,
    Complete,
    Defer,
    Fail,
    KeyDerived,
    KeyFailed,
    MarkIndeterminate,
    Policy,
    RetryDecision,
    Unasked,
    attempt_deadline,
    decide,
    failure_is_final,
    takeover_deadline,
)
from poimen._core.effects import Idempotent
from poimen._core.intents import (
    Completed,
    Failed,
    Indeterminate,
    Intent,
    IntentState,
    Outcome,
    Owner,
    Pending,
    Resolved,
)
from poimen._core.keys import encode_value
from poimen._core.retry import Retry as RetryPolicy
from poimen._core.slots import slot_init
from poimen._core.tools import Tool
from poimen._engine import crashpoints as _crashpoints
from poimen._engine import hooks as _hooks
from poimen._engine.hooks import TRANSITIONS
from poimen._engine.notify import approval_note, indeterminate_note
from poimen._engine.steps import (
    Block,
    CallState,
    Invoke,
    Lookup,
    Run,
    Sleep,
    Steps,
)
from poimen.errors import (
    ArgumentError,
    IntentNotFoundError,
    PoimenError,
)
from poimen.store import Store
from poimen.store._base import NewDispatch

if TYPE_CHECKING:
    from poimen._engine.engine import Engine

log = logging.getLogger("poimen")
S = IntentState
T = TypeVar("T")


# The protocol.


def call_steps(
    e: Engine,
    t: Tool,
    d: NewDispatch,
    kwargs: dict[str, Any],
    c: CallState,
    approval: Approval | None = None,
) -> Steps[Outcome]:
    """A call: journal it, run it, settle it; or answer from the log if its call id exists.
    With `approval`, the call is only recorded, for an operator to approve first."""
    if approval is not None:
        return (yield from _await_approval(e, t, d, c, approval))
    e.holds.take(d.intent_id)  # a fresh id: always ours
    try:
        _crashpoints.hit("before_dispatch_commit", d.call_id)
        store = e.store
        intent, created = yield Block(
            store.record_dispatch, (d,), getattr(store, "arecord_dispatch", None)
        )
        if not created:
            return (yield from existing_steps(e, t, intent, d, c))
        _hooks.dispatched(e, d, intent)
        _crashpoints.hit("after_dispatch_commit", d.call_id)
        if c.cancelled:  # cancelled during the dispatch commit: the tool never ran
            return (yield from untried(e, intent))
        started = yield from stamp_deadline(e, t, intent, d.now)
        if not isinstance(started, Intent):
            return started
        out = yield from run_steps(e, t, started, kwargs, c)
        return (yield from taken(e, out, late(d, c)))
    finally:
        e.holds.drop(d.intent_id)


def untried(e: Engine, intent: Intent) -> Steps[Outcome]:
    """A call whose caller was cancelled during its dispatch commit: FAILED, the tool never
    ran (nothing goes to recovery that nobody waits for)."""
    never = Run("failed", error="cancelled before the tool ran")
    return (yield from _write_outcome(e, intent, never))


def late(d: NewDispatch, c: CallState) -> bool:
    """Past half its first lease, the lease may have run out (renewals starved) and a recovery
    pass seized the call, marking its answer owed: then this caller is given it."""
    return time.monotonic() - c.began >= (d.lease_expires_at - d.now) / 2


@dataclass(frozen=True, slots=True)
class Approval:
    """This call waits for `approvers` distinct operators; it expires (FAILED) at
    `expires_at`, if set."""

    expires_at: float | None
    approvers: int = 1


def _await_approval(
    e: Engine, t: Tool, d: NewDispatch, c: CallState, approval: Approval
) -> Steps[Outcome]:
    note = approval_note(d, approval.expires_at, e.notifiers)
    intent, created = yield Block(
        e.store.record_awaiting, (d, note, approval.expires_at, approval.approvers)
    )
    if not created:
        return (yield from existing_steps(e, t, intent, d, c))
    _hooks.report(e, ev.ApprovalRequestedEvent, intent, expires_at=approval.expires_at)
    e.notify()
    return Pending(intent.id, "awaiting_approval")


def existing_steps(
    e: Engine, t: Tool, intent: Intent, d: NewDispatch, c: CallState
) -> Steps[Outcome]:
    """The call id is in the log: the recorded outcome, or the call driven to one."""
    from poimen.errors import CallIdMismatchError

    if intent.tool_id != t.id or intent.args_hash != d.args_hash:
        raise CallIdMismatchError(
            f"call id {d.call_id!r} was recorded for tool {intent.tool_id!r} with other "
            "arguments; a call id always names the same call",
            call_id=d.call_id,
            intent_id=intent.id,
        )
    end = time.monotonic() + e.wait_bound
    read_at = d.now  # the clock before the row was read (the dispatch commit read it)
    waited = False
    while True:
        if approval_due(intent, read_at):  # repeated after its window: it expires now
            gone = yield Block(e.store.expire_approvals, (read_at, 1, intent.id))
            _hooks.expired(e, gone, intent)
            intent = (yield Block(e.store.get_intent, (intent.id,))) or intent
        if intent.state != S.DISPATCHED:
            # Read settled by the dispatch commit: taken there. Settled since: taken now.
            return (yield from taken(e, answer(intent), waited))
        if e.claimable(intent, read_at) == "claimable":
            out = yield from orphan_steps(e, t, intent, c)
            if out is not None:
                return (yield from taken(e, out))
        if time.monotonic() >= end or c.cancelled:
            return Pending(intent.id, "in_flight")
        yield Sleep(0.05)
        waited = True
        read_at = e.store.now()
        current = yield Block(e.store.get_intent, (intent.id,))
        if current is None:
            raise IntentNotFoundError(f"no intent {intent.id!r}", intent_id=intent.id)
        intent = current


def orphan_steps(
    e: Engine, t: Tool, intent: Intent, c: CallState, *, owed: bool = False
) -> Steps[Outcome | None]:
    """Settle an unfinished intent found claimable; None if it is not taken over: this
    kernel drives it already, or a write since it was read (its owner's renewal) came first.
    `owed`: no caller waits for the outcome (a recovery pass), so its answer is owed."""
    if not e.holds.take(intent.id):
        return None
    try:
        # On the lease as judged: a renewal sent before the judgement and applied after
        # would otherwise hand the call to two live drivers.
        seized = yield Block(
            e.store.seize, (intent.id, intent.fence, intent.lease_expires_at), None,
            {"owed": owed},
        )
        if not seized:
            _hooks.fenced(e, intent, intent.fence, "seize")
            return None
        _hooks.report(
            e,
            ev.TakeoverEvent,
            intent,
            fence=intent.fence,
            attempt=intent.attempts,
            previous_owner=None if intent.owner is None else intent.owner.worker_id,
            reason="approved" if intent.attempts == 0 else "owner_gone",
        )
        later = takeover_deadline(intent, e.store.now(), e.deadline_margin)
        if later is not None and t.registration.effects.has_deadline:
            # Its owner stopped mid-attempt: what it sent until now may still land.
            intent = dataclasses.replace(intent, deadline_at=later)
        nxt = yield from decide_steps(e, t, intent, c)
        if not isinstance(nxt, Intent):
            return nxt
        try:
            _, kwargs = t.validate(json.loads(nxt.args))
        except (ArgumentError, ValueError, RecursionError) as exc:
            # The tool's signature changed since the dispatch, or the row is damaged.
            log.error("intent %s: recorded arguments no longer validate: %s", nxt.id, exc)
            return (yield from indeterminate_steps(e, nxt, "arguments_no_longer_valid"))
        return (yield from run_steps(e, t, nxt, kwargs, c))
    finally:
        e.holds.drop(intent.id)


def run_steps(
    e: Engine, t: Tool, intent: Intent, kwargs: dict[str, Any], c: CallState
) -> Steps[Outcome]:
    """Run a held intent's attempt and whatever its class allows after it, to an outcome."""
    retry = e.retry(t)
    in_place = 0  # tries of this attempt that sent nothing
    while True:
        if c.cancelled:
            return Pending(intent.id, "cancelled")
        c.runs += 1
        run: Run = yield Invoke(t, intent, kwargs)
        _crashpoints.hit("after_effect", intent.call_id)
        never_left = run.kind == "not_sent"  # known from the run, never read from its text
        if run.kind == "not_sent":
            in_place += 1
            wait = retry.delay(in_place)
            if not c.cancelled and in_place < retry.attempts and _within(c, retry, wait):
                log.info(
                    "intent %s: not sent (%s); trying again in %.2fs", intent.id, run.error, wait
                )
                yield Sleep(wait)
                continue
            run = Run("failed", error=f"not sent: {run.error}")
        if run.kind == "failed" and not failure_is_final(t.registration.effects, intent):
            # An earlier attempt may have landed: this one's refusal settles nothing.
            run = (
                Run("unknown", error=run.error)
                if never_left
                else Run("indeterminate", reason="refused_after_unknown", error=run.error)
            )
        if run.kind == "committed":  # the outcome committed with the tool's transaction
            _hooks.report(e, ev.CompletedEvent, intent, fence=intent.fence, via="transaction")
            return Completed(intent.id, run.value)
        if run.kind in ("completed", "failed"):
            return (yield from _write_outcome(e, intent, run))
        now = e.store.now()
        deadline = None
        if t.registration.effects.has_deadline:
            # A request sent until now may still land within its timeout.
            deadline = max(
                intent.deadline_at or 0.0,
                attempt_deadline(now, intent.timeout_s, e.deadline_margin),
            )
            intent = dataclasses.replace(intent, deadline_at=deadline)
        error = run.error or "unknown"
        ok = yield Block(e.store.record_unknown, (intent.id, intent.fence, error, now, deadline))
        if ok:
            _hooks.report(e, ev.UnknownOutcomeEvent, intent, fence=intent.fence, error=error)
        else:
            _hooks.fenced(e, intent, intent.fence, "unknown")
        if run.kind == "indeterminate":
            return (yield from indeterminate_steps(e, intent, run.reason or "unknown"))
        nxt = yield from decide_steps(e, t, intent, c)
        if not isinstance(nxt, Intent):
            return nxt
        intent = nxt
        in_place = 0


def decide_steps(e: Engine, t: Tool, intent: Intent, c: CallState) -> Steps[Outcome | Intent]:
    """Decide a held intent whose outcome is unknown and carry the decision out; returns an
    Outcome, or the Intent of a claimed new attempt for the caller to run."""
    policy = e.policy(t)
    effects = t.registration.effects
    got: Answer = Unasked()
    asked: float | None = None
    while True:
        now = e.store.now()
        # A provider's answer says what it knew at some moment after it was asked: judged as
        # of then, so "not landed" read before the deadline is never trusted after it.
        d = decide(effects, intent, got, now if asked is None else asked, policy)
        match d:
            case Ask(what="key"):
                assert isinstance(effects, Idempotent)
                try:
                    got = KeyDerived(effects.key.derive(t.id, json.loads(intent.args)))
                except Exception as exc:  # a user's derivation may raise anything
                    log.warning("intent %s: key derivation failed: %s", intent.id, exc)
                    got = KeyFailed(f"{type(exc).__name__}: {exc}")
            case Ask(what="lookup"):
                if c.cancelled or intent.request_id is None:
                    return Pending(intent.id, "cancelled" if c.cancelled else "no_request_id")
                asked = e.store.now()
                got = yield Lookup(t, intent.request_id, intent)
                if c.cancelled:
                    return Pending(intent.id, "cancelled")
            case Ask(what="marker"):
                if c.cancelled:
                    return Pending(intent.id, "cancelled")
                got = yield Lookup(t, intent.id, intent)
            case Complete(result=result):
                # The provider says it landed: that decides, even if its answer does not
                # encode (then, as on the call path, no result is recorded).
                text = _encode_result(result, intent.id, "<lookup result>")
                ok = yield Block(e.store.complete_landed, (intent.id, intent.fence, text, now))
                if ok:
                    _hooks.report(e, ev.CompletedEvent, intent, fence=intent.fence, via="lookup")
                    return Completed(intent.id, None if text is None else json.loads(text))
                return (yield from fenced_out(e, intent, "complete_landed"))
            case Defer(at=at, unknown_count=n, reason=reason):
                ok = yield Block(
                    _defer,
                    (e.store, intent.id, intent.fence, at, n, reason, now, intent.deadline_at),
                )
                _deferred(e, intent, ok, reason, at)
                if ok:
                    return Pending(intent.id, reason)
                return (yield from answer_current(e, intent.id))
            case MarkIndeterminate(reason=reason):
                return (yield from indeterminate_steps(e, intent, reason))
            case Fail(reason=reason):
                return (yield from _write_outcome(e, intent, Run("failed", error=reason)))
            case RetryDecision():
                return (yield from _retry(e, t, intent, c, policy))


def _retry(
    e: Engine, t: Tool, intent: Intent, c: CallState, policy: Policy
) -> Steps[Outcome | Intent]:
    if c.cancelled:
        return Pending(intent.id, "cancelled")
    retry = e.retry(t)
    # An orphan's first retry waits for nothing: its attempt ended long enough ago.
    wait = retry.delay(c.runs) if c.runs else 0.0
    if not _within(c, retry, wait):
        # Out of time for this caller: recovery takes the next attempt.
        now = e.store.now()
        at = now + wait
        ok = yield Block(
            _defer,
            (e.store, intent.id, intent.fence, at, intent.unknown_count, "retry_deferred", now),
        )
        _deferred(e, intent, ok, "retry_deferred", at)
        return (
            Pending(intent.id, "retry_deferred")
            if ok
            else (yield from answer_current(e, intent.id))
        )
    if wait > 0:
        yield Sleep(wait)
        if c.cancelled:
            return Pending(intent.id, "cancelled")
    now = e.store.now()
    timeout = intent.timeout_s
    claimed = yield Block(
        _claim,
        (
            e.store,
            intent.id,
            intent.fence,
            e.owner,
            now + max(e.lease_ttl, timeout),
            attempt_deadline(now, timeout, e.deadline_margin),
            now,
        ),
    )
    if claimed is None:
        _hooks.fenced(e, intent, intent.fence, "claim")
        return Pending(intent.id, "lost_race")
    _hooks.report(e, ev.RetryEvent, claimed, attempt=claimed.attempts, fence=claimed.fence)
    return (yield from stamp_deadline(e, t, claimed, now))


def indeterminate_steps(e: Engine, intent: Intent, reason: str) -> Steps[Outcome]:
    now = e.store.now()
    ok = yield Block(
        e.store.mark_indeterminate,
        (intent.id, intent.fence, reason, indeterminate_note(intent, reason, e.notifiers), now),
    )
    if ok:
        _hooks.report(e, ev.IndeterminateEvent, intent, fence=intent.fence, reason=reason)
        e.notify()
        return Indeterminate(intent.id, reason)
    return (yield from fenced_out(e, intent, "mark_indeterminate"))


def given(store: Store, out: Outcome) -> Outcome:
    """`out`, given to a caller by call id: a settled outcome's answer, if owed, is taken
    (docs/design.md section 4)."""
    if isinstance(out, Completed | Failed | Resolved):
        store.take_answer(out.intent_id)
    return out


def taken(e: Engine, out: Outcome, ask: bool = True) -> Steps[Outcome]:
    """`given`, as a step of a call."""
    if ask:
        yield Block(given, (e.store, out))
    return out


def fenced_out(e: Engine, intent: Intent, what: str) -> Steps[Outcome]:
    """A write on `intent`'s fence refused (someone else drives it now): what the log says."""
    _hooks.fenced(e, intent, intent.fence, what)
    return (yield from answer_current(e, intent.id))


def answer_current(e: Engine, intent_id: str) -> Steps[Outcome]:
    current = yield Block(e.store.get_intent, (intent_id,))
    if current is None:
        raise IntentNotFoundError(f"no intent {intent_id!r}", intent_id=intent_id)
    return answer(current)


def _write_outcome(e: Engine, intent: Intent, run: Run) -> Steps[Outcome]:
    w = Write.of(run, intent.id)
    store = e.store
    ok = yield Block(
        store.record_outcome,
        (intent.id, intent.fence, w.state),
        getattr(store, "arecord_outcome", None),
        {"result": w.result, "error": w.error, "now": store.now()},
    )
    if ok:
        return w.settled(e, intent)
    return (yield from fenced_out(e, intent, "outcome"))


def stamp_deadline(
    e: Engine, t: Tool, intent: Intent, stamped_at: float
) -> Steps[Intent | Outcome]:
    """A Queryable attempt's deadline counts from when it starts: if its commit took long,
    the deadline stamped before the commit would let "not landed" be trusted too early.
    Returns the intent to run, or an outcome if it was taken over meanwhile."""
    if not t.registration.effects.has_deadline:
        return intent
    for _ in range(3):
        now = e.store.now()
        needed = attempt_deadline(now, intent.timeout_s, e.deadline_margin - e.slack())
        if intent.deadline_at is not None and intent.deadline_at >= needed:
            return intent
        later = attempt_deadline(now, intent.timeout_s, e.deadline_margin) + (now - stamped_at)
        ok = yield Block(e.store.extend_deadline, (intent.id, intent.fence, later, now))
        if not ok:  # fenced out meanwhile: someone else drives it now
            current = yield Block(e.store.get_intent, (intent.id,))
            if current is not None and current.state != S.DISPATCHED:
                return answer(current)
            return Pending(intent.id, "lost_race")
        intent = dataclasses.replace(intent, deadline_at=later)
        stamped_at = now
    log.warning("intent %s: the log is slow; the attempt starts on a late deadline", intent.id)
    return intent


def _within(c: CallState, retry: RetryPolicy, wait: float) -> bool:
    return time.monotonic() - c.began + wait <= retry.budget


def _claim(
    store: Store,
    intent_id: str,
    fence: int,
    owner: Owner,
    lease: float,
    deadline: float,
    now: float,
) -> Intent | None:
    return store.claim(
        intent_id,
        fence,
        owner,
        lease_expires_at=lease,
        new_attempt=True,
        deadline_at=deadline,
        now=now,
    )


def _deferred(e: Engine, it: Intent, ok: bool, reason: str, until: float) -> None:
    if ok:
        _hooks.report(e, ev.DeferredEvent, it, fence=it.fence, reason=reason, until=until)
    else:
        _hooks.fenced(e, it, it.fence, "defer")


def _defer(
    store: Store,
    intent_id: str,
    fence: int,
    at: float,
    n: int,
    reason: str,
    now: float,
    deadline_at: float | None = None,
) -> bool:
    return store.defer(
        intent_id,
        fence,
        next_check_at=at,
        unknown_count=n,
        reason=reason,
        now=now,
        deadline_at=deadline_at,
    )


def answer(intent: Intent) -> Outcome:
    """What the log says of an intent, as a caller's outcome."""
    match intent.state:
        case S.COMPLETED:
            return Completed(intent.id, _loads(intent.result))
        case S.FAILED:
            return Failed(intent.id, intent.error or "", rejected=intent.reason == "rejected")
        case S.INDETERMINATE:
            return Indeterminate(intent.id, intent.reason or "")
        case S.RESOLVED_LANDED | S.RESOLVED_NOT_LANDED:
            return Resolved(intent.id, intent.state == S.RESOLVED_LANDED, _loads(intent.result))
        case S.DISPATCHED:
            return Pending(intent.id, intent.reason or "in_flight")
        case S.AWAITING_APPROVAL:
            return Pending(intent.id, "awaiting_approval")
    raise AssertionError(intent.state)


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


# Outcomes of a run, as the log records them.


def _encode_result(value: Any, intent_id: str, what: str) -> str | None:
    """The canonical JSON of a result, or None (logged) when it cannot be recorded: the call
    landed all the same, and losing its result must not lose the outcome."""
    try:
        return encode_value(value, what)
    except PoimenError as exc:
        log.warning("intent %s: result not recorded: %s", intent_id, exc)
        return None


@slot_init
@dataclass(frozen=True, slots=True)
class Write:
    """What a definite outcome writes, and what the caller gets once it is written."""

    state: IntentState
    result: str | None
    error: str | None
    value: Any

    @classmethod
    def of(cls, run: Run, intent_id: str) -> Write:
        if run.kind == "failed":
            return cls(S.FAILED, None, printable(run.error or ""), None)
        if run.value is None:  # a tool returning nothing: encode_value's text, known
            return cls(S.COMPLETED, "null", None, None)
        try:
            text = encode_value(run.value, "<result>")
        except PoimenError as exc:
            # The call still landed: complete it, and say what was lost.
            return cls(S.COMPLETED, None, printable(f"result not recorded: {exc}"), run.value)
        return cls(S.COMPLETED, text, None, None)

    def settled(self, e: Engine, intent: Intent) -> Outcome:
        """The caller's outcome, once written (and reported to the observers that want it)."""
        obs = e.observer
        if obs is not None and obs.wants & TRANSITIONS:
            obs.settled(intent, self.state == S.COMPLETED, self.error)
        return self.outcome(intent.id)

    def outcome(self, intent_id: str) -> Outcome:
        if self.state == S.FAILED:
            return Failed(intent_id, self.error or "")
        r = self.result
        if r is None or r == "null":  # no text, or json.loads' answer known
            return Completed(intent_id, self.value)
        return Completed(intent_id, json.loads(r))


def printable(text: str) -> str:
    """Text the log can store: lone surrogates (from a tool's exception) replaced."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
