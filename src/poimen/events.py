"""What a kernel does, as typed events: for your own reactions (`Kernel.on`), your own
observers (`Kernel(observers=[...])`), and poimen's logging and OpenTelemetry observers
(docs/observability.md).

Every state change of an intent made by a kernel is one event, emitted once, after its commit:
`DispatchedEvent`, `CompletedEvent`, `FailedEvent`, `UnknownOutcomeEvent`, `RetryEvent`,
`DeferredEvent`, `TakeoverEvent`, `IndeterminateEvent` (and `AbandonedEvent`),
`ResolvedEvent`, `ApprovalRequestedEvent`, `ApprovalDecidedEvent`, `ApprovalExpiredEvent`.
Scopes come as pairs, a start and a finish: a call, an attempt (one run of the tool), a lookup,
a recovery pass and the recovery of one intent in it. Besides: `DenialEvent` (a write the
capability layer refused), `FencedOutEvent` (a write that lost to another owner) and
`LeasesRenewedEvent`.

Events are values (frozen dataclasses). An `Observer` sees them in the thread that caused them,
so it must be quick; a hook registered with `Kernel.on` runs on a thread of its own instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from poimen._core.intents import RecoveryReport

__all__ = [
    "AbandonedEvent",
    "ApprovalDecidedEvent",
    "ApprovalExpiredEvent",
    "ApprovalRequestedEvent",
    "AttemptFinishedEvent",
    "AttemptStartedEvent",
    "AuditHeadEvent",
    "CallFinishedEvent",
    "CallStartedEvent",
    "CompletedEvent",
    "DeferredEvent",
    "DenialEvent",
    "DispatchedEvent",
    "FailedEvent",
    "FencedOutEvent",
    "FinishEvent",
    "IndeterminateEvent",
    "IntentEvent",
    "IntentRecoveryFinishedEvent",
    "IntentRecoveryStartedEvent",
    "KernelEvent",
    "LeasesRenewedEvent",
    "LookupFinishedEvent",
    "LookupStartedEvent",
    "Observer",
    "RecoveryPassFinishedEvent",
    "RecoveryPassStartedEvent",
    "ResolvedEvent",
    "RetryEvent",
    "StartEvent",
    "TakeoverEvent",
    "UnknownOutcomeEvent",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelEvent:
    """Something a kernel did: `at` is wall-clock seconds, `worker_id` the kernel's."""

    #: A short stable name, for logs and metrics.
    kind: ClassVar[str] = "event"

    at: float
    worker_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class IntentEvent(KernelEvent):
    """An event about one intent (one logical call)."""

    intent_id: str
    call_id: str
    tool_id: str
    effect: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StartEvent(KernelEvent):
    """The start of a scope (a call, an attempt, a lookup, a recovery pass)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishEvent(KernelEvent):
    """The end of the scope its start began; `duration` in seconds."""

    # Each finish event declares it: an intent's scopes are IntentEvents as well, and two
    # bases with fields of their own cannot share a slotted layout.
    if TYPE_CHECKING:

        @property
        def duration(self) -> float: ...


# Scopes.


@dataclass(frozen=True, slots=True, kw_only=True)
class CallStartedEvent(StartEvent):
    """`Kernel.call` or `acall` began, after the arguments validated (nothing written yet)."""

    kind: ClassVar[str] = "call_started"
    tool_id: str
    call_id: str
    effect: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CallFinishedEvent(FinishEvent):
    """A call returned its outcome (`completed`, `failed`, `indeterminate`, `resolved`,
    `pending`) or raised (`error`, with the exception's type and text in `reason`)."""

    kind: ClassVar[str] = "call_finished"
    duration: float
    tool_id: str
    call_id: str
    effect: str
    intent_id: str | None
    outcome: str
    reason: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptStartedEvent(IntentEvent, StartEvent):
    """The tool is about to run for this attempt."""

    kind: ClassVar[str] = "attempt_started"
    attempt: int
    fence: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptFinishedEvent(IntentEvent, FinishEvent):
    """The tool returned or raised: `outcome` is `completed`, `failed`, `unknown`,
    `not_sent` or `indeterminate` (a denied or refused write after one that went out, or a
    send the gate refused after an earlier attempt); `error` says why for all but
    `completed`."""

    kind: ClassVar[str] = "attempt_finished"
    duration: float
    attempt: int
    fence: int
    outcome: str
    error: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupStartedEvent(StartEvent):
    """A Queryable tool's provider is asked whether a request landed."""

    kind: ClassVar[str] = "lookup_started"
    tool_id: str
    request_id: str
    intent_id: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupFinishedEvent(FinishEvent):
    """The provider's answer: `landed`, `not_landed` or `unknown` (with `detail`)."""

    kind: ClassVar[str] = "lookup_finished"
    duration: float
    tool_id: str
    request_id: str
    intent_id: str | None
    answer: str
    detail: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryPassStartedEvent(StartEvent):
    """A recovery pass (the restart scan) began."""

    kind: ClassVar[str] = "recovery_pass_started"


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryPassFinishedEvent(FinishEvent):
    """A recovery pass ended: what it saw and did (`report`), or the error that stopped it."""

    kind: ClassVar[str] = "recovery_pass_finished"
    duration: float
    report: RecoveryReport | None
    error: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class IntentRecoveryStartedEvent(IntentEvent, StartEvent):
    """Recovery drives one unfinished intent whose owner is gone."""

    kind: ClassVar[str] = "intent_recovery_started"


@dataclass(frozen=True, slots=True, kw_only=True)
class IntentRecoveryFinishedEvent(IntentEvent, FinishEvent):
    """What recovering one intent came to (the outcome kinds of `CallFinishedEvent`)."""

    kind: ClassVar[str] = "intent_recovery_finished"
    duration: float
    outcome: str
    reason: str | None


# Transitions, each after its commit.


@dataclass(frozen=True, slots=True, kw_only=True)
class DispatchedEvent(IntentEvent):
    """The dispatch commit: the intent and its attempt 1 are recorded."""

    kind: ClassVar[str] = "dispatched"
    fence: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletedEvent(IntentEvent):
    """COMPLETED: the tool returned (`via` "call"), a lookup said it landed ("lookup"), or a
    Transactional tool's transaction committed with the outcome ("transaction")."""

    kind: ClassVar[str] = "completed"
    fence: int
    via: str


@dataclass(frozen=True, slots=True, kw_only=True)
class FailedEvent(IntentEvent):
    """FAILED: refused, never sent, cancelled before it ran, or an approval rejected."""

    kind: ClassVar[str] = "failed"
    fence: int
    error: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class UnknownOutcomeEvent(IntentEvent):
    """An attempt ended without a definite outcome; the class decides what follows."""

    kind: ClassVar[str] = "unknown_outcome"
    fence: int
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryEvent(IntentEvent):
    """A new attempt was claimed (fence + 1), as the class allows."""

    kind: ClassVar[str] = "retry"
    attempt: int
    fence: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DeferredEvent(IntentEvent):
    """Checked again at `until` (a Queryable deadline, a lookup's back-off, a retry deferred)."""

    kind: ClassVar[str] = "deferred"
    fence: int
    reason: str
    until: float


@dataclass(frozen=True, slots=True, kw_only=True)
class TakeoverEvent(IntentEvent):
    """This kernel took over an unfinished intent: its owner (`previous_owner`) is gone, or
    an operator approved it and nobody runs it yet (`reason` "approved")."""

    kind: ClassVar[str] = "takeover"
    fence: int
    attempt: int
    previous_owner: str | None
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class IndeterminateEvent(IntentEvent):
    """INDETERMINATE: the effect may or may not have happened; an operator decides."""

    kind: ClassVar[str] = "indeterminate"
    fence: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AbandonedEvent(IndeterminateEvent):
    """An operator abandoned a DISPATCHED intent (made it INDETERMINATE)."""

    kind: ClassVar[str] = "abandoned"
    operator: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvedEvent(IntentEvent):
    """An operator decided an INDETERMINATE intent: landed or not."""

    kind: ClassVar[str] = "resolved"
    landed: bool
    operator: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ApprovalRequestedEvent(IntentEvent):
    """The call is recorded AWAITING_APPROVAL; nothing is sent before an operator approves."""

    kind: ClassVar[str] = "approval_requested"
    expires_at: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class ApprovalDecidedEvent(IntentEvent):
    """An operator approved (DISPATCHED, run once by its class) or rejected (FAILED)."""

    kind: ClassVar[str] = "approval_decided"
    approved: bool
    operator: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ApprovalExpiredEvent(IntentEvent):
    """Nobody decided within the approval window: FAILED, nothing was sent."""

    kind: ClassVar[str] = "approval_expired"


@dataclass(frozen=True, slots=True, kw_only=True)
class FencedOutEvent(IntentEvent):
    """A write on `fence` changed nothing: another owner drives the intent now (a late
    outcome is kept on its attempt, as evidence)."""

    kind: ClassVar[str] = "fenced_out"
    fence: int
    write: str


# Other events.


@dataclass(frozen=True, slots=True, kw_only=True)
class DenialEvent(KernelEvent):
    """The capability layer refused a write (recorded in the denial audit)."""

    kind: ClassVar[str] = "denial"
    tool_id: str
    intent_id: str | None
    attempt: int | None
    action: str
    target: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LeasesRenewedEvent(KernelEvent):
    """The renewal duty extended the leases of the intents this kernel holds: `renewed` of
    `held` (fewer: some were settled or taken over meanwhile)."""

    kind: ClassVar[str] = "leases_renewed"
    held: int
    renewed: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditHeadEvent(KernelEvent):
    """The head of the log's audit chain, published (``Kernel(audit_head_every=...)``):
    keep it elsewhere, and `poimen audit verify --head SEQ:HASH` later shows whether the
    chain was rewritten since (docs/audit.md)."""

    kind: ClassVar[str] = "audit_head"
    log_id: str
    seq: int
    hash: str


class Observer:
    """Sees a kernel's events in the thread that caused them: override what you need, keep
    it quick (a slow observer slows calls down; use `Kernel.on` for slow reactions), and do
    not raise (an observer's exception is logged and dropped).

    `start` and `finish` bracket a scope in the caller's context (the place to open a span and
    make it current); by default each hands its event to `event`.
    """

    def bind(self, kernel: Any) -> None:
        """Called once when a kernel (a `poimen.Kernel`: this module sits below it) installs
        this observer."""

    def event(self, event: KernelEvent) -> None:
        """A point event (a transition, a denial, a renewal), or a scope's start or finish."""

    def start(self, event: StartEvent) -> object:
        """A scope begins; the value returned is given back to `finish`."""
        self.event(event)
        return None

    def finish(self, token: object, event: FinishEvent) -> None:
        """The scope `start` returned `token` for ends."""
        self.event(event)

    def close(self) -> None:
        """The kernel closes."""
