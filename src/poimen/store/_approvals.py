"""Approval before acting, in the store (docs/approvals.md): a call recorded awaiting an
operator; an operator's decision (approve, reject, approve with edited arguments); four eyes
(the approvals of distinct operators a call needs); the end of the approval window. Every
decision is taken under the intent's row lock, on its fence, within its window."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from poimen._core.intents import Intent, IntentState, check_transition
from poimen.errors import (
    ApprovalExpiredError,
    CallIdMismatchError,
    IntentNotFoundError,
    NotAwaitingApprovalError,
    SameApproverError,
)
from poimen.store._base import NewDispatch, NewNotification, intent_from_row

T = TypeVar("T")
S = IntentState


@dataclass(frozen=True, slots=True)
class Awaiting:
    """What recording a call awaiting approval writes besides the intent: the operator's
    notification (none for an edited call approved at once), the end of the window, how many
    distinct operators must approve, and the call an edit replaces."""

    note: NewNotification | None
    expires_at: float | None
    approvers: int = 1
    edit_of: str | None = None


class Approvals:
    """Mixed into the SQL stores; `_tx`, `_read`, `_event`, `_insert_note` and the scoped
    first commit come from `SqlStore`."""

    _sql: ClassVar[Any]

    def _read(self, sql: str, params: Any = ()) -> list[Any]:
        raise NotImplementedError

    def _tx(self, what: str, fn: Callable[[Any, bool], T]) -> T:
        raise NotImplementedError

    def _event(self, ex: Any, intent_id: str, at: float, kind: str, src: IntentState | None,
               dst: IntentState | None, actor: str, detail: dict[str, Any]) -> None:
        raise NotImplementedError

    def _insert_note(self, ex: Any, intent_id: str, note: NewNotification, now: float) -> bool:
        raise NotImplementedError

    def _intent_or_none(self, ex: Any, intent_id: str) -> Intent | None:
        raise NotImplementedError

    def _record_scoped(self, d: NewDispatch, awaiting: Awaiting | None) -> tuple[Intent, bool]:
        raise NotImplementedError

    def record_awaiting(
        self,
        d: NewDispatch,
        note: NewNotification,
        expires_at: float | None,
        approvers: int = 1,
    ) -> tuple[Intent, bool]:
        """Record a call that waits for `approvers` distinct operators' approval: nothing is
        dispatched, an operator is notified in the same transaction. The call id is unique,
        as for a dispatch: (the recorded intent, False) if it exists. A scoped call finds an
        unsettled identical call as `record_dispatch` does."""
        awaiting = Awaiting(note, expires_at, approvers)
        if d.scope is not None:
            return self._record_scoped(d, awaiting)

        def op(ex: Any, retrying: bool) -> tuple[Intent, bool]:
            return self._insert_awaiting(ex, d, awaiting, retrying)

        return self._tx("record_awaiting", op)

    def _insert_awaiting(
        self, ex: Any, d: NewDispatch, a: Awaiting, retrying: bool
    ) -> tuple[Intent, bool]:
        cur = ex.execute(
            self._sql.insert_awaiting,
            (d.intent_id, d.call_id, d.tool_id, d.effect, d.args, d.args_hash, d.key,
             d.request_id, d.timeout_s, a.expires_at, d.now, d.now, d.scope),
        )
        if cur.rowcount == 0:
            row = ex.execute(self._sql.intent_by_call_id, (d.call_id,)).fetchone()
            it = intent_from_row(row)
            return it, retrying and it.id == d.intent_id
        detail: dict[str, Any] = {"expires_at": a.expires_at}
        if a.approvers > 1:
            detail["approvers"] = a.approvers
        if a.edit_of is not None:
            detail["edit_of"] = a.edit_of
        self._event(ex, d.intent_id, d.now, "awaiting_approval", None, S.AWAITING_APPROVAL,
                    d.owner.worker_id, detail)
        if a.note is not None:
            self._insert_note(ex, d.intent_id, a.note, d.now)
        made = self._intent_or_none(ex, d.intent_id)
        assert made is not None
        return made, True

    def _approvals(self, ex: Any, intent_id: str) -> tuple[int, list[str]]:
        """How many distinct operators must approve, and who has so far (four eyes)."""
        needed = 1
        for (text,) in ex.execute(self._sql.awaiting_detail, (intent_id,)).fetchall():
            try:
                needed = max(needed, int(json.loads(text or "{}").get("approvers", 1)))
            except (ValueError, TypeError, AttributeError):
                continue
        given = [str(r[0]) for r in ex.execute(self._sql.approvals_given, (intent_id,))]
        return needed, given

    def decide_approval(
        self,
        intent_id: str,
        *,
        approve: bool,
        operator: str,
        reason: str,
        now: float,
        context: Mapping[str, str] | None = None,
        edit: tuple[NewDispatch, NewNotification] | None = None,
    ) -> Intent:
        """AWAITING_APPROVAL -> DISPATCHED (approved: any kernel with the tool then runs it
        once) or FAILED (rejected: nothing was sent); audited; of two deciding at once
        exactly one wins. Only within the approval window: a decision at or after its end
        expires the call instead, in the same transaction, and is refused
        (`ApprovalExpiredError`).

        Four eyes: a call recorded for `n` approvers stays awaiting until `n` distinct
        operators approved it (`SameApproverError` for an operator's second approval).
        `edit` (approve only): the approver changed the arguments. The call is FAILED
        (`edited`, naming the edited call) and the edited call (`edit`, its scope the
        original's) is recorded in the same transaction: approved, or awaiting the other
        approvers (the editor's approval counts); returns the edited call."""
        target = S.DISPATCHED if approve else S.FAILED
        check_transition(S.AWAITING_APPROVAL, target)
        late = {"refused": "approve" if approve else "reject", "operator": operator}
        sql = self._sql
        audit = {**(context or {}), "operator": operator, "reason": reason}

        def op(ex: Any, retrying: bool) -> tuple[Intent, bool]:
            row = ex.execute(sql.intent_locked, (intent_id,)).fetchone()
            if row is None:
                raise IntentNotFoundError(f"no intent {intent_id!r}", intent_id=intent_id)
            it = intent_from_row(row)
            if it.state == S.FAILED and it.reason == "approval_expired":
                return it, retrying and it.updated_at == now
            if retrying and it.updated_at == now and it.state in (target, S.FAILED):
                # Our own earlier try, whose answer the lost connection swallowed.
                return (self._edited(ex, edit) or it) if edit else it, False
            if it.state != S.AWAITING_APPROVAL:
                raise NotAwaitingApprovalError(
                    f"intent {intent_id!r} is {it.state}; only a call awaiting approval can be "
                    "approved or rejected",
                    intent_id=intent_id,
                    state=it.state.value,
                )
            if it.next_check_at is not None and it.next_check_at <= now:
                self._expire(ex, it, now, late)  # its window is over
                done = self._intent_or_none(ex, intent_id)
                assert done is not None
                return done, True
            needed, given = self._approvals(ex, intent_id)
            if approve and operator in given:
                if retrying:
                    return it, False
                raise SameApproverError(
                    f"intent {intent_id!r} needs {needed} distinct operators' approval and "
                    f"{operator!r} has approved it already: another operator must",
                    intent_id=intent_id,
                    operator=operator,
                )
            if approve and edit is None and len(given) + 1 < needed:
                self._event(ex, intent_id, now, "approval_given", None, None, operator,
                            {**audit, "approvals": len(given) + 1, "needed": needed})
                return it, False
            if edit is not None:
                return self._edit(ex, it, edit, needed, audit, now), False
            fence = it.fence
            if approve:
                cur = ex.execute(sql.approve, (now, intent_id, fence, now))
            else:
                error = f"rejected by {operator}: {reason}"
                cur = ex.execute(sql.reject, (error, now, intent_id, fence, now))
            assert cur.rowcount == 1  # under the row lock, within the window
            extra = {"approved_by": [*given, operator]} if approve and needed > 1 else {}
            self._event(ex, intent_id, now, "approved" if approve else "rejected",
                        S.AWAITING_APPROVAL, target, operator,
                        {**audit, "fence": fence + 1, **extra})
            done = self._intent_or_none(ex, intent_id)
            assert done is not None
            return done, False

        it, expired_here = self._tx("decide_approval", op)
        if it.reason != "approval_expired":
            return it
        raise ApprovalExpiredError(
            f"intent {intent_id!r}: its approval window ended before this decision; it failed "
            "(approval_expired) and nothing was sent",
            intent_id=intent_id,
            state=it.state.value,
            expired_here=expired_here,
        )

    def _edited(self, ex: Any, edit: tuple[NewDispatch, NewNotification]) -> Intent | None:
        row = ex.execute(self._sql.intent_by_call_id, (edit[0].call_id,)).fetchone()
        return None if row is None else intent_from_row(row)

    def _edit(
        self,
        ex: Any,
        it: Intent,
        edit: tuple[NewDispatch, NewNotification],
        needed: int,
        audit: dict[str, Any],
        now: float,
    ) -> Intent:
        """Approve with edit: the call FAILED (`edited`), the edited call recorded with the
        original's scope and window, approved by the editor."""
        sql = self._sql
        d, note = edit
        if d.tool_id != it.tool_id:
            raise CallIdMismatchError(
                f"an edit of intent {it.id!r} must call its tool {it.tool_id!r}",
                intent_id=it.id,
            )
        (scope,) = ex.execute(sql.scope_of_intent, (it.id,)).fetchone()
        d = dataclasses.replace(d, scope=scope)
        if scope is not None and ex.execute(
            sql.unsettled_same, (scope, d.tool_id, d.args_hash)
        ).fetchone():
            raise NotAwaitingApprovalError(
                f"intent {it.id!r}: a call with the edited arguments is already unsettled in "
                "its scope; approve or reject that call instead",
                intent_id=it.id,
                state=it.state.value,
            )
        operator = audit["operator"]
        error = f"edited by {operator}: {audit['reason']}; the edited call is {d.call_id}"
        cur = ex.execute(sql.edited, (error, now, it.id, it.fence, now))
        assert cur.rowcount == 1  # under the row lock, within the window
        self._event(ex, it.id, now, "edited", S.AWAITING_APPROVAL, S.FAILED, operator,
                    {**audit, "fence": it.fence + 1, "edited_as": d.intent_id,
                     "call_id": d.call_id})
        left = needed - 1  # the editor approved the edited arguments
        made, _ = self._insert_awaiting(
            ex, d, Awaiting(note if left else None, it.next_check_at, needed, it.id), False
        )
        if left:
            self._event(ex, made.id, now, "approval_given", None, None, operator,
                        {**audit, "approvals": 1, "needed": needed, "edit_of": it.id})
            return made
        ex.execute(sql.approve, (now, made.id, made.fence, now))
        self._event(ex, made.id, now, "approved", S.AWAITING_APPROVAL, S.DISPATCHED, operator,
                    {**audit, "fence": made.fence + 1, "edit_of": it.id})
        done = self._intent_or_none(ex, made.id)
        assert done is not None
        return done

    def expire_approvals(
        self, now: float, limit: int = 500, intent_id: str | None = None
    ) -> list[str]:
        """Calls whose approval window passed (all, up to `limit`, or the one `intent_id`):
        FAILED, nothing was sent. Returns those this call expired."""
        done: list[str] = []
        if intent_id is None:
            rows = self._read(self._sql.expired_approvals, (now, limit))
        else:
            rows = self._read(self._sql.expired_approval, (now, intent_id))
        for row in rows:
            it = intent_from_row(row)

            def op(ex: Any, _retrying: bool, it: Intent = it) -> bool:
                return self._expire(ex, it, now)

            if self._tx("expire_approval", op):
                done.append(it.id)
        return done

    def _expire(
        self, ex: Any, it: Intent, now: float, late: Mapping[str, str] | None = None
    ) -> bool:
        """FAILED (approval_expired) if its window ended by `now`, on the fence read."""
        cur = ex.execute(self._sql.expire, (now, it.id, it.fence, now))
        if cur.rowcount != 1:
            return False
        self._event(
            ex,
            it.id,
            now,
            "approval_expired",
            S.AWAITING_APPROVAL,
            S.FAILED,
            "kernel",
            {"fence": it.fence + 1, **({"late_decision": dict(late)} if late else {})},
        )
        return True
