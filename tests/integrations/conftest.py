"""The agent process of the kill tests, run as a real child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from poimen import Caps, DefiniteFailure, Kernel, ToolContext, Unsafe
from poimen.testing import ProviderProcess, kill_at_pause, register_test_tools

ROOT = Path(__file__).resolve().parents[2]
RunAgent = Callable[..., dict[str, Any] | None]
# Two agent processes per kill test; a loaded machine may take its time to start them.
KILL_TIMEOUT = pytest.mark.timeout(600)


@pytest.fixture
def run_agent(tmp_path: Path, sqlite_url: str, provider: ProviderProcess) -> RunAgent:
    """`run_agent(framework, tool_call_id, *, kill_after_effect=False, naive=False,
    resume=False, scope="conv-1")`: the report of a finished run, or None for one SIGKILLed
    after its tool's effect (its outcome not yet recorded)."""
    runs = iter(range(1, 100))

    def run(framework: str, tool_call_id: str, *, kill_after_effect: bool = False,
            naive: bool = False, resume: bool = False, scope: str = "conv-1",
            kill_at: str | None = None, tool: str = "email", reask: bool = False,
            pending_wait: float = 30.0, wait_bound: float = 5.0,
            decide: str | None = None, lookup_back: bool = False) -> Any:
        n = next(runs)
        report, pause = tmp_path / f"report-{n}.json", tmp_path / f"pause-{n}"
        cmd = [sys.executable, "-m", "tests.integrations.runner", framework, "--db", sqlite_url,
               "--provider", provider.url, "--scope", scope, "--tool-call-id", tool_call_id,
               "--report", str(report), "--checkpoint", str(tmp_path / "checkpoints.db"),
               "--saved", str(tmp_path / "saved-state.json")]
        cmd += ["--naive"] * naive + ["--resume"] * resume + ["--reask"] * reask
        cmd += ["--tool", tool, "--pending-wait", str(pending_wait)]
        cmd += ["--wait-bound", str(wait_bound)] + (["--decide", decide] if decide else [])
        cmd += ["--lookup-back"] * lookup_back
        env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
        if kill_after_effect:
            kill_at = "after_effect"
        if kill_at:
            env |= {"POIMEN_PAUSE_AT": kill_at, "POIMEN_PAUSE_FILE": str(pause)}
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        if kill_at:
            assert kill_at_pause(proc, pause, timeout=120) == kill_at
            return None
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        result: dict[str, Any] = json.loads(report.read_text(encoding="utf-8"))
        return result

    return run


LOST = "mail.lost"  # Unsafe; its request may have gone out when the connection broke
TWICE = "mail.twice"  # Unsafe, coalesce=False: two identical calls are two emails
GATED = "mail.gated"  # Unsafe, each call needs an operator's approval
FOUR_EYES = "mail.four_eyes"  # Unsafe, each call needs two distinct operators' approval
REFUSED = "mail.refused"  # the provider refuses: a definite failure


SLOW = "mail.slow"  # Unsafe, sends once the test lets it (`slow_kernel`)


def slow_kernel(
    sqlite_url: str, provider: str, release: threading.Event, *, gated: bool = False
) -> Kernel:
    """A kernel whose `mail.slow` sends its email once `release` is set (`gated`: once an
    operator approved it too)."""
    k = Kernel(sqlite_url, notifiers=[], wait_bound=0.1)

    @k.tool(id=SLOW, effects=Unsafe(), caps=Caps(), timeout=60, requires_approval=gated)
    def slow(ctx: ToolContext, to: str, subject: str) -> Any:
        """Send an email over a slow connection."""
        assert release.wait(60)
        return httpx.post(f"{provider}/plain", json={"to": to, "subject": subject}).json()

    return k


def in_flight(k: Kernel, args: dict[str, Any], call_id: str, scope: str) -> threading.Thread:
    """`mail.slow` called in another thread, once its attempt is in the log."""
    first = threading.Thread(target=k.call, args=(SLOW, args),
                             kwargs={"call_id": call_id, "scope": scope})
    first.start()
    while (it := k.store.get_by_call_id(call_id)) is None or not k.store.attempts(it.id):
        first.join(0.01)
    return first


@pytest.fixture
def kernel(sqlite_url: str, provider: ProviderProcess) -> Iterator[Kernel]:
    """A kernel with poimen's test tools (`test.email` writes to the provider's ledger), a
    tool whose outcome is unknown, and one the provider refuses."""
    k = Kernel(sqlite_url, notifiers=[])
    register_test_tools(k, provider.url)

    @k.tool(id=LOST, effects=Unsafe(), caps=Caps(), timeout=5)
    def lost(ctx: ToolContext, to: str, subject: str) -> dict[str, str]:
        """Send an email over a connection that breaks."""
        raise ConnectionResetError("the connection broke after the request was sent")

    @k.tool(id=TWICE, effects=Unsafe(), caps=Caps(), timeout=5, coalesce=False)
    def twice(ctx: ToolContext, to: str, subject: str) -> Any:
        """Send an email; sending the same one twice is meant."""
        return httpx.post(f"{provider.url}/plain", json={"to": to, "subject": subject}).json()

    @k.tool(id=GATED, effects=Unsafe(), caps=Caps(), timeout=5, requires_approval=True)
    def gated(ctx: ToolContext, to: str, subject: str) -> Any:
        """Send an email once an operator approved it."""
        return httpx.post(f"{provider.url}/plain", json={"to": to, "subject": subject}).json()

    @k.tool(id=FOUR_EYES, effects=Unsafe(), caps=Caps(), timeout=5, requires_approval=True,
            approvers=2)
    def four_eyes(ctx: ToolContext, to: str, subject: str) -> Any:
        """Send an email once two operators approved it."""
        return httpx.post(f"{provider.url}/plain", json={"to": to, "subject": subject}).json()

    @k.tool(id=REFUSED, effects=Unsafe(), caps=Caps(), timeout=5)
    def refused(ctx: ToolContext, to: str, subject: str) -> dict[str, str]:
        """Send an email to an address the provider refuses."""
        raise DefiniteFailure(f"no mailbox {to}")

    k.launch()
    try:
        yield k
    finally:
        k.close()


@pytest.fixture
def saver(tmp_path: Path) -> Iterator[Any]:
    """A LangGraph checkpointer on a SQLite file of the test."""
    import sqlite3

    from langgraph.checkpoint.sqlite import SqliteSaver

    conn = sqlite3.connect(tmp_path / "checkpoints.db", check_same_thread=False)
    try:
        yield SqliteSaver(conn)
    finally:
        conn.close()
