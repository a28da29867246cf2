"""Item 5: one recovery pass over 1,000 orphaned intents, alone and beside 1,000,000 settled.

The orphans are real DISPATCHED intents written by `store.record_dispatch`, owned by a
process that has exited; the settled rows are bulk-inserted into a real file, one row each
as a call that settled without incident leaves it (its attempt and events in the row). Each pass runs in a fresh child process, which reports its time and
how much its peak RSS grew during the pass (and, in a separate untimed child, the peak of the
Python heap under tracemalloc).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench._util import child_json
from bench.single import TOOL, args, noop_kernel
from poimen._core.intents import Owner
from poimen._engine.liveness import default_host
from poimen._runtime import engine_of
from poimen.store._base import latest_version


def dead_owner() -> Owner:
    """An owner on this host whose process has exited: recovery may claim its intents."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Owner(worker_id="bench-dead", host=default_host(), pid=int(child.stdout), pid_start="1")


def add_orphans(path: Path, n: int, *, new: bool, tag: str) -> None:
    """`n` DISPATCHED intents of the no-op tool, recorded as a dead process's calls."""
    owner = dead_owner()
    kernel = noop_kernel(path, new=new, synchronous="OFF")  # setup only; the pass runs FULL
    try:
        for i in range(n):
            _, d, _ = engine_of(kernel).prepare(TOOL, args(i), f"orphan-{tag}-{i}")
            _, created = kernel.store.record_dispatch(dataclasses.replace(d, owner=owner))
            assert created
    finally:
        kernel.close()
    _checkpoint(path)


def _checkpoint(path: Path) -> None:
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()


_SETTLED = """
WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n WHERE x < :count)
INSERT INTO {table}
"""


def build_settled(path: Path, count: int) -> float:
    """A log holding `count` COMPLETED intents, settled without incident; returns seconds.

    Reused when a previous run left one with the same count and schema.
    """
    marker = Path(f"{path}.count")
    tag = f"{count} v{latest_version('sqlite')}"
    if path.exists() and marker.exists() and marker.read_text() == tag:
        return 0.0
    t0 = time.perf_counter()
    noop_kernel(path).close()  # the current schema, by the store's own migrations
    marker.unlink(missing_ok=True)
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous=OFF")
        conn.execute("PRAGMA cache_size=-200000")
        conn.execute("BEGIN")
        base = time.time() - 86400 * 30
        conn.execute(
            _SETTLED.format(table="intents")
            + "SELECT printf('in_%016x0000000000', x), 'settled-' || x, :tool, 'idempotent', "
            '\'{"amount_cents":1200,"order_id":"o-\' || x || \'"}\', lower(hex(randomblob(32))), '
            "'pk1_' || lower(hex(randomblob(24))), NULL, 'COMPLETED', 1, 'bench-old', 'old', 1, "
            "'1', NULL, 10.0, :base + x * 0.001 + 10, NULL, 0, 1, 'null', NULL, NULL, "
            ":base + x * 0.001, :base + x * 0.001, 1, NULL, NULL, NULL, 0 FROM n",  # answer_owed 0
            {"count": count, "tool": TOOL, "base": base},
        )
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    marker.write_text(tag)
    return time.perf_counter() - t0


def pass_in_child(path: Path, *, traced: bool = False) -> dict[str, Any]:
    """Run one recovery pass in a fresh process; returns its report, seconds and memory."""
    return child_json("bench.recovery", "--db", str(path), *(["--tracemalloc"] if traced else []))


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> int:
    """Reset the peak-RSS mark (so VmHWM is the peak of the pass alone); returns the RSS now.

    ru_maxrss would not do: it keeps the parent's peak across fork and exec.
    """
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def _child(db: str, traced: bool) -> dict[str, Any]:
    kernel = noop_kernel(Path(db), new=False)
    try:
        if traced:
            import tracemalloc

            tracemalloc.start()
        rss_before = _reset_peak_rss()
        t0 = time.perf_counter()
        report = kernel.recover()
        seconds = time.perf_counter() - t0
        rss_after = _status_kib("VmHWM")
        heap_peak = tracemalloc.get_traced_memory()[1] if traced else None
    finally:
        kernel.close()
    return {
        "seconds": seconds,
        "scanned": report.scanned,
        "completed": report.completed,
        "rss_growth_kib": rss_after - rss_before,
        "rss_peak_kib": rss_after,
        "heap_peak_bytes": heap_peak,
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--tracemalloc", action="store_true")
    ns = p.parse_args()
    print(json.dumps(_child(ns.db, ns.tracemalloc)))
