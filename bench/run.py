"""Run the benchmark suite: print a table, write JSON to bench/results/.

    scripts/bench                 # the full run (a few minutes)
    scripts/bench --quick         # tiny sizes: checks the suite works, numbers mean nothing
    scripts/bench --only single,keys
    scripts/bench --only instructions   # CPU per call under callgrind (needs valgrind; minutes)

Every figure is the minimum / median / maximum over `--reps` repetitions. Ratios compare
medians measured in this one run, on this machine, on the same disk.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import re
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import concurrency, dbos_step, instructions, keys, observe, recovery, single
from bench._util import ROOT, Row, Skipped, child, machine
from poimen import KeyDerivation
from poimen.store.sqlite import SqliteStore

POSTGRES_URL = os.environ.get("POIMEN_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")
GROUPS = (
    "single",
    "dbos",
    "concurrency",
    "recovery",
    "keys",
    "capability",
    "postgres",
    "observe",
    "audit",
)
# Asked for by name only: minutes under valgrind.
EXTRA_GROUPS = ("instructions",)


@dataclass(frozen=True)
class Sizes:
    reps: int
    calls: int  # timed calls per repetition, one caller
    warmup: int
    dbos_calls: int
    concurrency_calls: int  # total calls per repetition, split across the callers
    callers: tuple[int, ...]
    orphans: int
    settled: int
    key_calls: int


FULL = Sizes(5, 2000, 300, 300, 4000, (1, 4, 16, 64), 1000, 1_000_000, 200_000)
QUICK = Sizes(2, 20, 5, 5, 64, (1, 4), 20, 200, 200)


class Suite:
    def __init__(self, sizes: Sizes, workdir: Path, log: Callable[[str], None]) -> None:
        self.s = sizes
        self.dir = workdir
        self.log = log
        self.rows: list[Row] = []
        self.skipped: list[Skipped] = []

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        self.log(f"  {row.name}: median {row.median:,.1f} {row.unit}")
        return row

    def find(self, name: str) -> Row | None:
        return next((r for r in self.rows if r.name == name), None)

    # 1. Floor against poimen, one caller.
    def single(self) -> None:
        s = self.s
        fsync, floor, store, call, acall, astore = [], [], [], [], [], []
        inline, crossed = [], []
        for rep in range(s.reps):
            # Interleaved so that disk weather hits both sides alike.
            runs = [
                (fsync, lambda: single.fsync_us(self.dir / "fsync.bin", s.calls // 4 or 1)),
                (None, lambda: self._crossing(inline, crossed)),
                (floor, lambda: single.floor_sqlite(self.dir / "floor.db", s.calls, s.warmup)),
                (store, lambda: single.poimen_store_only(self.dir / "store.db", s.calls, s.warmup)),
                (
                    astore,
                    lambda: single.poimen_store_awaited(self.dir / "astore.db", s.calls, s.warmup),
                ),
                (call, lambda: single.poimen_call(self.dir / "single.db", s.calls, s.warmup)),
                (acall, lambda: single.poimen_acall(self.dir / "asingle.db", s.calls, s.warmup)),
            ]
            for out, fn in runs if rep % 2 == 0 else reversed(runs):
                gc.collect()
                got = fn()
                if out is not None:
                    out.append(got)
        f = self.add(
            Row(
                "1 floor",
                "SQLite floor: raw sqlite3, 2 commits/call",
                "µs/call",
                floor,
                note="WAL, synchronous=FULL, one connection",
            )
        )
        d = self.add(
            Row(
                "1 floor",
                "disk: 4 KiB write + fsync, same disk",
                "µs/fsync",
                fsync,
                note="a slow disk, not a slow poimen, when the floor is a few of these",
            )
        )
        d.ratio, d.ratio_of = f.median / d.median, "x: floor/fsync"
        so = self.add(
            Row(
                "1 floor",
                "poimen store alone: record_dispatch + record_outcome",
                "µs/call",
                store,
                note="the log's SQL (intent, attempt, event rows) without the kernel",
            )
        )
        c = self.add(
            Row(
                "1 floor",
                "poimen Kernel.call, no-op Idempotent tool",
                "µs/call",
                call,
                note="SqliteStore defaults (WAL, FULL)",
            )
        )
        sa = self.add(
            Row(
                "1 floor",
                "poimen store alone, awaited from an event loop: arecord_dispatch + arecord_outcome",
                "µs/call",
                astore,
                note="the same two commits by the store's writer thread while the loop waits",
            )
        )
        a = self.add(Row("1 floor", "poimen Kernel.acall, no-op async tool", "µs/call", acall))
        for r in (so, sa, c, a):
            r.ratio, r.ratio_of = r.median / f.median, "x floor"
        c.target, c.met = "≤ 1.15x floor", c.median / f.median <= 1.15
        a.target, a.met = "≤ 1.2x Kernel.call", a.median / c.median <= 1.2
        i = self.add(Row("1 floor", "fsync on the event loop's thread", "µs/fsync", inline))
        x = self.add(
            Row(
                "1 floor",
                "fsync by a parked thread the loop awaits (an acall's commit)",
                "µs/fsync",
                crossed,
                note="acall commits twice this way; call commits on its own thread",
            )
        )
        x.ratio, x.ratio_of = x.median / i.median, "x on the loop"
        self.log(
            f"  acall - call: {a.median - c.median:,.1f} µs; two crossings: "
            f"{2 * (x.median - i.median):,.1f} µs"
        )

    def _crossing(self, inline: list[float], crossed: list[float]) -> None:
        on_loop, through = single.fsync_through_a_thread_us(
            self.dir / "crossing.bin", self.s.calls // 4 or 1
        )
        inline.append(on_loop)
        crossed.append(through)

    # 2. DBOS.
    def dbos(self) -> None:
        why = dbos_step.available()
        if why is not None:
            self.skipped.append(Skipped("2 dbos", "DBOS workflow step on SQLite", why))
            self.log(f"  skipped: {why}")
            return
        s = self.s
        labels = {
            "wal": "WAL, FULL: poimen's settings",
            "default": "DBOS defaults: rollback journal, FULL",
        }
        runs: dict[str, list[dict[str, Any]]] = {"wal": [], "default": []}
        beside: list[float] = []
        for _ in range(s.reps):
            # One DBOS process per repetition, next to a poimen repetition: same disk weather.
            gc.collect()
            beside.append(single.poimen_call(self.dir / "beside.db", s.dbos_calls, s.warmup))
            for journal in runs:
                runs[journal].append(
                    dbos_step.run_child(
                        self.dir / f"dbos-{journal}.db",
                        journal=journal,
                        calls=s.dbos_calls,
                        warmup=s.warmup // 3 or 1,
                        reps=1,
                    )
                )
        mine = self.add(
            Row(
                "2 dbos",
                "poimen Kernel.call, interleaved with the DBOS runs",
                "µs/call",
                beside,
                note="same tool and settings as group 1",
            )
        )
        for journal, label in labels.items():
            out = runs[journal]
            wf = self.add(
                Row(
                    "2 dbos",
                    f"DBOS workflow with 1 no-op step ({label})",
                    "µs/call",
                    [x for o in out for x in o["per_call_us"]],
                    extra={"settings": out[0]["settings"]},
                )
            )
            st = self.add(
                Row(
                    "2 dbos",
                    f"DBOS one more step in a running workflow ({label})",
                    "µs/step",
                    [x for o in out for x in o["per_step_us"]],
                    note="marginal: no record before the step runs",
                )
            )
            for r in (wf, st):
                r.ratio, r.ratio_of = r.median / mine.median, "x poimen call"
            if journal == "wal":
                wf.target, wf.met = "poimen ≥ 5x faster", wf.median / mine.median >= 5

    # 3. Concurrency.
    def concurrency(self) -> None:
        s = self.s
        for kind, fn in (("threads", concurrency.threads), ("async tasks", concurrency.tasks)):
            for n in s.callers:
                samples = []
                for _ in range(s.reps):
                    gc.collect()
                    samples.append(fn(self.dir / "conc.db", n, s.concurrency_calls, s.warmup))
                r = self.add(
                    Row(
                        "3 concurrency",
                        f"{n} callers, {kind}",
                        "calls/s",
                        samples,
                        note="SQLite FULL, group commit",
                    )
                )
                if n == 64:  # issue 25's targets
                    goal = 10_000 if kind == "threads" else 15_000
                    r.target, r.met = f"≥ {goal:,} calls/s", r.median >= goal
        for kind in ("threads", "async tasks"):
            one = self.find(f"1 callers, {kind}")
            for n in s.callers[1:]:
                r = self.find(f"{n} callers, {kind}")
                if one is not None and r is not None:
                    r.ratio, r.ratio_of = r.median / one.median, "x 1 caller"

    # 5. Recovery.
    def recovery(self) -> None:
        s = self.s
        big = self.dir / f"settled-{s.settled}.db"
        self.log(f"  building a log of {s.settled:,} settled intents (reused if present)...")
        built = recovery.build_settled(big, s.settled)
        os.sync()  # the bulk insert's dirty pages must not slow the timed commits
        if built:
            self.log(f"  built in {built:.1f}s")
        results: dict[str, list[dict[str, Any]]] = {"small": [], "large": []}
        tag = str(time.time_ns())
        for rep in range(s.reps):
            for case in ("small", "large") if rep % 2 == 0 else ("large", "small"):
                db = self.dir / "recovery-small.db" if case == "small" else big
                recovery.add_orphans(db, s.orphans, new=case == "small", tag=f"{tag}-{rep}")
                os.sync()
                res = recovery.pass_in_child(db)
                if res["completed"] != s.orphans:
                    raise RuntimeError(
                        f"recovery pass completed {res['completed']} of {s.orphans} orphans: {res}"
                    )
                results[case].append(res)
        traced = {}
        for case in ("small", "large"):
            db = self.dir / "recovery-small.db" if case == "small" else big
            recovery.add_orphans(db, s.orphans, new=case == "small", tag=f"{tag}-traced")
            traced[case] = recovery.pass_in_child(db, traced=True)["heap_peak_bytes"]
        label = {
            "small": f"{s.orphans:,} orphans",
            "large": f"{s.orphans:,} orphans + {s.settled:,} settled",
        }
        small = self.add(
            Row(
                "5 recovery",
                f"recovery pass, {label['small']}",
                "s",
                [r["seconds"] for r in results["small"]],
                note="2 FULL commits per orphan (claim, outcome)",
            )
        )
        small.target, small.met = "≤ 0.5 s", small.median <= 0.5
        large = self.add(
            Row(
                "5 recovery",
                f"recovery pass, {label['large']}",
                "s",
                [r["seconds"] for r in results["large"]],
            )
        )
        large.ratio, large.ratio_of = large.median / small.median, "x small case"
        large.target, large.met = "≤ 1.2x small case", large.ratio <= 1.2
        mem = {}
        for case in ("small", "large"):
            mem[case] = self.add(
                Row(
                    "5 recovery",
                    f"peak RSS growth during the pass, {label[case]}",
                    "MiB",
                    [r["rss_growth_kib"] / 1024 for r in results[case]],
                    note="VmHWM after the pass - VmRSS before, in the child",
                    extra={
                        "rss_peak_mib": [r["rss_peak_kib"] / 1024 for r in results[case]],
                        "python_heap_peak_mib": traced[case] / 2**20,
                    },
                )
            )
        ms, ml = mem["small"], mem["large"]
        ml.ratio, ml.ratio_of = (ml.median / ms.median if ms.median else None), "x small case"
        # Flat: the large log adds at most 20% (and 1 MiB of slack) to the pass's peak.
        ml.target, ml.met = "flat (≤ 1.2x small + 1 MiB)", ml.median <= ms.median * 1.2 + 1
        for case in ("small", "large"):
            self.add(
                Row(
                    "5 recovery",
                    f"Python heap peak of the pass, {label[case]}",
                    "MiB",
                    [traced[case] / 2**20],
                    note="tracemalloc, one untimed pass",
                )
            )

    # 6. Key derivation.
    def keys(self) -> None:
        s = self.s
        for name, kd in (
            ("fields", KeyDerivation.fields("order_id", "amount_cents")),
            ("all_args", KeyDerivation.all_args()),
        ):
            r = self.add(
                Row(
                    "6 keys",
                    f"key derivation, KeyDerivation.{name}, 3-field dict",
                    "µs/call",
                    [keys.derive(s.key_calls, kd) for _ in range(s.reps)],
                )
            )
            if name == "fields":
                r.target, r.met = "≤ 5 µs", r.median <= 5
        self.add(
            Row(
                "6 keys",
                "Engine.prepare: encode, validate, canonical, digest, key",
                "µs/call",
                [keys.prepare(self.dir / "keys.db", s.key_calls // 10) for _ in range(s.reps)],
                note="no I/O; the CPU part of a call before its first commit",
            )
        )

    # 1, in instructions: the CPU part of a call, free of the machine's noise.
    def instructions(self) -> None:
        why = instructions.available()
        if why:
            self.skipped.append(Skipped("1 instructions", "callgrind", why))
            return
        per = instructions.measure(
            calls=50 if self.s is QUICK else 500, only=("floor", "store", "call", "acall")
        )
        note = "callgrind, synchronous=OFF; repeatable, so one run"
        f = self.add(
            Row(
                "1 instructions",
                "floor: raw sqlite3, 2 commits",
                "instr/call",
                [per["floor"]],
                note,
            )
        )
        for key, name in (("store", "poimen store alone"), ("call", "poimen Kernel.call")):
            r = self.add(Row("1 instructions", name, "instr/call", [per[key]], note))
            r.ratio, r.ratio_of = r.median / f.median, "x floor"
        a = self.add(
            Row("1 instructions", "poimen Kernel.acall", "instr/call", [per["acall"]], note)
        )
        a.ratio, a.ratio_of = per["acall"] / per["call"], "x Kernel.call"

    # 4 and 6: benchmarks other engineers own, included when present.
    def external(self, group: str, module: str) -> None:
        if not (ROOT / "bench" / f"{module}.py").exists():
            self.skipped.append(Skipped(group, module, f"bench/{module}.py is not in this tree"))
            self.log(f"  skipped: bench/{module}.py is not present")
            return
        mod = importlib.import_module(f"bench.{module}")
        rows_fn = getattr(mod, "rows", None)
        if rows_fn is not None:
            out = rows_fn(reps=self.s.reps, quick=self.s is QUICK, workdir=self.dir)
        elif module == "bench_postgres":
            out = self._postgres_cli()
        else:
            raise RuntimeError(f"bench/{module}.py has no rows(*, reps, quick, workdir)")
        for item in out:
            if isinstance(item, Skipped):
                self.skipped.append(item)
            elif isinstance(item, Row):
                self.add(item)
            else:
                raise TypeError(f"bench/{module}.py returned {type(item).__name__}, not Row")

    def observe(self) -> None:
        why = observe.available()
        if why is not None:
            self.skipped.append(Skipped("7 observability", "observers on Kernel.call", why))
            return
        self.external("7 observability", "observe")

    def audit(self) -> None:
        self.external("8 audit chain", "audit")

    def postgres(self) -> None:
        """bench_postgres (another engineer's) beside the raw two-commit floor on one server."""
        import psycopg

        try:
            psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
        except psycopg.Error as exc:
            self.skipped.append(Skipped("4 postgres", "PostgreSQL", f"no server: {exc}"))
            return
        before = len(self.rows)
        self.external("4 postgres", "bench_postgres")
        mine = {_workers(r.name): r for r in self.rows[before:] if r.unit == "calls/s"}
        seconds = "0.5" if self.s is QUICK else "3"
        floor: dict[int, list[float]] = {}
        for _ in range(self.s.reps):
            out = json.loads(child("bench.pg_floor", "--seconds", seconds).splitlines()[-1])
            for w, cps in out.items():
                floor.setdefault(int(w), []).append(cps)
        for w, samples in sorted(floor.items()):
            f = self.add(
                Row(
                    "4 postgres",
                    f"PostgreSQL floor: raw psycopg, 2 commits/call, {w} worker processes",
                    "calls/s",
                    samples,
                    note="bench/pg_floor.py",
                )
            )
            r = mine.get(w)
            if r is None:
                continue
            if w == 1:  # per call: the floor's calls/s over poimen's
                r.ratio, r.ratio_of = f.median / r.median, "x floor per call"
                r.target, r.met = "<= 1.2x floor per call", r.ratio <= 1.2
            else:
                r.ratio, r.ratio_of = r.median / f.median, "x floor calls/s"
                r.target, r.met = ">= floor calls/s", r.ratio >= 1.0

    def _postgres_cli(self) -> list[Row | Skipped]:
        """bench_postgres as a command (`--workers 1,8 --json`), once per repetition."""
        seconds = "0.5" if self.s is QUICK else "3"
        per: dict[int, list[float]] = {}
        for rep in range(self.s.reps):
            out = self.dir / f"postgres-{rep}.json"
            child("bench.bench_postgres", "--seconds", seconds, "--json", str(out))
            for r in json.loads(out.read_text())["runs"]:
                per.setdefault(int(r["workers"]), []).append(float(r["calls_per_s"]))
        return [
            Row(
                "4 postgres",
                f"PostgreSQL store, {n} worker processes",
                "calls/s",
                v,
                note="bench/bench_postgres.py (Unsafe no-op)",
            )
            for n, v in sorted(per.items())
        ]


def _workers(name: str) -> int | None:
    m = re.search(r"(\d+) worker", name)
    return int(m.group(1)) if m else None


def table(rows: list[Row], skipped: list[Skipped]) -> str:
    head = (
        f"{'benchmark':64} {'min':>10} {'median':>10} {'max':>10} {'unit':9} {'ratio':>16}  target"
    )
    lines = [head, "-" * len(head)]
    group = None
    for r in rows:
        if r.group != group:
            group = r.group
            lines.append(f"[{group}]")
        ratio = f"{r.ratio:.2f}{r.ratio_of}" if r.ratio is not None else ""
        met = "" if r.met is None else ("  MET" if r.met else "  MISSED")
        lines.append(
            f"{r.name[:64]:64} {_num(r.min):>10} {_num(r.median):>10} {_num(r.max):>10} "
            f"{r.unit:9} {ratio:>16}  {r.target}{met}"
        )
    for s in skipped:
        lines.append(f"[{s.group}] {s.name}: NOT RUN: {s.reason}")
    return "\n".join(lines)


def _num(v: float) -> str:
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.3f}"


def settings(workdir: Path) -> dict[str, Any]:
    store = SqliteStore(workdir / "settings.db")
    try:

        def pragma(name: str) -> Any:
            return store._read(f"PRAGMA {name}")[0][0]

        return {
            "sqlite_journal_mode": pragma("journal_mode"),
            "sqlite_synchronous": {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}[
                pragma("synchronous")
            ],
            "sqlite_page_size": pragma("page_size"),
            "sqlite_wal_autocheckpoint": pragma("wal_autocheckpoint"),
            "sqlite_module": sqlite3.sqlite_version,
        }
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    p.add_argument(
        "--only",
        help=f"comma-separated groups of {', '.join(GROUPS)}; also {', '.join(EXTRA_GROUPS)} "
        "(not in the default run)",
    )
    p.add_argument("--reps", type=int, help="repetitions (default 5; at least 5 for a report)")
    p.add_argument(
        "--workdir",
        type=Path,
        default=ROOT / "bench" / "results" / "work",
        help="scratch directory for every database (one disk for all)",
    )
    p.add_argument("--json", type=Path, help="where to write the JSON (default bench/results/)")
    ns = p.parse_args(argv)
    sizes = QUICK if ns.quick else FULL
    if ns.reps:
        sizes = Sizes(**{**sizes.__dict__, "reps": ns.reps})
    groups = GROUPS if not ns.only else tuple(g.strip() for g in ns.only.split(","))
    unknown = set(groups) - set(GROUPS) - set(EXTRA_GROUPS)
    if unknown:
        known = ", ".join(GROUPS + EXTRA_GROUPS)
        p.error(f"unknown group(s) {', '.join(sorted(unknown))}; choose from {known}")
    ns.workdir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    info = {
        "machine": machine(ns.workdir),
        "settings": settings(ns.workdir),
        "sizes": sizes.__dict__,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    log("machine: " + ", ".join(f"{k}={v}" for k, v in info["machine"].items()))
    log("settings: " + ", ".join(f"{k}={v}" for k, v in info["settings"].items()))
    suite = Suite(sizes, ns.workdir, log)
    steps: dict[str, Callable[[], None]] = {
        "single": suite.single,
        "dbos": suite.dbos,
        "concurrency": suite.concurrency,
        "recovery": suite.recovery,
        "keys": suite.keys,
        "capability": lambda: suite.external("6 capability", "bench_capability"),
        "postgres": suite.postgres,
        "observe": suite.observe,
        "audit": suite.audit,
        "instructions": suite.instructions,
    }
    t0 = time.perf_counter()
    for g in groups:
        log(f"{g}...")
        steps[g]()
    info["seconds"] = round(time.perf_counter() - t0, 1)
    text = table(suite.rows, suite.skipped)
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info["machine"].items()))
    print("settings: " + ", ".join(f"{k}={v}" for k, v in info["settings"].items()))
    print(f"sizes: {sizes.__dict__}" + ("  (QUICK: numbers mean nothing)" if ns.quick else ""))
    print(text)
    out = ns.json or ROOT / "bench" / "results" / time.strftime(
        "bench-%Y%m%dT%H%M%SZ.json", time.gmtime()
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        **info,
        "rows": [r.as_json() for r in suite.rows],
        "skipped": [s.__dict__ for s in suite.skipped],
    }
    out.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {out} ({info['seconds']}s)")
    return 0
