"""The sandbox example runs offline: the replay moves nothing in the world, the diff shows the
changed step."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.integrations.conftest import ROOT


def test_the_sandbox_example_replays_a_changed_agent_and_shows_its_diff() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    done = subprocess.run([sys.executable, "examples/sandbox_replay.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.count("effects in the world: 2") == 2  # the replay added none
    assert "not carried out" in out
    assert "1 same, 1 arguments changed, 0 tool changed" in out
    assert '/to: "bob@example.com" -> "eve@example.com"' in out
    assert "unsafe     send_email" in out
