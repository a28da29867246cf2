"""The crash drill as a user runs it: `python -m poimen.testing drill`, a real process that
kills real agents (a naive runner and poimen) and counts effects in the provider's ledger."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.integration.operator_app import ROOT, poimen

DRILL = [sys.executable, "-m", "poimen.testing", "drill"]


def drill(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    env["TMPDIR"] = str(tmp)  # the drill's temporary directory goes here, to be seen removed
    return subprocess.run(
        [*DRILL, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in report["scenarios"]}


def test_both_halves_naive_doubles_poimen_single_effects(tmp_path: Path) -> None:
    r = drill("--json", tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    rows = by_name(report)
    # Without poimen: every call killed after its effect is applied twice on restart.
    for effect in ("idempotent", "queryable", "unsafe"):
        assert rows[f"{effect}, killed after the effect"]["naive_effects"] == 2
        assert rows[f"{effect}, killed before the effect"]["naive_effects"] == 1
    # With poimen: once each, except the Unsafe call that never went out; both Unsafe calls
    # wait for an operator, who was notified of each.
    expected = {
        "idempotent, killed after the effect": ("COMPLETED", 1),
        "idempotent, killed before the effect": ("COMPLETED", 1),
        "queryable, killed after the effect": ("COMPLETED", 1),
        "queryable, killed before the effect": ("COMPLETED", 1),
        "unsafe, killed after the effect": ("INDETERMINATE", 1),
        "unsafe, killed before the effect": ("INDETERMINATE", 0),
    }
    assert {n: (s["state"], s["effects"]) for n, s in rows.items()} == expected
    assert all(s["ok"] for s in rows.values())
    assert report["notified"] == 2
    assert [s["notified"] for s in report["scenarios"]] == [False] * 4 + [True] * 2
    assert report["kept"] is None
    assert list(tmp_path.iterdir()) == []  # its temporary directory is gone


def test_text_output_explains_itself_and_prints_no_log_noise(tmp_path: Path) -> None:
    r = drill(tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "without poimen | with poimen" in out
    assert out.count("twice!") == 3
    for column in ("killed", "effects", "without poimen", "with poimen", "state", "ok"):
        assert any(line.startswith(column + " ") for line in out.splitlines()), column
    assert "operator notified: 2" in out
    assert "without poimen 3 of 6 calls took effect twice; with poimen none did" in out
    assert "all poimen guarantees held" in out
    assert "--keep DIR" in out and "poimen status --db" in out and "poimen console --db" in out
    # The notifier is the drill's callback: no WARNING lines from a log notifier.
    assert r.stderr == ""
    assert list(tmp_path.iterdir()) == []


def test_keep_leaves_a_log_the_printed_commands_read(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    r = drill("--keep", str(kept), tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    db = f"sqlite:///{kept / 'intents.db'}"
    assert f"status --db {db}" in r.stdout and f"console --db {db}" in r.stdout
    assert {p.name for p in kept.iterdir()} >= {"intents.db", "ledger.db", "naive-journal.jsonl"}
    status = poimen("status", "--json", db=db)
    assert status.returncode == 0, status.stderr
    st = json.loads(status.stdout)
    assert st["indeterminate"] == 2 and st["unfinished"] == 0 and st["total"] == 6
    # A second drill into the same directory is refused: its call ids are taken.
    again = drill("--keep", str(kept), tmp=tmp_path)
    assert again.returncode == 2 and "holds a drill's log already" in again.stderr


def test_a_guarantee_that_fails_fails_the_drill(tmp_path: Path) -> None:
    # A provider whose lookup says "never arrived" for a shipment that did arrive makes
    # poimen ship it again: the drill must see the second parcel and exit non-zero.
    r = drill("--lookup-mode", "never_arrived", "--json", tmp=tmp_path)
    assert r.returncode == 1, r.stderr
    rows = by_name(json.loads(r.stdout))
    bad = rows["queryable, killed after the effect"]
    assert bad["effects"] == 2 and bad["ok"] is False
    assert [n for n, s in rows.items() if not s["ok"]] == ["queryable, killed after the effect"]
    text = drill("--lookup-mode", "never_arrived", tmp=tmp_path)
    assert text.returncode == 1 and "A POIMEN GUARANTEE FAILED" in text.stdout
