"""Liveness where there is no /proc (macOS, the BSDs): a live process must never look dead,
or recovery would take over a call that is still running. Run for real in a child whose mount
namespace hides /proc under an empty tmpfs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.operator_app import ROOT

REQUIRE_MOUNTS = os.environ.get("POIMEN_REQUIRE_MOUNTS") == "1"

SCRIPT = """
import json, os, sys
from poimen._core.decide import claimability
from poimen._core.intents import Intent, IntentState, Owner
from poimen._engine.liveness import current_owner, owner_alive, process_alive, process_start

live, dead = int(sys.argv[1]), int(sys.argv[2])
me = current_owner()
other = Owner(worker_id="w-other", host=me.host, pid=live, pid_start=process_start(live) or "")
intent = Intent(
    id="in_1", call_id="c", tool_id="t", effect="unsafe", args="{}", args_hash="h", key=None,
    request_id=None, state=IntentState.DISPATCHED, fence=1, owner=other,
    lease_expires_at=2e9, timeout_s=1.0, deadline_at=None, next_check_at=None,
    unknown_count=0, attempts=1, result=None, error=None, reason=None, created_at=0.0,
    updated_at=0.0,
)
print(json.dumps({
    "proc": os.path.exists("/proc/self/stat"),
    "self": owner_alive(me),
    "live": process_alive(live, other.pid_start),
    "dead": process_alive(dead, ""),
    "claim_live_owner": claimability(intent, me, held=False, now=1.0, alive=owner_alive),
}))
"""


def without_proc(*args: str) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs none /proc && exec "$@"', "sh",
           sys.executable, "-c", SCRIPT, *args]  # fmt: skip
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    if r.returncode != 0 and ("mount" in r.stderr or "unshare" in r.stderr):
        if REQUIRE_MOUNTS:
            pytest.fail(f"POIMEN_REQUIRE_MOUNTS=1 but /proc cannot be hidden: {r.stderr}")
        pytest.skip(f"cannot hide /proc here (root and unshare needed): {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    out: dict[str, object] = json.loads(r.stdout)
    return out


def test_a_live_process_is_alive_and_a_dead_one_dead_without_proc(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "120"])
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process
    try:
        seen = without_proc(str(sleeper.pid), str(gone.pid))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert seen["proc"] is False  # the child really had no /proc
    assert seen["self"] is True
    assert seen["live"] is True
    assert seen["dead"] is False
    # Recovery's rule: a live owner on this host, lease held, is not taken over.
    assert seen["claim_live_owner"] == "live"
