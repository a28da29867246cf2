"""Retention in the store: which settled intents may go, their whole history for an archive,
and the delete itself, in one short transaction per batch, on both backends.

Events and denials are append-only (triggers refuse UPDATE and DELETE); a prune transaction
alone may delete them, and marks itself so (SQLite: a row in ``poimen_pruning``, removed
before it commits; PostgreSQL: the transaction-local setting ``poimen.pruning``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from poimen._intents import Attempt, Denial, Event, Intent, Notification
from poimen.store._base import (
    ATTEMPT_COLUMNS,
    DENIAL_COLUMNS,
    EVENT_COLUMNS,
    INTENT_COLUMNS,
    NOTIFICATION_COLUMNS,
    attempt_from_row,
    denial_from_row,
    event_from_row,
    intent_from_row,
    notification_from_row,
)
from poimen.store._inline import inline_attempt, inline_events

T = TypeVar("T")

#: The states an intent may be pruned in: settled for good.
PRUNABLE = ("COMPLETED", "FAILED", "RESOLVED_LANDED", "RESOLVED_NOT_LANDED")
_STATES = "(" + ", ".join(f"'{s}'" for s in PRUNABLE) + ")"


@dataclass(frozen=True, slots=True)
class History:
    """Everything the log holds of one intent: what an archive line carries."""

    intent: Intent
    attempts: list[Attempt]
    events: list[Event]
    notifications: list[Notification]
    denials: list[Denial]


class Retention:
    """Mixed into the SQL stores: `_read`, `_tx`, the placeholder and the pruning mark come
    from the backend."""

    _sql: ClassVar[Any]
    dialect: ClassVar[str]

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        raise NotImplementedError

    def _tx(self, what: str, fn: Callable[[Any, bool], T]) -> T:
        raise NotImplementedError

    def _in(self, column: str, n: int) -> str:
        p = self._sql.p
        return f"{column} IN ({', '.join([p] * n)})"

    def prune_candidates(self, *, after_id: str, before: float, limit: int) -> list[Intent]:
        """Settled intents last changed before `before`, in id order after `after_id`, whose
        notifications have all been delivered (an undelivered one keeps its intent)."""
        p = self._sql.p
        rows = self._read(
            f"SELECT {INTENT_COLUMNS} FROM intents i WHERE id > {p} AND state IN {_STATES} "
            f"AND updated_at < {p} AND NOT EXISTS (SELECT 1 FROM outbox o "
            "WHERE o.intent_id = i.id AND o.delivered_at IS NULL) "
            f"ORDER BY id LIMIT {p}",
            (after_id, before, limit),
        )
        return [intent_from_row(r) for r in rows]

    def histories(self, intents: Sequence[Intent]) -> list[History]:
        """The whole history of each intent (for an archive), in the order given."""
        if not intents:
            return []
        ids = [i.id for i in intents]
        cond = self._in("intent_id", len(ids))
        attempts: dict[str, list[Attempt]] = {i: [] for i in ids}
        events: dict[str, list[Event]] = {i: [] for i in ids}
        notes: dict[str, list[Notification]] = {i: [] for i in ids}
        denials: dict[str, list[Denial]] = {i: [] for i in ids}
        for r in self._read(f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE {cond} "
                            "ORDER BY intent_id, number", ids):
            a = attempt_from_row(r)
            attempts[a.intent_id].append(a)
        for r in self._read(f"SELECT {EVENT_COLUMNS} FROM events WHERE {cond} ORDER BY id", ids):
            e = event_from_row(r)
            events[e.intent_id].append(e)
        for r in self._read(f"SELECT {NOTIFICATION_COLUMNS} FROM outbox WHERE {cond} "
                            "ORDER BY id", ids):
            n = notification_from_row(r)
            notes[n.intent_id].append(n)
        for r in self._read(f"SELECT {DENIAL_COLUMNS} FROM denials WHERE {cond} ORDER BY id", ids):
            d = denial_from_row(r)
            if d.intent_id is not None:
                denials[d.intent_id].append(d)
        # Whose attempt 1 and events are in the intent row: as `attempts` and `events` read them.
        inline = {
            str(r[0])
            for r in self._read(
                f"SELECT id FROM intents WHERE {self._in('id', len(ids))} AND inline_history = 1",
                ids,
            )
        }
        for i in intents:
            if i.id in inline:
                attempts[i.id], events[i.id] = [inline_attempt(i)], inline_events(i)
        return [
            History(i, attempts[i.id], events[i.id], notes[i.id], denials[i.id]) for i in intents
        ]

    def prune(self, intent_ids: Sequence[str], *, before: float) -> list[str]:
        """Delete these intents and their history, in one transaction; only those still
        settled and unchanged since `before` go. Returns the ids deleted."""
        if not intent_ids:
            return []
        ids = list(intent_ids)

        def op(ex: Any, _retrying: bool) -> list[str]:
            p = self._sql.p
            kept = [
                str(r[0])
                for r in ex.execute(
                    f"SELECT id FROM intents WHERE {self._in('id', len(ids))} "
                    f"AND state IN {_STATES} AND updated_at < {p}",
                    (*ids, before),
                ).fetchall()
            ]
            if not kept:
                return []
            self._mark_pruning(ex, True)
            cond = self._in("intent_id", len(kept))
            ex.execute(
                "DELETE FROM deliveries WHERE notification_id IN "
                f"(SELECT id FROM outbox WHERE {cond})",
                kept,
            )
            for table in ("outbox", "events", "denials", "attempts"):
                ex.execute(f"DELETE FROM {table} WHERE {cond}", kept)
            ex.execute(f"DELETE FROM intents WHERE {self._in('id', len(kept))}", kept)
            self._mark_pruning(ex, False)
            return kept

        return self._tx("prune", op)

    def prune_denials(self, *, before: float, limit: int) -> int:
        """Denials of no intent (a sandbox's refusals) older than `before`."""

        def op(ex: Any, _retrying: bool) -> int:
            p = self._sql.p
            ids = [
                r[0]
                for r in ex.execute(
                    f"SELECT id FROM denials WHERE intent_id IS NULL AND at < {p} "
                    f"ORDER BY id LIMIT {p}",
                    (before, limit),
                ).fetchall()
            ]
            if not ids:
                return 0
            self._mark_pruning(ex, True)
            ex.execute(f"DELETE FROM denials WHERE {self._in('id', len(ids))}", ids)
            self._mark_pruning(ex, False)
            return len(ids)

        return self._tx("prune_denials", op)

    def _mark_pruning(self, ex: Any, on: bool) -> None:
        if self.dialect == "postgres":
            if on:  # transaction-local: gone at COMMIT or ROLLBACK
                ex.execute("SELECT set_config('poimen.pruning', 'on', true)", ())
            return
        if on:
            ex.execute("INSERT INTO poimen_pruning (started_at) VALUES (0)", ())
        else:
            ex.execute("DELETE FROM poimen_pruning", ())
