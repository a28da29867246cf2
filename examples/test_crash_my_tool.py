"""Crash-test your own tools with poimen.testing: SIGKILL the agent's process at a crash point,
restart it, and count the effects where they land, outside poimen's log.

    python -m pytest examples/test_crash_my_tool.py

The provider process (poimen.testing) is the witness: its ledger counts each charge and each
email it took. The agent runs in a child process (this file, run as a script) that writes a
file and waits when it reaches the crash point named in its environment; the test kills it
there, and a new kernel settles the call as a restarted agent would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext, Unsafe
from poimen.testing import ProviderClient, ProviderProcess, crash_point, kill_at_pause

ORDER = {"order_id": "o-17", "amount_cents": 4200}
EMAIL = {"to": "bob@example.com", "subject": "Your receipt"}


def make_kernel(db_url: str, provider_url: str) -> Kernel:
    """Your application's kernel and tools."""
    kernel = Kernel(db_url, notifiers=[])
    caps = Caps(hosts=("127.0.0.1",))

    @kernel.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("order_id")), caps=caps,
                 timeout=10)
    def charge(ctx: ToolContext, order_id: str, amount_cents: int) -> dict[str, Any]:
        crash_point("mid_call")  # a crash test may stop the process here, before the effect
        r = ctx.http.post(f"{provider_url}/keyed", json={"order": order_id, "cents": amount_cents})
        r.raise_for_status()
        return r.json()

    @kernel.tool(id="send_receipt", effects=Unsafe(), caps=caps, timeout=10)
    def send_receipt(ctx: ToolContext, to: str, subject: str) -> dict[str, Any]:
        crash_point("mid_call")
        r = ctx.http.post(f"{provider_url}/plain", json={"to": to, "subject": subject})
        r.raise_for_status()
        return r.json()

    return kernel


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[ProviderProcess]:
    with ProviderProcess(tmp_path / "ledger.db") as p:
        yield p


@pytest.mark.parametrize(("tool", "args", "point", "state", "effects"), [
    ("charge", ORDER, "mid_call", "COMPLETED", 1),          # sent on restart, once
    ("charge", ORDER, "after_effect", "COMPLETED", 1),      # sent again under the same key
    ("send_receipt", EMAIL, "mid_call", "INDETERMINATE", 0),     # never sent again: an operator
    ("send_receipt", EMAIL, "after_effect", "INDETERMINATE", 1),  # decides whether it went out
])
def test_a_call_killed_at_a_crash_point_takes_effect_at_most_once(
    tmp_path: Path, provider: ProviderProcess, tool: str, args: dict[str, Any], point: str,
    state: str, effects: int,
) -> None:
    db = f"sqlite:///{tmp_path / 'agent.db'}"
    paused = tmp_path / "paused"
    env = {**os.environ, "POIMEN_PAUSE_AT": point, "POIMEN_PAUSE_FILE": str(paused)}
    agent = subprocess.Popen([sys.executable, __file__, db, provider.url, tool, json.dumps(args)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert kill_at_pause(agent, paused, timeout=120) == point  # SIGKILLed there

    with make_kernel(db, provider.url) as kernel:  # the restarted agent
        kernel.launch(background=False)  # the restart scan settles the killed call
        intent = kernel.store.get_by_call_id("order-17/step-1")
    assert intent is not None and intent.state == state
    with ProviderClient(provider.url) as ledger:  # the witness
        assert ledger.count() == effects


if __name__ == "__main__":  # the agent's process: one call, as the agent makes it
    db_url, provider_url, tool, args = sys.argv[1:]
    with make_kernel(db_url, provider_url) as kernel:
        kernel.launch()
        print(kernel.call(tool, json.loads(args), call_id="order-17/step-1"))
