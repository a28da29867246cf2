"""The embedded default store: SQLite in WAL mode, synchronous=FULL, one writer with group commit.

About 800 lines: the merged writes of a batch (dispatches, outcomes, claims) sit beside the
store methods whose statements they merge, so the two are changed together; the writer itself
is `_group_commit`, the statements both dialects share `_sql`, `poimen verify`'s checks of a
SQLite log `_sqlite_checks`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from poimen._core.audit import sqlite_link
from poimen._core.intents import Denial, Intent, IntentState, Owner
from poimen.errors import ReadOnlyStoreError, StoreError, StoreUnavailableError
from poimen.store import _sqlite_checks
from poimen.store._base import INTENT_COLUMNS, NewDispatch, Problem, intent_from_row, migrations
from poimen.store._chain import Stream
from poimen.store._dialect import SQLITE
from poimen.store._fs import refuse_network_fs, sqlite_writes
from poimen.store._group_commit import GroupCommit, Op
from poimen.store._inline import attempt_row, event_row, inline_attempt, inline_events
from poimen.store._sql import SqlStore
from poimen.store._statements import (
    Executor,
    Reader,
    Settlement,
    Sql,
    claim_event_params,
    claim_params,
    dispatch_params,
    retry_attempt_params,
    too_new,
)
from poimen.store._statements import dispatched as _dispatched
from poimen.store._statements import stored_owner as _stored

T = TypeVar("T")
S = IntentState
SQL = Sql(SQLITE)
log = logging.getLogger("poimen")
SYNCHRONOUS = ("OFF", "NORMAL", "FULL", "EXTRA")
# Connections a forked child inherited: never used, never closed (see `after_fork`).
_INHERITED: list[sqlite3.Connection] = []


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


def _many(conn: sqlite3.Connection, template: str, rows: list[tuple[Any, ...]]) -> Any:
    """One statement for many rows: `template`'s ``{values}`` becomes a tuple per row."""
    one = "(" + ",".join("?" * len(rows[0])) + ")"
    sql = template.format(values=",".join([one] * len(rows)))
    return conn.execute(sql, [p for row in rows for p in row])


class _MergeMismatch(Exception):
    """A merged write changed another number of rows than its check foresaw."""


def _expect(cur: Any, rows: int) -> None:
    if cur.rowcount != rows:
        raise _MergeMismatch(f"a merged write changed {cur.rowcount} rows, not {rows}")


def _merge_dispatches(conn: sqlite3.Connection, ops: list[Op[Any]]) -> None:
    """First dispatch commits of many calls in two statements. A call id already in the log
    or twice in the batch is left to its op, which reads the recorded intent.

    The check reads nothing in the usual case: one step of the statement, where RETURNING
    would take one per row, and each step hands the GIL to the callers' threads and has to
    win it back."""
    ds: list[NewDispatch] = [op.payload for op in ops]
    seen = {r[0] for r in _many(conn, _KNOWN_CALL_IDS, [(d.call_id,) for d in ds])}
    new: list[tuple[Op[Any], NewDispatch]] = []
    for op, d in zip(ops, ds, strict=True):
        if d.call_id not in seen:
            seen.add(d.call_id)
            new.append((op, d))
    if not new:
        return
    _expect(_many(conn, _INSERT_INTENTS, [dispatch_params(d) for _, d in new]), len(new))
    for op, d in new:
        op.value = (_dispatched(d), True)


def _merge_outcomes(conn: sqlite3.Connection, ops: list[Op[Any]]) -> None:
    """Outcome commits of many calls in two statements (four if some intent's history is in
    the tables already), each on its attempt's fence. An outcome whose fence is stale (or
    whose intent is missing or settled) is left to its op, which keeps it as evidence; so is
    one intent's second outcome in the batch."""
    outs: list[Settlement] = [op.payload for op in ops]
    odd = _many(conn, _UNSETTLEABLE, [(o.intent_id, o.fence) for o in outs]).fetchall()
    stale = {r[0] for r in odd if r[1]}
    spilled = {r[0] for r in odd if not r[1]}  # settled as before version 7
    done: list[tuple[Op[Any], Settlement]] = []
    for op, o in zip(ops, outs, strict=True):
        if o.intent_id not in stale:
            stale.add(o.intent_id)
            done.append((op, o))
    if not done:
        return
    _expect(_many(conn, _SETTLE_MANY, [o.settle_params() for _, o in done]), len(done))
    tables = [o for _, o in done if o.intent_id in spilled]
    if tables:
        _many(conn, _END_ATTEMPTS, [o.end_attempt_params() for o in tables])
        _many(conn, _INSERT_EVENTS, [o.event_params() for o in tables])
    for op, _ in done:
        op.value = True


def _merge_claims(conn: sqlite3.Connection, ops: list[Op[Any]]) -> None:
    """Claims of many intents (a recovery pass drives a page side by side) in a few
    statements: read them, take those still on the claimed fence, spill the history of those
    whose history is in their row (store/_inline.py), open their attempts, write their
    events. The claimed intent is the row read, changed as the claim changed it."""
    claims: dict[str, tuple[Op[Any], _Claim]] = {}
    for op in ops:
        c: _Claim = op.payload
        claims.setdefault(c.intent_id, (op, c))  # one intent twice: the later op decides alone
    found: dict[str, tuple[Intent, bool]] = {
        str(r[0]): (intent_from_row(r), bool(r[-1]))
        for r in _many(conn, _READ_INTENTS, [(i,) for i in claims])
    }
    taken: list[tuple[Op[Any], _Claim, Intent]] = []
    inline: list[Intent] = []
    for op, c in claims.values():
        it, in_row = found.get(c.intent_id, (None, False))
        if it is None or it.state != S.DISPATCHED or it.fence != c.fence:
            op.value = None  # the compare-and-set on the fence would change nothing
        else:
            taken.append((op, c, _after_claim(it, c)))
            if in_row:
                inline.append(it)
    if not taken:
        return
    if inline:  # first, as if these rows had been written at dispatch
        _many(conn, _INSERT_SPILLED_ATTEMPTS, [attempt_row(inline_attempt(it)) for it in inline])
        _many(conn, _INSERT_EVENTS, [event_row(e) for it in inline for e in inline_events(it)])
    rows = [
        (
            *claim_params(
                c.owner, c.lease_expires_at, c.deadline_at, c.new_attempt, c.now, c.intent_id
            ),
            c.fence,
        )
        for _, c, _ in taken
    ]
    _expect(_many(conn, _CLAIM_MANY, rows), len(taken))
    retries = [retry_attempt_params(it, c.owner, c.now) for _, c, it in taken if c.new_attempt]
    if retries:
        _many(conn, _INSERT_RETRY_ATTEMPTS, retries)
    _many(
        conn,
        _INSERT_EVENTS,
        [claim_event_params(it, c.owner, c.new_attempt, c.now, None) for _, c, it in taken],
    )
    for op, _, it in taken:
        op.value = it


def _after_claim(it: Intent, c: _Claim) -> Intent:
    """The row `it` as the claim `c` leaves it, as reading it back would decode it."""
    return dataclasses.replace(
        it,
        fence=it.fence + 1,
        owner=_stored(c.owner),
        lease_expires_at=float(c.lease_expires_at),
        next_check_at=None,
        deadline_at=it.deadline_at if c.deadline_at is None else float(c.deadline_at),
        attempts=it.attempts + (1 if c.new_attempt else 0),
        updated_at=float(c.now),
    )


class _Claim(NamedTuple):
    intent_id: str
    fence: int
    owner: Owner
    lease_expires_at: float
    new_attempt: bool
    deadline_at: float | None
    now: float


_KNOWN_CALL_IDS = "SELECT call_id FROM intents WHERE call_id IN (VALUES {values})"
_INSERT_INTENTS = (
    "INSERT INTO intents (id, call_id, tool_id, effect, args, args_hash, key, request_id, "
    "owner_id, owner_host, owner_pid, owner_start, lease_expires_at, timeout_s, deadline_at, "
    "created_at, updated_at, state, fence, unknown_count, attempts, inline_history) "
    "SELECT *, 'DISPATCHED', 1, 0, 1, 1 FROM (VALUES {values})"
)
_INSERT_EVENTS = (
    "INSERT INTO events (intent_id, at, kind, from_state, to_state, actor, detail) VALUES {values}"
)
# The outcomes that are not the happy path's: (intent id, 1) if it cannot settle, (intent id,
# 0) if its history is in the tables. Empty in the usual case.
_UNSETTLEABLE = (
    "SELECT v.column1, intents.id IS NULL OR intents.state != 'DISPATCHED' "
    "OR intents.fence != v.column2 FROM (VALUES {values}) AS v "
    "LEFT JOIN intents ON intents.id = v.column1 "
    "WHERE intents.id IS NULL OR intents.state != 'DISPATCHED' OR intents.fence != v.column2 "
    "OR intents.inline_history = 0"
)
# Merged statements take each row's values in the order of the single statement's parameters
# (`Settlement.settle_params`, `claim_params`, `Settlement.end_attempt_params`).
_SETTLE_MANY = (
    "UPDATE intents SET state = v.column1, result = v.column2, error = v.column3, "
    "lease_expires_at = NULL, next_check_at = NULL, updated_at = v.column4 "
    "FROM (VALUES {values}) AS v "
    "WHERE intents.id = v.column5 AND intents.fence = v.column6 "
    "AND intents.state = 'DISPATCHED'"
)
_READ_INTENTS = (
    f"SELECT {INTENT_COLUMNS}, inline_history FROM intents WHERE id IN (VALUES {{values}})"
)
_CLAIM_MANY = (
    "UPDATE intents SET fence = fence + 1, owner_id = v.column1, owner_host = v.column2, "
    "owner_pid = v.column3, owner_start = v.column4, lease_expires_at = v.column5, "
    "next_check_at = NULL, deadline_at = COALESCE(v.column6, deadline_at), "
    "attempts = attempts + v.column7, updated_at = v.column8, inline_history = 0 "
    "FROM (VALUES {values}) AS v "
    "WHERE intents.id = v.column9 AND intents.fence = v.column10 "
    "AND intents.state = 'DISPATCHED'"
)
_INSERT_SPILLED_ATTEMPTS = (
    "INSERT INTO attempts (intent_id, number, fence, owner_id, owner_host, owner_pid, "
    "owner_start, started_at, ended_at, outcome, result, error) VALUES {values}"
)
_INSERT_RETRY_ATTEMPTS = (
    "INSERT INTO attempts (intent_id, number, fence, owner_id, owner_host, owner_pid, "
    "owner_start, started_at) VALUES {values}"
)
_END_ATTEMPTS = (
    "UPDATE attempts SET ended_at = v.column1, outcome = v.column2, result = v.column3, "
    "error = v.column4 FROM (VALUES {values}) AS v "
    "WHERE attempts.intent_id = v.column5 AND attempts.fence = v.column6"
)


class SqliteStore(SqlStore):
    """A SQLite intent log at `path`. Thread-safe; several processes may share the file.

    Writes go through one connection (group commit); reads borrow one of at most `readers`
    connections for the length of one statement, however many threads read.
    `readonly=True` opens it for reading only (``mode=ro``): no migration, no switch to WAL,
    no writer, and every write raises `ReadOnlyStoreError`; the file is never changed.
    A log on a network or FUSE filesystem is refused (`NetworkFilesystemError`) unless
    `allow_network_fs` or ``POIMEN_ALLOW_NETWORK_FS=1`` (docs/platforms.md).

    Args:
        path: The log's file (``sqlite:///path`` names it in a URL); made if missing.
        synchronous: SQLite's ``synchronous`` setting: ``FULL`` (default) makes every commit
            durable on disk before a call goes on; ``NORMAL`` or ``OFF`` may lose the latest
            commits when the machine (not only the process) stops.
        migrate: Bring the schema to this poimen's version on opening; False only checks the
            version and changes nothing.
        readonly: Open for reading only, as above.
        readers: The most connections that read at once.
        allow_network_fs: Open a log on a network or FUSE filesystem anyway.
    """

    dialect = "sqlite"
    _sql = SQL

    def __init__(
        self,
        path: str | Path,
        *,
        synchronous: str = "FULL",
        migrate: bool = True,
        readonly: bool = False,
        readers: int = 8,
        allow_network_fs: bool = False,
    ) -> None:
        if not sqlite_writes(str(path)):
            url = f"sqlite:///{path}"
            raise StoreError(
                f"{url!r} opens no file SQLite writes (an in-memory, temporary or read-only "
                "database): an intent log there is never saved, and each connection would see "
                "its own; use a file, e.g. sqlite:///path/to/intents.db",
                url=url,
            )
        if synchronous.upper() not in SYNCHRONOUS:
            raise StoreError(f"synchronous must be one of {SYNCHRONOUS}, not {synchronous!r}")
        if isinstance(readers, bool) or not isinstance(readers, int) or readers < 1:
            raise StoreError(f"readers must be a whole number >= 1, not {readers!r}")
        refuse_network_fs(str(path), allow=allow_network_fs)
        self.path = str(path)
        self.url = f"sqlite:///{self.path}"
        self._synchronous = synchronous.upper()
        self._closed = False
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        lock = threading.Lock()
        self._reads = threading.Condition(lock)  # no read running, waited for by close()
        self._free = threading.Condition(lock)  # a reader connection came back
        self._reading = 0
        self._idle: list[sqlite3.Connection] = []  # reader connections not in use
        self._readers = 0  # reader connections open, in use or idle
        self._max_readers = readers
        self._readonly = readonly
        self._writer = None if readonly else GroupCommit(self._connect(writer=True))
        self._writer_lock = threading.Lock()
        self._forked = False
        if migrate and not readonly:
            self.migrate()
        else:
            self._check_version()

    # Connections.

    def _connect(self, *, writer: bool = False) -> sqlite3.Connection:
        try:
            conn = self._open_ro() if self._readonly else self._open(self.path, uri=False)
            if writer:  # WAL is a property of the file: the writer sets it, readers find it
                _set_wal(conn)
                # The audit chain's triggers link each history row with it (schema 10).
                conn.create_function("poimen_link", -1, sqlite_link)
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

    @staticmethod
    def _open(target: str, *, uri: bool) -> sqlite3.Connection:
        return sqlite3.connect(
            target,
            uri=uri,
            isolation_level=None,
            check_same_thread=False,
            timeout=30.0,
            # A merged write's text varies with its batch size: keep them all prepared.
            cached_statements=512,
        )

    def _open_ro(self) -> sqlite3.Connection:
        if not Path(self.path).is_file():  # mode=ro never creates it, but say so plainly
            raise sqlite3.OperationalError("no such file")
        base = Path(self.path).absolute().as_uri()
        conn = self._open(f"{base}?mode=ro", uri=True)
        try:
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            return conn
        except sqlite3.OperationalError:
            conn.close()
            # A WAL-mode log in a folder we cannot write: SQLite cannot make its shared-memory
            # file. With no write-ahead log beside it, no writer has anything unmerged: the
            # file alone is the log, and SQLite may read it as it stands.
            if Path(self.path + "-wal").exists():
                raise
        return self._open(f"{base}?mode=ro&immutable=1", uri=True)

    def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return self._writer_open().run(fn)

    def _tx(self, what: str, fn: Callable[[Executor, bool], T]) -> T:
        # One try only: SQLite has no lost connection, so `retrying` is always False.
        return self._write(lambda conn: fn(conn, False))

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[Any]:
        with self._reader() as conn:
            return conn.execute(sql, params).fetchall()

    def _snapshot(self, fn: Callable[[Reader], T]) -> T:
        # A deferred BEGIN: the first read fixes the snapshot (WAL), the writer goes on.
        with self._reader() as conn:
            conn.execute("BEGIN")
            try:
                return fn(lambda sql, params=(): conn.execute(sql, params).fetchall())
            finally:
                if conn.in_transaction:  # an error may have ended it already
                    conn.execute("ROLLBACK")

    @contextlib.contextmanager
    def _streaming(self) -> Iterator[Stream]:
        # One read transaction: every query of the block sees one snapshot, its rows fetched
        # as they are read (several cursors of one connection may step side by side).
        with self._reader() as conn:
            conn.execute("BEGIN")  # the first read fixes the snapshot

            def query(sql: str, params: Sequence[Any] = ()) -> Iterator[Any]:
                return iter(conn.execute(sql, params))

            try:
                yield query
            finally:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")

    @contextlib.contextmanager
    def _reader(self) -> Iterator[sqlite3.Connection]:
        """A reader connection of the pool, for this thread until the block ends."""
        conn: sqlite3.Connection | None = None
        counted = opening = False
        try:
            with self._reads:
                while not (self._closed or self._idle or self._readers < self._max_readers):
                    self._free.wait()
                if self._closed:
                    raise StoreUnavailableError("the store is closed")
                # No call between taking a connection (or a slot) and noting it: a signal's
                # exception can land only at a call, and the `finally` gives back what is noted.
                self._reading += 1
                counted = True
                if self._idle:
                    conn = self._idle[-1]
                    del self._idle[-1]
                else:
                    self._readers += 1
                    opening = True
            if conn is None:
                conn = self._connect()
            elif conn.in_transaction:
                # A snapshot an interrupt cut short came back open: a read must see the log
                # as it is now, not as it was then.
                conn.execute("ROLLBACK")
            yield conn
        except sqlite3.Error as exc:
            raise StoreError(f"read failed: {exc}") from exc
        finally:
            if counted:
                with self._reads:
                    self._reading -= 1
                    if conn is not None:
                        self._idle += [conn]
                    elif opening:  # it never opened
                        self._readers -= 1
                    self._free.notify()
                    if not self._reading:
                        self._reads.notify_all()

    def close(self) -> None:
        self._closed = True
        # A connection closed under a running statement can crash the interpreter: wait for
        # the writes already accepted.
        drained = self._forked or self._writer is None or self._writer.stop(within=30.0)
        with self._reads:  # reads are short: wait for those running
            self._free.notify_all()  # readers waiting for a connection give up
            self._reads.wait_for(lambda: not self._reading, 30.0)
        with self._conns_lock:
            conns, self._conns = self._conns, []
        if not drained and self._writer is not None:
            log.warning("SQLite store %s closed with a write still running", self.path)
            conns = [c for c in conns if c is not self._writer._conn]
        for c in conns:
            with contextlib.suppress(sqlite3.Error):
                c.close()

    def now(self) -> float:
        return time.time()

    def after_fork(self) -> None:
        """In a forked child: connections of its own. The parent's are never used here, nor
        closed: closing the last connection of a WAL log checkpoints it and may delete the
        WAL under the parent. They stay referenced for the life of the child."""
        _INHERITED.extend(self._conns)
        self._conns = []
        self._conns_lock = threading.Lock()
        lock = threading.Lock()
        self._reads = threading.Condition(lock)
        self._free = threading.Condition(lock)
        self._reading = 0
        self._idle = []
        self._readers = 0
        self._writer_lock = threading.Lock()
        self._forked = True  # the child's writer connection opens on its first write

    # Schema.

    def schema_version(self) -> int:
        rows = self._read(
            "SELECT name FROM sqlite_master WHERE type='table' AND name='poimen_schema'"
        )
        if not rows:
            return 0
        return int(self._read("SELECT COALESCE(MAX(version), 0) FROM poimen_schema")[0][0])

    def integrity(self, found: int) -> tuple[tuple[str, ...], list[Problem]]:
        return _sqlite_checks.CHECKS, _sqlite_checks.problems(self, found)

    def server_facts(self) -> dict[str, Any]:
        return _sqlite_checks.facts(self)

    def _check_version(self) -> None:
        known = migrations("sqlite")[-1][0]
        found = self.schema_version()
        if found > known:
            raise too_new(repr(self.path), found, known)
        # poimen makes no views: one in a log (a recursive one never ends) is not poimen's.
        views = [str(r[0]) for r in self._read("SELECT name FROM sqlite_master WHERE type='view'")]
        if views:
            raise StoreError(
                f"{self.path!r} is not an intent log as poimen writes it: it holds the view "
                f"{views[0][:100]!r} (poimen makes none); nothing was read from it",
                path=self.path,
                view=views[0][:100],
            )

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
                    try:
                        for stmt in _statements(sql):
                            conn.execute(stmt)
                    except sqlite3.Error as exc:  # the transaction is undone: the log unchanged
                        raise StoreError(
                            f"migrating the intent log at {self.path!r} to schema version "
                            f"{version} failed, nothing was changed: {exc}",
                            path=self.path,
                        ) from exc
                    conn.execute(
                        "INSERT INTO poimen_schema (version, applied_at) VALUES (?, ?)",
                        (version, time.time()),
                    )
            return known

        return self._write(apply)

    # The call path.

    def record_dispatch(self, d: NewDispatch) -> tuple[Intent, bool]:
        if d.scope is not None:
            return self._record_scoped(d, None)
        return self._writer_open().run(self._dispatch_op(d), _merge_dispatches, d)

    def arecord_dispatch(self, d: NewDispatch) -> asyncio.Future[tuple[Intent, bool]]:
        """`record_dispatch` for a caller on an event loop, without a thread of its own."""
        if d.scope is not None:
            op = self._scoped_op(d, None)
            return self._writer_open().submit(lambda conn: op(conn, False))
        return self._writer_open().submit(self._dispatch_op(d), _merge_dispatches, d)

    def _dispatch_op(self, d: NewDispatch) -> Callable[[sqlite3.Connection], tuple[Intent, bool]]:
        def op(conn: sqlite3.Connection) -> tuple[Intent, bool]:
            cur = conn.execute(SQL.insert_intent, dispatch_params(d))
            if cur.rowcount == 0:
                row = conn.execute(SQL.intent_by_call_id, (d.call_id,)).fetchone()
                return intent_from_row(row), False
            return _dispatched(d), True  # the one row is the whole write

        return op

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
        out = Settlement(intent_id, fence, state, result, error, now)
        return self._writer_open().run(self._settle_op(out), _merge_outcomes, out)

    def arecord_outcome(
        self,
        intent_id: str,
        fence: int,
        state: IntentState,
        *,
        result: str | None,
        error: str | None,
        now: float,
    ) -> asyncio.Future[bool]:
        """`record_outcome` for a caller on an event loop, without a thread of its own."""
        out = Settlement(intent_id, fence, state, result, error, now)
        return self._writer_open().submit(self._settle_op(out), _merge_outcomes, out)

    def _settle_op(self, o: Settlement) -> Callable[[sqlite3.Connection], bool]:
        fn = self._outcome_op(o)
        return lambda conn: fn(conn, False)

    def _linking(self, conn: Any) -> None:
        raw = getattr(conn, "conn", conn)  # a Transactional tool's session, or its connection
        raw.create_function("poimen_link", -1, sqlite_link)

    def _writer_open(self) -> GroupCommit:
        if self._closed:
            raise StoreUnavailableError("the store is closed")
        if self._readonly:
            raise ReadOnlyStoreError(
                f"the intent log at {self.path!r} was opened read-only", path=self.path
            )
        if self._forked:
            with self._writer_lock:
                if self._forked:
                    self._writer = GroupCommit(self._connect(writer=True))
                    self._forked = False
        assert self._writer is not None
        return self._writer

    def _prefix_match(self, prefix: str) -> tuple[str, tuple[Any, ...]]:
        # The range lets the call_id index find the rows; substr keeps the answer exact.
        exact = "substr(call_id, 1, ?) = ?"
        end = prefix_end(prefix)
        if end is None:  # only U+10FFFF: nothing sorts after the prefix's call ids
            return f"call_id >= ? AND {exact}", (prefix, len(prefix), prefix)
        return f"call_id >= ? AND call_id < ? AND {exact}", (prefix, end, len(prefix), prefix)

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
            self._spill(conn, intent_id)  # a claim opens the history tables
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

        payload = _Claim(intent_id, fence, owner, lease_expires_at, new_attempt, deadline_at, now)
        return self._writer_open().run(op, _merge_claims, payload)

    def renew_leases(
        self, worker_id: str, intent_ids: Sequence[str], lease_expires_at: float, now: float
    ) -> int:
        if not intent_ids:
            return 0
        ids = list(intent_ids)

        def op(conn: sqlite3.Connection) -> int:
            n = 0
            for i in range(0, len(ids), 500):
                chunk = ids[i : i + 500]
                cur = conn.execute(
                    SQL.renew + f"({','.join('?' * len(chunk))})",
                    (lease_expires_at, lease_expires_at, worker_id, now, *chunk),
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
        context: Mapping[str, Any] | None = None,
    ) -> Intent:
        target = S.RESOLVED_LANDED if landed else S.RESOLVED_NOT_LANDED

        def op(conn: sqlite3.Connection) -> Intent:
            row = conn.execute("SELECT state FROM intents WHERE id = ?", (intent_id,)).fetchone()
            self._resolvable(intent_id, row, target)
            conn.execute(SQL.resolve, (target.value, result, now, intent_id))
            self._resolved_event(
                conn, intent_id, target, landed, result, operator, reason, now, context
            )
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


def prefix_end(prefix: str) -> str | None:
    """The least text above every text that starts with `prefix` (SQLite compares UTF-8
    bytes, in code point order), or None when there is none (the prefix is all U+10FFFF)."""
    head = prefix.rstrip("\U0010ffff")
    if not head:
        return None
    n = ord(head[-1]) + 1
    return head[:-1] + chr(0xE000 if n == 0xD800 else n)  # surrogates are not text


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
