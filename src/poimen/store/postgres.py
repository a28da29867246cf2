"""The shared store: PostgreSQL through psycopg 3 and psycopg_pool, for many processes and hosts.

Semantics follow the SQLite store exactly (one transaction per method, compare-and-set on the
fence, events in the same transaction). What PostgreSQL adds:

- Time is the database server's clock. The offset between this host's clock and the server's is
  measured when the store opens and refreshed every `clock_refresh` seconds, so `now()` costs no
  round trip and every host compares leases against one clock.
- Claims take the row with ``FOR UPDATE SKIP LOCKED``: a recoverer never queues behind another
  one holding the same intent; it moves on.
- A lost connection (``OperationalError``) is retried with back-off for up to `retry_for`
  seconds. A retry after an unanswered COMMIT checks whether the first try landed, so a write is
  never applied twice. If the write cannot be made, `StoreUnavailableError` is raised and the
  intent stays DISPATCHED for recovery.
- Migrations run under a transaction-scoped advisory lock: concurrent migrators leave one schema.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import conninfo as _conninfo
from psycopg_pool import ConnectionPool, PoolTimeout

from poimen._intents import (
    Attempt,
    Denial,
    Event,
    Intent,
    IntentState,
    Notification,
    Owner,
    check_transition,
)
from poimen.errors import (
    IntentNotFoundError,
    NotIndeterminateError,
    PoimenError,
    SchemaTooNewError,
    StoreError,
    StoreUnavailableError,
)
from poimen.store._base import (
    ATTEMPT_COLUMNS,
    DENIAL_COLUMNS,
    EVENT_COLUMNS,
    INTENT_COLUMNS,
    NOTIFICATION_COLUMNS,
    NewDispatch,
    NewNotification,
    attempt_from_row,
    denial_from_row,
    event_from_row,
    intent_from_row,
    migrations,
    notification_from_row,
)

T = TypeVar("T")
S = IntentState
Cursor = psycopg.Cursor[Any]
log = logging.getLogger("poimen.store.postgres")

# Connection-level failures worth another try: a dropped or terminated connection, a server
# restart, a serialization failure or deadlock (these roll the transaction back).
_TRANSIENT = (psycopg.OperationalError, PoolTimeout)


def describe(url: str) -> str:
    """host:port/dbname of a URL, without credentials, for error messages."""
    try:
        info = _conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "<unparsable URL>"
    host = info.get("host") or "localhost"
    port = info.get("port") or "5432"
    return f"{host}:{port}/{info.get('dbname') or info.get('user') or ''}"


class PostgresStore:
    """An intent log in a PostgreSQL database, shared by any number of processes and hosts.

    `url` is a libpq URL (``postgresql://user@host:5432/db``); query parameters such as
    ``options=-csearch_path%3Dmyschema`` select a schema. Thread-safe.
    """

    dialect = "postgres"

    def __init__(
        self,
        url: str,
        *,
        migrate: bool = True,
        min_size: int = 1,
        max_size: int = 8,
        connect_timeout: float = 5.0,
        retry_for: float = 10.0,
        clock_refresh: float = 60.0,
        application_name: str = "poimen",
    ) -> None:
        if min_size < 0 or max_size < max(1, min_size):
            raise StoreError(
                f"pool sizes must satisfy 0 <= min_size <= max_size >= 1, got "
                f"min_size={min_size}, max_size={max_size}"
            )
        if retry_for < 0:
            raise StoreError(f"retry_for must be >= 0 seconds, got {retry_for!r}")
        self.url = url
        self._where = describe(url)
        self._retry_for = retry_for
        self._connect_timeout = connect_timeout
        self._clock_refresh = clock_refresh
        self._closed = False
        params: dict[str, Any] = {"autocommit": True}
        try:
            given = _conninfo.conninfo_to_dict(url)
        except psycopg.ProgrammingError as exc:
            raise StoreError(f"not a PostgreSQL URL: {exc}", url=url) from exc
        if "application_name" not in given:
            params["application_name"] = application_name
        if "connect_timeout" not in given:
            params["connect_timeout"] = max(1, round(connect_timeout))
        self._params = params
        # One direct connection first: a database that is down gives a clear error here,
        # not a pool retrying in the background.
        try:
            probe = psycopg.connect(url, **params)
        except psycopg.Error as exc:
            raise StoreUnavailableError(
                f"cannot connect to PostgreSQL at {self._where}: {_first_line(exc)}",
                url=self._where,
            ) from exc
        try:
            self._offset = _measure_offset(probe)
        except psycopg.Error as exc:
            probe.close()
            raise StoreUnavailableError(
                f"PostgreSQL at {self._where} did not answer: {_first_line(exc)}",
                url=self._where,
            ) from exc
        probe.close()
        self._clock_at = time.monotonic()
        self._clock_lock = threading.Lock()
        self._pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
            url,
            min_size=min_size,
            max_size=max_size,
            kwargs=params,
            open=False,
            timeout=connect_timeout,
            name="poimen",
        )
        try:
            self._pool.open(wait=min_size > 0, timeout=connect_timeout)
        except PoolTimeout as exc:
            self._pool.close()
            raise StoreUnavailableError(
                f"cannot open a connection pool to PostgreSQL at {self._where}", url=self._where
            ) from exc
        try:
            if migrate:
                self.migrate()
            else:
                self._check_version()
        except BaseException:
            self.close()
            raise

    # Connections, transactions, retries.

    def _run(self, what: str, fn: Callable[[Cursor, bool], T], *, write: bool = True) -> T:
        """Run `fn` in one transaction; retry it while the database is unreachable.

        `fn(cur, retrying)` gets `retrying=True` on every try after a failed one, so it can
        recognise its own earlier commit whose answer the lost connection swallowed.
        """
        if self._closed:
            raise StoreUnavailableError("the store is closed")
        deadline = time.monotonic() + self._retry_for
        delay = 0.02
        retrying = False
        while True:
            # Waiting for a connection counts against the same budget.
            wait = min(self._connect_timeout, max(0.05, deadline - time.monotonic()))
            try:
                with self._connection(wait, direct=retrying) as conn:
                    if write:
                        with conn.transaction(), conn.cursor() as cur:
                            return fn(cur, retrying)
                    with conn.cursor() as cur:
                        return fn(cur, retrying)
            except _TRANSIENT as exc:
                if self._closed:
                    raise StoreUnavailableError("the store is closed") from exc
                if time.monotonic() + delay > deadline:
                    raise StoreUnavailableError(
                        f"{what}: PostgreSQL at {self._where} unreachable for "
                        f"{self._retry_for:g}s: {_first_line(exc)}",
                        url=self._where,
                        operation=what,
                    ) from exc
                log.warning("%s: %s; retrying in %.2fs", what, _first_line(exc), delay)
                retrying = True
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 1.0)
            except PoimenError:
                raise
            except psycopg.Error as exc:
                raise StoreError(f"{what} failed: {_first_line(exc)}", operation=what) from exc

    @contextlib.contextmanager
    def _connection(self, wait: float, *, direct: bool) -> Iterator[psycopg.Connection[Any]]:
        if direct:
            # A retry takes a fresh connection: after an outage the pool's idle sessions may
            # all be dead, and the pool backs off its own reconnects for up to minutes.
            with psycopg.connect(self.url, **self._params) as conn:
                yield conn
            return
        conn = self._pool.getconn(timeout=wait)
        try:
            with conn:
                yield conn
        except psycopg.OperationalError:
            # A terminated session can still look IDLE to the pool: close it, so the pool
            # replaces it instead of handing the dead socket to the next retry.
            conn.close()
            raise
        finally:
            self._pool.putconn(conn)

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        def op(cur: Cursor, _retrying: bool) -> list[Any]:
            cur.execute(sql, params)
            return cur.fetchall()

        return self._run("read", op, write=False)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.close()

    def now(self) -> float:
        """The database server's clock, from the measured offset (no round trip)."""
        if time.monotonic() - self._clock_at > self._clock_refresh and self._clock_lock.acquire(
            blocking=False
        ):
            try:
                with self._connection(self._connect_timeout, direct=False) as conn:
                    self._offset = _measure_offset(conn)
            except (*_TRANSIENT, psycopg.Error) as exc:  # keep the last offset, try again later
                log.warning("clock offset not refreshed: %s", _first_line(exc))
            finally:
                self._clock_at = time.monotonic()
                self._clock_lock.release()
        return time.time() + self._offset

    # Schema.

    def schema_version(self) -> int:
        def op(cur: Cursor, _retrying: bool) -> int:
            return _found_version(cur)

        return self._run("schema_version", op, write=False)

    def _too_new(self, found: int, known: int) -> SchemaTooNewError:
        return SchemaTooNewError(
            f"the intent log at {self._where} has schema version {found}, newer than "
            f"version {known} that this poimen knows; upgrade poimen",
            found=found,
            known=known,
        )

    def _check_version(self) -> None:
        known = migrations("postgres")[-1][0]
        found = self.schema_version()
        if found > known:
            raise self._too_new(found, known)

    def migrate(self) -> int:
        steps = migrations("postgres")
        known = steps[-1][0]

        def op(cur: Cursor, _retrying: bool) -> int:
            # Held to the end of this transaction: a second migrator waits, then finds the
            # schema in place and applies nothing.
            cur.execute(
                "SELECT pg_advisory_xact_lock(hashtext('poimen.migrate:' || current_schema()))"
            )
            cur.execute(
                "CREATE TABLE IF NOT EXISTS poimen_schema "
                "(version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
            )
            row = cur.execute("SELECT COALESCE(MAX(version), 0) FROM poimen_schema").fetchone()
            found = int(row[0]) if row else 0
            if found > known:
                raise self._too_new(found, known)
            for version, sql in steps:
                if version > found:
                    cur.execute(sql.encode("utf-8"))
                    cur.execute(
                        "INSERT INTO poimen_schema (version, applied_at) VALUES (%s, %s)",
                        (version, self.now()),
                    )
            return known

        return self._run("migrate", op)

    # The call path.

    def record_dispatch(self, d: NewDispatch) -> tuple[Intent, bool]:
        def op(cur: Cursor, retrying: bool) -> tuple[Intent, bool]:
            o = d.owner
            cur.execute(
                "INSERT INTO intents (id, call_id, tool_id, effect, args, args_hash, key, "
                "request_id, state, fence, owner_id, owner_host, owner_pid, owner_start, "
                "lease_expires_at, timeout_s, deadline_at, next_check_at, unknown_count, "
                "attempts, created_at, updated_at) VALUES "
                "(%s,%s,%s,%s,%s,%s,%s,%s,'DISPATCHED',1,%s,%s,%s,%s,%s,%s,%s,NULL,0,1,%s,%s) "
                f"ON CONFLICT (call_id) DO NOTHING RETURNING {INTENT_COLUMNS}",
                (
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
                ),
            )
            row = cur.fetchone()
            if row is None:
                existing = _intent_where(cur, "call_id", d.call_id)
                # Our own earlier try, committed before the connection dropped: still ours.
                return existing, retrying and existing.id == d.intent_id
            cur.execute(
                "INSERT INTO attempts (intent_id, number, fence, owner_id, owner_host, "
                "owner_pid, owner_start, started_at) VALUES (%s,1,1,%s,%s,%s,%s,%s)",
                (d.intent_id, o.worker_id, o.host, o.pid, o.pid_start, d.now),
            )
            _event(
                cur,
                d.intent_id,
                d.now,
                "dispatched",
                None,
                S.DISPATCHED,
                o.worker_id,
                {"attempt": 1, "fence": 1, "key": d.key, "request_id": d.request_id},
            )
            return intent_from_row(row), True

        return self._run("record_dispatch", op)

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
        check_transition(S.DISPATCHED, state)
        outcome = {S.COMPLETED: "completed", S.FAILED: "failed"}[state]

        def op(cur: Cursor, retrying: bool) -> bool:
            cur.execute(
                "UPDATE intents SET state = %s, result = %s, error = %s, "
                "lease_expires_at = NULL, next_check_at = NULL, updated_at = %s "
                "WHERE id = %s AND fence = %s AND state = 'DISPATCHED'",
                (state.value, result, error, now, intent_id, fence),
            )
            if cur.rowcount == 1:
                cur.execute(
                    "UPDATE attempts SET ended_at = %s, outcome = %s, result = %s, error = %s "
                    "WHERE intent_id = %s AND fence = %s",
                    (now, outcome, result, error, intent_id, fence),
                )
                _event(
                    cur,
                    intent_id,
                    now,
                    outcome,
                    S.DISPATCHED,
                    state,
                    "kernel",
                    {"fence": fence, "error": error},
                )
                return True
            if retrying:
                row = cur.execute(
                    "SELECT outcome FROM attempts WHERE intent_id = %s AND fence = %s",
                    (intent_id, fence),
                ).fetchone()
                if row is not None and row[0] == outcome:
                    return True  # our earlier try landed; its answer was lost with the connection
            # A stale owner: keep what it saw as evidence, change nothing else.
            cur.execute(
                "UPDATE attempts SET late_outcome = %s, late_result = %s "
                "WHERE intent_id = %s AND fence = %s",
                (outcome, result if error is None else error, intent_id, fence),
            )
            _event(
                cur,
                intent_id,
                now,
                "late_outcome",
                None,
                None,
                "kernel",
                {"fence": fence, "outcome": outcome},
            )
            return False

        return self._run("record_outcome", op)

    def record_unknown(self, intent_id: str, fence: int, error: str, now: float) -> bool:
        def op(cur: Cursor, _retrying: bool) -> bool:
            cur.execute(
                "UPDATE attempts SET ended_at = %s, outcome = 'unknown', error = %s "
                "WHERE intent_id = %s AND fence = %s AND outcome IS NULL",
                (now, error, intent_id, fence),
            )
            if cur.rowcount:
                _event(
                    cur,
                    intent_id,
                    now,
                    "outcome_unknown",
                    S.DISPATCHED,
                    S.DISPATCHED,
                    "kernel",
                    {"fence": fence, "error": error},
                )
            return cur.rowcount == 1

        return self._run("record_unknown", op)

    # Recovery.

    def list_unfinished(self, *, after_id: str, limit: int) -> list[Intent]:
        rows = self._read(
            f"SELECT {INTENT_COLUMNS} FROM intents WHERE state = 'DISPATCHED' AND id > %s "
            "ORDER BY id LIMIT %s",
            (after_id, limit),
        )
        return [intent_from_row(r) for r in rows]

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
        nonce = uuid.uuid4().hex  # marks this claim's event, so a retry can find its own

        def op(cur: Cursor, retrying: bool) -> Intent | None:
            # SKIP LOCKED: if another recoverer is claiming this row right now, it wins and
            # we move on instead of waiting for its commit.
            locked = cur.execute(
                "SELECT 1 FROM intents WHERE id = %s AND fence = %s AND state = 'DISPATCHED' "
                "FOR UPDATE SKIP LOCKED",
                (intent_id, fence),
            ).fetchone()
            if locked is None:
                if retrying:
                    # The claim may have committed on the try whose answer we lost.
                    mine = cur.execute(
                        "SELECT 1 FROM events WHERE intent_id = %s AND kind IN "
                        "('retry', 'claimed') AND detail LIKE %s",
                        (intent_id, f'%"{nonce}"%'),
                    ).fetchone()
                    it = _intent_or_none(cur, intent_id)
                    if mine and it and it.state == S.DISPATCHED and it.fence == fence + 1:
                        return it
                return None
            cur.execute(
                "UPDATE intents SET fence = fence + 1, owner_id = %s, owner_host = %s, "
                "owner_pid = %s, owner_start = %s, lease_expires_at = %s, next_check_at = NULL, "
                "deadline_at = COALESCE(%s, deadline_at), attempts = attempts + %s, "
                f"updated_at = %s WHERE id = %s RETURNING {INTENT_COLUMNS}",
                (
                    owner.worker_id,
                    owner.host,
                    owner.pid,
                    owner.pid_start,
                    lease_expires_at,
                    deadline_at,
                    1 if new_attempt else 0,
                    now,
                    intent_id,
                ),
            )
            row = cur.fetchone()
            assert row is not None  # the row is locked by us
            it = intent_from_row(row)
            if new_attempt:
                cur.execute(
                    "INSERT INTO attempts (intent_id, number, fence, owner_id, owner_host, "
                    "owner_pid, owner_start, started_at) VALUES (%s,%s,%s,%s,%s,%s,%s,%s)",
                    (
                        intent_id,
                        it.attempts,
                        it.fence,
                        owner.worker_id,
                        owner.host,
                        owner.pid,
                        owner.pid_start,
                        now,
                    ),
                )
            _event(
                cur,
                intent_id,
                now,
                "retry" if new_attempt else "claimed",
                S.DISPATCHED,
                S.DISPATCHED,
                owner.worker_id,
                {
                    "fence": it.fence,
                    "attempt": it.attempts if new_attempt else None,
                    "claim": nonce,
                },
            )
            return it

        return self._run("claim", op)

    def complete_landed(self, intent_id: str, fence: int, result: str | None, now: float) -> bool:
        def op(cur: Cursor, retrying: bool) -> bool:
            cur.execute(
                "UPDATE intents SET state = 'COMPLETED', result = %s, "
                "reason = 'landed_by_lookup', lease_expires_at = NULL, next_check_at = NULL, "
                "updated_at = %s WHERE id = %s AND fence = %s AND state = 'DISPATCHED'",
                (result, now, intent_id, fence),
            )
            if cur.rowcount == 0:
                return retrying and _settled_as(cur, intent_id, fence, S.COMPLETED)
            _event(
                cur,
                intent_id,
                now,
                "landed_by_lookup",
                S.DISPATCHED,
                S.COMPLETED,
                "kernel",
                {"fence": fence},
            )
            return True

        return self._run("complete_landed", op)

    def mark_indeterminate(
        self, intent_id: str, fence: int, reason: str, note: NewNotification, now: float
    ) -> bool:
        def op(cur: Cursor, retrying: bool) -> bool:
            cur.execute(
                "UPDATE intents SET state = 'INDETERMINATE', reason = %s, "
                "lease_expires_at = NULL, next_check_at = NULL, updated_at = %s "
                "WHERE id = %s AND fence = %s AND state = 'DISPATCHED'",
                (reason, now, intent_id, fence),
            )
            if cur.rowcount == 0:
                return retrying and _settled_as(cur, intent_id, fence, S.INDETERMINATE)
            _event(
                cur,
                intent_id,
                now,
                "indeterminate",
                S.DISPATCHED,
                S.INDETERMINATE,
                "kernel",
                {"fence": fence, "reason": reason},
            )
            _insert_note(cur, intent_id, note, now)
            return True

        return self._run("mark_indeterminate", op)

    def defer(
        self,
        intent_id: str,
        fence: int,
        *,
        next_check_at: float,
        unknown_count: int,
        reason: str,
        now: float,
    ) -> bool:
        def op(cur: Cursor, _retrying: bool) -> bool:
            # The lease ends when the next check is due, so any live recoverer may take it then.
            cur.execute(
                "UPDATE intents SET next_check_at = %s, lease_expires_at = %s, "
                "unknown_count = %s, reason = %s, updated_at = %s "
                "WHERE id = %s AND fence = %s AND state = 'DISPATCHED'",
                (next_check_at, next_check_at, unknown_count, reason, now, intent_id, fence),
            )
            if cur.rowcount:
                _event(
                    cur,
                    intent_id,
                    now,
                    "deferred",
                    S.DISPATCHED,
                    S.DISPATCHED,
                    "kernel",
                    {"fence": fence, "reason": reason, "next_check_at": next_check_at},
                )
            return cur.rowcount == 1

        return self._run("defer", op)

    def renew_leases(
        self, worker_id: str, intent_ids: Sequence[str], lease_expires_at: float
    ) -> int:
        if not intent_ids:
            return 0
        ids = sorted(intent_ids)  # one lock order for every renewer

        def op(cur: Cursor, _retrying: bool) -> int:
            cur.execute(
                "UPDATE intents SET lease_expires_at = %s WHERE owner_id = %s AND "
                "state = 'DISPATCHED' AND next_check_at IS NULL AND id = ANY(%s)",
                (lease_expires_at, worker_id, ids),
            )
            return cur.rowcount

        return self._run("renew_leases", op)

    # The operator path.

    def resolve(
        self,
        intent_id: str,
        *,
        landed: bool,
        result: str | None,
        operator: str,
        reason: str,
        now: float,
    ) -> Intent:
        target = S.RESOLVED_LANDED if landed else S.RESOLVED_NOT_LANDED

        def op(cur: Cursor, retrying: bool) -> Intent:
            row = cur.execute(
                "SELECT state, result FROM intents WHERE id = %s FOR UPDATE", (intent_id,)
            ).fetchone()
            if row is None:
                raise IntentNotFoundError(f"no intent {intent_id!r}", intent_id=intent_id)
            if retrying and row[0] == target and row[1] == result:
                return _intent_where(cur, "id", intent_id)  # our decision already landed
            if row[0] != S.INDETERMINATE:
                raise NotIndeterminateError(
                    f"intent {intent_id!r} is {row[0]}; only an INDETERMINATE intent can be "
                    "resolved",
                    intent_id=intent_id,
                    state=row[0],
                )
            check_transition(S.INDETERMINATE, target)
            cur.execute(
                "UPDATE intents SET state = %s, result = %s, updated_at = %s "
                f"WHERE id = %s AND state = 'INDETERMINATE' RETURNING {INTENT_COLUMNS}",
                (target.value, result, now, intent_id),
            )
            updated = cur.fetchone()
            assert updated is not None  # the row is locked by us
            _event(
                cur,
                intent_id,
                now,
                "resolved",
                S.INDETERMINATE,
                target,
                operator,
                {"operator": operator, "reason": reason, "landed": landed, "result": result},
            )
            return intent_from_row(updated)

        return self._run("resolve", op)

    def get_intent(self, intent_id: str) -> Intent | None:
        rows = self._read(f"SELECT {INTENT_COLUMNS} FROM intents WHERE id = %s", (intent_id,))
        return intent_from_row(rows[0]) if rows else None

    def get_by_call_id(self, call_id: str) -> Intent | None:
        rows = self._read(f"SELECT {INTENT_COLUMNS} FROM intents WHERE call_id = %s", (call_id,))
        return intent_from_row(rows[0]) if rows else None

    def list_intents(
        self,
        *,
        state: IntentState | None = None,
        tool_id: str | None = None,
        since: float | None = None,
        limit: int = 100,
    ) -> list[Intent]:
        clauses: list[str] = []
        params: list[Any] = []
        if state is not None:
            clauses.append("state = %s")
            params.append(state.value)
        if tool_id is not None:
            clauses.append("tool_id = %s")
            params.append(tool_id)
        if since is not None:
            clauses.append("created_at >= %s")
            params.append(since)
        where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
        rows = self._read(
            f"SELECT {INTENT_COLUMNS} FROM intents {where} ORDER BY created_at, id LIMIT %s",
            (*params, limit),
        )
        return [intent_from_row(r) for r in rows]

    def attempts(self, intent_id: str) -> list[Attempt]:
        rows = self._read(
            f"SELECT {ATTEMPT_COLUMNS} FROM attempts WHERE intent_id = %s ORDER BY number",
            (intent_id,),
        )
        return [attempt_from_row(r) for r in rows]

    def events(self, intent_id: str) -> list[Event]:
        rows = self._read(
            f"SELECT {EVENT_COLUMNS} FROM events WHERE intent_id = %s ORDER BY id", (intent_id,)
        )
        return [event_from_row(r) for r in rows]

    def counts(self) -> dict[tuple[str, str], int]:
        rows = self._read("SELECT tool_id, state, COUNT(*) FROM intents GROUP BY tool_id, state")
        return {(r[0], r[1]): int(r[2]) for r in rows}

    # Outbox and audit.

    def add_notification(self, intent_id: str, note: NewNotification, now: float) -> bool:
        def op(cur: Cursor, retrying: bool) -> bool:
            if _insert_note(cur, intent_id, note, now):
                return True
            if not retrying:
                return False
            row = cur.execute(
                "SELECT intent_id, created_at FROM outbox WHERE delivery_id = %s",
                (note.delivery_id,),
            ).fetchone()
            return row is not None and row[0] == intent_id and row[1] == now

        return self._run("add_notification", op)

    def due_notifications(self, now: float, limit: int) -> list[Notification]:
        rows = self._read(
            f"SELECT {NOTIFICATION_COLUMNS} FROM outbox WHERE delivered_at IS NULL "
            "AND next_attempt_at <= %s ORDER BY next_attempt_at, id LIMIT %s",
            (now, limit),
        )
        return [notification_from_row(r) for r in rows]

    def notifications(self, intent_id: str | None = None) -> list[Notification]:
        if intent_id is None:
            rows = self._read(f"SELECT {NOTIFICATION_COLUMNS} FROM outbox ORDER BY id")
        else:
            rows = self._read(
                f"SELECT {NOTIFICATION_COLUMNS} FROM outbox WHERE intent_id = %s ORDER BY id",
                (intent_id,),
            )
        return [notification_from_row(r) for r in rows]

    def mark_delivered(self, notification_id: int, now: float) -> None:
        def op(cur: Cursor, _retrying: bool) -> None:
            cur.execute(
                "UPDATE outbox SET delivered_at = %s, attempts = attempts + 1 "
                "WHERE id = %s AND delivered_at IS NULL",
                (now, notification_id),
            )

        self._run("mark_delivered", op)

    def mark_delivery_failed(
        self, notification_id: int, error: str, next_attempt_at: float
    ) -> None:
        def op(cur: Cursor, _retrying: bool) -> None:
            cur.execute(
                "UPDATE outbox SET attempts = attempts + 1, last_error = %s, "
                "next_attempt_at = %s WHERE id = %s AND delivered_at IS NULL",
                (error, next_attempt_at, notification_id),
            )

        self._run("mark_delivery_failed", op)

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
    ) -> Denial:
        values = (now, tool_id, intent_id, attempt, action, target, reason)

        def op(cur: Cursor, retrying: bool) -> Denial:
            if retrying:
                # A denial row is never written twice: find the one a lost commit wrote.
                row = cur.execute(
                    "SELECT id FROM denials WHERE at = %s AND tool_id = %s "
                    "AND intent_id IS NOT DISTINCT FROM %s AND attempt IS NOT DISTINCT FROM %s "
                    "AND action = %s AND target = %s AND reason = %s",
                    values,
                ).fetchone()
                if row is not None:
                    return Denial(int(row[0]), *values)
            row = cur.execute(
                "INSERT INTO denials (at, tool_id, intent_id, attempt, action, target, reason) "
                "VALUES (%s,%s,%s,%s,%s,%s,%s) RETURNING id",
                values,
            ).fetchone()
            assert row is not None
            return Denial(int(row[0]), *values)

        return self._run("record_denial", op)

    def denials(
        self, *, tool_id: str | None = None, since: float | None = None, limit: int = 1000
    ) -> list[Denial]:
        clauses: list[str] = []
        params: list[Any] = []
        if tool_id is not None:
            clauses.append("tool_id = %s")
            params.append(tool_id)
        if since is not None:
            clauses.append("at >= %s")
            params.append(since)
        where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
        rows = self._read(
            f"SELECT {DENIAL_COLUMNS} FROM denials {where} ORDER BY id LIMIT %s",
            (*params, limit),
        )
        return [denial_from_row(r) for r in rows]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _measure_offset(conn: psycopg.Connection[Any]) -> float:
    """Server clock minus this host's clock, taken at the midpoint of one round trip."""
    best: tuple[float, float] | None = None
    for _ in range(3):  # the shortest round trip gives the tightest estimate
        t0 = time.time()
        row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        t1 = time.time()
        assert row is not None
        sample = (t1 - t0, float(row[0]) - (t0 + t1) / 2)
        if best is None or sample[0] < best[0]:
            best = sample
    if not conn.autocommit:
        conn.rollback()
    assert best is not None
    return best[1]


def _found_version(cur: Cursor) -> int:
    row = cur.execute("SELECT to_regclass('poimen_schema') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return 0
    row = cur.execute("SELECT COALESCE(MAX(version), 0) FROM poimen_schema").fetchone()
    return int(row[0]) if row else 0


def _intent_or_none(cur: Cursor, intent_id: str) -> Intent | None:
    row = cur.execute(
        f"SELECT {INTENT_COLUMNS} FROM intents WHERE id = %s", (intent_id,)
    ).fetchone()
    return None if row is None else intent_from_row(row)


def _intent_where(cur: Cursor, column: str, value: str) -> Intent:
    # `column` is one of two literals from this module, never user input.
    row = cur.execute(
        f"SELECT {INTENT_COLUMNS} FROM intents WHERE {column} = %s", (value,)
    ).fetchone()
    if row is None:
        raise StoreError(f"intent with {column} {value!r} vanished mid-transaction")
    return intent_from_row(row)


def _settled_as(cur: Cursor, intent_id: str, fence: int, state: IntentState) -> bool:
    it = _intent_or_none(cur, intent_id)
    return it is not None and it.fence == fence and it.state == state


def _event(
    cur: Cursor,
    intent_id: str,
    at: float,
    kind: str,
    src: IntentState | None,
    dst: IntentState | None,
    actor: str,
    detail: dict[str, Any],
) -> None:
    cur.execute(
        "INSERT INTO events (intent_id, at, kind, from_state, to_state, actor, detail) "
        "VALUES (%s,%s,%s,%s,%s,%s,%s)",
        (
            intent_id,
            at,
            kind,
            None if src is None else src.value,
            None if dst is None else dst.value,
            actor,
            json.dumps({k: v for k, v in detail.items() if v is not None}, sort_keys=True),
        ),
    )


def _insert_note(cur: Cursor, intent_id: str, note: NewNotification, now: float) -> bool:
    cur.execute(
        "INSERT INTO outbox (delivery_id, intent_id, kind, payload, created_at, "
        "next_attempt_at) VALUES (%s,%s,%s,%s,%s,%s) ON CONFLICT (delivery_id) DO NOTHING",
        (note.delivery_id, intent_id, note.kind, note.payload, now, now),
    )
    return cur.rowcount == 1
