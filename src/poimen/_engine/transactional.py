"""Transactional tools (docs/design.md §2): the tool's writes and a marker of its call commit
in one transaction of the application's database, so they land exactly once.

- `Database`: one registration's database: how a connection is opened (a URL, or the
  application's function), its dialect, whether it is the intent log's own database, and the
  marker table (``poimen_tx_markers``, made on first use or by ``poimen migrate
  --transactional URL``).
- `AttemptTx`: `ctx.tx` (`poimen._capability.tx.Tx`, the connection inside the transaction
  poimen opened; the tool cannot end it, and it is closed once the call is over) with
  poimen's side, `_finish`: after the tool returned, the transaction lands. On another database the
  marker row commits with the writes: an upsert on the intent id that is refused if another
  attempt landed, or if a lookup fenced this attempt out. On the log's own database the
  intent's outcome (a compare-and-set on its fence) commits with the writes instead.
- `Database.lookup`: recovery's question, which fences: it marks every attempt so far as
  never to land, unless one landed, and answers which. A "not landed" is then final: the
  retry that follows is the only attempt that can still land.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from poimen._capability.tx import Tx
from poimen._core.effects import Landed, LookupAnswer, NotLanded, Transactional, Unknown
from poimen._core.intents import Intent, IntentState
from poimen._core.keys import encode_value
from poimen._core.present import redact_store_url
from poimen._engine import crashpoints as _crashpoints
from poimen._engine.steps import Run
from poimen.errors import (
    NotSent,
    PoimenError,
    TransactionalDatabaseError,
)
from poimen.store._dialect import POSTGRES, SQLITE, same_log

if TYPE_CHECKING:
    from poimen.store import Store

Dialect = Literal["sqlite", "postgres"]

MARKERS = "poimen_tx_markers"
_CREATE = {
    "sqlite": (
        f"CREATE TABLE IF NOT EXISTS {MARKERS} (intent_id TEXT PRIMARY KEY, "
        "attempt INTEGER NOT NULL, landed INTEGER NOT NULL CHECK (landed IN (0, 1)), "
        "result TEXT, at REAL NOT NULL) WITHOUT ROWID"
    ),
    "postgres": (
        f"CREATE TABLE IF NOT EXISTS {MARKERS} (intent_id TEXT PRIMARY KEY, "
        "attempt INTEGER NOT NULL, landed SMALLINT NOT NULL CHECK (landed IN (0, 1)), "
        "result TEXT, at DOUBLE PRECISION NOT NULL)"
    ),
}
# Two makers of the table at once on PostgreSQL would collide in its catalogue: one waits.
_CREATE_LOCK = 0x706F696D656E7478  # "poimentx"
# An attempt's transaction lands its marker, unless an attempt landed already or a lookup
# fenced out the attempts up to this one (landed = 0, attempt >= this one).
_LAND = (
    f"INSERT INTO {MARKERS} (intent_id, attempt, landed, result, at) VALUES (?, ?, 1, ?, ?) "
    "ON CONFLICT (intent_id) DO UPDATE SET attempt = excluded.attempt, landed = 1, "
    "result = excluded.result, at = excluded.at "
    f"WHERE {MARKERS}.landed = 0 AND {MARKERS}.attempt < excluded.attempt"
)
# A lookup fences out the attempts up to `attempt`, unless one landed.
_FENCE = (
    f"INSERT INTO {MARKERS} (intent_id, attempt, landed, result, at) VALUES (?, ?, 0, NULL, ?) "
    "ON CONFLICT (intent_id) DO UPDATE SET attempt = excluded.attempt, at = excluded.at "
    f"WHERE {MARKERS}.landed = 0 AND {MARKERS}.attempt < excluded.attempt"
)
_READ = f"SELECT landed, result FROM {MARKERS} WHERE intent_id = ?"

# SQLite's authorizer codes (sqlite3.h): a tool may not end the transaction, nor attach
# another database file to write there.
_SQLITE_OK, _SQLITE_DENY, _SQLITE_TRANSACTION, _SQLITE_ATTACH = 0, 1, 22, 24


class _Session:
    """One connection to a Transactional database, and the transaction poimen runs on it."""

    __slots__ = ("conn", "dialect", "refused", "xid")

    def __init__(self, conn: Any, dialect: Dialect) -> None:
        self.conn = conn
        self.dialect = dialect
        self.xid: int | None = None  # PostgreSQL: the transaction poimen began
        self.refused: str | None = None  # SQLite: what the authorizer refused the tool

    def q(self, sql: str) -> str:
        return sql if self.dialect == "sqlite" else sql.replace("?", "%s")

    def execute(self, sql: str, params: Any = ()) -> Any:
        """A statement of poimen's (the store's own SQL on the log's database)."""
        return self.conn.execute(sql, params)

    def begin(self, timeout: float, *, lock_only: bool = False) -> None:
        """Open the transaction. SQLite: take the database's write lock now, so the attempt
        never fails on a snapshot another writer moved. PostgreSQL: no statement, lock wait or
        idle gap of it outlives the tool's timeout, and its id is kept, to tell whether the
        tool ended it."""
        ms = str(max(1, round(timeout * 1000)))
        if self.dialect == "sqlite":
            self.conn.execute("BEGIN IMMEDIATE")
            if not lock_only:
                self.conn.set_authorizer(self._authorize)
            return
        if lock_only:
            self.conn.execute("SELECT set_config('lock_timeout', %s, true)", (ms,))
            return
        row = self.conn.execute(
            "SELECT set_config('statement_timeout', %s, true), "
            "set_config('idle_in_transaction_session_timeout', %s, true), txid_current()",
            (ms, ms),
        ).fetchone()
        self.xid = int(row[2])

    def _authorize(self, action: int, arg1: str | None, *_: object) -> int:
        if action == _SQLITE_TRANSACTION:
            self.refused = f"{arg1 or 'end'} its transaction"
            return _SQLITE_DENY
        if action == _SQLITE_ATTACH:
            self.refused = f"attach {arg1 or 'a database'}"
            return _SQLITE_DENY
        return _SQLITE_OK

    def ended(self) -> bool:
        """Has the transaction poimen began ended (the tool committed or rolled it back)?"""
        if self.dialect == "sqlite":
            return not self.conn.in_transaction
        from psycopg.pq import TransactionStatus

        status = self.conn.info.transaction_status
        if status != TransactionStatus.INTRANS:
            return bool(status != TransactionStatus.INERROR)
        return int(self.conn.execute("SELECT txid_current()").fetchone()[0]) != self.xid

    def failed(self) -> bool:
        """PostgreSQL: a statement failed and the transaction can only roll back."""
        if self.dialect == "sqlite":
            return False
        from psycopg.pq import TransactionStatus

        return bool(self.conn.info.transaction_status == TransactionStatus.INERROR)

    def commit(self) -> None:
        if self.dialect == "sqlite":
            self.conn.set_authorizer(None)
            self.conn.execute("COMMIT")
        else:
            self.conn.commit()

    def rollback(self) -> None:
        """Roll back what is open; never raises (a dead connection rolled back with it)."""
        try:
            if self.dialect == "sqlite":
                self.conn.set_authorizer(None)
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
            else:
                self.conn.rollback()
        except Exception:  # the server rolls back what was never committed
            pass

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


class Database:
    """The database of one Transactional registration, as one kernel uses it."""

    def __init__(self, effects: Transactional, log_url: str) -> None:
        spec = effects.database
        self.spec = spec
        self.dialect: Dialect | None
        if isinstance(spec, str):
            self.shown = redact_store_url(spec)
            self.dialect = "sqlite" if SQLITE.opens(spec) else "postgres"
            self.own = same_database(spec, log_url)
        else:
            self.shown = f"{getattr(spec, '__qualname__', type(spec).__name__)}()"
            self.dialect = None  # known from the first connection it returns
            self.own = False
        self._ready = False  # the marker table exists

    def connect(self) -> _Session:
        """A new connection, outside any transaction. `NotSent` if none could be opened
        (nothing of a call can have happened), `TransactionalDatabaseError` if what opened is
        not a connection poimen can use."""
        try:
            conn = self._open() if isinstance(self.spec, str) else self.spec()
        except TransactionalDatabaseError:
            raise
        except Exception as exc:
            raise NotSent(
                f"cannot open the database {self.shown}: {type(exc).__name__}: {_line(exc)}"
            ) from exc
        s = _adopt(conn, self.shown)
        if self.dialect is None:
            self.dialect = s.dialect
        return s

    def _open(self) -> Any:
        assert isinstance(self.spec, str)
        if self.dialect == "sqlite":
            path = self.spec[len("sqlite:///") :]
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
            conn.execute("PRAGMA busy_timeout=30000")
            return conn
        try:
            import psycopg
        except ImportError as exc:
            raise TransactionalDatabaseError(
                f"the database {self.shown} is PostgreSQL, which needs the extra: "
                "pip install 'poimen[postgres]'",
                database=self.shown,
            ) from exc
        from psycopg import conninfo

        given = conninfo.conninfo_to_dict(self.spec)
        extra: dict[str, Any] = {} if "connect_timeout" in given else {"connect_timeout": 5}
        if "application_name" not in given:
            extra["application_name"] = "poimen-tx"
        return psycopg.connect(self.spec, autocommit=False, **extra)

    def ensure_markers(self, s: _Session) -> None:
        """Make the marker table if this process has not seen it yet."""
        if self.own or self._ready:
            return
        # Threads racing here both make it: IF NOT EXISTS, and on PostgreSQL one waits for
        # the other (no lock of this process's, which a fork could leave held).
        if s.dialect == "sqlite":
            s.conn.execute(_CREATE["sqlite"])  # one statement: its own transaction
        else:
            with s.conn.transaction():
                s.conn.execute("SELECT pg_advisory_xact_lock(%s)", (_CREATE_LOCK,))
                s.conn.execute(_CREATE["postgres"])
        self._ready = True

    def begin(self, intent: Intent, timeout: float, *, live: bool) -> AttemptTx:
        """Open the attempt's transaction: `NotSent` if the database cannot be reached or
        locked, so nothing can have happened."""
        s = self.connect()
        try:
            if live:  # a shadow attempt writes nothing at all, not even the marker table
                self.ensure_markers(s)
            s.begin(timeout)
        except Exception as exc:
            s.rollback()
            s.close()
            raise NotSent(
                f"cannot begin a transaction on {self.shown}: {type(exc).__name__}: {_line(exc)}"
            ) from exc
        return AttemptTx(self, s, intent, timeout, live)

    def lookup(self, intent: Intent, store: Store, timeout: float, *, live: bool) -> LookupAnswer:
        """Did an attempt of `intent` land? Fences first: from this answer on, none of its
        attempts so far can land, so "not landed" stays true until the next attempt."""
        if self.own:
            # The outcome commits with the writes: the intent row is the marker, and the
            # compare-and-set on its fence that acts on this answer is the fence.
            now = store.get_intent(intent.id)
            if now is not None and now.state == IntentState.COMPLETED:
                return Landed(_loads(now.result))
            return NotLanded()
        try:
            s = self.connect()
        except PoimenError as exc:
            return Unknown(str(exc)[:300])
        try:
            if not live:  # a sandbox kernel writes nothing: it only reads (its own always roll back)
                return self._peek(s, intent)
            self.ensure_markers(s)
            s.begin(timeout, lock_only=True)
            s.execute(s.q(_FENCE), (intent.id, intent.attempts, time.time()))
            row = s.execute(s.q(_READ), (intent.id,)).fetchone()
            s.commit()
        except Exception as exc:
            s.rollback()
            return Unknown(f"the marker table of {self.shown} did not answer: {_line(exc)}"[:300])
        finally:
            s.close()
        if row is not None and int(row[0]) == 1:
            return Landed(_loads(row[1]))
        return NotLanded()

    def _peek(self, s: _Session, intent: Intent) -> LookupAnswer:
        try:
            row = s.execute(s.q(_READ), (intent.id,)).fetchone()
        except Exception:  # no marker table: nothing ever landed here
            row = None
        s.rollback()
        if row is not None and int(row[0]) == 1:
            return Landed(_loads(row[1]))
        return NotLanded()

    def create_markers(self) -> None:
        """`poimen migrate --transactional URL`: the marker table, now."""
        s = self.connect()
        try:
            self._ready = False
            self.ensure_markers(s)
        finally:
            s.close()


def _adopt(conn: Any, shown: str) -> _Session:
    """A connection the database gave, ready for poimen to begin and end its transactions."""
    if isinstance(conn, sqlite3.Connection):
        if conn.in_transaction:
            conn.close()
            raise TransactionalDatabaseError(
                f"the database {shown} gave a sqlite3 connection inside a transaction: "
                "poimen begins the tool's transaction itself",
                database=shown,
            )
        if getattr(conn, "autocommit", None) is False:  # Python 3.12's PEP 249 mode
            conn.autocommit = True  # type: ignore[attr-defined,unused-ignore]
        else:
            conn.isolation_level = None  # no implicit BEGIN or COMMIT of the module's
        return _Session(conn, "sqlite")
    psycopg = _psycopg()
    if psycopg is not None and isinstance(conn, psycopg.Connection):
        from psycopg.pq import TransactionStatus

        if conn.info.transaction_status != TransactionStatus.IDLE:
            conn.close()
            raise TransactionalDatabaseError(
                f"the database {shown} gave a psycopg connection that is not idle "
                f"({conn.info.transaction_status.name}): poimen begins the tool's transaction "
                "itself",
                database=shown,
            )
        conn.autocommit = False
        return _Session(conn, "postgres")
    close = getattr(conn, "close", None)
    if callable(close):
        with contextlib.suppress(Exception):
            close()
    raise TransactionalDatabaseError(
        f"the database {shown} gave a {type(conn).__module__}.{type(conn).__qualname__}: a "
        "Transactional tool runs on a sqlite3 or a psycopg 3 connection",
        database=shown,
    )


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError:
        return None
    return psycopg


class AttemptTx(Tx):
    """`ctx.tx` as poimen holds it: the attempt's transaction, which it lands or rolls back
    once the tool returned."""

    __slots__ = ("_db",)
    _s: _Session

    def __init__(
        self, db: Database, s: _Session, intent: Intent, timeout: float, live: bool
    ) -> None:
        super().__init__(s, db.shown, intent, timeout, live)
        self._db = db

    def _finish(self, run: Run, store: Store) -> Run:
        """The tool's attempt is over with `run`: land its transaction if it completed,
        else roll it back; returns how the attempt ends."""
        with self._lock:
            aborted = self._done
            self._closed = self._closed or "the call has ended"
            self._done = True
        if aborted:
            if run.kind == "completed":  # the tool caught its denial and went on
                return Run("failed", error="a write of the tool was denied: its transaction "
                           "was rolled back, nothing written")
            return run
        if self._s.refused is not None:  # a mistake of the tool's, made again by any retry
            self._s.rollback()
            self._s.close()
            return Run("failed", error=f"the tool tried to {self._s.refused}: poimen ends a "
                       "Transactional tool's transaction itself; rolled back, nothing written")
        try:
            return self._land(run, store)
        finally:
            self._s.close()

    def _land(self, run: Run, store: Store) -> Run:
        s, it = self._s, self._intent
        if run.kind != "completed" or not self._live:
            s.rollback()  # a shadow attempt: what the tool answered, nothing committed
            return run
        try:
            ended = s.ended()
        except Exception as exc:  # the connection is gone: nothing committed
            s.rollback()
            return Run("unknown", error=f"the transaction was lost: {_line(exc)}")
        if ended:
            s.rollback()
            return Run(
                "indeterminate",
                reason="transaction_ended_by_tool",
                error="the tool ended its transaction itself: what it wrote before is "
                "committed without the call's marker",
            )
        if s.failed():
            s.rollback()
            return Run("unknown", error="the tool went on after a statement of its "
                       "transaction failed: rolled back, nothing written")
        spent = time.monotonic() - self._started
        if spent > self._timeout:
            s.rollback()
            return Run(
                "unknown",
                error=f"the transaction outlived the tool's timeout ({self._timeout:g}s, "
                f"{spent:.1f}s): rolled back, nothing written",
            )
        text, note = _result(run.value)
        crash = _at_commit(it.call_id)
        try:
            if self._db.own:
                if not store.commit_outcome_in(
                    s, it.id, it.fence, result=text, error=note, now=store.now(),
                    before_commit=crash,
                ):
                    return Run("unknown", error="the call was taken over before its "
                               "transaction committed: rolled back, nothing written")
                return Run("committed", value=run.value if text is None else json.loads(text))
            landed = s.execute(s.q(_LAND), (it.id, it.attempts, text, time.time())).rowcount
            if landed != 1:
                s.rollback()
                return self._refused(s)
            crash()
            s.commit()
        except Exception as exc:  # the commit's answer may be lost: the marker will say
            s.rollback()
            return Run("unknown", error=f"the transaction's commit failed: {_line(exc)}")
        return run

    def _refused(self, s: _Session) -> Run:
        """The marker refused this attempt: another landed (its result is the call's), or a
        lookup fenced this one out (rolled back; recovery decides what follows)."""
        row = s.execute(s.q(_READ), (self._intent.id,)).fetchone()
        if row is not None and int(row[0]) == 1:
            return Run("completed", value=_loads(row[1]))
        return Run("unknown", error="a lookup fenced this attempt out before it committed: "
                   "rolled back, nothing written")


def _at_commit(call_id: str) -> Callable[[], None]:
    return lambda: _crashpoints.hit("before_tx_commit", call_id)


def _result(value: Any) -> tuple[str | None, str | None]:
    """The result as recorded (the marker's and the log's), and what was lost if it does not
    encode: the write landed all the same."""
    try:
        return encode_value(value, "<result>"), None
    except PoimenError as exc:
        return None, f"result not recorded: {exc}"


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def same_database(url: str, log_url: str) -> bool:
    """Does `url` name the intent log's own database? Only then does the outcome commit with
    the tool's writes; two spellings of one database are taken as two (one more commit)."""
    if SQLITE.opens(url) and SQLITE.opens(log_url):
        return same_log(url, log_url)
    if POSTGRES.opens(url) and POSTGRES.opens(log_url):
        try:
            from psycopg import conninfo

            return conninfo.conninfo_to_dict(url) == conninfo.conninfo_to_dict(log_url)
        except Exception:
            return False
    return False
