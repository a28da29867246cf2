"""The example a new user runs first: offline, killed mid-call, one email."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.integrations.conftest import KILL_TIMEOUT, ROOT


@KILL_TIMEOUT
def test_the_pydantic_ai_example_runs_offline_and_sends_one_email() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    done = subprocess.run([sys.executable, "examples/pydantic_ai_agent.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "agent exit code -9; emails sent: 1" in out
    assert "Do NOT call it again" in out
    assert out.count("emails sent: 1") == 2 and "emails sent: 2" not in out
    assert "An operator confirmed that the action took effect" in out
