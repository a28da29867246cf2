"""Intent states, the one table of allowed transitions, and the values the log holds."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, assert_never

from poimen._core.slots import slot_init
from poimen.errors import IllegalTransitionError


class IntentState(enum.StrEnum):
    """Where an intent stands (docs/design.md §3); stored by value."""

    AWAITING_APPROVAL = "AWAITING_APPROVAL"
    DISPATCHED = "DISPATCHED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    INDETERMINATE = "INDETERMINATE"
    RESOLVED_LANDED = "RESOLVED_LANDED"
    RESOLVED_NOT_LANDED = "RESOLVED_NOT_LANDED"


S = IntentState

#: Every store checks against this table; `None` is "no intent yet".
TRANSITIONS: dict[IntentState | None, frozenset[IntentState]] = {
    None: frozenset({S.DISPATCHED, S.AWAITING_APPROVAL}),
    # Approved: dispatched (fence + 1); rejected or expired: FAILED, nothing was sent.
    S.AWAITING_APPROVAL: frozenset({S.DISPATCHED, S.FAILED}),
    # DISPATCHED -> DISPATCHED is a claim or a new attempt (fence + 1).
    S.DISPATCHED: frozenset({S.DISPATCHED, S.COMPLETED, S.FAILED, S.INDETERMINATE}),
    S.INDETERMINATE: frozenset({S.RESOLVED_LANDED, S.RESOLVED_NOT_LANDED}),
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.RESOLVED_LANDED: frozenset(),
    S.RESOLVED_NOT_LANDED: frozenset(),
}

TERMINAL = frozenset(s for s, nxt in TRANSITIONS.items() if s is not None and not nxt)
UNFINISHED = frozenset({S.DISPATCHED})


def check_transition(src: IntentState | None, dst: IntentState) -> None:
    if dst not in TRANSITIONS[src]:
        raise IllegalTransitionError(
            f"illegal transition {src or 'new'} -> {dst}", source=src, target=dst
        )


@dataclass(frozen=True, slots=True)
class Owner:
    """Who holds an in-flight intent: a worker, on a host, in a process."""

    worker_id: str
    host: str
    pid: int
    pid_start: str


@dataclass(frozen=True, slots=True)
class Intent:
    id: str
    call_id: str
    tool_id: str
    effect: str
    args: str
    args_hash: str
    key: str | None
    request_id: str | None
    state: IntentState
    fence: int
    owner: Owner | None
    lease_expires_at: float | None
    timeout_s: float
    deadline_at: float | None
    next_check_at: float | None
    unknown_count: int
    attempts: int
    result: str | None
    error: str | None
    reason: str | None
    created_at: float
    updated_at: float


@dataclass(frozen=True, slots=True)
class Attempt:
    intent_id: str
    number: int
    fence: int
    owner: Owner | None
    started_at: float
    ended_at: float | None
    outcome: str | None
    result: str | None
    error: str | None
    late_outcome: str | None
    late_result: str | None


@dataclass(frozen=True, slots=True)
class Event:
    id: int
    intent_id: str
    at: float
    kind: str
    from_state: str | None
    to_state: str | None
    actor: str
    detail: str | None


@dataclass(frozen=True, slots=True)
class Notification:
    id: int
    delivery_id: str
    intent_id: str
    kind: str
    payload: str
    created_at: float
    delivered_at: float | None
    attempts: int
    next_attempt_at: float
    last_error: str | None


@dataclass(frozen=True, slots=True)
class Delivery:
    """One notifier's delivery of one notification (``*``: any notifier)."""

    notification_id: int
    notifier: str
    delivered_at: float | None
    attempts: int
    last_error: str | None
    next_attempt_at: float


@dataclass(frozen=True, slots=True)
class Denial:
    id: int
    at: float
    tool_id: str
    intent_id: str | None
    attempt: int | None
    action: str
    target: str
    reason: str


# What a caller receives. Indeterminate is a value, not an exception. Each outcome says, for
# a model, what happened and whether calling the tool again is right (`for_model()`,
# `retryable`), and whether it is final (`terminal`): one text per outcome, used by every
# integration, so that no agent is told to retry a call whose effect may have happened.


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(value)


@slot_init
@dataclass(frozen=True, slots=True)
class Completed:
    intent_id: str
    result: Any

    terminal: ClassVar[bool] = True
    retryable: ClassVar[bool] = False

    def for_model(self) -> str:
        """The result as JSON text, for the model."""
        return _json(self.result)


@slot_init
@dataclass(frozen=True, slots=True)
class Failed:
    """The call had no effect: the provider refused it, or it was never sent."""

    intent_id: str
    error: str
    #: An operator rejected the call before it was sent (its approval): the model is told not
    #: to ask again on its own. Not part of equality: the same outcome either way.
    rejected: bool = field(default=False, compare=False)

    terminal: ClassVar[bool] = True
    retryable: ClassVar[bool] = True

    def for_model(self) -> str:
        """The standard text: the action failed and had no effect; the model may correct and
        call again, unless an operator rejected it."""
        if self.rejected:
            return (
                f"An operator rejected this action, so it was not carried out: {self.error}. "
                "Do not call it again unless the user asks you to."
            )
        return (
            f"The action failed and had no effect: {self.error}. You may correct the input "
            "and call it again."
        )


@dataclass(frozen=True, slots=True)
class Indeterminate:
    """The effect may or may not have happened; an operator decides."""

    intent_id: str
    reason: str

    terminal: ClassVar[bool] = False
    retryable: ClassVar[bool] = False

    def for_model(self) -> str:
        """The standard text: the outcome is unknown; do NOT call it again; an operator
        decides."""
        return (
            "The outcome of this action is unknown: it may or may not have taken effect. "
            "Do NOT call it again. An operator has been notified and will decide; tell the "
            f"user it is being checked (reference {self.intent_id})."
        )


@dataclass(frozen=True, slots=True)
class Resolved:
    """An operator decided an Indeterminate intent."""

    intent_id: str
    landed: bool
    result: Any

    terminal: ClassVar[bool] = True

    @property
    def retryable(self) -> bool:
        """True when the operator decided it did not land: calling again may be right."""
        return not self.landed

    def for_model(self) -> str:
        """The standard text of the operator's decision."""
        if self.landed:
            return (
                "An operator confirmed that the action took effect"
                + (f": {_json(self.result)}" if self.result is not None else "")
                + ". Do not call it again."
            )
        return (
            "An operator confirmed that the action did not take effect. Call it again only "
            "if it is still needed."
        )


@dataclass(frozen=True, slots=True)
class Pending:
    """Still in flight (another live owner), waiting for its deadline before recovery, or
    awaiting an operator's approval. In a sandbox run (shadow or replay), a call that was not
    carried out: ``would_have_called`` or ``not_in_recording`` (`intent_id` is then the id of
    the sandbox record, ``sb_...``)."""

    intent_id: str
    reason: str

    retryable: ClassVar[bool] = False

    @property
    def terminal(self) -> bool:
        """A sandbox call that was not carried out never changes: final."""
        return self.reason in SANDBOX_REASONS

    def for_model(self) -> str:
        """The standard text: still in progress (or awaiting approval); do NOT call it again."""
        if self.reason == "awaiting_approval":
            return (
                "This action awaits an operator's approval and has not been carried out yet. "
                "Do NOT call it again; its result will follow once it is decided."
            )
        if self.reason in SANDBOX_REASONS:
            return (
                "This action was recorded but not carried out (a test run that has no "
                "effects), so it has no result. Do NOT call it again; go on without it."
            )
        return (
            "This action is still in progress. Do NOT call it again; its result will follow."
        )


#: Why a sandbox kernel gave Pending for a call it did not carry out.
SANDBOX_REASONS = frozenset({"would_have_called", "not_in_recording"})

Outcome = Completed | Failed | Indeterminate | Resolved | Pending


@dataclass(slots=True)
class RecoveryReport:
    """What one recovery pass saw and did (`poimen._engine.recovery`): counts by outcome."""

    scanned: int = 0
    completed: int = 0
    failed: int = 0
    indeterminate: int = 0
    pending: int = 0
    busy: int = 0
    lost_race: int = 0
    unregistered: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    expired: int = 0  # calls whose approval window passed (FAILED, nothing sent)

    def count(self, outcome: Outcome) -> None:
        """Count one settled outcome in the report."""
        match outcome:
            case Completed() | Resolved():
                self.completed += 1
            case Failed():
                self.failed += 1
            case Indeterminate():
                self.indeterminate += 1
            case Pending(reason="lost_race"):
                self.lost_race += 1
            case Pending(reason="busy"):
                self.busy += 1
            case Pending():
                self.pending += 1
            case _:
                assert_never(outcome)
