"""An approval with edited arguments, as a kernel applies it (docs/approvals.md). The rules of
when a call waits are `poimen._core.approval`'s; the edited call a caller resumes with is
`poimen._engine.engine.followed`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from poimen import call_ids
from poimen._core.intents import Intent, IntentState
from poimen._engine.engine import MAKING
from poimen._engine.notify import approval_note
from poimen.errors import IntentNotFoundError, NotAwaitingApprovalError
from poimen.operator._ops import Identity, who_and_why

if TYPE_CHECKING:
    from poimen._engine.engine import Engine


def approve_edited(
    engine: Engine,
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
    store = engine.store
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
    making = MAKING.set(edit_id)
    try:
        _, d, _ = engine.prepare(it.tool_id, args, edit_id)
    finally:
        MAKING.reset(making)
    now = store.now()
    if d.args_hash == it.args_hash:  # nothing edited: a plain approval
        return store.decide_approval(
            intent_id, approve=True, operator=name, reason=why, now=now, context=context
        )
    note = approval_note(d, it.next_check_at, engine.notifiers)
    return store.decide_approval(
        intent_id, approve=True, operator=name, reason=why, now=now, context=context,
        edit=(d, note),
    )
