"""The embedded default store: SQLite in WAL mode, synchronous=FULL, one writer with group commit."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from poimen._intents import Denial, Intent, IntentState, Owner
from poimen.errors import StoreError, StoreUnavailableError
from poimen.store._base import NewDispatch, intent_from_row, migrations
from poimen.store._sql import Executor, Sql, SqlStore, claim_params, dispatch_params, too_new

T = TypeVar("T")
S = IntentState
SQL = Sql("?")
SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")


class _Op(Generic[T]):
    __slots__ = ("done", "error", "fn", "value", "wake")

    def __init__(self, fn: Callable[[sqlite3.Connection], T]) -> None:
        self.fn = fn
        self.done = False
        self.value: T | None = None
        self.error: BaseException | None = None
        # A lock held on the waiter's behalf: released once its commit is durable, or to
        # hand it the leader's role. None for a caller that led from the start.
        self.wake: threading.Lock | None = None


class _GroupCommit:
    """Many callers' writes in one transaction; each caller returns only after that commit.

    A caller that finds no leader becomes the leader and commits whatever is queued, its
    own write included; callers arriving meanwhile queue, each waiting on its own lock. The
    leader wakes exactly the callers of the batch it committed and hands the role to the
    first caller still queued, so no caller is woken for nothing. A single caller therefore
    commits inline, with no thread hop.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._queue: list[_Op[Any]] = []
        self._leading = False

    def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        op: _Op[T] = _Op(fn)
        with self._lock:
            self._queue.append(op)
            lead = not self._leading
            if lead:
                self._leading = True
            else:
                op.wake = wake = threading.Lock()
                wake.acquire()
        if not lead:
            assert op.wake is not None
            op.wake.acquire()  # our commit is durable, or we are the next leader
        if not op.done:
            self._lead(op)
        if op.error is not None:
            raise op.error
        return op.value  # type: ignore[return-value]

    def _lead(self, me: _Op[Any]) -> None:
        with self._lock:
            batch, self._queue = self._queue, []
        try:
            self._commit(batch)  # marks every op of the batch done, success or not
        finally:
            with self._lock:
                nxt = self._queue[0] if self._queue else None
                if nxt is None:
                    self._leading = False
            for op in batch:
                if op is not me and op.wake is not None:
                    op.wake.release()
            if nxt is not None:
                assert nxt.wake is not None
                nxt.wake.release()  # the role passes on; _leading stays set

    def _commit(self, batch: list[_Op[Any]]) -> None:
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            if len(batch) == 1:
                op = batch[0]
                try:
                    op.value = op.fn(conn)
                except BaseException as exc:
                    op.error = exc
                    conn.execute("ROLLBACK")
                    return
            elif not _run_all(conn, batch):
                # One op raised: undo the whole batch, then run it again with each op in its
                # own savepoint, so one caller's failure does not sink the others. An op
                # touches nothing but the connection, so running it twice is safe.
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                conn.execute("BEGIN IMMEDIATE")
                for op in batch:
                    conn.execute("SAVEPOINT op")
                    try:
                        op.value = op.fn(conn)
                        conn.execute("RELEASE op")
                    except BaseException as exc:
                        op.error = exc
                        conn.execute("ROLLBACK TO op")
                        conn.execute("RELEASE op")
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            err = StoreError(f"commit failed: {exc}")
            err.__cause__ = exc
            for op in batch:
                if op.error is None:
                    op.error, op.value = err, None
        finally:
            for op in batch:
                op.done = True


def _set_wal(conn: sqlite3.Connection, *, within: float = 30.0) -> None:
    # Switching a new file to WAL takes an exclusive lock without calling the busy handler,
    # so processes opening one file at once get "database is locked": wait for each other.
    end = time.monotonic() + within
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > end:
                raise
            time.sleep(0.01)


def _run_all(conn: sqlite3.Connection, batch: list[_Op[Any]]) -> bool:
    """Run every op of a batch without savepoints (two statements per op saved, and ops
    seldom fail); False as soon as one raises."""
    for op in batch:
        try:
            op.value = op.fn(conn)
        except BaseException:
            return False
    return True


class SqliteStore(SqlStore):
    """A SQLite intent log at `path`. Thread-safe; several processes may share the file."""

    dialect = "sqlite"
    _sql = SQL

    def __init__(
        self, path: str | Path, *, synchronous: str = "FULL", migrate: bool = True
    ) -> None:
        if synchronous.upper() not in SYNCHRONOUS:
            raise StoreError(f"synchronous must be one of {SYNCHRONOUS}, not {synchronous!r}")
        self.path = str(path)
        self.url = f"sqlite:///{self.path}"
        self._synchronous = synchronous.upper()
        self._local = threading.local()
        self._closed = False
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self._writer = _GroupCommit(self._connect(writer=True))
        if migrate:
            self.migrate()
        else:
            self._check_version()

    # Connections.

    def _connect(self, *, writer: bool = False) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=30.0
            )
            if writer:  # WAL is a property of the file: the writer sets it, readers find it
                _set_wal(conn)
            conn.execute(f"PRAGMA synchronous={self._synchronous}")
            conn.execute("PRAGMA busy_timeout=30000")
            conn.execute("PRAGMA foreign_keys=ON")
        except sqlite3.Error as exc:
            raise StoreUnavailableError(
                f"cannot open the SQLite intent log at {self.path!r}: {exc}", path=self.path
            ) from exc
        with self._conns_lock:
            self._conns.append(conn)
        return conn

    def _reader(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            if self._closed:
                raise StoreUnavailableError("the store is closed")
            conn = self._connect()
            self._local.conn = conn
        return conn

    def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise StoreUnavailableError("the store is closed")
        return self._writer.run(fn)

    def _tx(self, what: str, fn: Callable[[Executor, bool], T]) -> T:
        # One try only: SQLite has no lost connection, so `retrying` is always False.
        return self._write(lambda conn: fn(conn, False))

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        try:
            return self._reader().execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"read failed: {exc}") from exc

    def close(self) -> None:
        self._closed = True
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(sqlite3.Error):
                c.close()

    def now(self) -> float:
        return time.time()

    # Schema.

    def schema_version(self) -> int:
        rows = self._read(
            "SELECT name FROM sqlite_master WHERE type='table' AND name='poimen_schema'"
        )
        if not rows:
            return 0
        return int(self._read("SELECT COALESCE(MAX(version), 0) FROM poimen_schema")[0][0])

    def _check_version(self) -> None:
        known = migrations("sqlite")[-1][0]
        found = self.schema_version()
        if found > known:
            raise too_new(repr(self.path), found, known)

    def migrate(self) -> int:
        steps = migrations("sqlite")
        known = steps[-1][0]

        def apply(conn: sqlite3.Connection) -> int:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS poimen_schema "
                "(version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)"
            )
            found = int(
                conn.execute("SELECT COALESCE(MAX(version), 0) FROM poimen_schema").fetchone()[0]
            )
            if found > known:
                raise too_new(repr(self.path), found, known)
            for version, sql in steps:
                if version > found:
                    for stmt in _statements(sql):
                        conn.execute(stmt)
                    conn.execute(
                        "INSERT INTO poimen_schema (version, applied_at) VALUES (?, ?)",
                        (version, time.time()),
                    )
            return known

        return self._write(apply)

    # The call path.

    def record_dispatch(self, d: NewDispatch) -> tuple[Intent, bool]:
        def op(conn: sqlite3.Connection) -> tuple[Intent, bool]:
            cur = conn.execute(SQL.insert_intent, dispatch_params(d))
            if cur.rowcount == 0:
                row = conn.execute(SQL.intent_by_call_id, (d.call_id,)).fetchone()
                return intent_from_row(row), False
            o = d.owner
            conn.execute(
                SQL.insert_first_attempt,
                (d.intent_id, o.worker_id, o.host, o.pid, o.pid_start, d.now),
            )
            self._dispatched_event(conn, d)
            return _dispatched(d), True

        return self._write(op)

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
        def op(conn: sqlite3.Connection) -> Intent | None:
            cur = conn.execute(
                _CLAIM,
                (
                    *claim_params(
                        owner, lease_expires_at, deadline_at, new_attempt, now, intent_id
                    ),
                    fence,
                ),
            )
            if cur.rowcount == 0:
                return None
            it = intent_from_row(conn.execute(SQL.intent_by_id, (intent_id,)).fetchone())
            self._claimed(conn, it, owner, new_attempt, now, None)
            return it

        return self._write(op)

    def renew_leases(
        self, worker_id: str, intent_ids: Sequence[str], lease_expires_at: float
    ) -> int:
        if not intent_ids:
            return 0
        ids = list(intent_ids)

        def op(conn: sqlite3.Connection) -> int:
            n = 0
            for i in range(0, len(ids), 500):
                chunk = ids[i : i + 500]
                cur = conn.execute(
                    "UPDATE intents SET lease_expires_at = ? WHERE owner_id = ? AND "
                    f"state = 'DISPATCHED' AND next_check_at IS NULL AND id IN "
                    f"({','.join('?' * len(chunk))})",
                    (lease_expires_at, worker_id, *chunk),
                )
                n += cur.rowcount
            return n

        return self._write(op)

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

        def op(conn: sqlite3.Connection) -> Intent:
            row = conn.execute("SELECT state FROM intents WHERE id = ?", (intent_id,)).fetchone()
            self._resolvable(intent_id, row, target)
            conn.execute(SQL.resolve, (target.value, result, now, intent_id))
            self._resolved_event(conn, intent_id, target, landed, result, operator, reason, now)
            return intent_from_row(conn.execute(SQL.intent_by_id, (intent_id,)).fetchone())

        return self._write(op)

    # Audit.

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
        def op(conn: sqlite3.Connection) -> Denial:
            cur = conn.execute(
                SQL.insert_denial, (now, tool_id, intent_id, attempt, action, target, reason)
            )
            return Denial(
                int(cur.lastrowid or 0), now, tool_id, intent_id, attempt, action, target, reason
            )

        return self._write(op)


_CLAIM = (
    "UPDATE intents SET fence = fence + 1, owner_id = ?, owner_host = ?, "
    "owner_pid = ?, owner_start = ?, lease_expires_at = ?, next_check_at = NULL, "
    "deadline_at = COALESCE(?, deadline_at), attempts = attempts + ?, "
    "updated_at = ? WHERE id = ? AND fence = ? AND state = 'DISPATCHED'"
)


def _dispatched(d: NewDispatch) -> Intent:
    """The row record_dispatch just inserted, as reading it back would decode it (the same
    values, converted as the columns convert them), without the read."""
    o = d.owner
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
        owner=Owner(str(o.worker_id), str(o.host or ""), int(o.pid or 0), str(o.pid_start or "")),
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


def _statements(sql: str) -> list[str]:
    """Split a migration into statements; trigger bodies contain semicolons."""
    out, buf = [], ""
    for line in sql.splitlines(keepends=True):
        if not buf and line.lstrip().startswith("--"):
            continue
        buf += line
        if sqlite3.complete_statement(buf):
            out.append(buf.strip())
            buf = ""
    if buf.strip():
        out.append(buf.strip())
    return out
