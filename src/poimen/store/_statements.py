"""The statements the SQLite and PostgreSQL stores share, written once with ``?`` placeholders
and translated per dialect at import, and the parameters each one takes (`poimen.store._sql`
runs them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from poimen._core.intents import (
    Intent,
    IntentState,
    Owner,
)
from poimen.errors import (
    SchemaTooNewError,
)
from poimen.store._base import (
    ATTEMPT_COLUMNS,
    DELIVERY_COLUMNS,
    EVENT_COLUMNS,
    INTENT_COLUMNS,
    NOTIFICATION_COLUMNS,
    NewDispatch,
)
from poimen.store._dialect import Dialect
from poimen.store._inline import (
    detail_json,
)

T = TypeVar("T")
S = IntentState
#: The reason of an intent an operator moved from DISPATCHED to INDETERMINATE.
ABANDONED = "abandoned_by_operator"
APPROVAL_EXPIRED_ERROR = "no operator approved it in time"
OUTCOMES = {S.COMPLETED: "completed", S.FAILED: "failed"}
#: The lease a takeover leaves (`SqlStore.seize`): run out since the epoch, by every clock.
SEIZED = 0.0


class Result(Protocol):
    """What `Executor.execute` returns: a sqlite3 or psycopg cursor."""

    @property
    def rowcount(self) -> int: ...
    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...


class Executor(Protocol):
    """What one transaction's statements run on: a sqlite3.Connection or a psycopg cursor."""

    def execute(self, sql: str, params: Sequence[Any], /) -> Result: ...


class Reader(Protocol):
    """One read inside a snapshot (`SqlStore._snapshot`): a statement and its rows."""

    def __call__(self, sql: str, params: Sequence[Any] = (), /) -> list[Any]: ...


class Sql:
    """The statements both dialects share, with the dialect's placeholder for each ``?``."""

    def __init__(self, dialect: Dialect) -> None:
        def q(sql: str) -> str:
            return sql.replace("?", dialect.placeholder)

        self.p = dialect.placeholder
        g = dialect.greatest
        # The row lock: two spills of one intent at once would write its attempt 1 twice.
        lock = dialect.lock
        # Reads.
        self.intent_by_id = q(f"SELECT {INTENT_COLUMNS} FROM intents WHERE id = ?")
        self.intent_by_call_id = q(f"SELECT {INTENT_COLUMNS} FROM intents WHERE call_id = ?")
        self.unfinished = q(
            f"SELECT {INTENT_COLUMNS} FROM intents WHERE state = 'DISPATCHED' AND id > ? "
            "ORDER BY id LIMIT ?"
        )
        self.attempts = q(
            f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE intent_id = ? ORDER BY number"
        )
        self.events = q(f"SELECT {EVENT_COLUMNS} FROM events WHERE intent_id = ? ORDER BY id")
        self.counts = "SELECT tool_id, state, COUNT(*) FROM intents GROUP BY tool_id, state"
        self.due_notifications = q(
            f"SELECT {NOTIFICATION_COLUMNS} FROM outbox WHERE delivered_at IS NULL "
            "AND next_attempt_at <= ? ORDER BY next_attempt_at, id LIMIT ?"
        )
        self.notifications = f"SELECT {NOTIFICATION_COLUMNS} FROM outbox ORDER BY id"
        self.notifications_of = q(
            f"SELECT {NOTIFICATION_COLUMNS} FROM outbox WHERE intent_id = ? ORDER BY id"
        )
        self.attempt_outcome = q("SELECT outcome FROM attempts WHERE intent_id = ? AND fence = ?")
        self.note_by_delivery = q("SELECT intent_id, created_at FROM outbox WHERE delivery_id = ?")
        # Writes.
        self.insert_intent = q(
            "INSERT INTO intents (id, call_id, tool_id, effect, args, args_hash, key, "
            "request_id, state, fence, owner_id, owner_host, owner_pid, owner_start, "
            "lease_expires_at, timeout_s, deadline_at, next_check_at, unknown_count, "
            "attempts, created_at, updated_at, inline_history) VALUES "
            "(?,?,?,?,?,?,?,?,'DISPATCHED',1,?,?,?,?,?,?,?,NULL,0,1,?,?,1) "
            "ON CONFLICT (call_id) DO NOTHING"
        )
        # The happy path's history in the row (store/_inline.py): read, and spilled into
        # the history tables by the first write that deviates from that path.
        self.inline_intent = q(
            f"SELECT {INTENT_COLUMNS} FROM intents WHERE id = ? AND inline_history = 1"
        )
        self.spill_intent = self.inline_intent + lock
        self.intent_locked = self.intent_by_id + lock
        self.undone_details = q("SELECT detail FROM events WHERE intent_id = ? AND kind = 'undone'")
        self.spilled = q("UPDATE intents SET inline_history = 0 WHERE id = ?")
        self.insert_spilled_attempt = q(
            "INSERT INTO attempts (intent_id, number, fence, owner_id, owner_host, "
            "owner_pid, owner_start, started_at, ended_at, outcome, result, error) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?)"
        )
        self.insert_attempt = q(
            "INSERT INTO attempts (intent_id, number, fence, owner_id, owner_host, "
            "owner_pid, owner_start, started_at) VALUES (?,?,?,?,?,?,?,?)"
        )
        self.settle = q(
            "UPDATE intents SET state = ?, result = ?, error = ?, lease_expires_at = NULL, "
            "next_check_at = NULL, updated_at = ? "
            "WHERE id = ? AND fence = ? AND state = 'DISPATCHED'"
        )
        # The happy path's second commit: this row is the whole write.
        self.settle_inline = self.settle + " AND inline_history = 1"
        self.end_attempt = q(
            "UPDATE attempts SET ended_at = ?, outcome = ?, result = ?, error = ? "
            "WHERE intent_id = ? AND fence = ?"
        )
        self.late_outcome = q(
            "UPDATE attempts SET late_outcome = ?, late_result = ? "
            "WHERE intent_id = ? AND fence = ?"
        )
        self.unknown = q(
            "UPDATE attempts SET ended_at = ?, outcome = 'unknown', error = ? "
            "WHERE intent_id = ? AND fence = ? AND outcome IS NULL"
        )
        # Deadlines and leases only ever move later: a slower path never shortens them.
        self.extend_deadline = q(
            f"UPDATE intents SET deadline_at = {g}(COALESCE(deadline_at, ?), ?), updated_at = ? "
            "WHERE id = ? AND fence = ? AND state = 'DISPATCHED'"
        )
        # A lease that has run out is never renewed: its owner counts as gone from then on,
        # and another worker may already be deciding on it.
        self.renew = q(
            f"UPDATE intents SET lease_expires_at = {g}(COALESCE(lease_expires_at, ?), ?) "
            "WHERE owner_id = ? AND state = 'DISPATCHED' AND next_check_at IS NULL "
            "AND lease_expires_at > ? AND id IN "
        )
        # A takeover's first write: only on the lease it judged run out, so a renewal that
        # applied since wins; the lease left has run out for good, so none applies after.
        same = dialect.same
        judged = (
            f"WHERE id = ? AND fence = ? AND state = 'DISPATCHED' AND lease_expires_at {same} ?"
        )
        self.seize = q(f"UPDATE intents SET lease_expires_at = {SEIZED!r} {judged}")
        # A recovery pass's takeover: no caller waits for it, so a scoped call's answer is
        # owed to the first call that asks for it (version 11, docs/design.md section 4).
        self.seize_owed = q(
            f"UPDATE intents SET lease_expires_at = {SEIZED!r}, "
            f"answer_owed = CASE WHEN scope IS NULL THEN 0 ELSE 1 END {judged}"
        )
        self.seized = q(
            "SELECT 1 FROM intents WHERE id = ? AND fence = ? AND state = 'DISPATCHED' "
            f"AND lease_expires_at = {SEIZED!r}"
        )
        self.landed = q(
            "UPDATE intents SET state = 'COMPLETED', result = ?, reason = 'landed_by_lookup', "
            "lease_expires_at = NULL, next_check_at = NULL, updated_at = ? "
            "WHERE id = ? AND fence = ? AND state = 'DISPATCHED'"
        )
        self.indeterminate = q(
            "UPDATE intents SET state = 'INDETERMINATE', reason = ?, lease_expires_at = NULL, "
            "next_check_at = NULL, updated_at = ? "
            "WHERE id = ? AND fence = ? AND state = 'DISPATCHED'"
        )
        self.defer = q(
            "UPDATE intents SET next_check_at = ?, lease_expires_at = ?, unknown_count = ?, "
            # NULL leaves the deadline as it is (SQLite's MAX is NULL then, PostgreSQL's
            # GREATEST the other value: COALESCE makes both mean the same).
            f"reason = ?, updated_at = ?, deadline_at = COALESCE({g}(deadline_at, ?), "
            "deadline_at, ?) "
            "WHERE id = ? AND fence = ? AND state = 'DISPATCHED'"
        )
        # An operator's decision owes no answer: the application tells the model of it, and
        # a call it makes afterwards, knowingly, is a new call (section 4).
        self.resolve = q(
            "UPDATE intents SET state = ?, result = ?, updated_at = ?, answer_owed = 0 "
            "WHERE id = ? AND state = 'INDETERMINATE'"
        )
        # The fence moves on: a worker that comes back after all only adds late evidence.
        self.abandon = q(
            f"UPDATE intents SET state = 'INDETERMINATE', reason = '{ABANDONED}', "
            "fence = fence + 1, lease_expires_at = NULL, next_check_at = NULL, updated_at = ? "
            "WHERE id = ? AND fence = ? AND state = 'DISPATCHED'"
        )
        # Approval: a call recorded before anything is dispatched, decided by an operator.
        # Identical calls in a scope (version 8): the scoped insert, the unsettled intent
        # of the same call, and the call ids that answer with another call's intent.
        self.insert_scoped_intent = q(
            "INSERT INTO intents (id, call_id, tool_id, effect, args, args_hash, key, "
            "request_id, state, fence, owner_id, owner_host, owner_pid, owner_start, "
            "lease_expires_at, timeout_s, deadline_at, next_check_at, unknown_count, "
            "attempts, created_at, updated_at, inline_history, scope) VALUES "
            "(?,?,?,?,?,?,?,?,'DISPATCHED',1,?,?,?,?,?,?,?,NULL,0,1,?,?,1,?) "
            "ON CONFLICT (call_id) DO NOTHING"
        )
        self.unsettled_same = q(
            f"SELECT {INTENT_COLUMNS} FROM intents WHERE scope = ? AND tool_id = ? "
            "AND args_hash = ? AND state IN ('DISPATCHED', 'AWAITING_APPROVAL', 'INDETERMINATE')"
        )
        settled = "state IN ('COMPLETED', 'FAILED', 'RESOLVED_LANDED', 'RESOLVED_NOT_LANDED')"
        self.owed_same = q(
            f"SELECT {INTENT_COLUMNS} FROM intents WHERE scope = ? AND tool_id = ? "
            f"AND args_hash = ? AND answer_owed = 1 AND {settled}"
        )
        self.answer_owed = q("SELECT answer_owed FROM intents WHERE id = ?")
        # A call id's intent at its dispatch commit, and whether its answer is owed.
        self.known_by_call_id = q(
            f"SELECT {INTENT_COLUMNS}, answer_owed FROM intents WHERE call_id = ?"
        )
        self.known_by_alias = q(
            f"SELECT {INTENT_COLUMNS}, answer_owed FROM intents WHERE id = "
            "(SELECT intent_id FROM call_aliases WHERE call_id = ?)"
        )
        self.take_answer = q(
            f"UPDATE intents SET answer_owed = 0 WHERE id = ? AND answer_owed = 1 AND {settled}"
        )
        self.intent_by_alias = q(
            f"SELECT {INTENT_COLUMNS} FROM intents WHERE id = "
            "(SELECT intent_id FROM call_aliases WHERE call_id = ?)"
        )
        self.insert_alias = q(
            "INSERT INTO call_aliases (call_id, intent_id, created_at) VALUES (?,?,?) "
            "ON CONFLICT (call_id) DO NOTHING"
        )
        self.drop_alias = q("DELETE FROM call_aliases WHERE call_id = ?")
        self.insert_awaiting = q(
            "INSERT INTO intents (id, call_id, tool_id, effect, args, args_hash, key, "
            "request_id, state, fence, timeout_s, deadline_at, next_check_at, unknown_count, "
            "attempts, created_at, updated_at, scope) VALUES "
            "(?,?,?,?,?,?,?,?,'AWAITING_APPROVAL',1,?,NULL,?,0,0,?,?,?) "
            "ON CONFLICT (call_id) DO NOTHING"
        )
        # An operator's decision holds only within the window (next_check_at, when set);
        # the expiry only after it: of the two racing, the fence lets one win.
        self.approve = q(
            "UPDATE intents SET state = 'DISPATCHED', fence = fence + 1, next_check_at = NULL, "
            "reason = 'approved', updated_at = ? "
            "WHERE id = ? AND fence = ? AND state = 'AWAITING_APPROVAL' "
            "AND (next_check_at IS NULL OR next_check_at > ?)"
        )
        self.reject = q(
            "UPDATE intents SET state = 'FAILED', fence = fence + 1, next_check_at = NULL, "
            "error = ?, reason = 'rejected', updated_at = ? "
            "WHERE id = ? AND fence = ? AND state = 'AWAITING_APPROVAL' "
            "AND (next_check_at IS NULL OR next_check_at > ?)"
        )
        # Approve with edit: the call fails, naming the edited call recorded with it.
        self.edited = q(
            "UPDATE intents SET state = 'FAILED', fence = fence + 1, next_check_at = NULL, "
            "error = ?, reason = 'edited', updated_at = ? "
            "WHERE id = ? AND fence = ? AND state = 'AWAITING_APPROVAL' "
            "AND (next_check_at IS NULL OR next_check_at > ?)"
        )
        self.scope_of_intent = q("SELECT scope FROM intents WHERE id = ?")
        # Four eyes: how many operators a call needs, and who approved it so far.
        self.awaiting_detail = q(
            "SELECT detail FROM events WHERE intent_id = ? AND kind = 'awaiting_approval'"
        )
        self.approvals_given = q(
            "SELECT DISTINCT actor FROM events WHERE intent_id = ? AND kind = 'approval_given'"
        )
        self.expire = q(
            "UPDATE intents SET state = 'FAILED', fence = fence + 1, next_check_at = NULL, "
            f"error = '{APPROVAL_EXPIRED_ERROR}', reason = 'approval_expired', updated_at = ? "
            "WHERE id = ? AND fence = ? AND state = 'AWAITING_APPROVAL' AND next_check_at <= ?"
        )
        self.expired_approvals = q(
            f"SELECT {INTENT_COLUMNS} FROM intents WHERE state = 'AWAITING_APPROVAL' "
            "AND next_check_at <= ? ORDER BY id LIMIT ?"
        )
        self.expired_approval = q(
            f"SELECT {INTENT_COLUMNS} FROM intents WHERE state = 'AWAITING_APPROVAL' "
            "AND next_check_at <= ? AND id = ?"
        )
        self.insert_event = q(
            "INSERT INTO events (intent_id, at, kind, from_state, to_state, actor, detail) "
            "VALUES (?,?,?,?,?,?,?)"
        )
        self.same_event = q(
            "SELECT 1 FROM events WHERE intent_id = ? AND kind = ? AND actor = ? AND detail = ?"
        )
        self.insert_note = q(
            "INSERT INTO outbox (delivery_id, intent_id, kind, payload, created_at, "
            "next_attempt_at) VALUES (?,?,?,?,?,?) ON CONFLICT (delivery_id) DO NOTHING"
        )
        self.insert_delivery = q(
            "INSERT INTO deliveries (notification_id, notifier, next_attempt_at) "
            "SELECT id, ?, ? FROM outbox WHERE delivery_id = ? "
            "ON CONFLICT (notification_id, notifier) DO NOTHING"
        )
        self.deliveries_of = q(
            f"SELECT {', '.join('d.' + c for c in DELIVERY_COLUMNS.split(', '))} "
            "FROM deliveries d JOIN outbox o ON o.id = d.notification_id "
            "WHERE o.intent_id = ? ORDER BY d.notification_id, d.notifier"
        )
        self.delivered = q(
            "UPDATE deliveries SET delivered_at = ?, attempts = attempts + 1 "
            "WHERE notification_id = ? AND notifier = ? AND delivered_at IS NULL"
        )
        # The outbox row keeps the totals, and is delivered once all its notifiers are.
        self.note_tried = q("UPDATE outbox SET attempts = attempts + 1 WHERE id = ?")
        self.note_delivered = q(
            "UPDATE outbox SET delivered_at = ? WHERE id = ? AND delivered_at IS NULL "
            "AND NOT EXISTS (SELECT 1 FROM deliveries WHERE notification_id = ? "
            "AND delivered_at IS NULL)"
        )
        self.delivery_failed = q(
            "UPDATE deliveries SET attempts = attempts + 1, last_error = ?, next_attempt_at = ? "
            "WHERE notification_id = ? AND notifier = ? AND delivered_at IS NULL"
        )
        self.note_failed = q(
            "UPDATE outbox SET attempts = attempts + 1, last_error = ?, next_attempt_at = ? "
            "WHERE id = ? AND delivered_at IS NULL"
        )
        self.insert_denial = q(
            "INSERT INTO denials (at, tool_id, intent_id, attempt, action, target, reason) "
            "VALUES (?,?,?,?,?,?,?)"
        )


def _where(p: str, conds: Sequence[tuple[str, Any]]) -> tuple[str, list[Any]]:
    """``WHERE <cond> p AND ...`` over the conditions whose value is not None, in order."""
    kept = [(cond, value) for cond, value in conds if value is not None]
    if not kept:
        return "", []
    return "WHERE " + " AND ".join(f"{c} {p}" for c, _ in kept), [v for _, v in kept]


def too_new(where: str, found: int, known: int) -> SchemaTooNewError:
    return SchemaTooNewError(
        f"the intent log at {where} has schema version {found}, newer than "
        f"version {known} that this poimen knows; upgrade poimen",
        found=found,
        known=known,
    )


def event_params(
    intent_id: str,
    at: float,
    kind: str,
    src: IntentState | None,
    dst: IntentState | None,
    actor: str,
    detail: dict[str, Any],
) -> tuple[Any, ...]:
    """The parameters of `Sql.insert_event`; None values are left out of the detail."""
    return (
        intent_id,
        at,
        kind,
        None if src is None else src.value,
        None if dst is None else dst.value,
        actor,
        detail_json(detail),
    )


class Settlement(NamedTuple):
    """A definite outcome to write on an attempt's fence, and the parameters of its three
    statements (settle, end_attempt, the event), in one place for every way of writing it."""

    intent_id: str
    fence: int
    state: IntentState
    result: str | None
    error: str | None
    now: float

    def settle_params(self) -> tuple[Any, ...]:
        return (self.state.value, self.result, self.error, self.now, self.intent_id, self.fence)

    def end_attempt_params(self) -> tuple[Any, ...]:
        o = self
        return (o.now, OUTCOMES[o.state], o.result, o.error, o.intent_id, o.fence)

    def event_params(self) -> tuple[Any, ...]:
        return event_params(
            self.intent_id,
            self.now,
            OUTCOMES[self.state],
            S.DISPATCHED,
            self.state,
            "kernel",
            {"fence": self.fence, "error": self.error},
        )


def dispatch_params(d: NewDispatch) -> tuple[Any, ...]:
    """The parameters of `Sql.insert_intent`."""
    o = d.owner
    return (
        d.intent_id,
        d.call_id,
        d.tool_id,
        d.effect,
        d.args,
        d.args_hash,
        d.key,
        d.request_id,
        o.worker_id,
        o.host,
        o.pid,
        o.pid_start,
        d.lease_expires_at,
        d.timeout_s,
        d.deadline_at,
        d.now,
        d.now,
    )


def dispatched(d: NewDispatch) -> Intent:
    """The row record_dispatch just inserted, as reading it back would decode it (the same
    values, converted as the columns convert them), without the read."""
    return Intent(
        id=d.intent_id,
        call_id=d.call_id,
        tool_id=d.tool_id,
        effect=d.effect,
        args=d.args,
        args_hash=d.args_hash,
        key=d.key,
        request_id=d.request_id,
        state=S.DISPATCHED,
        fence=1,
        owner=stored_owner(d.owner),
        lease_expires_at=float(d.lease_expires_at),
        timeout_s=float(d.timeout_s),
        deadline_at=float(d.deadline_at),
        next_check_at=None,
        unknown_count=0,
        attempts=1,
        result=None,
        error=None,
        reason=None,
        created_at=float(d.now),
        updated_at=float(d.now),
    )


def stored_owner(o: Owner) -> Owner:
    """An owner as the log returns it (the columns' conversions applied)."""
    return Owner(str(o.worker_id), str(o.host or ""), int(o.pid or 0), str(o.pid_start or ""))


def retry_attempt_params(it: Intent, owner: Owner, now: float) -> tuple[Any, ...]:
    """The parameters of `Sql.insert_attempt` for the attempt a claim opens; `it` is the row
    after the claim."""
    return (
        it.id,
        it.attempts,
        it.fence,
        owner.worker_id,
        owner.host,
        owner.pid,
        owner.pid_start,
        now,
    )


def claim_event_params(
    it: Intent, owner: Owner, new_attempt: bool, now: float, nonce: str | None
) -> tuple[Any, ...]:
    return event_params(
        it.id,
        now,
        "retry" if new_attempt else "claimed",
        S.DISPATCHED,
        S.DISPATCHED,
        owner.worker_id,
        {"fence": it.fence, "attempt": it.attempts if new_attempt else None, "claim": nonce},
    )


def claim_params(
    owner: Owner,
    lease_expires_at: float,
    deadline_at: float | None,
    new_attempt: bool,
    now: float,
    intent_id: str,
) -> tuple[Any, ...]:
    """The parameters of a claim's UPDATE, through ``WHERE id = ?``."""
    return (
        owner.worker_id,
        owner.host,
        owner.pid,
        owner.pid_start,
        lease_expires_at,
        deadline_at,
        1 if new_attempt else 0,
        now,
        intent_id,
    )
