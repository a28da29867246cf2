"""The store protocol: domain actions on the durable intent log, one implementation per backend."""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import re
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from poimen._core.effects import EFFECT_NAMES
from poimen._core.intents import (
    Attempt,
    Delivery,
    Denial,
    Event,
    Intent,
    IntentState,
    Notification,
    Owner,
)
from poimen.errors import CorruptRowError

if TYPE_CHECKING:
    from poimen._core.audit import Head
    from poimen.store._chain import ChainView
    from poimen.store._retention import History


T = TypeVar("T")


class Answer(asyncio.Future[T]):
    """The answer to a write queued by a caller on an event loop (``arecord_*``): resolved
    once the commit is done. Cancelling it is refused: the write is committed or not
    whatever its waiter does, and a waiting task that is cancelled is told only once the
    answer is in, which decides what comes next. This is what `asyncio.shield` gives,
    without shield's second future and the two turns of the loop its callbacks take."""

    def cancel(self, msg: Any = None) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class NewDispatch:
    """Everything the first dispatch commit writes: the intent and its attempt 1."""

    intent_id: str
    call_id: str
    tool_id: str
    effect: str
    args: str
    args_hash: str
    key: str | None
    request_id: str | None
    owner: Owner
    lease_expires_at: float
    timeout_s: float
    deadline_at: float
    now: float
    # The call's scope: within one, an identical call (tool, arguments) finds an unsettled
    # intent instead of dispatching again (docs/design.md section 4). None: no such rule.
    scope: str | None = None


#: The notifier a notification is written for when its writer had none: any kernel that
#: has notifiers delivers it to all of its own.
ANY_NOTIFIER = "*"


@dataclass(frozen=True, slots=True)
class NewNotification:
    """A notification to queue, for the named notifiers (none named: `ANY_NOTIFIER`)."""

    delivery_id: str
    kind: str
    payload: str
    notifiers: tuple[str, ...] = ()

    def targets(self) -> tuple[str, ...]:
        return self.notifiers or (ANY_NOTIFIER,)


def indeterminate_notification(
    intent: Intent, reason: str, notifiers: tuple[str, ...] = ()
) -> NewNotification:
    """The note written with the transaction that makes `intent` INDETERMINATE (once per
    intent: its delivery id is the intent's)."""
    payload = {
        "intent_id": intent.id,
        "call_id": intent.call_id,
        "tool_id": intent.tool_id,
        "effect": intent.effect,
        "reason": reason,
        "created_at": intent.created_at,
    }
    return NewNotification(
        delivery_id=f"{intent.id}:indeterminate",
        kind="indeterminate",
        payload=json.dumps(payload, sort_keys=True),
        notifiers=notifiers,
    )


# The store in roles: each part of poimen names the role it uses; `Store` is all of them, what
# a backend implements. Every method is one transaction; every state change is a
# compare-and-set on the fence.


class StoreBase(Protocol):
    """What every role has: the log's URL, its schema, its clock."""

    url: str

    def migrate(self) -> int: ...
    def schema_version(self) -> int: ...
    def now(self) -> float: ...
    def close(self) -> None: ...


class CallPathStore(StoreBase, Protocol):
    """The call path's commits: a dispatch, an outcome, an unknown outcome, a deadline."""

    def record_dispatch(self, d: NewDispatch) -> tuple[Intent, bool]: ...
    def record_outcome(
        self,
        intent_id: str,
        fence: int,
        state: IntentState,
        *,
        result: str | None,
        error: str | None,
        now: float,
    ) -> bool: ...
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
        """Settle COMPLETED on the fence inside `conn`'s open transaction on this log's own
        database (a Transactional tool's) and commit both; False (rolled back) if the fence
        moved."""
        ...

    def record_unknown(
        self, intent_id: str, fence: int, error: str, now: float, deadline_at: float | None = None
    ) -> bool: ...
    def extend_deadline(
        self, intent_id: str, fence: int, deadline_at: float, now: float
    ) -> bool: ...


class RecoveryStore(StoreBase, Protocol):
    """Recovery: the scan of unfinished intents, claims, decisions, takeovers, leases."""

    def list_unfinished(self, *, after_id: str, limit: int) -> list[Intent]: ...
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
    ) -> Intent | None: ...
    def complete_landed(
        self, intent_id: str, fence: int, result: str | None, now: float
    ) -> bool: ...
    def mark_indeterminate(
        self, intent_id: str, fence: int, reason: str, note: NewNotification, now: float
    ) -> bool: ...
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
    ) -> bool: ...
    def seize(
        self, intent_id: str, fence: int, judged_lease: float | None, *, owed: bool = False
    ) -> bool:
        """A takeover's first write: run the lease out for good, if it is still the one the
        takeover judged (`judged_lease`, as read) on this fence; False if a renewal or another
        write came first, and the intent is not to be taken over now. `owed`: no caller waits
        for this takeover (a recovery pass): a scoped intent's answer is owed from then on."""
        ...
    def take_answer(self, intent_id: str) -> bool:
        """A call was answered with this settled intent's outcome: the answer owed (if any)
        is taken, and an identical call in its scope is a new call from then on."""
        ...

    def renew_leases(
        self, worker_id: str, intent_ids: Sequence[str], lease_expires_at: float, now: float
    ) -> int: ...


class OperatorStore(StoreBase, Protocol):
    """The operator's decisions: resolve, abandon, approvals."""

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
    ) -> Intent: ...
    def abandon(
        self,
        intent_id: str,
        *,
        operator: str,
        reason: str,
        now: float,
        context: Mapping[str, str] | None = None,
        notifiers: tuple[str, ...] = (),
    ) -> Intent: ...
    def record_awaiting(
        self,
        d: NewDispatch,
        note: NewNotification,
        expires_at: float | None,
        approvers: int = 1,
    ) -> tuple[Intent, bool]: ...
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
    ) -> Intent: ...
    def expire_approvals(
        self, now: float, limit: int = 500, intent_id: str | None = None
    ) -> list[str]: ...


class RetentionStore(StoreBase, Protocol):
    """Retention (`poimen prune`): what may go, its history for an archive, the delete."""

    def prune_candidates(self, *, after_id: str, before: float, limit: int) -> list[Intent]: ...
    def histories(self, intents: Sequence[Intent]) -> list[History]: ...
    def prune(self, histories: Sequence[History], *, before: float) -> list[str]: ...
    def prune_denials(self, *, before: float, limit: int) -> int: ...
    def record_event(
        self, intent_id: str, kind: str, *, actor: str, detail: dict[str, Any], now: float
    ) -> bool: ...


class ReadStore(StoreBase, Protocol):
    """Reads: intents, their attempts and events, counts."""

    def get_intent(self, intent_id: str) -> Intent | None: ...
    def get_by_call_id(self, call_id: str) -> Intent | None: ...
    def unsettled_call(self, scope: str, tool_id: str, args_hash: str) -> Intent | None: ...
    def list_intents(
        self,
        *,
        state: IntentState | None = None,
        tool_id: str | None = None,
        since: float | None = None,
        limit: int = 100,
    ) -> list[Intent]: ...
    def search_call_id(self, prefix: str, *, limit: int) -> list[Intent]: ...
    def attempts(self, intent_id: str) -> list[Attempt]: ...
    def events(self, intent_id: str) -> list[Event]: ...
    def counts(self) -> dict[tuple[str, str], int]: ...


class OutboxStore(StoreBase, Protocol):
    """The outbox and the audit of denied writes."""

    def add_notification(self, intent_id: str, note: NewNotification, now: float) -> bool: ...
    def due_notifications(self, now: float, limit: int) -> list[Notification]: ...
    def due_deliveries(
        self, notifiers: Sequence[str], now: float, limit: int
    ) -> list[tuple[Notification, Delivery]]: ...
    def notifications(self, intent_id: str | None = None) -> list[Notification]: ...
    def deliveries(self, intent_id: str) -> list[Delivery]: ...
    def mark_delivered(self, notification_id: int, notifier: str, now: float) -> None: ...
    def mark_delivery_failed(
        self, notification_id: int, notifier: str, error: str, next_attempt_at: float
    ) -> None: ...
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
    ) -> Denial: ...
    def denials(
        self, *, tool_id: str | None = None, since: float | None = None, limit: int = 1000
    ) -> list[Denial]: ...

    # The audit chain (docs/audit.md; the links are the database's triggers').
    def audit_head(self) -> Head | None: ...
    def audit_chain(self) -> AbstractContextManager[ChainView]: ...


@dataclass(frozen=True, slots=True)
class Problem:
    """What `poimen verify` found wrong in a log: the check that found it, and what."""

    check: str
    message: str


class HealthStore(StoreBase, Protocol):
    """`poimen verify` and `poimen doctor`: what only the backend can say of its own schema
    and server. The checks both dialects share are `poimen.operator._health`'s."""

    @property
    def dialect(self) -> str:
        """Its dialect's name (`store/_dialect.py`), the folder of its migrations."""
        ...

    def integrity(self, found: int) -> tuple[tuple[str, ...], list[Problem]]:
        """The checks made of a log at schema version `found`, and what they found."""
        ...

    def server_facts(self) -> dict[str, Any]:
        """What the log's durability depends on, for a bug report."""
        ...


class Store(
    CallPathStore,
    RecoveryStore,
    OperatorStore,
    RetentionStore,
    ReadStore,
    OutboxStore,
    HealthStore,
    Protocol,
):
    """The intent log: every role; what a backend implements."""


# Row decoding shared by the backends. Rows come in the column order below.

INTENT_COLUMNS = (
    "id, call_id, tool_id, effect, args, args_hash, key, request_id, state, fence, owner_id, "
    "owner_host, owner_pid, owner_start, lease_expires_at, timeout_s, deadline_at, "
    "next_check_at, unknown_count, attempts, result, error, reason, created_at, updated_at"
)
ATTEMPT_COLUMNS = (
    "intent_id, number, fence, owner_id, owner_host, owner_pid, owner_start, started_at, "
    "ended_at, outcome, result, error, late_outcome, late_result"
)
EVENT_COLUMNS = "id, intent_id, at, kind, from_state, to_state, actor, detail"
NOTIFICATION_COLUMNS = (
    "id, delivery_id, intent_id, kind, payload, created_at, delivered_at, attempts, "
    "next_attempt_at, last_error"
)
DENIAL_COLUMNS = "id, at, tool_id, intent_id, attempt, action, target, reason"
DELIVERY_COLUMNS = "notification_id, notifier, delivered_at, attempts, last_error, next_attempt_at"

_EFFECTS = frozenset(EFFECT_NAMES)


def _owner(worker: Any, host: Any, pid: Any, start: Any) -> Owner | None:
    if worker is None:
        return None
    return Owner(str(worker), str(host or ""), int(pid or 0), str(start or ""))


def intent_from_row(row: Sequence[Any]) -> Intent:
    try:
        state = IntentState(row[8])
        if row[3] not in _EFFECTS:
            raise ValueError(f"unknown effect class {row[3]!r}")
        return Intent(
            id=str(row[0]),
            call_id=str(row[1]),
            tool_id=str(row[2]),
            effect=str(row[3]),
            args=str(row[4]),
            args_hash=str(row[5]),
            key=row[6],
            request_id=row[7],
            state=state,
            fence=int(row[9]),
            owner=_owner(row[10], row[11], row[12], row[13]),
            lease_expires_at=_opt_float(row[14]),
            timeout_s=float(row[15]),
            deadline_at=_opt_float(row[16]),
            next_check_at=_opt_float(row[17]),
            unknown_count=int(row[18]),
            attempts=int(row[19]),
            result=row[20],
            error=row[21],
            reason=row[22],
            created_at=float(row[23]),
            updated_at=float(row[24]),
        )
    except (ValueError, TypeError, IndexError) as exc:
        ident = row[0] if row else "?"
        raise CorruptRowError(f"intent {ident!r} does not decode: {exc}", intent_id=ident) from exc


def attempt_from_row(row: Sequence[Any]) -> Attempt:
    return Attempt(
        intent_id=row[0],
        number=int(row[1]),
        fence=int(row[2]),
        owner=_owner(row[3], row[4], row[5], row[6]),
        started_at=float(row[7]),
        ended_at=_opt_float(row[8]),
        outcome=row[9],
        result=row[10],
        error=row[11],
        late_outcome=row[12],
        late_result=row[13],
    )


def event_from_row(row: Sequence[Any]) -> Event:
    return Event(
        id=int(row[0]),
        intent_id=row[1],
        at=float(row[2]),
        kind=row[3],
        from_state=row[4],
        to_state=row[5],
        actor=row[6],
        detail=row[7],
    )


def notification_from_row(row: Sequence[Any]) -> Notification:
    return Notification(
        id=int(row[0]),
        delivery_id=row[1],
        intent_id=row[2],
        kind=row[3],
        payload=row[4],
        created_at=float(row[5]),
        delivered_at=_opt_float(row[6]),
        attempts=int(row[7]),
        next_attempt_at=float(row[8]),
        last_error=row[9],
    )


def delivery_from_row(row: Sequence[Any]) -> Delivery:
    return Delivery(
        notification_id=int(row[0]),
        notifier=row[1],
        delivered_at=_opt_float(row[2]),
        attempts=int(row[3]),
        last_error=row[4],
        next_attempt_at=float(row[5]),
    )


def denial_from_row(row: Sequence[Any]) -> Denial:
    return Denial(
        id=int(row[0]),
        at=float(row[1]),
        tool_id=row[2],
        intent_id=row[3],
        attempt=None if row[4] is None else int(row[4]),
        action=row[5],
        target=row[6],
        reason=row[7],
    )


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


_MIGRATION = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


def migrations(dialect: str) -> list[tuple[int, str]]:
    """The versioned SQL shipped in the package, in order."""
    root = importlib.resources.files("poimen.store") / "sql" / dialect
    out = []
    for entry in root.iterdir():
        m = _MIGRATION.match(entry.name)
        if m:
            out.append((int(m.group(1)), entry.read_text(encoding="utf-8")))
    out.sort()
    return out


def latest_version(dialect: str) -> int:
    return migrations(dialect)[-1][0]
