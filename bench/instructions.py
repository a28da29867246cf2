"""CPU cost per call in instructions, under valgrind's callgrind: the floor, the store's two
commits alone, Kernel.call, and Kernel.acall of the async no-op tool, on SQLite WAL with
synchronous=OFF (no fsync to wait for); and what the OpenTelemetry SDK observer adds to a
call, beside the same span and point made by hand (the SDK's floor).

    python -m bench.instructions [--calls 500]
    python -m bench.instructions --only store store_sql store_sql_nochain   # SQLite's share
    python -m bench.instructions --only call threads64 aobserved   # 64 callers' CPU a call

Instruction counts do not depend on what else the machine is doing, so this group shows what
poimen's own code and SQL cost where wall-clock figures drown in noise. Each figure is the
difference between a run of `base + calls` calls and one of `base` calls, divided by `calls`:
start-up, imports and the schema cancel out. Checkpoints are off on both sides: one copies
the WAL into the database every 1,000 pages, so whether the extra calls happen to include one
would swing the floor's figure by a quarter; their cost follows the pages written, which the
wall-clock groups include. Kernel time (the write system calls) is not counted either.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench._util import ROOT

WORKLOADS = (
    *("floor", "store", "call", "acall"),
    *("observed", "otel", "otel_by_hand", "otel_no_sdk", "logged"),
    *("aobserved", "aotel", "aotel_by_hand"),
)
#: The async workloads' concurrent callers, as bench.observe's.
CALLERS = 64
# On the PostgreSQL server of POIMEN_BENCH_POSTGRES, in a scratch database: asked for by name
# (`--only pg_floor pg_store pg_call`), never in the default set.
PG_WORKLOADS = ("pg_floor", "pg_store", "pg_call")
# The store's own statements replayed by raw sqlite3 (`--only store_sql store_sql_nochain`):
# what SQLite spends on poimen's schema, which no Python change removes.
SQL_WORKLOADS = ("store_sql", "store_sql_nochain")
# 64 thread callers sharing the calls, as bench.concurrency's (`--only threads64`):
# callgrind runs one thread at a time, so the count is the CPU work a call, every thread's.
THREAD_WORKLOADS = ("threads64",)
BASE = 100


def available() -> str | None:
    """None when callgrind can run here, else why not."""
    return None if shutil.which("valgrind") else "valgrind is not installed"


def _workload(what: str, n: int, total: int, workdir: Path) -> None:
    """`n` timed calls of one workload; `total` fixes what is prepared, so it cancels out."""
    from bench.single import TOOL, args, floor_call, floor_connection, noop_kernel, store_call
    from poimen._runtime import engine_of

    if what == "floor":
        conn = floor_connection(workdir / "floor.db", synchronous="OFF")
        conn.execute("PRAGMA wal_autocheckpoint=0")
        for i in range(n):
            floor_call(conn, f"c{i}")
        conn.close()
        return
    if what in ("observed", "otel", "otel_by_hand", "otel_no_sdk", "logged"):
        _observed(what, n, workdir)
        return
    if what in ("aobserved", "aotel", "aotel_by_hand"):
        _aobserved(what, n, workdir)
        return
    if what in PG_WORKLOADS:
        _postgres(what, n, total, os.environ["POIMEN_CG_POSTGRES"])
        return
    if what in THREAD_WORKLOADS:
        _threads(n, workdir)
        return
    if what in SQL_WORKLOADS:
        _store_sql(n, total, workdir, chain=what == "store_sql")
        return
    kernel = noop_kernel(workdir / "poimen.db", synchronous="OFF")
    kernel.store._writer._conn.execute("PRAGMA wal_autocheckpoint=0")  # type: ignore[attr-defined]
    try:
        kernel.call(TOOL, args(-1), call_id="warm")
        if what == "acall":
            import asyncio

            async def calls() -> None:
                await kernel.acall(TOOL + ".async", args(-2), call_id="awarm")
                for i in range(n):
                    await kernel.acall(TOOL + ".async", args(i), call_id=f"c{i}")

            asyncio.run(calls())
        elif what == "store":
            ds = [engine_of(kernel).prepare(TOOL, args(i), f"c{i}")[1] for i in range(total)]
            for d in ds[:n]:
                store_call(kernel.store, d)
        else:
            for i in range(n):
                kernel.call(TOOL, args(i), call_id=f"c{i}")
    finally:
        kernel.close()


def _observed(what: str, n: int, workdir: Path) -> None:
    """bench.observe's `Kernel.call`: without observers ("observed"), with the OpenTelemetry
    SDK observer, wrapped by hand in the same span and point (`bench.observe.ByHand`, the
    SDK's floor), with the OpenTelemetry observer and no SDK, or with the transitions logged
    at INFO; the differences to "observed" are what each adds."""
    import logging

    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from bench.observe import TOOL, ByHand, _kernel, _sdk
    from poimen.otel import OpenTelemetry

    tp, mp = _sdk(processor=SimpleSpanProcessor)  # no thread of its own to count
    observers = {
        "otel": [OpenTelemetry(tracer_provider=tp, meter_provider=mp)],
        "otel_no_sdk": [OpenTelemetry()],
    }.get(what, [])
    if what == "logged":  # as bench.observe's: INFO, to a handler that drops the records
        quiet = logging.getLogger("poimen")
        quiet.setLevel(logging.INFO)
        quiet.propagate = False
        quiet.handlers[:] = [logging.NullHandler()]
    kernel = _kernel(workdir / "poimen.db", "OFF", observers, what == "logged")
    kernel.store._writer._conn.execute("PRAGMA wal_autocheckpoint=0")  # type: ignore[attr-defined]
    hand = ByHand(tp, mp)
    call = functools.partial(hand.call, kernel) if what == "otel_by_hand" else kernel.call
    try:
        call(TOOL, {"n": -1}, call_id="warm")
        for i in range(n):
            call(TOOL, {"n": i}, call_id=f"c{i}")
    finally:
        kernel.close()
        tp.shutdown()
        mp.shutdown()


def _aobserved(what: str, n: int, workdir: Path) -> None:
    """bench.observe's 64 async callers, `n` acalls in all: without observers ("aobserved"),
    with the OpenTelemetry SDK observer, or each acall wrapped by hand in the same span and
    point; the writer thread's instructions are counted with the loop's."""
    import asyncio

    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from bench.observe import TOOL, ByHand, _kernel, _sdk
    from poimen.otel import OpenTelemetry

    tp, mp = _sdk(processor=SimpleSpanProcessor)
    observers = [OpenTelemetry(tracer_provider=tp, meter_provider=mp)] if what == "aotel" else []
    kernel = _kernel(workdir / "poimen.db", "OFF", observers, False)
    kernel.store._writer._conn.execute("PRAGMA wal_autocheckpoint=0")  # type: ignore[attr-defined]
    hand = ByHand(tp, mp) if what == "aotel_by_hand" else None
    tool = TOOL + ".async"
    left = iter(range(n))

    async def caller() -> None:
        for i in left:  # the callers share the calls: `n` in all
            if hand is not None:
                await hand.acall(kernel, tool, {"n": i}, f"c{i}")
            else:
                await kernel.acall(tool, {"n": i}, call_id=f"c{i}")

    async def main() -> None:
        await kernel.acall(tool, {"n": -1}, call_id="warm")
        await asyncio.gather(*(caller() for _ in range(CALLERS)))

    try:
        asyncio.run(main())
    finally:
        kernel.close()
        tp.shutdown()
        mp.shutdown()


def _postgres(what: str, n: int, total: int, url: str) -> None:
    """A worker of bench.bench_postgres (one process, one session) or bench.pg_floor's loop;
    the client's instructions alone: the server's backend is another process."""
    if what == "pg_floor":
        import psycopg

        from bench.single import ARGS_JSON

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS calls (call_id TEXT PRIMARY KEY, "
                "args TEXT NOT NULL, state TEXT NOT NULL, result TEXT)"
            )
            run = os.urandom(4).hex()
            for i in range(-5, n):  # as pg_floor's worker; its first 5 warm the plans
                cid = f"{run}-{i}"
                conn.execute("INSERT INTO calls VALUES (%s, %s, 'D', NULL)", (cid, ARGS_JSON))
                conn.execute(
                    "UPDATE calls SET state = 'C', result = 'null' WHERE call_id = %s", (cid,)
                )
        return
    from bench.bench_postgres import pg_kernel
    from bench.single import TOOL, store_call
    from poimen._runtime import engine_of

    kernel = pg_kernel(url, "cg")
    run = os.urandom(4).hex()
    try:
        for i in range(10):  # the pool, the prepared statements, the generic plans
            kernel.call(TOOL, {"n": i}, call_id=f"{run}-warm-{i}")
        if what == "pg_store":
            engine = engine_of(kernel)
            ds = [engine.prepare(TOOL, {"n": i}, f"{run}-{i}")[1] for i in range(total)]
            for d in ds[:n]:
                store_call(kernel.store, d)
        else:
            for i in range(n):
                kernel.call(TOOL, {"n": i}, call_id=f"{run}-{i}")
    finally:
        kernel.close()


def _threads(n: int, workdir: Path) -> None:
    """`n` calls of `Kernel.call` made by 64 threads in all, on SQLite at `synchronous=OFF`."""
    import threading

    from bench.single import TOOL, args, noop_kernel

    kernel = noop_kernel(workdir / "poimen.db", synchronous="OFF")
    kernel.store._writer._conn.execute("PRAGMA wal_autocheckpoint=0")  # type: ignore[attr-defined]
    left = iter(range(n))
    lock = threading.Lock()

    def caller() -> None:
        while True:
            with lock:
                i = next(left, None)
            if i is None:
                return
            kernel.call(TOOL, args(i), call_id=f"c{i}")

    try:
        kernel.call(TOOL, args(-1), call_id="warm")
        workers = [threading.Thread(target=caller) for _ in range(CALLERS)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        kernel.close()


class _Recording:
    """The store's writer connection, recording each statement and its parameters."""

    def __init__(self, conn: Any, into: list[tuple[str, Any]]) -> None:
        self._conn, self._into = conn, into

    def execute(self, sql: str, params: Any = ()) -> Any:
        self._into.append((sql, params))
        return self._conn.execute(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def _store_sql(n: int, total: int, workdir: Path, *, chain: bool) -> None:
    """The `store` workload's statements, in its transactions, replayed by raw sqlite3 on a
    log poimen made (its migrations, triggers, `poimen_link`), without the store's Python.
    The statements are recorded from the store itself on another log first: every call's,
    `total` of them, so the recording cancels out. `chain=False`: the audit head row
    removed first, so the settle trigger's WHEN (`EXISTS (SELECT 1 FROM audit_head)`) is false
    and no link is made."""
    import sqlite3

    from bench.single import TOOL, args, noop_kernel, store_call
    from poimen._core.audit import sqlite_link
    from poimen._runtime import engine_of

    kernel = noop_kernel(workdir / "record.db", synchronous="OFF")
    calls: list[list[tuple[str, Any]]] = []
    try:
        writer = kernel.store._writer  # type: ignore[attr-defined]
        ds = [engine_of(kernel).prepare(TOOL, args(i), f"c{i}")[1] for i in range(total)]
        raw = writer._conn
        for d in ds:
            calls.append([])
            writer._conn = _Recording(raw, calls[-1])
            store_call(kernel.store, d)
        writer._conn = raw
    finally:
        kernel.close()
    noop_kernel(workdir / "replay.db", synchronous="OFF").close()
    conn = sqlite3.connect(workdir / "replay.db", isolation_level=None)
    conn.create_function("poimen_link", -1, sqlite_link)
    for pragma in ("synchronous=OFF", "foreign_keys=ON", "wal_autocheckpoint=0"):
        conn.execute(f"PRAGMA {pragma}")
    if not chain:
        conn.execute("DELETE FROM audit_head")
    assert conn.execute("SELECT COUNT(*) FROM audit_head").fetchone()[0] == int(chain)
    for stmts in calls[:n]:
        for sql, params in stmts:
            conn.execute(sql, params)
    conn.close()


@contextlib.contextmanager
def _scratch_postgres() -> Iterator[str]:
    """A fresh database, migrated, dropped at the end."""
    import psycopg

    from poimen.store import open_store

    admin_url = os.environ.get("POIMEN_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
    name = f"poimen_cg_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name} TEMPLATE template0")
    url = urlsplit(admin_url)._replace(path=f"/{name}").geturl()
    try:
        open_store(url).close()
        yield url
    finally:
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _instructions(what: str, n: int, total: int) -> int:
    with tempfile.TemporaryDirectory(prefix="poimen-cg-") as tmp:
        out = Path(tmp) / "callgrind.out"
        proc = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                "-m",
                "bench.instructions",
                "--run",
                what,
                str(n),
                str(total),
                tmp,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": "0", "POIMEN_CG_POSTGRES": _PG_URL[0]},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"callgrind run of {what} failed: {proc.stderr[-2000:]}")
        m = re.search(r"Collected : (\d+)", proc.stderr)
        if m is None:
            raise RuntimeError(f"callgrind printed no total for {what}")
        return int(m.group(1))


_PG_URL = [""]  # the scratch database of the PostgreSQL workloads, while they run


def measure(calls: int = 500, only: tuple[str, ...] = WORKLOADS) -> dict[str, float]:
    """Instructions per call of each workload."""
    total = BASE + calls
    with contextlib.ExitStack() as stack:
        if set(only) & set(PG_WORKLOADS):
            _PG_URL[0] = stack.enter_context(_scratch_postgres())
        return {
            what: (_instructions(what, total, total) - _instructions(what, BASE, total)) / calls
            for what in only
        }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--run":
        what, n, total, tmp = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
        _workload(what, n, total, tmp)
        return
    p = argparse.ArgumentParser(prog="python -m bench.instructions")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument(
        "--only",
        nargs="+",
        choices=WORKLOADS + PG_WORKLOADS + SQL_WORKLOADS + THREAD_WORKLOADS,
        default=list(WORKLOADS),
    )
    ns = p.parse_args()
    why = available()
    if why:
        raise SystemExit(why)
    print(json.dumps(measure(ns.calls, tuple(ns.only))))


if __name__ == "__main__":
    main()
