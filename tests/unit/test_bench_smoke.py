"""The benchmark suite still runs end to end (tiny sizes; no timing is asserted here)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# Five groups, DBOS among them: minutes on a loaded 2-core machine, not the default two.
@pytest.mark.timeout(600)
def test_bench_quick_run_writes_every_group(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "--quick",
            # The capability and PostgreSQL benchmarks belong to their own modules' tests.
            "--only",
            "single,dbos,concurrency,recovery,keys",
            "--workdir",
            str(tmp_path / "work"),
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text(encoding="utf-8"))
    names = {r["name"] for r in doc["rows"]}
    ran = {r["group"] for r in doc["rows"]} | {s["group"] for s in doc["skipped"]}
    assert {"1 floor", "2 dbos", "3 concurrency", "5 recovery", "6 keys"} <= ran
    assert "SQLite floor: raw sqlite3, 2 commits/call" in names
    assert "poimen Kernel.call, no-op Idempotent tool" in names
    # What an acall's commit pays for crossing threads, beside the same fsync on the loop.
    assert "fsync by a parked thread the loop awaits (an acall's commit)" in names
    assert "fsync on the event loop's thread" in names
    assert any(n.startswith("poimen store alone, awaited from an event loop") for n in names)
    for row in doc["rows"]:
        assert len(row["samples"]) >= 1 and row["min"] <= row["median"] <= row["max"], row
    # Every pass recovered every orphan (the suite raises otherwise); the durable setting held.
    assert doc["settings"]["sqlite_synchronous"] == "FULL"
    assert doc["settings"]["sqlite_journal_mode"] == "wal"
    assert doc["machine"]["cores"] and doc["machine"]["sqlite"]
    assert "poimen Kernel.call" in proc.stdout and "median" in proc.stdout


@pytest.mark.parametrize("chain", [True, False])
def test_the_store_sql_workload_replays_the_stores_own_writes(
    tmp_path: Path, chain: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bench.instructions' store_sql: the statements the store ran, replayed by raw sqlite3;
    # its figure means something only if the replay writes what the store wrote.
    import sqlite3

    monkeypatch.syspath_prepend(str(ROOT))
    from bench.instructions import _store_sql

    _store_sql(4, 6, tmp_path, chain=chain)
    cols = "call_id, tool_id, effect, args, args_hash, key, state, result, fence, attempts"
    with contextlib.closing(sqlite3.connect(tmp_path / "record.db")) as rec:
        recorded = rec.execute(f"SELECT {cols} FROM intents ORDER BY call_id").fetchall()
    with contextlib.closing(sqlite3.connect(tmp_path / "replay.db")) as rep:
        replayed = rep.execute(f"SELECT {cols} FROM intents ORDER BY call_id").fetchall()
        linked = rep.execute("SELECT COUNT(*) FROM intents WHERE chain_seq IS NOT NULL")
        assert linked.fetchone()[0] == (4 if chain else 0)
    assert len(recorded) == 6 and replayed == recorded[:4]
    assert {r[6] for r in replayed} == {"COMPLETED"}
