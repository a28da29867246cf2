"""Timing, statistics, machine description and scratch files shared by the benchmarks."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Row:
    """One line of the table: a measurement over repetitions, and its target if it has one."""

    group: str
    name: str
    unit: str
    samples: list[float]
    note: str = ""
    ratio: float | None = None
    ratio_of: str = ""
    target: str = ""
    met: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(min=self.min, median=self.median, max=self.max)
        return d


@dataclass
class Skipped:
    """A benchmark that could not run here, and why; printed and written, never hidden."""

    group: str
    name: str
    reason: str


def fresh(path: Path) -> Path:
    """Remove a SQLite file and its WAL/SHM/journal so a run starts empty."""
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    return path


def per_call_us(seconds: float, calls: int) -> float:
    return seconds / calls * 1e6


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _mem_total_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def _filesystem(path: Path) -> str:
    """The device and filesystem type the scratch files live on (all benchmarks share it)."""
    try:
        out = subprocess.run(
            ["df", "--output=source,fstype", str(path)], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        return " ".join(out[-1].split())
    except (OSError, subprocess.CalledProcessError):
        return "?"


def machine(workdir: Path) -> dict[str, Any]:
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gb": _mem_total_gb(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "sqlite": sqlite3.sqlite_version,
        "poimen": version("poimen"),
        "pydantic": version("pydantic"),
        "dbos": version("dbos"),
        "psycopg": version("psycopg"),
        "workdir": str(workdir),
        "filesystem": _filesystem(workdir),
    }


def reps_of(fn: Callable[[int], float], reps: int) -> list[float]:
    return [fn(i) for i in range(reps)]


def child(module: str, *args: str) -> str:
    """Run `python -m <module> <args>` from the repository root; returns its stdout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", module, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{module} child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return out.stdout


def children(module: str, argvs: list[list[str]], timeout: float) -> list[str]:
    """Start `python -m <module> <argv>` once per argv, all at once, from the repository
    root; returns each one's stdout, in order."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, *argv],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{module} worker failed ({p.returncode}):\n{err[-3000:]}")
        outs.append(out)
    return outs


def child_json(module: str, *args: str) -> dict[str, Any]:
    """`child`, whose last stdout line is JSON."""
    result: dict[str, Any] = json.loads(child(module, *args).splitlines()[-1])
    return result


class BackendCpu:
    """CPU seconds that the server's backends of one database spend between two instants
    (wall-clock `start` and `end`), read from /proc: `seconds` is None unless the server runs
    on this host and its processes are readable. Sampled on a thread of its own."""

    def __init__(self, admin_url: str, dbname: str, start: float, end: float) -> None:
        import threading

        self.seconds: float | None = None
        self._args = (admin_url, dbname, start, end)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _ticks(self, admin_url: str, dbname: str) -> dict[int, int]:
        import psycopg

        with psycopg.connect(admin_url, autocommit=True) as conn:
            pids = [
                int(r[0])
                for r in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = %s", (dbname,)
                )
            ]
        out = {}
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[pid] = int(fields[11]) + int(fields[12])  # utime + stime
        return out

    def _sample(self) -> None:
        import time

        admin_url, dbname, start, end = self._args
        time.sleep(max(0.0, start - time.time()))
        first = self._ticks(admin_url, dbname)
        time.sleep(max(0.0, end - time.time()))
        last = self._ticks(admin_url, dbname)
        if last:
            ticks = sum(max(0, t - first.get(pid, 0)) for pid, t in last.items())
            self.seconds = ticks / os.sysconf("SC_CLK_TCK")

    def result(self) -> float | None:
        self._thread.join()
        return self.seconds
