"""Sandbox records (schema version 5, table ``sandbox_calls``): what a shadow or replay kernel
answered instead of dispatching a call, and the paged reads an intent diff needs.

A sandbox record is not an intent: recovery reads only ``intents``, so nothing recorded here can
ever be dispatched, by the sandbox kernel or by a live kernel that opens the same log.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass
from typing import Any, Literal

from poimen._core.intents import Intent
from poimen.errors import CorruptRowError, StoreError
from poimen.store._base import INTENT_COLUMNS, Store, intent_from_row
from poimen.store._sql import SqlStore
from poimen.store._statements import Executor

#: The schema version that has ``sandbox_calls``; an older log has no sandbox records.
SANDBOX_VERSION = 5

SandboxAnswer = Literal["recorded", "live", "would_have_called", "not_in_recording", "refused"]
ANSWERS: frozenset[str] = frozenset(
    {"recorded", "live", "would_have_called", "not_in_recording", "refused"}
)
COLUMNS = (
    "id, call_id, mode, tool_id, effect, args, args_hash, answer, source, outcome, divergence, "
    "created_at"
)


@dataclass(frozen=True, slots=True)
class SandboxCall:
    """One call a sandbox kernel answered without dispatching it.

    `answer`: ``recorded`` (replay: the recording's outcome), ``live`` (shadow: the live
    run's outcome), ``would_have_called`` (shadow: nothing was run), ``not_in_recording``
    (replay, a divergence answered so the run goes on) or ``refused`` (replay, a divergence
    refused with `DivergenceError`). `source` is the intent id in the recording or live log
    that answered; `outcome` the caller's outcome and `divergence` what differed, as JSON.
    """

    id: str
    call_id: str
    mode: Literal["shadow", "replay"]
    tool_id: str
    effect: str
    args: str
    args_hash: str
    answer: SandboxAnswer
    source: str | None
    outcome: str | None
    divergence: str | None
    created_at: float


def _from_row(row: Sequence[Any]) -> SandboxCall:
    if row[2] not in ("shadow", "replay") or row[7] not in ANSWERS:
        raise CorruptRowError(f"sandbox record {row[0]!r} does not decode", intent_id=row[0])
    return SandboxCall(
        id=str(row[0]),
        call_id=str(row[1]),
        mode=row[2],
        tool_id=str(row[3]),
        effect=str(row[4]),
        args=str(row[5]),
        args_hash=str(row[6]),
        answer=row[7],
        source=row[8],
        outcome=row[9],
        divergence=row[10],
        created_at=float(row[11]),
    )


def sql_store(store: Store) -> SqlStore:
    if not isinstance(store, SqlStore):
        raise StoreError(
            f"a sandbox kernel needs a poimen SQLite or PostgreSQL store, not {type(store).__name__}"
        )
    return store


def has_records(store: Store) -> bool:
    """Whether the log's schema has sandbox records (a log older than version 5 has none)."""
    return store.schema_version() >= SANDBOX_VERSION


def record(store: Store, call: SandboxCall) -> tuple[SandboxCall, bool]:
    """Record `call` unless its call id has a record already: (the record, whether it is
    this one). Call ids are unique here as in the intent log."""
    s = sql_store(store)
    p = s._sql.p
    insert = (
        f"INSERT INTO sandbox_calls ({COLUMNS}) VALUES ({', '.join([p] * 12)}) "
        "ON CONFLICT (call_id) DO NOTHING"
    )
    select = f"SELECT {COLUMNS} FROM sandbox_calls WHERE call_id = {p}"

    def op(ex: Executor, retrying: bool) -> tuple[SandboxCall, bool]:
        created = ex.execute(insert, astuple(call)).rowcount == 1
        got = _from_row(ex.execute(select, (call.call_id,)).fetchone())
        # A retried transaction whose first commit landed finds its own row.
        return got, created or (retrying and got.id == call.id)

    return s._tx("record_sandbox_call", op)


def get(store: Store, call_id: str) -> SandboxCall | None:
    s = sql_store(store)
    rows = s._read(f"SELECT {COLUMNS} FROM sandbox_calls WHERE call_id = {s._sql.p}", (call_id,))
    return _from_row(rows[0]) if rows else None


def _where(s: SqlStore, prefix: str | None, after_id: str) -> tuple[str, tuple[Any, ...]]:
    p = s._sql.p
    if prefix:
        cond, params = s._prefix_match(prefix)
        return f"WHERE {cond} AND id > {p}", (*params, after_id)
    return f"WHERE id > {p}", (after_id,)


def sandbox_calls(
    store: Store, prefix: str | None, *, after_id: str = "", limit: int = 1000
) -> list[SandboxCall]:
    """Sandbox records whose call id starts with `prefix` (all: None), in id order."""
    if not has_records(store):
        return []
    s = sql_store(store)
    where, params = _where(s, prefix, after_id)
    rows = s._read(
        f"SELECT {COLUMNS} FROM sandbox_calls {where} ORDER BY id LIMIT {s._sql.p}",
        (*params, limit),
    )
    return [_from_row(r) for r in rows]


def intents(
    store: Store, prefix: str | None, *, after_id: str = "", limit: int = 1000
) -> list[Intent]:
    """Intents whose call id starts with `prefix` (all: None), in id (creation) order."""
    s = sql_store(store)
    where, params = _where(s, prefix, after_id)
    rows = s._read(
        f"SELECT {INTENT_COLUMNS} FROM intents {where} ORDER BY id LIMIT {s._sql.p}",
        (*params, limit),
    )
    return [intent_from_row(r) for r in rows]
