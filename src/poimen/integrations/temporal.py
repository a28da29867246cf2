"""poimen tools as Temporal activities. Needs ``pip install 'poimen[temporal]'``.

::

    send_email = temporal_activity(kernel, "send_email")
    worker = Worker(client, task_queue="mail", workflows=[Notify],
                    activities=[send_email, outcome_activity(kernel)])
    # in the workflow:
    await workflow.execute_activity("send_email", {"to": to, "subject": "Your invoice"},
                                    start_to_close_timeout=timedelta(seconds=30))

Temporal runs an activity again when its worker died in it or its answer was lost (a new
attempt, on any worker). The activity's call id is the workflow id, its run id and the
activity id (``temporal/<workflow id>/<run id>/<activity id>``), which every attempt shares;
a new attempt finds the call in the log and answers from it, so an email activity killed after
sending does not send again.

The activity returns the tool's result. A call that failed with no effect raises
``ApplicationError(type="PoimenToolCallFailed", non_retryable=True)``; a call whose effect is
unknown raises ``ApplicationError(type="PoimenOutcomeUnknown", non_retryable=True)``; the
details hold the call id and the intent id. After an operator decides, the
``poimen.outcome`` activity (`outcome_activity`) returns the decision. A call awaiting an
operator's approval raises ``ApplicationError(type="PoimenApprovalRequired",
non_retryable=True)``; the workflow receives the approvers' decisions (a signal, an update),
applies each with the ``poimen.decide`` activity (`decide_activity`) until the call is
decided, and gets its outcome from ``poimen.outcome``: see docs/integrations/temporal.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from poimen.errors import MissingExtraError

try:
    from temporalio import activity
    from temporalio.exceptions import ApplicationError, ApplicationErrorCategory
except ImportError as exc:  # the extra is missing: say which one
    raise MissingExtraError.of("poimen.integrations.temporal", "temporal", exc) from exc

from poimen import Indeterminate, Kernel, Outcome, call_ids
from poimen.errors import (
    IntentNotFoundError,
    OutcomeUnknownError,
    PoimenError,
    ToolCallFailedError,
)
from poimen.integrations._outcomes import (
    awaiting,
    followed,
    request,
    resumed_decision,
    value_or_raise,
)

__all__ = [
    "APPROVAL",
    "FAILED",
    "NOT_DECIDED",
    "UNKNOWN",
    "activity_call_id",
    "decide_activity",
    "outcome_activity",
    "temporal_activity",
]

#: `ApplicationError.type` of a call that failed with no effect (non-retryable).
FAILED = "PoimenToolCallFailed"
#: `ApplicationError.type` of a call whose effect is unknown (non-retryable).
UNKNOWN = "PoimenOutcomeUnknown"
#: `ApplicationError.type` from `poimen.outcome` while no one has decided yet (retryable:
#: Temporal's retry policy is the polling loop).
NOT_DECIDED = "PoimenNotDecided"
#: `ApplicationError.type` of a call that awaits an operator's approval (non-retryable); the
#: details hold the call id, intent id, arguments and approvals asked for.
APPROVAL = "PoimenApprovalRequired"


def activity_call_id() -> str:
    """The call id of the activity running now.

    The run id is part of it: activity ids are numbered per workflow run, so a workflow that
    continues as new (or is retried as a whole) numbers its activities from 1 again, and
    those are other calls."""
    info = activity.info()
    if info.workflow_id is not None and info.workflow_run_id:
        return call_ids.framework_id(
            f"temporal/{info.workflow_id}/{info.workflow_run_id}", info.activity_id
        )
    run_id = getattr(info, "activity_run_id", None)  # an activity started on its own
    if run_id:
        return call_ids.framework_id(f"temporal/activity/{run_id}", info.activity_id)
    raise PoimenError(
        f"activity {info.activity_id!r} has neither a workflow run nor an activity run id, "
        "so it has no call id that survives a retry; nothing was recorded"
    )


def temporal_activity(
    kernel: Kernel, tool: str, *, name: str | None = None
) -> Callable[[dict[str, Any]], Awaitable[Any]]:
    """The tool `tool` (an id or a spec name) of `kernel` as an async Temporal activity named
    `name` (default: the tool id) taking the tool's arguments as one dict."""
    tool_id = kernel.tool_id(tool)

    @activity.defn(name=name or tool_id)
    async def run(args: dict[str, Any]) -> Any:
        call_id = activity_call_id()
        scope = call_id.rpartition("/")[0]  # the run: an identical unsettled call answers it
        outcome = await kernel.acall(tool_id, args, call_id=call_id, scope=scope)
        return _value(followed(kernel, call_id, outcome), call_id, kernel)

    return run


def outcome_activity(
    kernel: Kernel, *, name: str = "poimen.outcome"
) -> Callable[[str], Awaitable[Any]]:
    """An activity that answers a call's settled outcome by its call id: the result, or the
    same errors as the tool's activity. While the outcome is still unknown (Indeterminate:
    an operator decides; Pending: on its way, driven here when its worker died) it raises a
    retryable `NOT_DECIDED` error, so the activity's retry policy is the polling loop."""

    @activity.defn(name=name)
    async def outcome(call_id: str) -> Any:
        try:  # a Pending call nobody drives (its worker died) is driven here
            out = await kernel.wait(call_id, timeout=0)
        except IntentNotFoundError:
            raise ApplicationError(f"no call has the call id {call_id!r}", {"call_id": call_id},
                                   type="PoimenUnknownCall", non_retryable=True) from None
        if not out.terminal:
            waits = ("an operator's approval" if awaiting(out) else "an operator's decision"
                     if isinstance(out, Indeterminate) else "its outcome")
            raise ApplicationError(
                f"call {call_id!r} (intent {out.intent_id}) awaits {waits}",
                {"call_id": call_id, "intent_id": out.intent_id},
                type=NOT_DECIDED,
            )
        return _value(out, call_id)

    return outcome


def decide_activity(
    kernel: Kernel, *, name: str = "poimen.decide"
) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]:
    """An activity that applies an approver's decision to a call awaiting approval:
    ``{"call_id": ..., "decision": {"decision": "approve" | "edit" | "reject", "operator":
    ..., "reason": ..., "args": {...} (edit)}}``, recorded on the call's intent (audited).
    Returns what is asked now: ``{}`` once decided (then ``poimen.outcome`` runs it and
    answers), else the call as the `APPROVAL` error's details have it (four eyes, or an
    edited call), with ``refused``: why this decision did not count. A decision on a call
    decided already (an attempt retried after its worker died) changes nothing."""

    @activity.defn(name=name)
    async def decide(asked: dict[str, Any]) -> dict[str, Any]:
        call_id = asked.get("call_id") if isinstance(asked, dict) else None
        if not isinstance(call_id, str):
            raise ApplicationError(f"poimen.decide takes {{'call_id', 'decision'}}, not {asked!r}",
                                   type="PoimenBadDecision", non_retryable=True)
        return await asyncio.to_thread(_decided, kernel, call_id, asked.get("decision"))

    return decide


def _decided(kernel: Kernel, call_id: str, decision: Any) -> dict[str, Any]:
    outcome = kernel.outcome(call_id)
    if outcome is None:
        raise ApplicationError(f"no call has the call id {call_id!r}", {"call_id": call_id},
                               type="PoimenUnknownCall", non_retryable=True)
    refused = None
    if awaiting(outcome):
        refused = resumed_decision(kernel, outcome.intent_id, decision)
        outcome = kernel.outcome(call_id) or outcome
    if not awaiting(outcome):
        return {}
    asked = _asked(kernel, call_id, outcome)
    return asked if refused is None else {**asked, "refused": refused}


def _asked(kernel: Kernel, call_id: str, outcome: Outcome) -> dict[str, Any]:
    intent = kernel.store.get_intent(outcome.intent_id)
    return request(kernel, call_id, intent.tool_id if intent else "", {}, outcome)


def _value(outcome: Outcome, call_id: str, kernel: Kernel | None = None) -> Any:
    if kernel is not None and awaiting(outcome):
        asked = _asked(kernel, call_id, outcome)
        raise ApplicationError(
            f"call {call_id!r} (intent {outcome.intent_id}) awaits an operator's approval and "
            "has not run: send the decision to the workflow, which applies it with "
            "poimen.decide",
            asked, type=APPROVAL, non_retryable=True,
            category=ApplicationErrorCategory.BENIGN,  # the workflow's next step: not logged
        )
    try:
        return value_or_raise(outcome, call_id)
    except ToolCallFailedError as exc:
        _raise(exc, FAILED)
    except OutcomeUnknownError as exc:
        _raise(exc, UNKNOWN)


def _raise(exc: PoimenError, kind: str) -> NoReturn:
    details = {k: v for k, v in exc.data.items() if isinstance(v, str)}
    raise ApplicationError(str(exc), details, type=kind, non_retryable=True) from exc
