"""What the SQLite and PostgreSQL stores share: every method whose SQL and logic are the same
on both, over the statements of `_statements`. A backend supplies `_read`, `_tx` (its
transaction and, for PostgreSQL, its retries) and the methods that really differ.

Over 600 lines: `SqlStore` is one class, the store's shared half, and each of its methods is
one transaction a reader wants to see whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

from poimen._core.intents import (
    TERMINAL,
    Attempt,
    Delivery,
    Denial,
    Event,
    Intent,
    IntentState,
    Notification,
    Owner,
    check_transition,
)
from poimen.errors import (
    AlreadyUndoneError,
    IntentNotFoundError,
    NotDispatchedError,
    NotIndeterminateError,
)
from poimen.store._approvals import Approvals, Awaiting
from poimen.store._base import (
    DELIVERY_COLUMNS,
    DENIAL_COLUMNS,
    INTENT_COLUMNS,
    NOTIFICATION_COLUMNS,
    NewDispatch,
    NewNotification,
    attempt_from_row,
    delivery_from_row,
    denial_from_row,
    event_from_row,
    indeterminate_notification,
    intent_from_row,
    notification_from_row,
)
from poimen.store._chain import Chain
from poimen.store._inline import (
    attempt_row,
    event_row,
    inline_attempt,
    inline_events,
)
from poimen.store._retention import Retention
from poimen.store._statements import (
    ABANDONED,
    OUTCOMES,
    Executor,
    Reader,
    Settlement,
    Sql,
    _where,
    claim_event_params,
    dispatch_params,
    event_params,
    retry_attempt_params,
)

T = TypeVar("T")
S = IntentState


class SqlStore(Retention, Approvals, Chain):
    """The methods both backends run the same way. Each write's `op(ex, retrying)` gets
    `retrying=True` only on PostgreSQL, on a try after one whose answer was lost."""

    _sql: ClassVar[Sql]

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        raise NotImplementedError

    def _tx(self, what: str, fn: Callable[[Executor, bool], T]) -> T:
        raise NotImplementedError

    def _snapshot(self, fn: Callable[[Reader], T]) -> T:
        """`fn`'s reads, all in one snapshot of the log (a read-only transaction): a write
        that commits meanwhile is seen by every one of them or by none. A reader of one
        intent's history needs it: a spill moves that history from the row to the tables."""
        raise NotImplementedError

    def _prefix_match(self, prefix: str) -> tuple[str, tuple[Any, ...]]:
        """A condition on call_id that holds for the call ids starting with `prefix`."""
        raise NotImplementedError

    # Statements used inside a write transaction.

    def _event(
        self,
        ex: Executor,
        intent_id: str,
        at: float,
        kind: str,
        src: IntentState | None,
        dst: IntentState | None,
        actor: str,
        detail: dict[str, Any],
    ) -> None:
        ex.execute(
            self._sql.insert_event, event_params(intent_id, at, kind, src, dst, actor, detail)
        )

    def _insert_note(self, ex: Executor, intent_id: str, note: NewNotification, now: float) -> bool:
        cur = ex.execute(
            self._sql.insert_note,
            (note.delivery_id, intent_id, note.kind, note.payload, now, now),
        )
        if cur.rowcount != 1:
            return False
        for notifier in note.targets():
            ex.execute(self._sql.insert_delivery, (notifier, now, note.delivery_id))
        return True

    def _intent_or_none(self, ex: Executor, intent_id: str) -> Intent | None:
        row = ex.execute(self._sql.intent_by_id, (intent_id,)).fetchone()
        return None if row is None else intent_from_row(row)

    def _settled_as(self, ex: Executor, intent_id: str, fence: int, state: IntentState) -> bool:
        it = self._intent_or_none(ex, intent_id)
        return it is not None and it.fence == fence and it.state == state

    def _spill(self, ex: Executor, intent_id: str) -> None:
        """Before a write that deviates from the happy path: move the history the intent row
        holds (attempt 1, its events) into the history tables, so that write goes on as if
        they had always been there. Nothing for an intent already spilled or missing."""
        row = ex.execute(self._sql.spill_intent, (intent_id,)).fetchone()
        if row is not None:
            self._spill_intent(ex, intent_from_row(row))

    def _spill_intent(self, ex: Executor, it: Intent) -> None:
        """`_spill` for an inline intent `it` already read in this transaction."""
        sql = self._sql
        ex.execute(sql.spilled, (it.id,))
        ex.execute(sql.insert_spilled_attempt, attempt_row(inline_attempt(it)))
        for e in inline_events(it):
            ex.execute(sql.insert_event, event_row(e))

    def _claimed(
        self,
        ex: Executor,
        it: Intent,
        owner: Owner,
        new_attempt: bool,
        now: float,
        nonce: str | None,
    ) -> None:
        """Record a claim: its attempt row (if a new attempt) and its event; `it` is the row after
        the claim. `nonce` (PostgreSQL) marks the event so that a retry can find its own."""
        if new_attempt:
            ex.execute(self._sql.insert_attempt, retry_attempt_params(it, owner, now))
        ex.execute(self._sql.insert_event, claim_event_params(it, owner, new_attempt, now, nonce))

    def _resolvable(self, intent_id: str, row: Any, target: IntentState) -> None:
        """Raise unless `row` (its state first) is an INDETERMINATE intent."""
        if row is None:
            raise IntentNotFoundError(f"no intent {intent_id!r}", intent_id=intent_id)
        if row[0] != S.INDETERMINATE:
            raise NotIndeterminateError(
                f"intent {intent_id!r} is {row[0]}; only an INDETERMINATE intent can be resolved",
                intent_id=intent_id,
                state=row[0],
            )
        check_transition(S.INDETERMINATE, target)

    def _resolved_event(
        self,
        ex: Executor,
        intent_id: str,
        target: IntentState,
        landed: bool,
        result: str | None,
        operator: str,
        reason: str,
        now: float,
        context: Mapping[str, Any] | None = None,
    ) -> None:
        self._event(
            ex,
            intent_id,
            now,
            "resolved",
            S.INDETERMINATE,
            target,
            operator,
            {
                **(context or {}),
                "operator": operator,
                "reason": reason,
                "landed": landed,
                "result": result,
            },
        )

    # The call path.

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
        o = Settlement(intent_id, fence, state, result, error, now)
        return self._tx("record_outcome", self._outcome_op(o))

    def _outcome_op(self, o: Settlement) -> Callable[[Executor, bool], bool]:
        """One outcome write: settle on the fence, or keep a stale owner's as evidence."""
        check_transition(S.DISPATCHED, o.state)
        intent_id, fence, result, error, now = o.intent_id, o.fence, o.result, o.error, o.now
        outcome = OUTCOMES[o.state]
        sql = self._sql

        def op(ex: Executor, retrying: bool) -> bool:
            if self._settle(ex, o):
                return True
            if retrying:
                row = ex.execute(sql.attempt_outcome, (intent_id, fence)).fetchone()
                if row is None:
                    row = ex.execute(sql.inline_intent, (intent_id,)).fetchone()
                    row = None if row is None else (inline_attempt(intent_from_row(row)).outcome,)
                if row is not None and row[0] == outcome:
                    return True  # our earlier try landed; its answer was lost with the connection
            # A stale owner: keep what it saw as evidence, change nothing else.
            self._spill(ex, intent_id)
            ex.execute(
                sql.late_outcome,
                (outcome, result if error is None else error, intent_id, fence),
            )
            self._event(
                ex,
                intent_id,
                now,
                "late_outcome",
                None,
                None,
                "kernel",
                {"fence": fence, "outcome": outcome},
            )
            return False

        return op

    def _linking(self, conn: Any) -> None:
        """Make `conn`, a connection of the application's to this log, able to write what the
        audit chain links (SQLite: its triggers call a function of the connection's)."""

    def _settle(self, ex: Executor, o: Settlement) -> bool:
        """Settle on the fence; False (nothing written) if the fence moved."""
        sql = self._sql
        params = o.settle_params()
        if ex.execute(sql.settle_inline, params).rowcount == 1:
            return True  # the happy path: the intent row holds the whole history
        if ex.execute(sql.settle, params).rowcount == 1:
            ex.execute(sql.end_attempt, o.end_attempt_params())
            ex.execute(sql.insert_event, o.event_params())
            return True
        return False

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
        """The outcome commit of a Transactional tool whose database is this log's: settle the
        intent COMPLETED on `fence` inside `conn`'s open transaction, which holds the tool's
        writes, and commit the two at once. If the fence moved (the call was taken over),
        `conn` is rolled back and False returned: the tool's writes never land. An error of
        the commit itself leaves the outcome unknown and is raised."""
        o = Settlement(intent_id, fence, S.COMPLETED, result, error, now)
        self._linking(conn)
        if not self._settle(conn, o):
            conn.rollback()
            return False
        if before_commit is not None:
            before_commit()
        conn.commit()
        return True

    def record_unknown(
        self, intent_id: str, fence: int, error: str, now: float, deadline_at: float | None = None
    ) -> bool:
        def op(ex: Executor, _retrying: bool) -> bool:
            self._spill(ex, intent_id)
            cur = ex.execute(self._sql.unknown, (now, error, intent_id, fence))
            if deadline_at is not None:
                ex.execute(
                    self._sql.extend_deadline,
                    (deadline_at, deadline_at, now, intent_id, fence),
                )
            if cur.rowcount:
                self._event(
                    ex,
                    intent_id,
                    now,
                    "outcome_unknown",
                    S.DISPATCHED,
                    S.DISPATCHED,
                    "kernel",
                    {"fence": fence, "error": error, "deadline_at": deadline_at},
                )
            return cur.rowcount == 1

        return self._tx("record_unknown", op)

    def extend_deadline(self, intent_id: str, fence: int, deadline_at: float, now: float) -> bool:
        """Move an attempt's deadline later (never earlier); False if its fence is stale."""

        def op(ex: Executor, _retrying: bool) -> bool:
            self._spill(ex, intent_id)
            cur = ex.execute(
                self._sql.extend_deadline, (deadline_at, deadline_at, now, intent_id, fence)
            )
            if cur.rowcount:
                self._event(
                    ex,
                    intent_id,
                    now,
                    "deadline_extended",
                    S.DISPATCHED,
                    S.DISPATCHED,
                    "kernel",
                    {"fence": fence, "deadline_at": deadline_at},
                )
            return cur.rowcount == 1

        return self._tx("extend_deadline", op)

    # Recovery.

    def list_unfinished(self, *, after_id: str, limit: int) -> list[Intent]:
        rows = self._read(self._sql.unfinished, (after_id, limit))
        return [intent_from_row(r) for r in rows]

    def complete_landed(self, intent_id: str, fence: int, result: str | None, now: float) -> bool:
        def op(ex: Executor, retrying: bool) -> bool:
            self._spill(ex, intent_id)
            cur = ex.execute(self._sql.landed, (result, now, intent_id, fence))
            if cur.rowcount == 0:
                return retrying and self._settled_as(ex, intent_id, fence, S.COMPLETED)
            self._event(
                ex,
                intent_id,
                now,
                "landed_by_lookup",
                S.DISPATCHED,
                S.COMPLETED,
                "kernel",
                {"fence": fence},
            )
            return True

        return self._tx("complete_landed", op)

    def seize(
        self, intent_id: str, fence: int, judged_lease: float | None, *, owed: bool = False
    ) -> bool:
        # The lease is no part of the history an inline row stands for: nothing to spill.
        statement = self._sql.seize_owed if owed else self._sql.seize

        def op(ex: Executor, retrying: bool) -> bool:
            cur = ex.execute(statement, (intent_id, fence, judged_lease))
            if cur.rowcount == 0:
                # Our own earlier try, whose answer was lost, may have seized it.
                got = ex.execute(self._sql.seized, (intent_id, fence)).fetchone()
                return retrying and got is not None
            return True

        return self._tx("seize", op)

    def mark_indeterminate(
        self, intent_id: str, fence: int, reason: str, note: NewNotification, now: float
    ) -> bool:
        def op(ex: Executor, retrying: bool) -> bool:
            self._spill(ex, intent_id)
            cur = ex.execute(self._sql.indeterminate, (reason, now, intent_id, fence))
            if cur.rowcount == 0:
                return retrying and self._settled_as(ex, intent_id, fence, S.INDETERMINATE)
            self._event(
                ex,
                intent_id,
                now,
                "indeterminate",
                S.DISPATCHED,
                S.INDETERMINATE,
                "kernel",
                {"fence": fence, "reason": reason},
            )
            self._insert_note(ex, intent_id, note, now)
            return True

        return self._tx("mark_indeterminate", op)

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
        """Ask again at `next_check_at`; `deadline_at` (only ever moved later) keeps a
        deadline this decision relied on, such as a takeover's, for whoever asks next."""

        def op(ex: Executor, _retrying: bool) -> bool:
            self._spill(ex, intent_id)
            # The lease ends when the next check is due, so any live recoverer may take it then.
            cur = ex.execute(
                self._sql.defer,
                (
                    next_check_at,
                    next_check_at,
                    unknown_count,
                    reason,
                    now,
                    deadline_at,
                    deadline_at,
                    intent_id,
                    fence,
                ),
            )
            if cur.rowcount:
                self._event(
                    ex,
                    intent_id,
                    now,
                    "deferred",
                    S.DISPATCHED,
                    S.DISPATCHED,
                    "kernel",
                    {"fence": fence, "reason": reason, "next_check_at": next_check_at},
                )
            return cur.rowcount == 1

        return self._tx("defer", op)

    # The operator path.

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
        """DISPATCHED -> INDETERMINATE by an operator, bumping the fence; one winner.
        `context` (how the operator is known) goes into the event beside the name. As for
        any INDETERMINATE intent, a notification goes to the outbox in the same transaction,
        for `notifiers` (none named: any kernel's)."""
        check_transition(S.DISPATCHED, S.INDETERMINATE)

        def op(ex: Executor, retrying: bool) -> Intent:
            it = self._intent_or_none(ex, intent_id)
            if it is None:
                raise IntentNotFoundError(f"no intent {intent_id!r}", intent_id=intent_id)
            if retrying and it.state == S.INDETERMINATE and it.updated_at == now:
                return it  # our own earlier try, whose answer the lost connection swallowed
            if it.state == S.DISPATCHED:
                self._spill(ex, intent_id)
                cur = ex.execute(self._sql.abandon, (now, intent_id, it.fence))
                if cur.rowcount == 1:
                    self._event(
                        ex,
                        intent_id,
                        now,
                        "abandoned",
                        S.DISPATCHED,
                        S.INDETERMINATE,
                        operator,
                        {
                            **(context or {}),
                            "operator": operator,
                            "reason": reason,
                            "fence": it.fence + 1,
                            "owner": None if it.owner is None else it.owner.worker_id,
                        },
                    )
                    note = indeterminate_notification(it, ABANDONED, notifiers)
                    self._insert_note(ex, intent_id, note, now)
                    done = self._intent_or_none(ex, intent_id)
                    assert done is not None
                    return done
                it = self._intent_or_none(ex, intent_id) or it  # another operator won
            raise NotDispatchedError(
                f"intent {intent_id!r} is {it.state}; only a DISPATCHED intent can be abandoned",
                intent_id=intent_id,
                state=it.state.value,
            )

        return self._tx("abandon", op)

    # Identical calls in a scope (docs/design.md section 4).

    def _serialize(self, ex: Executor, key: str) -> None:
        """Hold, until this transaction ends, a lock that every transaction naming the same
        `key` takes. SQLite needs none: its one writer runs one transaction at a time."""

    def _record_scoped(
        self, d: NewDispatch, awaiting: Awaiting | None
    ) -> tuple[Intent, bool]:
        return self._tx("record_dispatch", self._scoped_op(d, awaiting))

    def _scoped_op(
        self, d: NewDispatch, awaiting: Awaiting | None
    ) -> Callable[[Executor, bool], tuple[Intent, bool]]:
        """A scoped call's first commit. Its call id known (as an intent's or an alias's):
        (that intent, False). Else an unsettled intent of the same tool and arguments in the
        scope: this call id becomes its alias, and (that intent, False): nothing is
        dispatched. Else the call is recorded (dispatched, or awaiting approval)."""
        assert d.scope is not None
        scope = d.scope

        def op(ex: Executor, retrying: bool) -> tuple[Intent, bool]:
            # Every scoped write of this (scope, tool, arguments), of this call id too, in
            # turn: a reader of "none unsettled" inserts before the next one reads.
            self._serialize(ex, json.dumps([scope, d.tool_id, d.args_hash]))
            found = self._by_call_id(ex, d.call_id)
            if found is not None:
                known, owed = found
                if owed and known.state in TERMINAL:  # answered now: the answer is taken
                    ex.execute(self._sql.take_answer, (known.id,))
                return known, retrying and known.id == d.intent_id
            same = (scope, d.tool_id, d.args_hash)
            row = ex.execute(self._sql.unsettled_same, same).fetchone()
            owed = False
            if row is None:  # settled by recovery, its answer not given yet: this call's
                row = ex.execute(self._sql.owed_same, same).fetchone()
                owed = row is not None
            if row is not None:
                first = intent_from_row(row)
                ex.execute(self._sql.insert_alias, (d.call_id, first.id, d.now))
                # PostgreSQL: a take by call id (outside this lock) may have committed since
                # the read; this call is answered still, but the audit says it took nothing.
                took = owed and ex.execute(self._sql.take_answer, (first.id,)).rowcount == 1
                self._spill(ex, first.id)
                self._event(
                    ex, first.id, d.now, "coalesced", None, None, d.owner.worker_id,
                    {"call_id": d.call_id, **({"answer_taken": True} if took else {})},
                )
                return first, False
            ex.execute(self._sql.drop_alias, (d.call_id,))  # its intent was pruned
            if awaiting is not None:
                return self._insert_awaiting(ex, d, awaiting, retrying)
            ex.execute(self._sql.insert_scoped_intent, (*dispatch_params(d), scope))
            made = self._intent_or_none(ex, d.intent_id)
            assert made is not None
            return made, True

        return op

    def take_answer(self, intent_id: str) -> bool:
        """A call was answered with this settled intent's outcome: an answer owed to the
        next caller (recovery settled it) is taken. True if this took it. Read first: a
        caller is seldom owed, and a read costs no commit."""
        rows = self._read(self._sql.answer_owed, (intent_id,))
        if not rows or not rows[0][0]:
            return False

        def op(ex: Executor, retrying: bool) -> bool:
            return ex.execute(self._sql.take_answer, (intent_id,)).rowcount == 1 or retrying

        return self._tx("take_answer", op)

    def unsettled_call(self, scope: str, tool_id: str, args_hash: str) -> Intent | None:
        """The one unsettled intent of this tool and argument set in the scope, if any."""
        rows = self._read(self._sql.unsettled_same, (scope, tool_id, args_hash))
        return intent_from_row(rows[0]) if rows else None

    def _by_call_id(self, ex: Executor, call_id: str) -> tuple[Intent, bool] | None:
        """The intent of this call id (its own or an alias's), and whether its answer is owed."""
        row = ex.execute(self._sql.known_by_call_id, (call_id,)).fetchone()
        if row is None:
            row = ex.execute(self._sql.known_by_alias, (call_id,)).fetchone()
        return None if row is None else (intent_from_row(row), bool(row[-1]))

    # Approval before acting: `_approvals.Approvals`.

    def record_event(
        self, intent_id: str, kind: str, *, actor: str, detail: dict[str, Any], now: float
    ) -> bool:
        """Append an event that changes no state (who asked for an undo, which intent undid
        this one). An event equal to one already recorded (intent, kind, actor, detail) is not
        written again, so a retried write never doubles it: False then. Undo's events
        (docs/design.md section 9): an `undone` naming an undo intent already named is not
        written again (False); an `undo_requested` on an intent that has an `undone` event
        raises AlreadyUndoneError. All decided under the intent's row lock."""

        def op(ex: Executor, _retrying: bool) -> bool:
            # The lock first: two writers that both read "not there yet" would both write.
            if ex.execute(self._sql.intent_locked, (intent_id,)).fetchone() is None:
                raise IntentNotFoundError(f"no intent {intent_id!r}", intent_id=intent_id)
            if kind in ("undo_requested", "undone") and not self._undo_event_fits(
                ex, intent_id, kind, detail
            ):
                return False
            params = event_params(intent_id, now, kind, None, None, actor, detail)
            if ex.execute(self._sql.same_event, (intent_id, kind, actor, params[-1])).fetchone():
                return False
            self._spill(ex, intent_id)
            ex.execute(self._sql.insert_event, params)
            return True

        return self._tx("record_event", op)

    def _undo_event_fits(
        self, ex: Executor, intent_id: str, kind: str, detail: dict[str, Any]
    ) -> bool:
        """Whether undo's event `kind` may be written: an undone call takes no new undo."""
        undone = []
        for (text,) in ex.execute(self._sql.undone_details, (intent_id,)).fetchall():
            try:
                undone.append(json.loads(text or "{}").get("undo_intent_id"))
            except (ValueError, AttributeError):
                undone.append(None)
        if kind == "undone":
            return detail.get("undo_intent_id") not in undone
        if undone:
            raise AlreadyUndoneError(
                f"intent {intent_id!r} was undone already (by undo intent {undone[0]!r})",
                intent_id=intent_id,
                undo_intent_id=undone[0],
            )
        return True

    def search_call_id(self, prefix: str, *, limit: int) -> list[Intent]:
        """Intents whose call id starts with `prefix`, newest first."""
        cond, params = self._prefix_match(prefix)
        rows = self._read(
            f"SELECT {INTENT_COLUMNS} FROM intents WHERE {cond} ORDER BY created_at DESC, id DESC "
            f"LIMIT {self._sql.p}",
            (*params, limit),
        )
        return [intent_from_row(r) for r in rows]

    def get_intent(self, intent_id: str) -> Intent | None:
        rows = self._read(self._sql.intent_by_id, (intent_id,))
        return intent_from_row(rows[0]) if rows else None

    def get_by_call_id(self, call_id: str) -> Intent | None:
        """The intent of this call id: its own, or the one it is an alias of."""
        rows = self._read(self._sql.intent_by_call_id, (call_id,)) or self._read(
            self._sql.intent_by_alias, (call_id,)
        )
        return intent_from_row(rows[0]) if rows else None

    def list_intents(
        self,
        *,
        state: IntentState | None = None,
        tool_id: str | None = None,
        since: float | None = None,
        limit: int = 100,
    ) -> list[Intent]:
        p = self._sql.p
        where, params = _where(
            p,
            (
                ("state =", None if state is None else state.value),
                ("tool_id =", tool_id),
                ("created_at >=", since),
            ),
        )
        rows = self._read(
            f"SELECT {INTENT_COLUMNS} FROM intents {where} ORDER BY id LIMIT {p}",
            (*params, limit),
        )
        return [intent_from_row(r) for r in rows]

    def attempts(self, intent_id: str) -> list[Attempt]:
        def read(q: Reader) -> list[Attempt]:
            rows = q(self._sql.attempts, (intent_id,))
            if rows:  # an intent whose history is in its row has none
                return [attempt_from_row(r) for r in rows]
            inline = q(self._sql.inline_intent, (intent_id,))
            return [inline_attempt(intent_from_row(r)) for r in inline]

        return self._snapshot(read)

    def events(self, intent_id: str) -> list[Event]:
        def read(q: Reader) -> list[Event]:
            rows = q(self._sql.events, (intent_id,))
            if rows:
                return [event_from_row(r) for r in rows]
            inline = q(self._sql.inline_intent, (intent_id,))
            return inline_events(intent_from_row(inline[0])) if inline else []

        return self._snapshot(read)

    def counts(self) -> dict[tuple[str, str], int]:
        return {(r[0], r[1]): int(r[2]) for r in self._read(self._sql.counts)}

    # Outbox and audit.

    def add_notification(self, intent_id: str, note: NewNotification, now: float) -> bool:
        def op(ex: Executor, retrying: bool) -> bool:
            if self._insert_note(ex, intent_id, note, now):
                return True
            if not retrying:
                return False
            row = ex.execute(self._sql.note_by_delivery, (note.delivery_id,)).fetchone()
            return row is not None and row[0] == intent_id and row[1] == now

        return self._tx("add_notification", op)

    def due_notifications(self, now: float, limit: int) -> list[Notification]:
        rows = self._read(self._sql.due_notifications, (now, limit))
        return [notification_from_row(r) for r in rows]

    def notifications(self, intent_id: str | None = None) -> list[Notification]:
        if intent_id is None:
            rows = self._read(self._sql.notifications)
        else:
            rows = self._read(self._sql.notifications_of, (intent_id,))
        return [notification_from_row(r) for r in rows]

    def due_deliveries(
        self, notifiers: Sequence[str], now: float, limit: int
    ) -> list[tuple[Notification, Delivery]]:
        """Undelivered (notification, delivery) pairs due by `now` for these notifiers."""
        if not notifiers:
            return []
        p = self._sql.p
        outbox = ", ".join("o." + c for c in NOTIFICATION_COLUMNS.split(", "))
        delivery = ", ".join("d." + c for c in DELIVERY_COLUMNS.split(", "))
        rows = self._read(
            f"SELECT {outbox}, {delivery} FROM deliveries d "
            "JOIN outbox o ON o.id = d.notification_id "
            f"WHERE d.delivered_at IS NULL AND d.next_attempt_at <= {p} "
            f"AND d.notifier IN ({', '.join([p] * len(notifiers))}) "
            f"ORDER BY d.next_attempt_at, d.notification_id, d.notifier LIMIT {p}",
            (now, *notifiers, limit),
        )
        width = len(NOTIFICATION_COLUMNS.split(", "))
        return [(notification_from_row(r[:width]), delivery_from_row(r[width:])) for r in rows]

    def deliveries(self, intent_id: str) -> list[Delivery]:
        return [delivery_from_row(r) for r in self._read(self._sql.deliveries_of, (intent_id,))]

    def mark_delivered(self, notification_id: int, notifier: str, now: float) -> None:
        def op(ex: Executor, _retrying: bool) -> None:
            sql = self._sql
            if ex.execute(sql.delivered, (now, notification_id, notifier)).rowcount:
                ex.execute(sql.note_tried, (notification_id,))
                ex.execute(sql.note_delivered, (now, notification_id, notification_id))

        self._tx("mark_delivered", op)

    def mark_delivery_failed(
        self, notification_id: int, notifier: str, error: str, next_attempt_at: float
    ) -> None:
        def op(ex: Executor, _retrying: bool) -> None:
            sql = self._sql
            params = (error, next_attempt_at, notification_id)
            if ex.execute(sql.delivery_failed, (*params, notifier)).rowcount:
                ex.execute(sql.note_failed, params)

        self._tx("mark_delivery_failed", op)

    def denials(
        self, *, tool_id: str | None = None, since: float | None = None, limit: int = 1000
    ) -> list[Denial]:
        p = self._sql.p
        where, params = _where(p, (("tool_id =", tool_id), ("at >=", since)))
        rows = self._read(
            f"SELECT {DENIAL_COLUMNS} FROM denials {where} ORDER BY id LIMIT {p}",
            (*params, limit),
        )
        return [denial_from_row(r) for r in rows]
