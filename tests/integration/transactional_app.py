"""An application with a Transactional tool, for the Transactional tests: run in-process, and
as a crash-test child (``python -m tests.integration.transactional_app --log URL --app URL
--call-id C``, SIGKILLed at a crash point).

`tx.note` inserts one row into the application's own table ``notes`` (no unique key: a write
applied twice is two rows) and returns how many rows its call has. That table is the witness:
each call's row exactly once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import poimen
from poimen import Caps, Kernel, ToolContext, Transactional
from poimen._engine import crashpoints as _crashpoints
from tests.conftest import fresh_postgres_database

NOTE = "tx.note"
ROOT = Path(__file__).resolve().parents[2]


def _q(ctx: ToolContext, sql: str) -> str:
    return sql if ctx.tx.paramstyle == "qmark" else sql.replace("?", "%s")


def make_kernel(log: str, app: str, *, timeout: float = 10.0, **kw: Any) -> Kernel:
    k = Kernel(log, notifiers=[], **kw)

    @k.tool(id=NOTE, effects=Transactional(database=app), caps=Caps(), timeout=timeout)
    def note(ctx: ToolContext, text: str) -> dict[str, Any]:
        ctx.tx.execute(_q(ctx, "INSERT INTO notes (call_id, text) VALUES (?, ?)"),
                       (ctx.call_id, text))
        _crashpoints.hit("mid_call", ctx.call_id)  # written, not committed
        n = ctx.tx.execute(_q(ctx, "SELECT COUNT(*) FROM notes WHERE call_id = ?"),
                           (ctx.call_id,)).fetchone()[0]
        return {"rows": int(n), "attempt": ctx.attempt}

    return k


# The application's database.


def app_sql(url: str, sql: str, params: Sequence[Any] = ()) -> list[Any]:
    """One statement on the application's database, committed; its rows."""
    if url.startswith("sqlite:///"):
        conn = sqlite3.connect(url[len("sqlite:///") :], isolation_level=None, timeout=30)
        try:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description else []
        finally:
            conn.close()
    import psycopg

    with psycopg.connect(url, autocommit=True) as pg:
        cur = pg.execute(sql.replace("?", "%s").encode(), params or None)
        return cur.fetchall() if cur.description else []


def make_notes(url: str) -> None:
    app_sql(url, "CREATE TABLE notes (call_id TEXT NOT NULL, text TEXT NOT NULL)")


def rows(url: str, call_id: str) -> int:
    """The witness: how many times this call's write landed."""
    return int(app_sql(url, "SELECT COUNT(*) FROM notes WHERE call_id = ?", (call_id,))[0][0])


def marker(url: str, intent_id: str) -> tuple[int, int, Any] | None:
    """(attempt, landed, result) of the call's marker, None if it has none (or no table)."""
    try:
        got = app_sql(
            url, "SELECT attempt, landed, result FROM poimen_tx_markers WHERE intent_id = ?",
            (intent_id,),
        )
    except Exception:
        return None
    return None if not got else (int(got[0][0]), int(got[0][1]), got[0][2])


SETUPS = [
    "sqlite-own",
    "sqlite-other",
    pytest.param("postgres-own", marks=pytest.mark.postgres),
    pytest.param("postgres-other", marks=pytest.mark.postgres),
]


@contextlib.contextmanager
def databases(setup: str, tmp: Path) -> Iterator[tuple[str, str]]:
    """(log URL, application URL) for a setup: on SQLite or PostgreSQL, the application's
    table in the log's own database or in another one. The witness table is made."""
    if setup.startswith("sqlite"):
        log = f"sqlite:///{tmp / 'log.db'}"
        app = log if setup.endswith("own") else f"sqlite:///{tmp / 'app.db'}"
        make_notes(app)
        yield log, app
        return
    with fresh_postgres_database() as log:
        if setup.endswith("own"):
            make_notes(log)
            yield log, log
            return
        with fresh_postgres_database() as app:
            make_notes(app)
            yield log, app


@pytest.fixture(params=SETUPS)
def dbs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    with databases(request.param, tmp_path) as got:
        yield got


# The child.


def spawn(log: str, app: str, call_id: str, **env: str) -> subprocess.Popen[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    # The poimen this process imported (a mutant's copy under scripts/mutate), then the tests.
    e["PYTHONPATH"] = os.pathsep.join([str(Path(poimen.__file__).parents[1]), str(ROOT)])
    e.update(env)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.transactional_app", "--log", log, "--app", app,
         "--call-id", call_id],
        env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--log", required=True)
    p.add_argument("--app", required=True)
    p.add_argument("--call-id", required=True)
    ns = p.parse_args(argv)
    with make_kernel(ns.log, ns.app) as k:
        out = k.call(NOTE, {"text": "hello"}, call_id=ns.call_id)
    print(json.dumps({"type": type(out).__name__}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
