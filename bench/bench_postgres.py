"""Calls per second on the PostgreSQL store, with 1 and 8 worker processes.

    python -m bench.bench_postgres [--seconds 5] [--workers 1,8] [--json PATH]

Each worker process opens its own Kernel on one shared, fresh database and makes sequential
calls to a tool that does nothing, so the figure is the kernel's own cost: two durable commits
per call (the dispatch record and the outcome), the physical floor docs/design.md §4 names.
PostgreSQL runs as configured on the machine (fsync and synchronous_commit as found; both are
reported). The database is created from template0 and dropped afterwards.

Environment: POIMEN_BENCH_POSTGRES (default postgresql://postgres@127.0.0.1:5432/test) names
the server and the database used to create the scratch database.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench._util import BackendCpu, children
from poimen import Caps, Kernel, ToolContext, Unsafe

ADMIN_URL = os.environ.get("POIMEN_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


def pg_kernel(url: str, wid: str) -> Kernel:
    """A worker's kernel, with the no-op tool `bench.noop`."""
    kernel = Kernel(url, worker_id=wid)

    @kernel.tool(id="bench.noop", effects=Unsafe(), caps=Caps(), timeout=5.0)
    def noop(ctx: ToolContext, n: int) -> int:
        return n

    return kernel


def worker(url: str, start_at: float, seconds: float, wid: str) -> dict[str, Any]:
    """One process: sequential calls from `start_at` for `seconds`; returns its counts."""
    kernel = pg_kernel(url, wid)

    # Warm the pool and the prepared statements before the clock starts.
    for i in range(20):
        kernel.call("bench.noop", {"n": i}, call_id=f"{wid}-warm-{i}")
    late = max(0.0, time.time() - start_at)
    time.sleep(max(0.0, start_at - time.time()))
    latencies: list[float] = []
    # One window for every worker: a worker that starts late still stops on time.
    end = time.perf_counter() + (start_at + seconds - time.time())
    cpu = time.process_time()
    i = 0
    while True:
        t0 = time.perf_counter()
        if t0 >= end:
            break
        kernel.call("bench.noop", {"n": i}, call_id=f"{wid}-{i}")
        latencies.append(time.perf_counter() - t0)
        i += 1
    cpu = time.process_time() - cpu
    time.sleep(1.0)  # the server's side is read at the window's end: keep its sessions till then
    kernel.close()
    return {"calls": len(latencies), "latencies": latencies, "late_s": late, "cpu_s": cpu}


def run(workers: int, seconds: float, url: str) -> dict[str, Any]:
    start_at = time.time() + 3.0 + 0.6 * workers  # after every process has imported and warmed
    argvs = [["--worker", url, str(start_at), str(seconds), f"w{n}"] for n in range(workers)]
    server = BackendCpu(ADMIN_URL, urlsplit(url).path[1:], start_at, start_at + seconds)
    results = [json.loads(o) for o in children("bench.bench_postgres", argvs, seconds + 120)]
    server_s = server.result()
    lat = sorted(x for r in results for x in r["latencies"])
    calls = sum(r["calls"] for r in results)
    return {
        "workers": workers,
        "seconds": seconds,
        "calls": calls,
        "calls_per_s": round(calls / seconds, 1),
        "per_worker_calls_per_s": [round(r["calls"] / seconds, 1) for r in results],
        "workers_started_late_s": max(r["late_s"] for r in results),
        # Where the CPU goes, per call: the server's backends (from /proc; null if the server
        # is not on this host) and the worker processes (the kernel's Python and psycopg).
        "cpu_us_per_call": {
            "server": None if server_s is None else round(1e6 * server_s / calls, 1),
            "client": round(1e6 * sum(r["cpu_s"] for r in results) / calls, 1),
        },
        "latency_ms": {
            "p50": round(1000 * statistics.median(lat), 3),
            "p99": round(1000 * lat[int(0.99 * (len(lat) - 1))], 3),
            "max": round(1000 * lat[-1], 3),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_postgres")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--workers", default="1,8", help="comma-separated process counts")
    p.add_argument("--json", help="also write the result to this file")
    p.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.worker:
        url, start_at, seconds, wid = ns.worker
        print(json.dumps(worker(url, float(start_at), float(seconds), wid)))
        return 0

    import psycopg

    name = f"poimen_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name} TEMPLATE template0")
        settings = {
            k: admin.execute(f"SHOW {k}").fetchone()[0]  # type: ignore[index]
            for k in ("server_version", "fsync", "synchronous_commit", "max_connections")
        }
    url = urlsplit(ADMIN_URL)._replace(path=f"/{name}").geturl()
    try:
        from poimen.store import open_store

        open_store(url).close()  # migrate once, before the workers race to
        runs = [run(int(n), ns.seconds, url) for n in ns.workers.split(",")]
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    report = {
        "benchmark": "postgres_calls_per_second",
        "tool": "Unsafe no-op (kernel cost only: two durable commits per call)",
        "postgres": settings,
        "cpus": os.cpu_count(),
        "runs": runs,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if ns.json:
        Path(ns.json).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
