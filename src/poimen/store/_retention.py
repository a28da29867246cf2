"""Retention in the store: which settled intents may go, their whole history for an archive,
and the delete itself, in one short transaction per batch, on both backends.

Events and denials are append-only (triggers refuse UPDATE and DELETE); a prune transaction
alone may delete them, and marks itself so (SQLite: a row in ``poimen_pruning``, removed
before it commits; PostgreSQL: the transaction-local setting ``poimen.pruning``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, TypeVar

from poimen._core.audit import ranges_of
from poimen._core.intents import Attempt, Denial, Event, Intent, Notification
from poimen.call_ids import is_undo, original_of
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
from poimen.store._chain import CHAIN_VERSION
from poimen.store._dialect import DIALECTS
from poimen.store._inline import inline_attempt, inline_events
from poimen.store._statements import Reader

T = TypeVar("T")

#: The states an intent may be pruned in: settled for good.
PRUNABLE = ("COMPLETED", "FAILED", "RESOLVED_LANDED", "RESOLVED_NOT_LANDED")
_STATES = "(" + ", ".join(f"'{s}'" for s in PRUNABLE) + ")"


@dataclass(frozen=True, slots=True)
class History:
    """Everything the log holds of one intent: what an archive line carries. `links`: its
    rows' links of the audit chain (kind, row id, position, hash), in position order."""

    intent: Intent
    attempts: list[Attempt]
    events: list[Event]
    notifications: list[Notification]
    denials: list[Denial]
    links: tuple[Linked, ...] = ()


#: The history tables of an intent, with the columns an archive line holds.
_HISTORY = (
    ("attempts", ATTEMPT_COLUMNS),
    ("events", EVENT_COLUMNS),
    ("outbox", NOTIFICATION_COLUMNS),
    ("denials", DENIAL_COLUMNS),
)


class Linked(NamedTuple):
    """A row's link of the audit chain, with the columns it was hashed over."""

    kind: str
    id: str
    seq: int
    hash: str
    values: tuple[Any, ...]


#: The history tables whose rows carry a link of the audit chain, and the columns read.
_LINKED = frozenset({"events", "denials"})
_LINK = ", chain_seq, chain_hash"
_SCOPE = ", scope"  # an intent's last hashed column
_KINDS = (None, "event", None, "denial")  # of `_HISTORY`'s tables, in order


class _Changed(Exception):
    """A prune found these intents' history changed since it was read: nothing deleted."""

    def __init__(self, ids: set[str]) -> None:
        super().__init__(f"changed since read: {sorted(ids)}")
        self.ids = ids


def _unlinked(
    rows: Sequence[Sequence[Any]], kind: str, width: int, links: dict[str, list[Any]]
) -> list[Sequence[Any]]:
    """`rows` without their trailing link columns (chain_seq, chain_hash) when they have
    them; each link found goes into `links` under the row's intent: (kind, row id, position,
    hash, the columns hashed), the columns being the row's first ones (`_audit.COLUMNS`)."""
    if not rows or len(rows[0]) <= width:  # read without the links
        return list(rows)
    of = 3 if kind == "denial" else 1 if kind == "event" else 0  # the intent id's column
    for r in rows:
        if r[width] is not None and r[of] is not None:
            links.setdefault(str(r[of]), []).append(
                Linked(kind, str(r[0]), int(r[width]), str(r[width + 1]), tuple(r[:width]))
            )
    return [r[:width] for r in rows]


def _assemble(
    intents: Sequence[Intent],
    inline: set[str],
    attempt_rows: Sequence[Any],
    event_rows: Sequence[Any],
    note_rows: Sequence[Any],
    denial_rows: Sequence[Any],
    links: dict[str, list[Any]] | None = None,
) -> list[History]:
    """Each intent's history from its rows (in any order), as every reader reads it."""
    links = links or {}
    ids = [i.id for i in intents]
    attempts: dict[str, list[Attempt]] = {i: [] for i in ids}
    events: dict[str, list[Event]] = {i: [] for i in ids}
    notes: dict[str, list[Notification]] = {i: [] for i in ids}
    denials: dict[str, list[Denial]] = {i: [] for i in ids}
    for a in sorted(map(attempt_from_row, attempt_rows), key=lambda a: a.number):
        attempts[a.intent_id].append(a)
    for e in sorted(map(event_from_row, event_rows), key=lambda e: e.id):
        events[e.intent_id].append(e)
    for n in sorted(map(notification_from_row, note_rows), key=lambda n: n.id):
        notes[n.intent_id].append(n)
    for d in sorted(map(denial_from_row, denial_rows), key=lambda d: d.id):
        if d.intent_id is not None:
            denials[d.intent_id].append(d)
    for i in intents:
        if i.id in inline:
            attempts[i.id], events[i.id] = [inline_attempt(i)], inline_events(i)
    return [
        History(
            i, attempts[i.id], events[i.id], notes[i.id], denials[i.id],
            tuple(sorted(links.get(i.id, ()), key=lambda x: x.seq)),
        )
        for i in intents
    ]


def _histories(
    intents: Sequence[Intent], found: Sequence[Any], rows: Sequence[Sequence[Any]]
) -> list[History]:
    """The histories of `intents` from their rows as read (or deleted): `found`, the intent
    rows (INTENT_COLUMNS, the links if read, inline_history), and `rows`, those of the
    `_HISTORY` tables in order; an intent no longer found keeps the row given."""
    links: dict[str, list[Any]] = {}
    width = len(INTENT_COLUMNS.split(", ")) + 1  # and the scope
    plain = _unlinked([r[:-1] for r in found], "intent", width, links)
    current = {str(r[0]): intent_from_row(r) for r in plain}
    inline = {str(r[0]) for r in found if r[-1] == 1}
    tables = [
        _unlinked(t, kind, len(cols.split(", ")), links) if kind else t
        for t, (_, cols), kind in zip(rows, _HISTORY, _KINDS, strict=True)
    ]
    attempts, events, notes, denials = tables
    return _assemble(
        [current.get(i.id, i) for i in intents], inline, attempts, events, notes, denials, links
    )


class Retention:
    """Mixed into the SQL stores: `_read`, `_tx`, the placeholder and the pruning mark come
    from the backend."""

    _sql: ClassVar[Any]
    dialect: ClassVar[str]

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        raise NotImplementedError

    def _tx(self, what: str, fn: Callable[[Any, bool], T]) -> T:
        raise NotImplementedError

    def _snapshot(self, fn: Callable[[Reader], T]) -> T:
        raise NotImplementedError

    def now(self) -> float:
        raise NotImplementedError

    @staticmethod
    def _chained(rows: Callable[[str], Sequence[Any]]) -> bool:
        """Whether the log has the audit chain (schema version 10): a prune then records what
        it removed from it, and its archive carries the links. Read in the caller's own
        transaction (`rows`), so it is of the same snapshot as what the caller reads."""
        return int(rows("SELECT MAX(version) FROM poimen_schema")[0][0] or 0) >= CHAIN_VERSION

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
        """The whole history of each intent (for an archive), in the order given, read in one
        snapshot: a spill between two of its reads would otherwise hide a history."""
        if not intents:
            return []
        ids = [i.id for i in intents]
        cond = self._in("intent_id", len(ids))

        def read(q: Reader) -> list[History]:
            chain = _LINK if self._chained(q) else ""
            rows = [
                q(f"SELECT {cols}{chain if table in _LINKED else ''} FROM {table} "
                  f"WHERE {cond}", ids)
                for table, cols in _HISTORY
            ]
            # Whose attempt 1 and events are in the intent row, as `attempts` and `events` read
            # them; the rows themselves are read again here, as of this snapshot.
            found = q(
                f"SELECT {INTENT_COLUMNS}{_SCOPE + chain if chain else ''}, inline_history "
                "FROM intents "
                f"WHERE {self._in('id', len(ids))}",
                ids,
            )
            return _histories(intents, found, rows)

        return self._snapshot(read)

    def prune(self, histories: Sequence[History], *, before: float) -> list[str]:
        """Delete these intents and their history, in one transaction. An intent goes only if
        it is still settled and unchanged since `before`, its history is still the one given
        (what the caller read, and archived), and it is not an undo intent whose original
        remains (docs/design.md section 9). Returns the ids deleted."""
        given = {h.intent.id: h for h in histories}
        todo = list(given)
        while todo:

            def op(ex: Any, _retrying: bool, ids: list[str] = todo) -> list[str]:
                return self._prune(ex, ids, given, before)

            try:
                return self._tx("prune", op)
            except _Changed as exc:  # rolled back: the others go without them
                todo = [i for i in todo if i not in exc.ids]
        return []

    def _prune(
        self, ex: Any, ids: list[str], given: dict[str, History], before: float
    ) -> list[str]:
        p = self._sql.p
        lock = DIALECTS[self.dialect].lock
        found = ex.execute(
            f"SELECT id, call_id FROM intents WHERE {self._in('id', len(ids))} "
            f"AND state IN {_STATES} AND updated_at < {p} ORDER BY id{lock}",
            (*ids, before),
        ).fetchall()
        going = {str(r[0]) for r in found}
        kept = [str(i) for i, c in found if not self._undo_of_one_staying(ex, str(c), going)]
        if not kept:
            return []
        self._mark_pruning(ex, True)
        cond = self._in("intent_id", len(kept))
        ex.execute(
            "DELETE FROM deliveries WHERE notification_id IN "
            f"(SELECT id FROM outbox WHERE {cond})",
            kept,
        )
        ex.execute(f"DELETE FROM call_aliases WHERE {cond}", kept)
        chain = _LINK if self._chained(lambda sql: ex.execute(sql, ()).fetchall()) else ""
        # What the deletes return is what the log held: it must be what was archived.
        rows = [
            ex.execute(
                f"DELETE FROM {table} WHERE {cond} RETURNING {cols}"
                f"{chain if table in _LINKED else ''}", kept
            ).fetchall()
            for table, cols in _HISTORY
        ]
        gone = ex.execute(
            f"DELETE FROM intents WHERE {self._in('id', len(kept))} "
            f"RETURNING {INTENT_COLUMNS}{_SCOPE + chain if chain else ''}, inline_history",
            kept,
        ).fetchall()
        self._mark_pruning(ex, False)
        histories = _histories([given[str(r[0])].intent for r in gone], gone, rows)
        changed = {h.intent.id for h in histories if h != given[h.intent.id]}
        if changed:
            raise _Changed(changed)
        if chain:
            self._record_pruned(ex, [x for h in histories for x in h.links])
        return kept

    def _record_pruned(self, ex: Any, links: Sequence[Linked]) -> None:
        """The chain's record of a prune, in its transaction: the runs of positions it
        removed, each with the hash of its last one, so the chain is checked across them
        (docs/audit.md). Chained itself, by its table's trigger."""
        if not links:
            return
        p = self._sql.p
        ranges = ranges_of((x.seq, x.hash) for x in links)
        ex.execute(
            f"INSERT INTO audit_pruned (at, ranges, rows) VALUES ({p}, {p}, {p})",
            (self.now(), json.dumps(ranges, separators=(",", ":")), len(links)),
        )

    def _undo_of_one_staying(self, ex: Any, call_id: str, going: set[str]) -> bool:
        """Whether `call_id` is an undo's whose original stays in the log."""
        if not is_undo(call_id):
            return False
        p = self._sql.p
        original = original_of(call_id)
        if original is not None:
            sql, params = f"SELECT id FROM intents WHERE call_id = {p}", [original]
        else:  # shortened to a hash: the original's undo events name it
            sql = (
                "SELECT intent_id FROM events WHERE kind IN ('undo_requested', 'undone') "
                f"AND detail LIKE {p}"
            )
            params = [f'%"undo_call_id": "{call_id}"%']
        return any(str(r[0]) not in going for r in ex.execute(sql, params).fetchall())

    def prune_denials(self, *, before: float, limit: int) -> int:
        """Denials of no intent (a sandbox's refusals) older than `before`."""

        def op(ex: Any, _retrying: bool) -> int:
            p = self._sql.p
            chained = self._chained(lambda sql: ex.execute(sql, ()).fetchall())
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
            gone = ex.execute(
                f"DELETE FROM denials WHERE {self._in('id', len(ids))}"
                f"{' RETURNING id, chain_seq, chain_hash' if chained else ''}",
                ids,
            )
            self._mark_pruning(ex, False)
            if chained:
                self._record_pruned(ex, [
                    Linked("denial", str(r[0]), int(r[1]), str(r[2]), ())
                    for r in gone.fetchall() if r[1] is not None
                ])
            return len(ids)

        return self._tx("prune_denials", op)

    def _mark_pruning(self, ex: Any, on: bool) -> None:
        """Tell the history triggers a prune is deleting (a row of ``poimen_pruning``; a
        store may mark it its own way)."""
        if on:
            ex.execute("INSERT INTO poimen_pruning (started_at) VALUES (0)", ())
        else:
            ex.execute("DELETE FROM poimen_pruning", ())
