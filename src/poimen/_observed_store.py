"""The kernel's store while it has observers (`poimen._observe`): each transition reported
after its commit, reads and everything else passed through."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from poimen import events as ev
from poimen._core.intents import (
    Intent,
    IntentState,
    Owner,
)
from poimen.errors import ApprovalExpiredError
from poimen.store._base import NewDispatch, NewNotification

if TYPE_CHECKING:
    from poimen.store import Store

from poimen._observe import Observation, _Info, _of


class ObservedStore:
    """The kernel's store with every transition reported: the kernel uses it only while it
    has observers. Reads and anything not named here go to the store itself."""

    arecord_dispatch: Callable[[NewDispatch], Awaitable[tuple[Intent, bool]]]
    arecord_outcome: Callable[..., Awaitable[bool]]

    def __init__(self, inner: Store, obs: Observation) -> None:
        self._inner = inner
        self._obs = obs
        # The async forms exist only where the store has its own.
        if callable(getattr(inner, "arecord_dispatch", None)):
            self.arecord_dispatch = self._arecord_dispatch
        if callable(getattr(inner, "arecord_outcome", None)):
            self.arecord_outcome = self._arecord_outcome

    @property
    def inner(self) -> Store:
        return self._inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def now(self) -> float:  # on every step of a call: not through __getattr__
        return self._inner.now()

    def _about(self, intent_id: str) -> dict[str, Any]:
        return self._obs.about(intent_id, self._inner)

    def _fenced(self, intent_id: str, fence: int, write: str) -> None:
        self._obs.emit(ev.FencedOutEvent(**self._about(intent_id), fence=fence, write=write))
        self._obs.known.drop(intent_id)

    # The call path.

    def record_dispatch(self, d: NewDispatch) -> tuple[Intent, bool]:
        got = self._inner.record_dispatch(d)
        self._dispatched(d, got)
        return got

    async def _arecord_dispatch(self, d: NewDispatch) -> tuple[Intent, bool]:
        got: tuple[Intent, bool] = await self._inner.arecord_dispatch(d)  # type: ignore[attr-defined]
        self._dispatched(d, got)
        return got

    def _dispatched(self, d: NewDispatch, got: tuple[Intent, bool]) -> None:
        intent, created = got
        if created:
            self._obs.known.put(d.intent_id, _Info(d.call_id, d.tool_id, d.effect, d.request_id))
            self._obs.emit(ev.DispatchedEvent(**self._about(intent.id), fence=intent.fence))

    def record_outcome(
        self,
        intent_id: str,
        fence: int,
        state: IntentState,
        *,
        result: str | None,
        error: str | None,
        now: float,
    ) -> bool:
        ok = self._inner.record_outcome(
            intent_id, fence, state, result=result, error=error, now=now
        )
        self._settled(ok, intent_id, fence, state, error)
        return ok

    async def _arecord_outcome(
        self,
        intent_id: str,
        fence: int,
        state: IntentState,
        *,
        result: str | None,
        error: str | None,
        now: float,
    ) -> bool:
        ok: bool = await self._inner.arecord_outcome(  # type: ignore[attr-defined]
            intent_id, fence, state, result=result, error=error, now=now
        )
        self._settled(ok, intent_id, fence, state, error)
        return ok

    def _settled(
        self,
        ok: bool,
        intent_id: str,
        fence: int,
        state: IntentState,
        error: str | None,
        via: str = "call",
    ) -> None:
        if not ok:
            self._fenced(intent_id, fence, "outcome")
            return
        about = self._about(intent_id)
        if state == IntentState.COMPLETED:
            self._obs.emit(ev.CompletedEvent(**about, fence=fence, via=via))
        else:
            self._obs.emit(ev.FailedEvent(**about, fence=fence, error=error))
        self._obs.known.drop(intent_id)

    def commit_outcome_in(
        self,
        conn: Any,
        intent_id: str,
        fence: int,
        *,
        result: str | None,
        error: str | None,
        now: float,
        before_commit: Callable[[], object] | None = None,
    ) -> bool:
        ok = self._inner.commit_outcome_in(
            conn, intent_id, fence, result=result, error=error, now=now,
            before_commit=before_commit,
        )
        self._settled(ok, intent_id, fence, IntentState.COMPLETED, error, via="transaction")
        return ok

    def record_unknown(
        self, intent_id: str, fence: int, error: str, now: float, deadline_at: float | None = None
    ) -> bool:
        ok = self._inner.record_unknown(intent_id, fence, error, now, deadline_at)
        if ok:
            self._obs.emit(
                ev.UnknownOutcomeEvent(**self._about(intent_id), fence=fence, error=error)
            )
        else:
            self._fenced(intent_id, fence, "unknown")
        return ok

    # Recovery.

    def claim(
        self,
        intent_id: str,
        fence: int,
        owner: Owner,
        *,
        lease_expires_at: float,
        new_attempt: bool,
        deadline_at: float | None,
        now: float,
    ) -> Intent | None:
        it = self._inner.claim(
            intent_id,
            fence,
            owner,
            lease_expires_at=lease_expires_at,
            new_attempt=new_attempt,
            deadline_at=deadline_at,
            now=now,
        )
        if it is None:
            self._fenced(intent_id, fence, "claim")
        elif new_attempt:
            self._obs.known.intent(it)
            self._obs.emit(ev.RetryEvent(**self._about(it.id), attempt=it.attempts, fence=it.fence))
        return it

    def complete_landed(self, intent_id: str, fence: int, result: str | None, now: float) -> bool:
        ok = self._inner.complete_landed(intent_id, fence, result, now)
        if ok:
            self._obs.emit(ev.CompletedEvent(**self._about(intent_id), fence=fence, via="lookup"))
            self._obs.known.drop(intent_id)
        else:
            self._fenced(intent_id, fence, "complete_landed")
        return ok

    def mark_indeterminate(
        self, intent_id: str, fence: int, reason: str, note: NewNotification, now: float
    ) -> bool:
        ok = self._inner.mark_indeterminate(intent_id, fence, reason, note, now)
        if ok:
            about = self._about(intent_id)
            self._obs.emit(ev.IndeterminateEvent(**about, fence=fence, reason=reason))
            self._obs.known.drop(intent_id)
        else:
            self._fenced(intent_id, fence, "mark_indeterminate")
        return ok

    def defer(
        self,
        intent_id: str,
        fence: int,
        *,
        next_check_at: float,
        unknown_count: int,
        reason: str,
        now: float,
        deadline_at: float | None = None,
    ) -> bool:
        ok = self._inner.defer(
            intent_id,
            fence,
            deadline_at=deadline_at,
            next_check_at=next_check_at,
            unknown_count=unknown_count,
            reason=reason,
            now=now,
        )
        if ok:
            about = self._about(intent_id)
            self._obs.emit(
                ev.DeferredEvent(**about, fence=fence, reason=reason, until=next_check_at)
            )
        else:
            self._fenced(intent_id, fence, "defer")
        return ok

    def seize(
        self, intent_id: str, fence: int, judged_lease: float | None, *, owed: bool = False
    ) -> bool:
        ok = self._inner.seize(intent_id, fence, judged_lease, owed=owed)
        if not ok:
            self._fenced(intent_id, fence, "seize")
        return ok

    def renew_leases(
        self, worker_id: str, intent_ids: Sequence[str], lease_expires_at: float, now: float
    ) -> int:
        n = self._inner.renew_leases(worker_id, intent_ids, lease_expires_at, now)
        self._obs.emit(
            ev.LeasesRenewedEvent(
                at=time.time(), worker_id=self._obs.worker_id, held=len(intent_ids), renewed=n
            )
        )
        return n

    # The operator path.

    def _decided(self, it: Intent) -> dict[str, Any]:
        return {**self._obs._base(), **_of(it)}

    def resolve(
        self,
        intent_id: str,
        *,
        landed: bool,
        result: str | None,
        operator: str,
        reason: str,
        now: float,
        context: Mapping[str, Any] | None = None,
    ) -> Intent:
        it = self._inner.resolve(
            intent_id,
            landed=landed,
            result=result,
            operator=operator,
            reason=reason,
            now=now,
            context=context,
        )
        self._obs.emit(
            ev.ResolvedEvent(**self._decided(it), landed=landed, operator=operator, reason=reason)
        )
        return it

    def abandon(
        self,
        intent_id: str,
        *,
        operator: str,
        reason: str,
        now: float,
        context: Mapping[str, str] | None = None,
        notifiers: tuple[str, ...] = (),
    ) -> Intent:
        it = self._inner.abandon(
            intent_id,
            operator=operator,
            reason=reason,
            now=now,
            context=context,
            notifiers=notifiers,
        )
        self._obs.emit(
            ev.AbandonedEvent(
                **self._decided(it),
                fence=it.fence,
                reason=it.reason or "abandoned",
                operator=operator,
            )
        )
        return it

    def record_awaiting(
        self,
        d: NewDispatch,
        note: NewNotification,
        expires_at: float | None,
        approvers: int = 1,
    ) -> tuple[Intent, bool]:
        it, created = self._inner.record_awaiting(d, note, expires_at, approvers)
        if created:
            self._obs.emit(ev.ApprovalRequestedEvent(**self._decided(it), expires_at=expires_at))
        return it, created

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
        try:
            it = self._inner.decide_approval(
                intent_id,
                approve=approve,
                operator=operator,
                reason=reason,
                now=now,
                context=context,
                edit=edit,
            )
        except ApprovalExpiredError as exc:
            if getattr(exc, "expired_here", False):  # this decision came late and expired it
                self._obs.emit(ev.ApprovalExpiredEvent(**self._about(intent_id)))
            raise
        if it.state == IntentState.AWAITING_APPROVAL:  # one approval of several (four eyes)
            return it
        self._obs.emit(
            ev.ApprovalDecidedEvent(
                **self._decided(it), approved=approve, operator=operator, reason=reason
            )
        )
        return it

    def expire_approvals(
        self, now: float, limit: int = 500, intent_id: str | None = None
    ) -> list[str]:
        ids = self._inner.expire_approvals(now, limit, intent_id)
        for intent_id in ids:
            self._obs.emit(ev.ApprovalExpiredEvent(**self._about(intent_id)))
        return ids

    def record_denial(
        self,
        *,
        tool_id: str,
        intent_id: str | None,
        attempt: int | None,
        action: str,
        target: str,
        reason: str,
        now: float,
    ) -> Any:
        denial = self._inner.record_denial(
            tool_id=tool_id,
            intent_id=intent_id,
            attempt=attempt,
            action=action,
            target=target,
            reason=reason,
            now=now,
        )
        self._obs.emit(
            ev.DenialEvent(
                at=time.time(),
                worker_id=self._obs.worker_id,
                tool_id=tool_id,
                intent_id=intent_id,
                attempt=attempt,
                action=action,
                target=target,
                reason=reason,
            )
        )
        return denial


#: The store methods `ObservedStore` reports on, and those it passes through because they
#: change no intent's state; a store method in neither list fails
#: tests/unit/test_observe_store.py, so that a new write is never left unreported.
OBSERVED_WRITES = frozenset(
    {
        "record_dispatch",
        "arecord_dispatch",
        "record_outcome",
        "arecord_outcome",
        "commit_outcome_in",
        "record_unknown",
        "claim",
        "complete_landed",
        "mark_indeterminate",
        "defer",
        "renew_leases",
        "seize",
        "resolve",
        "abandon",
        "record_awaiting",
        "decide_approval",
        "expire_approvals",
        "record_denial",
    }
)
UNOBSERVED = frozenset(
    {
        "migrate",
        "schema_version",
        "now",
        "close",
        "after_fork",
        "extend_deadline",  # the same attempt's deadline, later: no transition
        "list_unfinished",
        "get_intent",
        "get_by_call_id",
        "unsettled_call",
        "take_answer",  # an answer owed, given: no transition
        "list_intents",
        "search_call_id",
        "attempts",
        "events",
        "counts",
        "add_notification",
        "due_notifications",
        "due_deliveries",
        "notifications",
        "deliveries",
        "mark_delivered",
        "mark_delivery_failed",
        "denials",
        "record_event",  # an undo's note on the original: no transition
        "prune_candidates",
        "histories",
        "prune",  # removes settled intents and their history: no transition
        "prune_denials",
        "audit_head",  # the audit chain, read (its links are made by the database)
        "audit_chain",
    }
)
