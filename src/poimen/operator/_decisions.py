"""An operator's decisions made through a running kernel (`Kernel.resolve`, `abandon`,
`approve`, `reject`): the store's decision, as the CLI and the console make it
(`poimen.operator._ops`), then the kernel's observers hear of it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from poimen._core.intents import Intent, IntentState
from poimen._engine import hooks as _hooks
from poimen._engine.notify import notifier_names
from poimen.errors import ApprovalExpiredError
from poimen.events import AbandonedEvent, ApprovalDecidedEvent, ResolvedEvent
from poimen.operator import _ops

if TYPE_CHECKING:
    from poimen._engine.engine import Engine


def resolve(
    e: Engine, intent_id: str, *, landed: bool, result: Any, operator: str, reason: str
) -> Intent:
    it = _ops.resolve(
        e.store, intent_id, landed=landed, result=result, operator=operator, reason=reason
    )
    _hooks.report(e, ResolvedEvent, it, landed=landed, operator=operator, reason=reason)
    return it


def abandon(e: Engine, intent_id: str, *, operator: str, reason: str) -> Intent:
    """The intent becomes INDETERMINATE, notified to the kernel's notifiers (delivered soon,
    off the caller's thread)."""
    done = _ops.abandon(
        e.store, intent_id, operator=operator, reason=reason, notifiers=notifier_names(e.notifiers)
    )
    _hooks.report(
        e,
        AbandonedEvent,
        done,
        fence=done.fence,
        reason=done.reason or "abandoned",
        operator=operator,
    )
    e.notify()
    return done


def decide_approval(
    e: Engine, intent_id: str, *, approve: bool, operator: str, reason: str
) -> Intent:
    try:
        it = _ops.decide_approval(
            e.store, intent_id, approve=approve, operator=operator, reason=reason
        )
    except ApprovalExpiredError as exc:
        if getattr(exc, "expired_here", False):  # this decision came late and expired it
            _hooks.expired(e, [intent_id])
        raise
    if it.state != IntentState.AWAITING_APPROVAL:  # not one approval of several
        decided = {"approved": approve, "operator": operator, "reason": reason}
        _hooks.report(e, ApprovalDecidedEvent, it, **decided)
    return it
