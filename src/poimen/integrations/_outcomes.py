"""What every integration tells its framework of a call: the text for a model when the
arguments were refused, and an outcome as a framework that runs steps expects it (a value, or
an exception)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from poimen import Completed, Failed, Indeterminate, Kernel, Outcome, Pending, Resolved
from poimen._engine import crashpoints as _crashpoints
from poimen.errors import (
    NotAwaitingApprovalError,
    OutcomeUnknownError,
    SameApproverError,
    ToolCallFailedError,
)
from poimen.operator._ops import OperatorInputError

log = logging.getLogger("poimen")


def refusal(error: Exception) -> str:
    """Arguments refused before anything was recorded: the model may correct them."""
    return f"The call was refused and had no effect: {error}. Correct the input and call it again."


def value_or_raise(outcome: Outcome, call_id: str) -> Any:
    """Completed (or resolved as landed): the result. Failed (or resolved as not landed):
    `ToolCallFailedError`. Indeterminate or Pending: `OutcomeUnknownError`, never to be
    retried by the framework."""
    match outcome:
        case Completed(result=result) | Resolved(landed=True, result=result):
            return result
        case Failed(intent_id=intent_id, error=error):
            raise ToolCallFailedError(
                f"call {call_id!r} failed and had no effect: {error}",
                call_id=call_id, intent_id=intent_id, error=error,
            )
        case Resolved(intent_id=intent_id):
            error = "an operator decided that it did not take effect"
            raise ToolCallFailedError(
                f"call {call_id!r}: {error}", call_id=call_id, intent_id=intent_id, error=error
            )
        case Pending(intent_id=intent_id, reason="awaiting_approval"):
            raise OutcomeUnknownError(
                f"call {call_id!r} (intent {intent_id}) awaits an operator's approval and has "
                f"not run. Do not retry it; once approvers decide, kernel.wait({call_id!r}) "
                f"returns its outcome",
                call_id=call_id, intent_id=intent_id, outcome="pending",
                reason="awaiting_approval",
            )
        case Indeterminate(intent_id=intent_id, reason=reason) | Pending(
            intent_id=intent_id, reason=reason
        ):
            kind = type(outcome).__name__.lower()
            raise OutcomeUnknownError(
                f"call {call_id!r} (intent {intent_id}) is {kind} ({reason}): its effect may "
                f"have happened. Do not retry it; an operator decides, then "
                f"kernel.wait({call_id!r}) returns the decision",
                call_id=call_id, intent_id=intent_id, outcome=kind, reason=reason,
            )
    raise TypeError(f"not an outcome: {outcome!r}")


#: How long an integration waits, by default, for a Pending call to settle (its deadline, a
#: lookup, a takeover of a gone owner) before answering Pending through its framework.
PENDING_WAIT = 30.0


def unsettled(outcome: Outcome) -> bool:
    """Pending (not a sandbox's final Pending) or Indeterminate: no result for the caller, so
    a model asking again is the same call, never a new one."""
    return isinstance(outcome, Indeterminate) or (
        isinstance(outcome, Pending) and not outcome.terminal
    )


def awaiting(outcome: Outcome | None) -> bool:
    """Pending until an operator approves or rejects it."""
    return isinstance(outcome, Pending) and outcome.reason == "awaiting_approval"


def waitable(outcome: Outcome) -> bool:
    """Pending on its way to an outcome (not waiting for an operator)."""
    return (
        isinstance(outcome, Pending)
        and not outcome.terminal
        and outcome.reason != "awaiting_approval"
    )


async def settle(kernel: Kernel, call_id: str, outcome: Outcome, wait: float) -> Outcome:
    """`outcome`, or for a Pending call the outcome after waiting up to `wait` seconds."""
    if waitable(outcome) and wait > 0:
        return await kernel.wait(call_id, timeout=wait)
    return outcome


def settle_sync(kernel: Kernel, call_id: str, outcome: Outcome, wait: float) -> Outcome:
    """`settle` for a caller without an event loop."""
    if waitable(outcome) and wait > 0:
        return kernel.wait_sync(call_id, timeout=wait)
    return outcome


def followed(kernel: Kernel, call_id: str, outcome: Outcome) -> Outcome:
    """`outcome`, or for a call an approver edited (Failed, ``edited``) its edited call's."""
    if isinstance(outcome, Failed):
        return kernel.outcome(call_id) or outcome
    return outcome


def request(
    kernel: Kernel, call_id: str, tool_id: str, args: Mapping[str, Any], outcome: Outcome
) -> dict[str, Any]:
    """What a framework's human-in-the-loop shows of a call poimen holds back: an approval
    asked for (``reason: awaiting_approval``: the arguments to approve, those of an edited
    call once an approver edited it, and ``approvals``: how many distinct operators must
    approve and who has), or a call still Pending."""
    asked: dict[str, Any] = {
        "call_id": call_id,
        "intent_id": outcome.intent_id,
        "tool": tool_id,
        "args": dict(args),
        "outcome": type(outcome).__name__,
        "reason": getattr(outcome, "reason", None),
    }
    if asked["reason"] == "awaiting_approval":
        intent = kernel.store.get_intent(outcome.intent_id)
        if intent is not None:
            asked["args"] = json.loads(intent.args)
        asked["approvals"] = approvals(kernel, outcome.intent_id)
    return asked


def approvals(kernel: Kernel, intent_id: str) -> dict[str, Any]:
    """``{"needed": n, "given": [operators]}`` of a call awaiting approval (four eyes: n > 1)."""
    needed, given = 1, []
    for e in kernel.store.events(intent_id):
        if e.kind == "awaiting_approval":
            try:
                needed = max(needed, int(json.loads(e.detail or "{}").get("approvers", 1)))
            except (ValueError, TypeError, AttributeError):
                continue
        elif e.kind == "approval_given" and e.actor not in given:
            given.append(e.actor)
    return {"needed": needed, "given": given}


def apply_decision(kernel: Kernel, intent_id: str, decision: Any) -> None:
    """An approver's decision given through a framework's human-in-the-loop, applied to the
    intent the framework asked about: ``{"decision": "approve" | "reject" | "edit",
    "operator": ..., "reason": ..., "args": {...} (edit)}``. A decision on a call decided
    already (a stale saved state resumed again) changes nothing: the log answers."""
    if not isinstance(decision, Mapping):
        raise OperatorInputError(
            f"an approval decision is a mapping with 'decision', 'operator' and 'reason', not "
            f"{decision!r}",
            field="decision",
        )
    kind = decision.get("decision")
    operator, reason = str(decision.get("operator") or ""), str(decision.get("reason") or "")
    try:
        if kind == "approve":
            kernel.approve(intent_id, operator=operator, reason=reason)
        elif kind == "edit":
            args = decision.get("args")
            if not isinstance(args, Mapping):
                raise OperatorInputError("an edit needs the edited 'args'", field="args")
            kernel.approve(intent_id, operator=operator, reason=reason, args=args)
        elif kind == "reject":
            kernel.reject(intent_id, operator=operator, reason=reason)
        else:
            raise OperatorInputError(
                f"decision must be 'approve', 'edit' or 'reject', not {kind!r}", field="decision"
            )
    except NotAwaitingApprovalError as exc:
        if isinstance(exc, SameApproverError):
            raise
        log.info("intent %s was decided already: %s", intent_id, exc)
    _crashpoints.hit("after_approval")


def resumed_decision(kernel: Kernel, intent_id: str, decision: Any) -> str | None:
    """`apply_decision` for a graph resumed from an interrupt: None, or why the decision did
    not count, to be asked again (never raised: LangGraph gives the same answer to the same
    interrupt every time the node runs again, so a raised refusal would stop the thread for
    good). An earlier four-eyes approval replayed is such a refusal, and harmless."""
    try:
        apply_decision(kernel, intent_id, decision)
    except (OperatorInputError, SameApproverError) as exc:
        log.info("intent %s: the decision did not count: %s", intent_id, exc)
        return str(exc)
    return None
