"""When a tool's call waits for an operator's approval (docs/approvals.md): always, or when a
predicate on the recorded arguments says so; and for how long."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from poimen import _undo, call_ids
from poimen._core.intents import Intent, IntentState
from poimen._engine.notify import approval_note
from poimen.errors import (
    ArgumentError,
    IntentNotFoundError,
    NotAwaitingApprovalError,
    RegistrationError,
)
from poimen.operator._ops import Identity, who_and_why
from poimen.store import Store

if TYPE_CHECKING:
    from poimen._kernel import Kernel


class ApprovalRule:
    """When a tool's call waits for an operator: always, or when a predicate on the recorded
    arguments says so."""

    __slots__ = ("approvers", "predicate", "ttl")

    def __init__(
        self,
        predicate: Callable[[Mapping[str, Any]], bool] | None,
        ttl: float | None,
        approvers: int = 1,
    ):
        self.predicate = predicate
        self.ttl = ttl
        self.approvers = approvers

    def needed(self, tool_id: str, recorded: Mapping[str, Any]) -> bool:
        if self.predicate is None:
            return True
        try:
            return bool(self.predicate(recorded))
        except Exception as exc:  # nothing is recorded: the caller learns why
            raise ArgumentError(
                f"tool {tool_id!r}: its approval rule raised {type(exc).__name__}: {exc}",
                tool_id=tool_id,
                argument="<requires_approval>",
            ) from exc


def approval_rule(
    tool_id: str, requires: object, ttl: float | None, approvers: object = 1
) -> ApprovalRule | None:
    if ttl is not None and (
        isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0
    ):
        raise RegistrationError(
            f"tool {tool_id!r}: approval_ttl must be a positive number of seconds or None, "
            f"not {ttl!r}",
            tool_id=tool_id,
        )
    if isinstance(approvers, bool) or not isinstance(approvers, int) or approvers < 1:
        raise RegistrationError(
            f"tool {tool_id!r}: approvers must be a whole number from 1, not {approvers!r}",
            tool_id=tool_id,
        )
    if requires is False:
        if approvers > 1:
            raise RegistrationError(
                f"tool {tool_id!r}: approvers needs requires_approval", tool_id=tool_id
            )
        if ttl is not None:
            raise RegistrationError(
                f"tool {tool_id!r}: approval_ttl needs requires_approval", tool_id=tool_id
            )
        return None
    if requires is True:
        return ApprovalRule(None, ttl, approvers)
    if callable(requires):
        return ApprovalRule(requires, ttl, approvers)
    raise RegistrationError(
        f"tool {tool_id!r}: requires_approval must be True, False or a predicate on the "
        f"arguments, not {requires!r}",
        tool_id=tool_id,
    )


def approval_due(intent: Intent, now: float) -> bool:
    """Whether a call awaiting approval is past its window at `now` (it must expire, and no
    decision may dispatch it any more)."""
    return (
        intent.state == IntentState.AWAITING_APPROVAL
        and intent.next_check_at is not None
        and intent.next_check_at <= now
    )


def followed(store: Store, intent: Intent) -> Intent:
    """An intent approved with edited arguments answers with its edited call."""
    if intent.state == IntentState.FAILED and intent.reason == "edited":
        edited = store.get_by_call_id(call_ids.edit_of(intent.call_id))
        if edited is not None:
            return edited
    return intent


def approve_edited(
    kernel: Kernel,
    intent_id: str,
    *,
    operator: str | Identity,
    reason: str,
    args: Mapping[str, Any],
) -> Intent:
    """Approve with edit: the call is FAILED (`edited`, naming the edited call), and the
    edited call, a new intent bound to `args` under the call id ``edit/<call id>``, is
    recorded approved (or awaiting the other approvers of a four-eyes tool), both audited
    with the approver, in one transaction. Returns the edited call."""
    store = kernel.store
    it = store.get_intent(intent_id)
    if it is None:
        raise IntentNotFoundError(f"no intent {intent_id!r}", intent_id=intent_id)
    if it.state != IntentState.AWAITING_APPROVAL:
        raise NotAwaitingApprovalError(
            f"intent {intent_id!r} is {it.state}; only a call awaiting approval can be "
            "approved with edited arguments",
            intent_id=intent_id,
            state=it.state.value,
        )
    name, why, context = who_and_why("approve", operator, reason)
    edit_id = call_ids.edit_of(it.call_id)
    making = _undo._MAKING.set(edit_id)
    try:
        _, d, _ = kernel._prepare(it.tool_id, args, edit_id)
    finally:
        _undo._MAKING.reset(making)
    now = store.now()
    if d.args_hash == it.args_hash:  # nothing edited: a plain approval
        return store.decide_approval(
            intent_id, approve=True, operator=name, reason=why, now=now, context=context
        )
    note = approval_note(d, it.next_check_at, kernel.notifiers)
    return store.decide_approval(
        intent_id, approve=True, operator=name, reason=why, now=now, context=context,
        edit=(d, note),
    )
