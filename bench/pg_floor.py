"""Item 4's floor: raw psycopg, two commits per call (the record, then the outcome), on the
same PostgreSQL server bench_postgres uses, with 1 and 8 worker processes.

    python -m bench.pg_floor --seconds 3 --workers 1,8

Prints one JSON line: {"<workers>": calls/s, ...}. Each worker holds one autocommit
connection and loops INSERT, UPDATE for the same window: one statement is its own transaction,
so each durable commit costs exactly one round trip (no BEGIN, no COMMIT), the least two
commits per call can cost. The table lives in a scratch database created from template0 and
dropped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

from bench._util import BackendCpu, children

ADMIN_URL = os.environ.get("POIMEN_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


def _worker(url: str, start_at: float, seconds: float, wid: str) -> tuple[int, float]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        args = '{"amount_cents":1200,"order_id":"o-1"}'
        for i in range(20):  # warm the connection and prepare the plans
            cid = f"{wid}-w{i}"
            conn.execute("INSERT INTO calls VALUES (%s, %s, 'D', NULL)", (cid, args))
            conn.execute("UPDATE calls SET state = 'C', result = 'null' WHERE call_id = %s", (cid,))
        time.sleep(max(0.0, start_at - time.time()))
        end = time.perf_counter() + (start_at + seconds - time.time())
        cpu = time.process_time()
        n = 0
        while time.perf_counter() < end:
            cid = f"{wid}-{n}"
            conn.execute("INSERT INTO calls VALUES (%s, %s, 'D', NULL)", (cid, args))
            conn.execute("UPDATE calls SET state = 'C', result = 'null' WHERE call_id = %s", (cid,))
            n += 1
        cpu = time.process_time() - cpu
        time.sleep(1.0)  # the server's side is read at the window's end: keep the session
    return n, cpu


def run(workers: list[int], seconds: float) -> tuple[dict[str, float], dict[str, Any]]:
    """Calls/s per worker count, and the CPU per call of the server's backends and of the
    workers (as bench_postgres reports it)."""
    import psycopg

    name = f"poimen_floor_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name} TEMPLATE template0")
    url = urlsplit(ADMIN_URL)._replace(path=f"/{name}").geturl()
    out: dict[str, float] = {}
    cpu: dict[str, Any] = {}
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE calls (call_id TEXT PRIMARY KEY, args TEXT NOT NULL, "
                "state TEXT NOT NULL, result TEXT)"
            )
        for w in workers:
            start_at = time.time() + 1.5 + 0.3 * w
            argvs = [["--worker", url, str(start_at), str(seconds), f"f{w}-{n}"] for n in range(w)]
            server = BackendCpu(ADMIN_URL, name, start_at, start_at + seconds)
            done = [json.loads(o) for o in children("bench.pg_floor", argvs, seconds + 60)]
            server_s = server.result()
            calls = sum(n for n, _ in done)
            out[str(w)] = calls / seconds
            cpu[str(w)] = {
                "server": None if server_s is None else round(1e6 * server_s / calls, 1),
                "client": round(1e6 * sum(c for _, c in done) / calls, 1),
            }
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    return out, cpu


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--workers", default="1,8")
    p.add_argument("--worker", nargs=4)
    ns = p.parse_args()
    if ns.worker:
        url, start_at, seconds, wid = ns.worker
        print(json.dumps(_worker(url, float(start_at), float(seconds), wid)))
    else:
        calls, cpu = run([int(w) for w in ns.workers.split(",")], ns.seconds)
        print(json.dumps({"cpu_us_per_call": cpu}))
        print(json.dumps(calls))  # the last line: what bench/run.py reads
