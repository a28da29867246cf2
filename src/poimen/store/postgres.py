"""The shared store: PostgreSQL through psycopg 3 and psycopg_pool, for many processes and hosts.

Semantics follow the SQLite store exactly (one transaction per method, compare-and-set on the
fence, events in the same transaction). What PostgreSQL adds:

- Time is the database server's clock, measured when the store opens and again every
  `clock_refresh` seconds; in between, `now()` adds the time elapsed on this host's monotonic
  clock, so it costs no round trip, every host compares leases against one clock, and a step of
  this host's wall clock never moves it.
- Claims take the row with ``FOR UPDATE SKIP LOCKED``: a recoverer never queues behind another
  one holding the same intent; it moves on.
- A lost connection (``OperationalError``) is retried with back-off for up to `retry_for`
  seconds. A retry after an unanswered COMMIT checks whether the first try landed, so a write is
  never applied twice. If the write cannot be made, `StoreUnavailableError` is raised and the
  intent stays DISPATCHED for recovery. A statement the server refuses for its data or a limit
  (SQLSTATE classes 22 and 54) is a `StoreError` at once; its session stays in the pool.
- Migrations run under a transaction-scoped advisory lock: concurrent migrators leave one schema.
- A call's two commits are one statement each (data-modifying CTEs), prepared once per session
  and sent with their BEGIN and COMMIT in one message: one round trip per durable commit.

A little over 600 lines: the statements both dialects share live in `_sql`; what stays here
is what only PostgreSQL does (the pool, the clock, retries, locking claims).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import conninfo as _conninfo
from psycopg import errors as _errors
from psycopg import generators as _generators
from psycopg import pq
from psycopg_pool import ConnectionPool, PoolTimeout

from poimen._core.backoff import RECONNECT
from poimen._core.intents import Denial, Intent, IntentState, Owner
from poimen.errors import PoimenError, ReadOnlyStoreError, StoreError, StoreUnavailableError
from poimen.store._base import (
    INTENT_COLUMNS,
    NewDispatch,
    Problem,
    intent_from_row,
    migrations,
)
from poimen.store._chain import Stream
from poimen.store._dialect import POSTGRES
from poimen.store._sql import SqlStore
from poimen.store._statements import (
    Executor,
    Reader,
    Settlement,
    Sql,
    claim_params,
    dispatch_params,
    dispatched,
    too_new,
)

T = TypeVar("T")
S = IntentState
SQL = Sql(POSTGRES)
Cursor = psycopg.Cursor[Any]
Connection = psycopg.Connection[Any]
log = logging.getLogger("poimen.store.postgres")

# Connection-level failures worth another try: a dropped or terminated connection, a server
# restart, a serialization failure or deadlock (these roll the transaction back).
_TRANSIENT = (psycopg.OperationalError, PoolTimeout)
# Pools a forked child inherited: never used, never closed (see `PostgresStore.after_fork`).
_INHERITED: list[Any] = []
# SQLSTATE classes that judge the statement, not the connection: data exceptions (22) and
# program limits exceeded (54, e.g. an index row too large). psycopg raises class 54 as an
# OperationalError, but no retry can succeed and the session is sound.
_REFUSED = ("22", "54")
_ACTIVE = pq.TransactionStatus.ACTIVE
_IDLE = pq.TransactionStatus.IDLE
_FATAL = pq.ExecStatus.FATAL_ERROR
# Seconds the wall clock may run ahead of the monotonic one before the server is asked again.
_STALL = 1.0


def _refused(exc: BaseException) -> bool:
    return isinstance(exc, psycopg.Error) and (exc.sqlstate or "").startswith(_REFUSED)


def describe(url: str) -> str:
    """host:port/dbname of a URL, without credentials, for error messages."""
    try:
        info = _conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "<unparsable URL>"
    host = info.get("host") or "localhost"
    port = info.get("port") or "5432"
    return f"{host}:{port}/{info.get('dbname') or info.get('user') or ''}"


class PostgresStore(SqlStore):
    """An intent log in a PostgreSQL database, shared by any number of processes and hosts.

    `url` is a libpq URL (``postgresql://user@host:5432/db``); query parameters such as
    ``options=-csearch_path%3Dmyschema`` select a schema. Thread-safe. `readonly=True` never
    migrates, and its sessions are read-only (``default_transaction_read_only``): every
    write raises `ReadOnlyStoreError`.

    Args:
        url: The database, as above.
        migrate: Bring the schema to this poimen's version on opening (under an advisory
            lock, so processes may start at once); False only checks the version.
        min_size: Connections the pool opens at start.
        max_size: The most connections of this process; budget the server's
            ``max_connections`` for all processes.
        connect_timeout: Seconds to wait for a connection, at start and for each one.
        retry_for: Seconds a transaction is retried while the database is unreachable, before
            `StoreUnavailableError`.
        clock_refresh: Seconds between measurements of the server's clock, which leases are
            compared against (docs/postgres.md).
        application_name: The name the server shows for these sessions, unless `url` sets one.
        readonly: Read only, as above.
    """

    dialect = "postgres"
    _sql = SQL

    def _mark_pruning(self, ex: Any, on: bool) -> None:
        if on:  # transaction-local: gone at COMMIT or ROLLBACK
            ex.execute("SELECT set_config('poimen.pruning', 'on', true)", ())

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
        readonly: bool = False,
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
        self._readonly = readonly
        params: dict[str, Any] = {"autocommit": True}
        try:
            given = _conninfo.conninfo_to_dict(url)
        except psycopg.ProgrammingError as exc:
            raise StoreError(f"not a PostgreSQL URL: {exc}", url=url) from exc
        if "application_name" not in given:
            params["application_name"] = application_name
        if "connect_timeout" not in given:
            params["connect_timeout"] = max(1, round(connect_timeout))
        if readonly:
            params["options"] = f"{given.get('options', '')} -c default_transaction_read_only=on"
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
            self._clock = _measure_clock(probe)
        except psycopg.Error as exc:
            probe.close()
            raise StoreUnavailableError(
                f"PostgreSQL at {self._where} did not answer: {_first_line(exc)}",
                url=self._where,
            ) from exc
        probe.close()
        self._clock_next = time.monotonic() + clock_refresh
        self._clock_lock = threading.Lock()
        # Sessions that hold the call path's prepared statements.
        self._prepared: weakref.WeakKeyDictionary[psycopg.Connection[Any], set[str]] = (
            weakref.WeakKeyDictionary()
        )
        self._sizes = (min_size, max_size)
        self._pool_lock = threading.Lock()
        self._forked = False
        self._pool = self._open_pool()
        # Sessions lent by the pool and kept between uses: taking one is a `pop`, where
        # `getconn` and `putconn` were the biggest part of a commit's own Python. Any thread
        # takes any of them; `now()` gives them back to the pool every `clock_refresh` seconds,
        # so its lifetime and idle limits still apply.
        self._idle: list[psycopg.Connection[Any]] = []
        try:
            if migrate and not readonly:
                self.migrate()
            else:
                self._check_version()
        except BaseException:
            self.close()
            raise

    # Connections, transactions, retries.

    def _open_pool(self) -> ConnectionPool[psycopg.Connection[Any]]:
        min_size, max_size = self._sizes
        pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
            self.url,
            min_size=min_size,
            max_size=max_size,
            kwargs=self._params,
            open=False,
            timeout=self._connect_timeout,
            name="poimen",
        )
        try:
            pool.open(wait=min_size > 0, timeout=self._connect_timeout)
        except PoolTimeout as exc:
            pool.close()
            raise StoreUnavailableError(
                f"cannot open a connection pool to PostgreSQL at {self._where}", url=self._where
            ) from exc
        return pool

    def after_fork(self) -> None:
        """In a forked child: a pool of its own. The parent's sessions are never used here,
        nor closed (closing one would end the parent's session on the server): they are
        kept referenced for the life of the child."""
        _INHERITED.append((self._pool, self._idle))
        self._idle = []
        self._prepared = weakref.WeakKeyDictionary()
        self._clock_lock = threading.Lock()
        self._pool_lock = threading.Lock()
        self._forked = True  # the child's pool opens on its first use

    def _pool_open(self) -> ConnectionPool[psycopg.Connection[Any]]:
        if self._forked:
            with self._pool_lock:
                if self._forked:
                    self._pool = self._open_pool()
                    self._forked = False
        return self._pool

    def _run(
        self,
        what: str,
        fn: Callable[[Cursor, bool], T],
        *,
        transaction: bool = True,
        snapshot: bool = False,
        session: bool = False,
    ) -> T:
        """Run `fn` in one transaction; retry it while the database is unreachable.

        `fn(cur, retrying)` gets `retrying=True` on every try after a failed one, so it can
        recognise its own earlier commit whose answer the lost connection swallowed. With
        `transaction=False` statements run in autocommit: for reads, and for writes that bring
        their own BEGIN and COMMIT (`_one_trip`). `snapshot=True` reads in one read-only
        transaction whose statements all see the log as of its first one. `session=True` (with
        `transaction=False`) hands `fn` the connection instead of a cursor.
        """
        if self._closed:
            raise StoreUnavailableError("the store is closed")
        if self._readonly and not snapshot and (transaction or what in _ONE_TRIP_WRITES):
            raise ReadOnlyStoreError(
                f"{what}: the intent log at {self._where} was opened read-only",
                url=self._where,
            )
        deadline = time.monotonic() + self._retry_for
        n = 1  # the next wait is RECONNECT's n-th
        retrying = False
        while True:
            # Waiting for a connection counts against the same budget.
            wait = min(self._connect_timeout, max(0.05, deadline - time.monotonic()))
            try:
                with self._connection(wait, direct=retrying) as conn:
                    if transaction or snapshot:
                        with conn.transaction(), conn.cursor() as cur:
                            if snapshot:
                                cur.execute(_SNAPSHOT)
                            return fn(cur, retrying)
                    if session:
                        return fn(conn, retrying)  # type: ignore[arg-type]
                    with conn.cursor() as cur:
                        return fn(cur, retrying)
            except _TRANSIENT as exc:
                if _refused(exc):
                    raise StoreError(
                        f"{what} refused by PostgreSQL: {_first_line(exc)}",
                        operation=what,
                        sqlstate=getattr(exc, "sqlstate", None),
                    ) from exc
                if self._closed:
                    raise StoreUnavailableError("the store is closed") from exc
                if time.monotonic() + RECONNECT.cap(n) > deadline:
                    raise StoreUnavailableError(
                        f"{what}: PostgreSQL at {self._where} unreachable for "
                        f"{self._retry_for:g}s: {_first_line(exc)}",
                        url=self._where,
                        operation=what,
                    ) from exc
                delay = RECONNECT.delay(n)
                log.warning("%s: %s; retrying in %.2fs", what, _first_line(exc), delay)
                retrying = True
                time.sleep(delay)
                n += 1
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
        idle = self._idle
        try:
            conn = idle.pop()
        except IndexError:
            conn = self._pool_open().getconn(timeout=wait)
        try:
            # What `with conn:` does for a pooled session, without its commit()'s round of
            # psycopg's machinery when nothing is open (the common case: autocommit).
            try:
                yield conn
            except BaseException:
                if conn.pgconn.transaction_status != _IDLE:
                    with contextlib.suppress(psycopg.Error):
                        conn.rollback()
                raise
            if conn.pgconn.transaction_status != _IDLE:
                conn.commit()
        except psycopg.OperationalError as exc:
            # A terminated session can still look IDLE to the pool: close it, so the pool
            # replaces it instead of handing the dead socket to the next retry.
            if not _refused(exc):
                conn.close()
            raise
        finally:
            # Kept for the next use while sound and idle; anything else goes back to the pool,
            # which rolls back, or replaces a closed session.
            if conn.pgconn.transaction_status == _IDLE and not self._closed:
                idle.append(conn)
                if self._closed:  # closed meanwhile: `close` may have drained the list already
                    self._return_idle()
            else:
                self._pool.putconn(conn)

    def _return_idle(self) -> None:
        """Give the kept sessions back to the pool (which closes them once it is closed)."""
        while True:
            try:
                conn = self._idle.pop()
            except IndexError:
                return
            self._pool.putconn(conn)

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        def op(cur: Cursor, _retrying: bool) -> list[Any]:
            cur.execute(sql, params)
            return cur.fetchall()

        return self._run("read", op, transaction=False)

    def _snapshot(self, fn: Callable[[Reader], T]) -> T:
        def op(cur: Cursor, _retrying: bool) -> T:
            return fn(lambda sql, params=(): cur.execute(sql, params).fetchall())

        return self._run("read", op, snapshot=True)

    def _tx(self, what: str, fn: Callable[[Executor, bool], T]) -> T:
        return self._run(what, fn)

    @contextlib.contextmanager
    def _streaming(self) -> Iterator[Stream]:
        # One REPEATABLE READ transaction; each query a server-side cursor fetched in pages.
        if self._closed:
            raise StoreUnavailableError("the store is closed")
        names = itertools.count()

        try:
            with (
                self._connection(self._connect_timeout, direct=False) as conn,
                conn.transaction(),
            ):
                conn.execute(_SNAPSHOT)
                opened: list[psycopg.ServerCursor[Any]] = []

                def query(sql: str, params: Sequence[Any] = ()) -> Iterator[Any]:
                    cur = conn.cursor(name=f"poimen_stream_{next(names)}")
                    opened.append(cur)
                    cur.itersize = 2000
                    cur.execute(sql, params)
                    return iter(cur)

                try:
                    yield query
                finally:
                    for cur in opened:
                        cur.close()
        except (*_TRANSIENT, psycopg.Error) as exc:
            raise StoreError(f"read failed: {_first_line(exc)}", url=self._where) from exc

    def _prefix_match(self, prefix: str) -> tuple[str, tuple[Any, ...]]:
        return "starts_with(call_id, %s)", (prefix,)

    def _serialize(self, ex: Executor, key: str) -> None:
        # Until the transaction ends; a hash collision only serializes two unrelated calls.
        ex.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (key,))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._forked:
            self._return_idle()
            self._pool.close()

    def now(self) -> float:
        """The database server's clock: its last measurement plus the time elapsed since on
        this host's monotonic clock (no round trip). The wall clock is no part of it."""
        server, at, wall = self._clock
        mono = time.monotonic()
        # A monotonic clock that stood still while the wall clock went on (a suspended host)
        # is measured against the server again at once.
        due = mono >= self._clock_next or time.time() - wall - (mono - at) > _STALL
        if due and self._clock_lock.acquire(blocking=False):
            try:
                with self._connection(self._connect_timeout, direct=False) as conn:
                    self._clock = _measure_clock(conn)
            except (*_TRANSIENT, psycopg.Error) as exc:  # keep the last one, try again later
                log.warning("server clock not measured: %s", _first_line(exc))
                # ... and take the wall clock's jump as seen, or every call would ask again.
                self._clock = (server, at, time.time() - (time.monotonic() - at))
            finally:
                self._clock_next = time.monotonic() + self._clock_refresh
                self._clock_lock.release()
            self._return_idle()
            server, at, _ = self._clock
            mono = time.monotonic()
        return server + (mono - at)

    # Schema.

    def schema_version(self) -> int:
        def op(cur: Cursor, _retrying: bool) -> int:
            return _found_version(cur)

        return self._run("schema_version", op, transaction=False)

    def integrity(self, found: int) -> tuple[tuple[str, ...], list[Problem]]:
        return ("constraints", "triggers"), _problems(self, found)

    def server_facts(self) -> dict[str, Any]:
        out = {}
        for name in (
            "server_version",
            "synchronous_commit",
            "default_transaction_isolation",
            "TimeZone",
        ):
            out[name.lower()] = self._read(f"SHOW {name}")[0][0]
        out["current_schema"] = self._read("SELECT current_schema()")[0][0]
        return out

    def _check_version(self) -> None:
        known = migrations("postgres")[-1][0]
        found = self.schema_version()
        if found > known:
            raise too_new(self._where, found, known)

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
                raise too_new(self._where, found, known)
            for version, sql in steps:
                if version > found:
                    cur.execute(sql.encode("utf-8"))
                    cur.execute(
                        "INSERT INTO poimen_schema (version, applied_at) VALUES (%s, %s)",
                        (version, self.now()),
                    )
            return known

        return self._run("migrate", op)

    # The call path: each commit is one round trip (see `_one_trip`).

    def _one_trip(self, conn: Connection, name: str, params: Sequence[Any]) -> bool:
        """BEGIN, EXECUTE `name`, COMMIT in one simple-protocol message: one round trip per
        commit (the extended protocol takes one per statement). True if EXECUTE returned a row.

        Sent on the connection's libpq handle: psycopg's cursors (their adaptation, row makers
        and result sets) cost the call path three times its own Python (docs/performance.md).
        """
        pg = conn.pgconn
        prepare, head = _ONE_TRIP[name]
        done = self._prepared.setdefault(conn, set())
        for last in (False, True):
            if name not in done:  # once per session: a plan, not a parse, per call
                # Already there if an interrupt cut in between an earlier PREPARE and `add`.
                with contextlib.suppress(psycopg.errors.DuplicatePreparedStatement):
                    conn.execute(prepare)
                done.add(name)
            # Parameters are quoted here: a multi-statement message cannot carry them.
            encoding = conn.info.encoding
            args = ", ".join([_literal(p, pg, encoding) for p in params])
            message = f"{head}({args}); COMMIT".encode(encoding)
            with conn.lock:
                try:
                    pg.send_query(message)
                    results = conn.wait(_generators.execute(pg))
                finally:
                    # An interrupt between the send and the answer: finish sending, read the
                    # answer, so the session is not left with one pending (the commit lands or
                    # not, the caller was not told either way).
                    if pg.transaction_status == _ACTIVE:
                        conn.wait(_generators.execute(pg))
            failed = next((r for r in results if r.status == _FATAL), None)
            if failed is None:
                return bool(results[1].ntuples)
            # The EXECUTE failed inside its BEGIN, and the COMMIT never ran: undo the BEGIN.
            conn.execute("ROLLBACK")
            error = _errors.error_from_result(failed, encoding=conn.info.encoding)
            if isinstance(error, psycopg.errors.InvalidSqlStatementName) and not last:
                # The session lost its statements: psycopg sends DEALLOCATE ALL after a
                # rollback once it has prepared statements of its own (as DISCARD ALL does).
                done.clear()
                continue
            raise error
        raise AssertionError("unreachable")

    def record_dispatch(self, d: NewDispatch) -> tuple[Intent, bool]:
        if d.scope is not None:
            return self._record_scoped(d, None)
        params = dispatch_params(d)

        def op(conn: Connection, retrying: bool) -> tuple[Intent, bool]:
            if self._one_trip(conn, "dispatch", params):
                return dispatched(d), True  # the one row is the whole write
            # The call id exists: nothing was written.
            with conn.cursor() as cur:
                existing = _intent_where(cur, SQL.intent_by_call_id, "call_id", d.call_id)
            # Our own earlier try, committed before the connection dropped: still ours.
            return existing, retrying and existing.id == d.intent_id

        return self._run("record_dispatch", op, transaction=False, session=True)  # type: ignore[arg-type]

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
        shared = self._outcome_op(o)
        params = o.settle_params()

        def op(conn: Connection, retrying: bool) -> bool:
            if self._one_trip(conn, "settle", params):
                return True  # the happy path: the intent row holds the whole history
            # History in the tables (after a claim), our own earlier try, or a stale owner:
            # the shared write tells which and writes what each needs.
            with conn.transaction(), conn.cursor() as cur:
                return shared(cur, retrying)

        return self._run("record_outcome", op, transaction=False, session=True)  # type: ignore[arg-type]

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
                    it = self._intent_or_none(cur, intent_id)
                    if mine and it and it.state == S.DISPATCHED and it.fence == fence + 1:
                        return it
                return None
            self._spill(cur, intent_id)  # a claim opens the history tables
            cur.execute(
                "UPDATE intents SET fence = fence + 1, owner_id = %s, owner_host = %s, "
                "owner_pid = %s, owner_start = %s, lease_expires_at = %s, next_check_at = NULL, "
                "deadline_at = COALESCE(%s, deadline_at), attempts = attempts + %s, "
                f"updated_at = %s WHERE id = %s RETURNING {INTENT_COLUMNS}",
                claim_params(owner, lease_expires_at, deadline_at, new_attempt, now, intent_id),
            )
            row = cur.fetchone()
            assert row is not None  # the row is locked by us
            it = intent_from_row(row)
            self._claimed(cur, it, owner, new_attempt, now, nonce)
            return it

        return self._run("claim", op)

    def renew_leases(
        self, worker_id: str, intent_ids: Sequence[str], lease_expires_at: float, now: float
    ) -> int:
        if not intent_ids:
            return 0
        ids = sorted(intent_ids)  # one lock order for every renewer

        def op(cur: Cursor, _retrying: bool) -> int:
            cur.execute(
                SQL.renew.replace("id IN ", "id = ANY(%s)"),
                (lease_expires_at, lease_expires_at, worker_id, now, ids),
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
        context: Mapping[str, Any] | None = None,
    ) -> Intent:
        target = S.RESOLVED_LANDED if landed else S.RESOLVED_NOT_LANDED

        def op(cur: Cursor, retrying: bool) -> Intent:
            row = cur.execute(
                "SELECT state, result FROM intents WHERE id = %s FOR UPDATE", (intent_id,)
            ).fetchone()
            if row is not None and retrying and row[0] == target and row[1] == result:
                # Our decision already landed.
                return _intent_where(cur, SQL.intent_by_id, "id", intent_id)
            self._resolvable(intent_id, row, target)
            updated = cur.execute(_RESOLVE, (target.value, result, now, intent_id)).fetchone()
            assert updated is not None  # the row is locked by us
            self._resolved_event(
                cur, intent_id, target, landed, result, operator, reason, now, context
            )
            return intent_from_row(updated)

        return self._run("resolve", op)

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
            row = cur.execute(_INSERT_DENIAL, values).fetchone()
            assert row is not None
            return Denial(int(row[0]), *values)

        return self._run("record_denial", op)


def _literal(value: Any, pg: pq.abc.PGconn, encoding: str) -> str:
    """`value` as a SQL literal of unknown type, which the prepared statement's parameter
    types convert: a quoted text, a number's text, or NULL. A text with anything to escape
    goes through libpq's own quoting (`PQescapeLiteral`, which knows the session's encoding
    and `standard_conforming_strings`)."""
    if value is None:
        return "NULL"
    text = value if isinstance(value, str) else str(value)
    if "'" not in text and "\\" not in text and "\x00" not in text:
        return f"'{text}'"  # the common case: nothing to escape
    if "\x00" in text:
        raise psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")
    return pq.Escaping(pg).escape_literal(text.encode(encoding)).decode(encoding)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _measure_clock(conn: psycopg.Connection[Any]) -> tuple[float, float, float]:
    """The server's clock, and this host's monotonic and wall clocks at the same instant: the
    midpoint of the shortest of three round trips (the tightest estimate)."""
    best: tuple[float, float, float, float] | None = None
    for _ in range(3):
        w0, t0 = time.time(), time.monotonic()
        row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
        t1, w1 = time.monotonic(), time.time()
        assert row is not None
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, float(row[0]), (t0 + t1) / 2, (w0 + w1) / 2)
    if not conn.autocommit:
        conn.rollback()
    assert best is not None
    return best[1:]


def _found_version(cur: Cursor) -> int:
    row = cur.execute("SELECT to_regclass('poimen_schema') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return 0
    row = cur.execute("SELECT COALESCE(MAX(version), 0) FROM poimen_schema").fetchone()
    return int(row[0]) if row else 0


def _intent_where(cur: Cursor, sql: str, column: str, value: str) -> Intent:
    row = cur.execute(sql, (value,)).fetchone()
    if row is None:
        raise StoreError(f"intent with {column} {value!r} vanished mid-transaction")
    return intent_from_row(row)


_INSERT_EVENT = "INSERT INTO events (intent_id, at, kind, from_state, to_state, actor, detail)"
_EVENT = "%s, %s::float8, %s, %s, %s, %s, %s"  # the event's values, as `event_params` gives them
# The intent, whose row holds its attempt 1 and events (store/_inline.py), or nothing at all
# when the call id exists.
_DISPATCH = f"{SQL.insert_intent} RETURNING 1"
# The compare-and-set on the fence, for an intent whose row holds its whole history. It
# matches nothing for one whose history is in the tables (written before version 7, after a
# claim, or by a spill that committed while the settle waited for the row: the UPDATE reads
# the row's newest version again), and the shared write settles that one.
_SETTLE = f"{SQL.settle_inline} RETURNING 1"


def _prepared(name: str, sql: str) -> tuple[str, str]:
    """PREPARE for `sql` as ``poimen_<name>``, and the head of the one-trip message that
    executes it (its arguments and the COMMIT follow)."""
    parts = sql.split("%s")
    numbered = parts[0] + "".join(f"${n}{part}" for n, part in enumerate(parts[1:], 1))
    return f"PREPARE poimen_{name} AS {numbered}", f"BEGIN; EXECUTE poimen_{name}"


# Every statement of the transaction sees the snapshot its first one took.
_SNAPSHOT = "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY"
_ONE_TRIP_WRITES = frozenset({"record_dispatch", "record_outcome"})
_ONE_TRIP = {"dispatch": _prepared("dispatch", _DISPATCH), "settle": _prepared("settle", _SETTLE)}
_RESOLVE = f"{SQL.resolve} RETURNING {INTENT_COLUMNS}"
_INSERT_DENIAL = f"{SQL.insert_denial} RETURNING id"

# What the newest schema holds that the guarantees rest on (`poimen verify`): keys, the checks
# on states and classes, the links between rows, and the triggers that keep the history
# append-only and make the audit chain's links (schema version 10, docs/audit.md).
CONSTRAINTS = frozenset({
    "poimen_schema_pkey", "intents_pkey", "intents_call_id_key", "intents_effect_check",
    "intents_state_check", "attempts_pkey", "attempts_intent_id_fkey", "attempts_outcome_check",
    "events_pkey", "outbox_pkey", "outbox_delivery_id_key", "denials_pkey", "deliveries_pkey",
    "deliveries_notification_id_fkey",
})  # fmt: skip
TRIGGERS = frozenset({
    "events_append_only", "events_append_only_t", "denials_append_only", "denials_append_only_t",
    "audit_pruned_append_only", "audit_pruned_append_only_t",
})  # fmt: skip
CHAIN_TRIGGERS = frozenset({
    "events_chain", "denials_chain", "audit_pruned_chain", "intents_chain_settle",
})  # fmt: skip


def _problems(store: PostgresStore, found: int) -> list[Problem]:
    if found != migrations("postgres")[-1][0]:
        return []  # the lists below describe the newest schema
    out = []
    rows = store._read(
        "SELECT c.conname, c.convalidated FROM pg_constraint c "
        "JOIN pg_namespace n ON n.oid = c.connamespace WHERE n.nspname = current_schema()",
    )
    have = {str(name): bool(valid) for name, valid in rows}
    for name in sorted(CONSTRAINTS - have.keys()):
        out.append(Problem("constraints", f"the constraint {name} is missing"))
    for name in sorted(n for n in CONSTRAINTS & have.keys() if not have[n]):
        out.append(Problem("constraints", f"the constraint {name} is NOT VALID"))
    rows = store._read(
        "SELECT t.tgname, t.tgenabled FROM pg_trigger t JOIN pg_class r ON r.oid = t.tgrelid "
        "JOIN pg_namespace n ON n.oid = r.relnamespace "
        "WHERE n.nspname = current_schema() AND NOT t.tgisinternal",
    )
    triggers = {str(name): str(enabled) for name, enabled in rows}
    for what, names in (("append-only", TRIGGERS), ("audit chain", CHAIN_TRIGGERS)):
        for name in sorted(names - triggers.keys()):
            out.append(Problem("triggers", f"the {what} trigger {name} is missing"))
        for name in sorted(n for n in names & triggers.keys() if triggers[n] == "D"):
            out.append(Problem("triggers", f"the {what} trigger {name} is disabled"))
    return out
