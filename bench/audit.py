"""What the audit chain costs on the call path (docs/audit.md): the same calls on a log with
the chain and on one without it (its head row removed, so no trigger links anything),
interleaved in one run, as ratios of medians.

    python -m bench.audit [--quick] [--json PATH] [--no-postgres]

A call that settles writes one linked row: its settled record (the hash of that one row, and
the head moved, in the settle's own commit); its dispatch commit links nothing.

- SQLite, one caller, `Kernel.call` of a no-op Idempotent tool, at synchronous=OFF (the CPU
  the chain adds shows above the disk) and FULL (poimen's default, as a user sees it);
- SQLite, 8 threads of one kernel (group commit: a batch's settles linked in one statement);
- PostgreSQL, 1 and 8 worker processes (bench/bench_postgres.py's workers): every linked
  write holds the head's row lock until it commits, so linked commits are made one at a time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench._util import Row, Skipped, children, fresh, per_call_us
from poimen import Caps, Completed, Idempotent, Kernel, KeyDerivation, ToolContext
from poimen.store.sqlite import SqliteStore

GROUP = "8 audit chain"
TOOL = "bench.audited"
ADMIN_URL = os.environ.get("POIMEN_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


def _kernel(store: Any) -> Kernel:
    k = Kernel(store, notifiers=[])

    @k.tool(id=TOOL, effects=Idempotent(key=KeyDerivation.fields("n")), caps=Caps(), timeout=10)
    def noop(ctx: ToolContext, n: int) -> None:
        return None

    return k


def chain_off(store: Any) -> None:
    """A log without the chain: no head row, so the triggers link nothing (the baseline)."""
    store._tx("bench", lambda ex, _retrying: ex.execute("DELETE FROM audit_head", ()))


def _sqlite_one(
    path: Path, synchronous: str, chained: bool, calls: int, warmup: int
) -> tuple[float, float]:
    store = SqliteStore(fresh(path), synchronous=synchronous)
    if not chained:
        chain_off(store)
    k = _kernel(store)
    try:
        for i in range(warmup):
            k.call(TOOL, {"n": i}, call_id=f"w{i}")
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(calls):
            out = k.call(TOOL, {"n": i}, call_id=f"c{i}")
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert isinstance(out, Completed), out
        head = store.audit_head()
        assert (head is not None and head.seq == calls + warmup) == chained, head
        return per_call_us(elapsed, calls), per_call_us(cpu, calls)
    finally:
        k.close()


def _sqlite_threads(path: Path, chained: bool, calls: int, threads: int) -> float:
    store = SqliteStore(fresh(path), synchronous="FULL")
    if not chained:
        chain_off(store)
    k = _kernel(store)
    per = calls // threads
    try:
        def run(t: int) -> None:
            for i in range(per):
                k.call(TOOL, {"n": i}, call_id=f"t{t}-{i}")

        workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - t0
        return per * threads / elapsed
    finally:
        k.close()


def _postgres(workers: int, seconds: float, chained: bool) -> float:
    import psycopg

    from poimen.store import open_store

    name = f"poimen_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name} TEMPLATE template0")
    url = urlsplit(ADMIN_URL)._replace(path=f"/{name}").geturl()
    try:
        store = open_store(url)
        if not chained:
            chain_off(store)
        store.close()
        start_at = time.time() + 6.0 + 1.5 * workers  # every worker imported and warm
        argvs = [["--worker", url, str(start_at), str(seconds), f"w{n}"] for n in range(workers)]
        results = [json.loads(o) for o in children("bench.bench_postgres", argvs, seconds + 120)]
        return float(sum(r["calls"] for r in results)) / seconds
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _pair(
    group: str, name: str, unit: str, on: list[float], off: list[float], note: str, *,
    lower_is_better: bool,
) -> list[Row]:
    base = Row(group, f"{name}, no chain", unit, off, note=note)
    row = Row(group, f"{name}, chain", unit, on, note=note)
    if min(base.median, row.median) <= 0:  # nothing measured (a --quick run on a busy host)
        return [base, row]
    if lower_is_better:
        row.ratio, row.ratio_of = row.median / base.median, "x without chain"
    else:
        row.ratio, row.ratio_of = base.median / row.median, "x slower than without"
    return [base, row]


def rows(*, reps: int, quick: bool, workdir: Path, postgres: bool = True) -> list[Row | Skipped]:
    calls, warmup = (30, 5) if quick else (2000, 300)
    threaded = 64 if quick else 4000
    out: list[Row | Skipped] = []
    for sync in ("OFF", "FULL"):
        on: list[float] = []
        off: list[float] = []
        cpu_on: list[float] = []
        cpu_off: list[float] = []
        for rep in range(reps):
            runs = [(on, cpu_on, True), (off, cpu_off, False)]
            for samples, cpu, chained in runs if rep % 2 == 0 else reversed(runs):
                gc.collect()
                wall, used = _sqlite_one(workdir / f"audit-{sync}.db", sync, chained, calls,
                                         warmup)
                samples.append(wall)
                cpu.append(used)
        out += _pair(GROUP, f"SQLite Kernel.call, one caller, synchronous={sync}", "µs/call",
                     on, off, "no-op Idempotent tool", lower_is_better=True)
        # The process's CPU per call: what the chain adds, less sensitive to a busy disk.
        out += _pair(GROUP, f"SQLite Kernel.call CPU, one caller, synchronous={sync}",
                     "µs CPU/call", cpu_on, cpu_off, "process time, same runs",
                     lower_is_better=True)
    th_on: list[float] = []
    th_off: list[float] = []
    for rep in range(reps):
        th_runs = [(th_on, True), (th_off, False)]
        for samples, chained in th_runs if rep % 2 == 0 else reversed(th_runs):
            gc.collect()
            samples.append(_sqlite_threads(workdir / "audit-threads.db", chained, threaded, 8))
    out += _pair(GROUP, "SQLite Kernel.call, 8 threads, synchronous=FULL", "calls/s", th_on, th_off,
                 "group commit", lower_is_better=False)
    if not postgres:
        return out
    try:
        import psycopg

        psycopg.connect(ADMIN_URL, connect_timeout=3).close()
    except Exception as exc:  # no driver or no server: said, never hidden
        out.append(Skipped(GROUP, "PostgreSQL", f"no server: {exc}"))
        return out
    seconds = 1.0 if quick else 3.0
    for workers in (1, 8):
        pg_on: list[float] = []
        pg_off: list[float] = []
        for rep in range(reps):
            pg_runs = [(pg_on, True), (pg_off, False)]
            for samples, chained in pg_runs if rep % 2 == 0 else reversed(pg_runs):
                samples.append(_postgres(workers, seconds, chained))
        out += _pair(GROUP, f"PostgreSQL, {workers} worker processes", "calls/s", pg_on, pg_off,
                     "bench_postgres workers (Unsafe no-op)", lower_is_better=False)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.audit")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--no-postgres", action="store_true")
    ns = p.parse_args(argv)
    reps = ns.reps or (2 if ns.quick else 5)
    with tempfile.TemporaryDirectory(prefix="poimen-bench-audit-") as tmp:
        got = rows(reps=reps, quick=ns.quick, workdir=Path(tmp), postgres=not ns.no_postgres)
    report = {
        "benchmark": "audit_chain_cost",
        "rows": [r.as_json() for r in got if isinstance(r, Row)],
        "skipped": [vars(s) for s in got if isinstance(s, Skipped)],
    }
    for r in got:
        if isinstance(r, Row):
            ratio = f"  {r.ratio:.3f}{r.ratio_of}" if r.ratio is not None else ""
            print(f"{r.name:62} median {statistics.median(r.samples):>10.1f} {r.unit}{ratio}",
                  file=sys.stderr)
    text = json.dumps(report, indent=2)
    print(text)
    if ns.json:
        Path(ns.json).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
