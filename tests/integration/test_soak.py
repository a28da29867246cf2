"""The kill soak, short (docs/verification.md): about fifty SIGKILLed workers per backend,
judged by the provider's ledger; and proof that its checks fail when a rule is broken or the
witness is doctored.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from poimen._soak import SoakConfig, run_soak
from poimen._soak_check import _ENDING as ENDING
from poimen._soak_check import SoakReport, check_run
from tests.conftest import fresh_postgres_database

KILLS = 50
# The defaults' rates, raised a little so that fifty kills meet every fault on a slow machine.
FAULTS = ("before=0.06,after=0.06,lost=0.06,refuse=0.04,latency=0.3,max_latency=0.25,"
          "lookup_error=0.05")


def soak(tmp_path: Path, db: str, **options: Any) -> SoakReport:
    config = {"kills": KILLS, "seed": 15, "workers": 2, "db": db, "faults": FAULTS,
              "progress": False, **options}
    return run_soak(SoakConfig(**config))


def assert_clean(report: SoakReport) -> None:
    """0 violations, and the run really exercised what the checks judge."""
    assert report.ok(), report.table()
    assert report.kills == KILLS
    for c in report.checks:
        assert c.checked > 0, f"{c.name}: nothing was checked\n{report.table()}"
    at_kill = report.stats["kills with ... at the SIGKILL"]
    assert at_kill["a tool running"] > 0, report.table()
    assert at_kill["a recovery pass running"] > 0, report.table()
    faults = report.stats["writes received, by injected fault"]
    assert all(faults.get(k, 0) > 0 for k in ("before", "after", "lost", "refuse")), faults
    assert report.stats["calls made again by call id"] > 0
    classes = report.stats["intents by class and state"]
    assert set(classes) == {"idempotent", "queryable", "unsafe", "readonly", "transactional"}
    assert classes["unsafe"].get("INDETERMINATE", 0) > 0  # Unsafe calls cut off, never re-sent


def violated(report: SoakReport) -> dict[str, int]:
    return {c.name: len(c.violations) for c in report.checks if c.violations}


def test_fifty_kills_on_sqlite_hold_and_a_doctored_witness_is_caught(tmp_path: Path) -> None:
    base = tmp_path / "soak"
    report = soak(tmp_path, "sqlite", workdir=str(base))
    assert_clean(report)

    # The ledger doctored after the run: each change must break exactly its invariant.
    intents = sqlite3.connect(base / "intents.db")
    failed = intents.execute(
        "SELECT call_id, key, request_id FROM intents WHERE state = 'FAILED' "
        "AND tool_id NOT IN ('soak.read', 'soak.note')"
    ).fetchone()
    assert failed is not None, "no FAILED call in the run (refusals are injected)"
    (charged,) = intents.execute(
        "SELECT call_id FROM intents WHERE state = 'COMPLETED' AND tool_id = 'soak.charge'"
    ).fetchone()
    (noted,) = intents.execute(
        "SELECT call_id FROM intents WHERE state = 'COMPLETED' AND tool_id = 'soak.note' "
        "ORDER BY call_id"
    ).fetchone()
    intents.close()
    # The application's table doctored: a Transactional write applied twice.
    with sqlite3.connect(base / "app.db") as app:
        app.execute("INSERT INTO soak_notes (call_id) VALUES (?)", (noted,))
    ledger = sqlite3.connect(base / "ledger.db")
    with ledger:
        kind, key, request_id, body = ledger.execute(
            "SELECT kind, key, request_id, body FROM entries WHERE kind = 'request' LIMIT 1"
        ).fetchone()
        # A Queryable call's request landing twice.
        ledger.execute("INSERT INTO entries (kind, key, request_id, body, at) VALUES "
                       "(?, ?, ?, ?, 0)", (kind, key, request_id, body))
        # An effect that no intent in the log made.
        ledger.execute("INSERT INTO entries (kind, body, at) VALUES ('plain', ?, 0)",
                       (json.dumps({"to": "u.nobody.0.0", "subject": "soak"}),))
        # An Unsafe call sent a second time (refused by the provider, but sent).
        plain = ledger.execute("SELECT body FROM entries WHERE kind = 'plain' LIMIT 1").fetchone()
        ledger.execute("INSERT INTO received (kind, identity, body, fault, at) VALUES "
                       "('plain', ?, ?, 'refuse', 0)", (plain[0], plain[0]))
        # A FAILED call whose effect landed.
        call_id, key, request_id = failed
        kind, field = {"i": ("keyed", "order_id"), "q": ("request", "order_id"),
                       "u": ("plain", "to")}[call_id[0]]
        ledger.execute("INSERT INTO entries (kind, key, request_id, body, at) VALUES "
                       "(?, ?, ?, ?, 0)", (kind, key if kind == "keyed" else None,
                                           request_id if kind == "request" else None,
                                           json.dumps({field: call_id})))
        # A COMPLETED call's effect gone.
        gone = ledger.execute("DELETE FROM entries WHERE kind = 'keyed' "
                              "AND json_extract(body, '$.order_id') = ?", (charged,))
        assert gone.rowcount == 1
    ledger.close()
    # A worker's side file doctored: another worker wrote on a call its owner still drove.
    sides = base / "sides"
    owner, intent_id, at = live_ownership(sides)
    other = next(p for p in sorted(sides.glob("w*.jsonl")) if p.stem != owner)
    with other.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"e": "w", "op": "defer", "i": intent_id, "f": 1, "ok": True,
                            "t0": at, "t1": at}) + "\n")
        # ... and ran the tool of an attempt it never dispatched nor claimed (long before).
        f.write(json.dumps({"e": "run", "i": intent_id, "a": 1, "t": 1.0}) + "\n")

    again = check_run(base)
    got = violated(again)
    assert got.get("Queryable: at most one effect per call (request id)", 0) >= 1, got
    assert got.get("every effect belongs to an intent in the log", 0) >= 1, got
    assert got.get("Unsafe: never sent twice", 0) >= 1, got
    assert got.get("no landed call is FAILED (Unsafe included)", 0) >= 1, got
    assert got.get("a COMPLETED call has its effect", 0) >= 1, got
    assert got.get("Transactional: each write once in the application's table, never lost",
                   0) == 1, got
    assert got.get("no live call taken over by another worker", 0) == 1, got
    assert got.get("each tool run by its attempt's owner in the log", 0) == 1, got
    assert "Idempotent: at most one effect per key and per call" not in got, got
    assert not again.ok()
    assert "VIOLATION" in again.table()


def live_ownership(sides: Path) -> tuple[str, str, float]:
    """A worker, an intent it dispatched, and a moment it still drove it (after its dispatch
    commit, before it let go of the intent)."""
    for path in sorted(sides.glob("w*.jsonl")):
        recs = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        for r in recs:
            if r["e"] == "w" and r["op"] == "record_dispatch" and r["ok"]:
                # It drives the call until it lets go of it or begins the write that ends it.
                drop = min((d["t"] if d["e"] == "drop" else d["t0"] for d in recs
                            if d.get("i") == r["i"] and (d["e"] == "drop" or (
                                d["e"] == "w" and d["op"] in ENDING and d["t0"] > r["t1"]))),
                           default=None)
                if drop is not None and drop - r["t1"] > 0.002:
                    return path.stem, r["i"], (r["t1"] + drop) / 2
    raise AssertionError("no dispatch held for any time in the run")


@pytest.mark.postgres
def test_fifty_kills_on_postgres_hold(tmp_path: Path) -> None:
    with fresh_postgres_database() as url:
        report = soak(tmp_path, url, workers=3)
    assert_clean(report)


def test_a_broken_rule_is_caught(tmp_path: Path) -> None:
    # Every worker may take over any call, live or not: the soak must see live takeovers.
    # Whether a short run meets one depends on how the machine schedules the workers (a loaded
    # machine runs them less at once), so the soak goes on, seed after seed, until it does.
    tables = []
    for seed in range(15, 23):
        report = soak(tmp_path, "sqlite", kills=12, seed=seed, break_rule="claimable",
                      recover_share=0.6)
        if violated(report).get("no live call taken over by another worker", 0) > 0:
            return
        tables.append(report.table())
    pytest.fail("8 soaks with the claim rule broken saw no live takeover:\n" + tables[-1])
