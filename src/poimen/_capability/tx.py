"""`ctx.tx`: what a Transactional tool holds of the transaction poimen opened for its attempt
(docs/transactional.md). poimen's side, which lands or rolls it back, is
`poimen._engine.transactional`."""

from __future__ import annotations

import threading
import time
from typing import Any, NoReturn, Protocol

from poimen._core.intents import Intent
from poimen.errors import TransactionControlError


class Session(Protocol):
    """The connection poimen opened, as the tool's side uses it."""

    @property
    def conn(self) -> Any: ...

    @property
    def dialect(self) -> str: ...

    def rollback(self) -> None: ...

    def close(self) -> None: ...


class Tx:
    """`ctx.tx`: a DB-API connection inside the transaction poimen opened for this attempt.

    Run statements with `execute`, `executemany` or a `cursor()`; placeholders are the
    driver's (`paramstyle`: ``qmark`` for sqlite3, ``format`` for psycopg). poimen commits the
    transaction, with the call's marker, after the tool returns; `commit`, `rollback` and
    `close` raise `TransactionControlError`, and every use after the call has ended too.
    """

    __slots__ = ("_closed", "_done", "_intent", "_live", "_lock", "_s", "_shown", "_started",
                 "_timeout", "tool_id")

    def __init__(
        self, s: Session, shown: str, intent: Intent, timeout: float, live: bool
    ) -> None:
        self._s = s
        self._shown = shown  # the database, its password redacted
        self._intent = intent
        self._timeout = timeout
        self._live = live
        self._started = time.monotonic()
        self._closed: str | None = None  # why the tool may not use it any more
        self._done = False  # poimen has ended the transaction
        self._lock = threading.Lock()
        self.tool_id = intent.tool_id

    @property
    def dialect(self) -> str:
        """``"sqlite"`` or ``"postgresql"``."""
        return "sqlite" if self._s.dialect == "sqlite" else "postgresql"

    @property
    def paramstyle(self) -> str:
        """The driver's placeholders: ``"qmark"`` (``?``) or ``"format"`` (``%s``)."""
        return "qmark" if self._s.dialect == "sqlite" else "format"

    def _usable(self) -> Any:
        why = self._closed
        if why is not None:
            raise TransactionControlError(
                f"ctx.tx of tool {self.tool_id!r} (intent {self._intent.id}, attempt "
                f"{self._intent.attempts}) is closed: {why}",
                tool_id=self.tool_id,
                intent_id=self._intent.id,
                action="use",
            )
        return self._s.conn

    def cursor(self) -> TxCursor:
        """A cursor of the transaction."""
        return TxCursor(self, self._usable().cursor())

    def execute(self, sql: str, params: Any = None) -> TxCursor:
        """Run one statement; returns its cursor."""
        cur = self.cursor()
        cur.execute(sql, params)
        return cur

    def executemany(self, sql: str, seq_of_params: Any) -> TxCursor:
        """Run one statement for each parameter set; returns its cursor."""
        cur = self.cursor()
        cur.executemany(sql, seq_of_params)
        return cur

    def _refuse(self, action: str) -> NoReturn:
        raise TransactionControlError(
            f"tool {self.tool_id!r} called ctx.tx.{action}(): poimen commits a Transactional "
            "tool's transaction with the call's marker once the tool returns (raise to roll "
            "it back)",
            tool_id=self.tool_id,
            intent_id=self._intent.id,
            action=action,
        )

    def commit(self) -> NoReturn:
        """Refused: poimen commits the transaction."""
        self._refuse("commit")

    def rollback(self) -> NoReturn:
        """Refused: raise from the tool to roll the transaction back."""
        self._refuse("rollback")

    def close(self) -> NoReturn:
        """Refused: poimen closes the connection."""
        self._refuse("close")

    def __repr__(self) -> str:
        state = "open" if self._closed is None else "closed"
        return f"<ctx.tx {self.dialect} {self._shown} {state}>"

    # poimen's side.

    def _abort(self, why: str) -> None:
        """Roll back now and close for good (a write of the tool was denied)."""
        with self._lock:
            if self._closed is None:
                self._closed = why
            if self._done:
                return
            self._done = True
        self._s.rollback()
        self._s.close()


class TxCursor:
    """A cursor of `ctx.tx`: the DB-API cursor's reading and running, while the call lasts."""

    __slots__ = ("_cur", "_tx")

    def __init__(self, tx: Tx, cur: Any) -> None:
        self._tx = tx
        self._cur = cur

    @property
    def connection(self) -> Tx:
        """The `ctx.tx` this cursor belongs to (never the driver's connection)."""
        return self._tx

    def execute(self, sql: str, params: Any = None) -> TxCursor:
        """Run one statement in the transaction; returns this cursor."""
        self._tx._usable()
        if params is None:
            self._cur.execute(sql)
        else:
            self._cur.execute(sql, params)
        return self

    def executemany(self, sql: str, seq_of_params: Any) -> TxCursor:
        """Run one statement for each parameter set; returns this cursor."""
        self._tx._usable()
        self._cur.executemany(sql, seq_of_params)
        return self

    def fetchone(self) -> Any:
        """The next row, or None."""
        self._tx._usable()
        return self._cur.fetchone()

    def fetchmany(self, size: int | None = None) -> list[Any]:
        """The next `size` rows (the cursor's arraysize if not given)."""
        self._tx._usable()
        rows = self._cur.fetchmany() if size is None else self._cur.fetchmany(size)
        return list(rows)

    def fetchall(self) -> list[Any]:
        """The remaining rows."""
        self._tx._usable()
        return list(self._cur.fetchall())

    def __iter__(self) -> Any:
        while (row := self.fetchone()) is not None:
            yield row

    @property
    def description(self) -> Any:
        """The DB-API description of the last statement's columns."""
        return self._cur.description

    @property
    def rowcount(self) -> int:
        """The rows the last statement changed (-1 if the driver cannot say)."""
        return int(self._cur.rowcount)

    @property
    def lastrowid(self) -> Any:
        """The rowid of the last inserted row (SQLite), else None."""
        return getattr(self._cur, "lastrowid", None)

    def close(self) -> None:
        """Close this cursor (the transaction stays open)."""
        self._cur.close()
