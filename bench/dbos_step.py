"""Item 2: a DBOS workflow step doing the same no-op on SQLite, in a child process.

DBOS is a process-wide singleton with background threads, so it runs in its own process
(`python -m bench.dbos_step`), which prints one JSON line of per-call microseconds.

Two settings of DBOS's SQLite system database are measured: DBOS's own defaults (rollback
journal, synchronous=FULL) and the same settings poimen uses (WAL, synchronous=FULL), the
fairer comparison. Each call is one workflow, with the call id as its workflow id, running one
no-op step: the smallest DBOS unit that records a call before and after it runs. The marginal
cost of one more step inside a running workflow is reported as well.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench._util import child_json, fresh, per_call_us


def available() -> str | None:
    """None if dbos imports here, else why not."""
    try:
        import dbos  # noqa: F401
    except ImportError as exc:
        return f"dbos is not installed ({exc}); `pip install dbos` to include it"
    return None


def run_child(db: Path, *, journal: str, calls: int, warmup: int, reps: int) -> dict[str, Any]:
    return child_json(
        "bench.dbos_step",
        *("--db", str(db), "--journal", journal, "--calls", str(calls)),
        *("--warmup", str(warmup), "--reps", str(reps)),
    )


def _child(db: Path, journal: str, calls: int, warmup: int, reps: int) -> dict[str, Any]:
    import logging

    import sqlalchemy as sa
    from dbos import DBOS, DBOSConfig, SetWorkflowID
    from sqlalchemy import event

    fresh(db)
    config: DBOSConfig = {
        "name": "poimen-bench",
        "system_database_url": f"sqlite:///{db}",
        "log_level": "WARNING",
    }
    if journal == "wal":
        engine = sa.create_engine(f"sqlite:///{db}")

        @event.listens_for(engine, "connect")
        def _settings(dbapi_conn: Any, _record: Any) -> None:
            # What DBOS itself sets on connect, plus poimen's journal settings.
            dbapi_conn.isolation_level = "IMMEDIATE"
            dbapi_conn.execute("PRAGMA journal_mode=WAL")
            dbapi_conn.execute("PRAGMA synchronous=FULL")
            dbapi_conn.execute("PRAGMA busy_timeout=30000")
            dbapi_conn.execute("PRAGMA foreign_keys=ON")

        config["system_database_engine"] = engine
    DBOS(config=config)

    @DBOS.step()
    def noop(order_id: str, amount_cents: int) -> None:
        return None

    @DBOS.workflow()
    def call(order_id: str, amount_cents: int) -> None:
        noop(order_id, amount_cents)

    @DBOS.workflow()
    def many(n: int) -> float:
        t0 = time.perf_counter()
        for i in range(n):
            noop(f"o-{i}", 1200)
        return time.perf_counter() - t0

    DBOS.launch()
    logging.getLogger("dbos").setLevel(logging.WARNING)
    try:
        with sa.create_engine(f"sqlite:///{db}").connect() as c:
            settings = {
                "journal_mode": c.execute(sa.text("PRAGMA journal_mode")).scalar(),
                "synchronous": c.execute(sa.text("PRAGMA synchronous")).scalar(),
            }
        for i in range(warmup):
            with SetWorkflowID(f"w{i}"):
                call(f"o-{i}", 1200)
        per_call: list[float] = []
        per_step: list[float] = []
        for r in range(reps):
            t0 = time.perf_counter()
            for i in range(calls):
                with SetWorkflowID(f"r{r}-{i}"):
                    call(f"o-{i}", 1200)
            per_call.append(per_call_us(time.perf_counter() - t0, calls))
            with SetWorkflowID(f"many-{r}"):
                per_step.append(per_call_us(many(calls), calls))
    finally:
        DBOS.destroy(destroy_registry=True)
    return {"per_call_us": per_call, "per_step_us": per_step, "settings": settings}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--journal", choices=("wal", "default"), required=True)
    p.add_argument("--calls", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--reps", type=int, required=True)
    ns = p.parse_args()
    print(json.dumps(_child(Path(ns.db), ns.journal, ns.calls, ns.warmup, ns.reps)))
