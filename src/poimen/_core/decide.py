"""What to do with an intent whose outcome is unknown: pure rules, no I/O (docs/design.md §5).

The kernel's call path and recovery gather the evidence a rule asks for (a key derived again
from the recorded arguments, a provider's lookup answer) and execute the decision; every
rule that can double an effect or take over a live call lives here, where it is tested as a
table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, assert_never

from poimen._core.backoff import Backoff
from poimen._core.effects import (
    EffectClass,
    Idempotent,
    Landed,
    NotLanded,
    Queryable,
    ReadOnly,
    Transactional,
    Unknown,
    Unsafe,
    effect_name,
)
from poimen._core.intents import Intent, IntentState, Owner

# The evidence a decision is made on.


@dataclass(frozen=True, slots=True)
class Unasked:
    """Nothing has been asked yet."""


@dataclass(frozen=True, slots=True)
class KeyDerived:
    """The key derived again from the recorded arguments by the tool's current derivation."""

    key: str


@dataclass(frozen=True, slots=True)
class KeyFailed:
    """The current derivation raised on the recorded arguments."""

    error: str


Answer = Unasked | KeyDerived | KeyFailed | Landed | NotLanded | Unknown

# Decisions.


@dataclass(frozen=True, slots=True)
class Ask:
    """Gather this evidence, then decide again."""

    what: Literal["key", "lookup", "marker"]


@dataclass(frozen=True, slots=True)
class RetryDecision:
    """Claim a new attempt (fence + 1) and run the tool again."""


@dataclass(frozen=True, slots=True)
class Complete:
    """The provider says the request landed: complete without running the tool again."""

    result: object


@dataclass(frozen=True, slots=True)
class Defer:
    """Ask again at `at`; the intent stays DISPATCHED."""

    at: float
    unknown_count: int
    reason: str


@dataclass(frozen=True, slots=True)
class Fail:
    """A call without effect that cannot go on: FAILED, nothing to resolve."""

    reason: str


@dataclass(frozen=True, slots=True)
class MarkIndeterminate:
    """Nothing makes a retry safe: an operator decides."""

    reason: str


Decision = Ask | RetryDecision | Complete | Defer | Fail | MarkIndeterminate


@dataclass(frozen=True, slots=True)
class Policy:
    """The bounds a kernel sets on recovery."""

    max_attempts: int
    lookup_limit: int
    lookup_backoff: float
    max_backoff: float
    lookup: Backoff = field(init=False, repr=False, compare=False)
    """The wait before asking again after the n-th "unknown" answer, as a `Backoff`."""

    def __post_init__(self) -> None:
        backoff = Backoff(initial=self.lookup_backoff, maximum=self.max_backoff)
        object.__setattr__(self, "lookup", backoff)


def decide(
    current: EffectClass, intent: Intent, answer: Answer, now: float, policy: Policy
) -> Decision:
    """Decide an unfinished intent by the class recorded with it.

    `current` is the class its tool is registered with now; when that is not the recorded
    class, no rule of either class applies and an operator decides (`effect_changed`).
    """
    if effect_name(current) != intent.effect:
        return MarkIndeterminate("effect_changed")
    if intent.attempts == 0:
        # Approved by an operator and never run yet: its first attempt, whatever its class.
        return RetryDecision()
    match current:
        case Idempotent(key_ttl=ttl):
            # The provider forgets keys: a retry whose request could arrive past the window
            # is no longer deduplicated. (The send gate judges it again as it leaves.)
            if key_window_passed(ttl, intent.created_at, now + intent.timeout_s):
                return MarkIndeterminate("key_expired")
            match answer:
                case Unasked():
                    return Ask("key")
                case KeyFailed():
                    return MarkIndeterminate("key_derivation_failed")
                case KeyDerived(key=key):
                    if key != intent.key:
                        return MarkIndeterminate("key_drift")
                    if intent.attempts >= policy.max_attempts:
                        return MarkIndeterminate("retries_exhausted")
                    return RetryDecision()
        case Queryable():
            match answer:
                case Unasked():
                    return Ask("lookup")
                case Landed(result=result):
                    return Complete(result)
                case NotLanded():
                    # Not trusted before the deadline: a request in flight could still land.
                    if intent.deadline_at is not None and now < intent.deadline_at:
                        return Defer(intent.deadline_at, intent.unknown_count, "awaiting_deadline")
                    if intent.attempts >= policy.max_attempts:
                        return MarkIndeterminate("retries_exhausted")
                    return RetryDecision()
                case Unknown(reason=why):
                    return _ask_later(intent, why, now, policy)
        case Transactional():
            match answer:
                case Unasked():
                    return Ask("marker")
                case Landed(result=result):
                    # The marker committed with the tool's transaction: its write landed.
                    return Complete(result)
                case NotLanded():
                    # Asking fenced every attempt so far out of the marker: none can land now.
                    if intent.attempts >= policy.max_attempts:
                        return Fail("retries_exhausted")
                    return RetryDecision()
                case Unknown(reason=why):
                    return _ask_later(intent, why, now, policy)
        case Unsafe():
            return MarkIndeterminate("unsafe_unknown_outcome")
        case ReadOnly():
            # Nothing happened whatever the outcome: run it again, or give up plainly.
            if intent.attempts >= policy.max_attempts:
                return Fail("retries_exhausted")
            return RetryDecision()
        case _:
            assert_never(current)
    raise TypeError(f"{type(answer).__name__} is no answer for a {intent.effect} intent")


def _ask_later(intent: Intent, why: str, now: float, policy: Policy) -> Defer | MarkIndeterminate:
    """A lookup that could not say: back off and ask again, up to `lookup_limit` answers."""
    n = intent.unknown_count + 1
    if n >= policy.lookup_limit:
        return MarkIndeterminate("lookup_unknown_limit")
    delay = policy.lookup.delay(n)
    return Defer(now + delay, n, f"lookup_unknown: {why}"[:500])


def key_window_passed(ttl: float | None, key_from: float, at: float) -> bool:
    """Has a provider that remembers keys `ttl` seconds forgotten, at `at`, a key it could
    first have received at `key_from`? `key_from` is the call's creation: no request carrying
    the key can have left before it (an approved call's wait counts too, so the age is never
    underestimated)."""
    return ttl is not None and at - key_from > ttl


# The send gate: whether one request may leave a tool's handle now.


@dataclass(frozen=True, slots=True)
class Send:
    """A request a handle (`ctx.http`, `ctx.ahttp`, the httpx transport, `ctx.sink`) is
    about to let out, and what its attempt knows at that moment."""

    effect: EffectClass  # the class the tool runs under
    recorded: str  # the class recorded with the call
    write: bool  # may change something: an HTTP method but GET/HEAD/OPTIONS/TRACE, a sink write
    live: bool  # the kernel runs in live mode (not shadow, not replay)
    state: IntentState  # the call's state when this attempt started
    attempt: int  # the attempt's number, 1 for the first dispatch
    writes: int  # writes of this attempt let out before this one
    key_from: float  # the call's creation: before it, nothing carried its key
    now: float  # the log's clock
    within: float  # how long after `now` the request may still reach the provider


@dataclass(frozen=True, slots=True)
class Refused:
    """The request does not leave: `reason` (a code) and what it means."""

    reason: str
    detail: str


def send_gate(s: Send) -> Refused | None:
    """May this request leave now? None lets it go. The only rule that lets a request of a
    tool out; every refusal is recorded as a denial and decides the attempt (`after_refusal`)."""
    if not s.write:
        return None  # a read changes nothing
    if effect_name(s.effect) != s.recorded:
        return Refused("effect_changed", f"the call was recorded {s.recorded}")
    if isinstance(s.effect, ReadOnly):
        return Refused("read_only", "a ReadOnly tool writes nothing")
    if isinstance(s.effect, Transactional):
        return Refused("transactional", "a Transactional tool writes only through ctx.tx")
    if not s.live:
        return Refused("sandbox", "a shadow or replay kernel lets no write leave")
    if s.state != IntentState.DISPATCHED:
        return Refused("not_dispatched", f"the call is {s.state.value}, not dispatched")
    # Whether a request of this call may have gone out before this one.
    earlier = s.attempt > 1 or s.writes > 0
    if isinstance(s.effect, Unsafe) and s.attempt > 1:
        return Refused("unsafe_reissue", "an Unsafe call is never sent again")
    if (
        isinstance(s.effect, Idempotent)
        and earlier
        and key_window_passed(s.effect.key_ttl, s.key_from, s.now + s.within)
    ):
        return Refused(
            "key_expired",
            f"the provider may have forgotten the key (key_ttl={s.effect.key_ttl:g}s) before "
            "this request reaches it",
        )
    return None


def after_refusal(
    effect: EffectClass, attempt: int, writes: int, refused: Refused
) -> Fail | MarkIndeterminate:
    """How an attempt ends once the gate refused one of its requests, whatever the tool did
    next: FAILED if nothing of the call can have gone out (no write of this attempt left, and
    no earlier attempt may have landed), else Indeterminate by the refusal's reason. A
    Transactional retry follows a lookup that fenced every earlier attempt out: none landed."""
    landed_before = attempt > 1 and not isinstance(effect, Queryable | ReadOnly | Transactional)
    if writes == 0 and not landed_before:
        return Fail(f"send refused: {refused.reason}: {refused.detail}")
    return MarkIndeterminate(refused.reason)


def failure_is_final(current: EffectClass, intent: Intent) -> bool:
    """May a refusal, or a request that never left, end this attempt's call FAILED? Only if
    no earlier attempt's outcome is unknown: an Idempotent retry follows one whose effect may
    have landed, and its own refusal says nothing of that one."""
    return not (current.keyed and intent.attempts > 1)


Claimability = Literal["claimable", "settled", "not_due", "held", "live"]


def claimability(
    intent: Intent,
    me: Owner,
    *,
    held: bool,
    now: float,
    alive: Callable[[Owner], bool],
) -> Claimability:
    """May `me` take this intent over now? `held`: this kernel drives it already; `alive`
    says whether an owner's process on this host still runs."""
    if intent.state != IntentState.DISPATCHED:
        return "settled"
    if held:
        return "held"
    if intent.next_check_at is not None and intent.next_check_at > now:
        return "not_due"
    o = intent.owner
    if o is None or o == me:
        # Ours and not held: the thread that drove it is gone (a crash of a caller or a
        # cancelled one that already settled would not leave it unheld and unfinished).
        return "claimable"
    if intent.lease_expires_at is not None and intent.lease_expires_at <= now:
        return "claimable"
    # Only on our own host can a pid say anything; elsewhere the lease decides.
    if o.host == me.host and not alive(o):
        return "claimable"
    return "live"


def attempt_deadline(start: float, timeout: float, margin: float) -> float:
    """Until when a request sent by an attempt started at `start` may still land."""
    return start + timeout + margin


def takeover_deadline(intent: Intent, now: float, margin: float) -> float | None:
    """The deadline after taking over an intent whose owner stopped mid-attempt: a request
    it sent up to now may land until now + timeout. A deferred intent's owner had finished
    its attempt, so its deadline stands."""
    if intent.next_check_at is not None:
        return None
    later = attempt_deadline(now, intent.timeout_s, margin)
    return later if intent.deadline_at is None or intent.deadline_at < later else None
