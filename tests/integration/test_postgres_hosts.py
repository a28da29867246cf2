"""Across hosts, only leases decide (issue 4, acceptance 3 and 4).

A "host" is the host string a kernel runs under: a process on another host never looks at pids,
so a dead worker's intents wait for their lease to expire, and a stalled worker (SIGSTOP past
its lease) finds, when it wakes, that its outcome is refused and kept as evidence.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from poimen import Caps, Kernel, Unsafe
from poimen.store import Store
from poimen.testing import CHARGE, EMAIL, ProviderClient, register_test_tools

from .test_postgres_recovery import (
    _child_env,
    check_ledger,
    hold_and_kill,
    recoverers,
    settle_stragglers,
    wait_past_deadlines,
)

pytestmark = pytest.mark.postgres


@pytest.fixture
def store(postgres_store: Store) -> Store:
    return postgres_store


def test_other_host_recovers_a_killed_workers_calls_after_lease_expiry(
    postgres_url: str, store: Store, provider: Any, ledger: ProviderClient, tmp_path: Path
) -> None:
    count = 50
    landed = hold_and_kill(
        postgres_url,
        provider.url,
        ledger,
        count,
        tmp_path,
        prefix="fifty",
        host="host-a",
        worker_id="worker-a",
        lease_ttl=20.0,  # the early pass must start and finish before it, on a loaded machine
        timeout=3.0,
    )
    unfinished = store.list_unfinished(after_id="", limit=count + 1)
    assert len(unfinished) == count
    first_expiry = min(i.lease_expires_at or 0.0 for i in unfinished)
    # The worker's pid is dead, but host-b cannot know that: before expiry, hands off.
    effects = len(ledger.entries())
    [early] = recoverers(postgres_url, provider.url, 1, host="host-b")
    assert store.now() < first_expiry, "the lease expired before the early pass; raise lease_ttl"
    assert (early["busy"], early["completed"], early["indeterminate"]) == (count, 0, 0), early
    assert len(ledger.entries()) == effects
    assert len(store.list_unfinished(after_id="", limit=count + 1)) == count
    last_expiry = max(i.lease_expires_at or 0.0 for i in unfinished)
    time.sleep(max(0.0, last_expiry - store.now() + 0.05))
    wait_past_deadlines(store)
    [late] = recoverers(postgres_url, provider.url, 1, host="host-b")
    assert late["busy"] == 0, late
    settle_stragglers(postgres_url, provider.url, store, host="host-b")
    assert store.list_unfinished(after_id="", limit=10) == []
    check_ledger(store, ledger, "fifty", count, landed)
    for it in store.list_intents(limit=count + 1):
        attempts = store.attempts(it.id)
        assert attempts[0].owner is not None and attempts[0].owner.host == "host-a"
        if len(attempts) > 1:
            assert attempts[-1].owner is not None and attempts[-1].owner.host == "host-b"


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        stat = f.read()
    return stat[stat.rfind(")") + 2] == "T"


@pytest.mark.parametrize(
    ("tool", "args", "point", "state"),
    [
        (CHARGE, {"order_id": "st-1", "amount_cents": 700}, "after_effect", "COMPLETED"),
        (CHARGE, {"order_id": "st-2", "amount_cents": 800}, "mid_call", "COMPLETED"),
        (EMAIL, {"to": "st@example.com", "subject": "hi"}, "after_effect", "INDETERMINATE"),
    ],
)
def test_stalled_worker_cannot_overwrite_the_newer_attempt(
    postgres_url: str,
    store: Store,
    provider: Any,
    ledger: ProviderClient,
    tmp_path: Path,
    tool: str,
    args: dict[str, Any],
    point: str,
    state: str,
) -> None:
    marker = tmp_path / "stopped"
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "poimen.testing",
            "call",
            "--db",
            postgres_url,
            "--provider",
            provider.url,
            "--tool",
            tool,
            "--args",
            json.dumps(args),
            "--call-id",
            "stalled",
            "--host",
            "host-a",
            "--worker-id",
            "stalled-worker",
            "--lease-ttl",
            "1",
            "--timeout",
            "0.5",
            "--stop-at",
            point,
            "--stop-file",
            str(marker),
        ],
        env=_child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        end = time.monotonic() + 30
        while not (marker.exists() and _stopped(child.pid)):
            assert child.poll() is None, child.communicate()[1][-3000:]
            assert time.monotonic() < end, "the worker never stalled"
            time.sleep(0.02)
        it = store.get_by_call_id("stalled")
        assert it is not None and it.lease_expires_at is not None
        time.sleep(max(0.0, it.lease_expires_at - store.now() + 0.05))
        wait_past_deadlines(store)
        kernel = Kernel(postgres_url, host="host-b", worker_id="recoverer", deadline_margin=0.1)
        register_test_tools(kernel, provider.url, timeout=0.5)
        try:
            report = kernel.recover()
        finally:
            kernel.close()
        assert report.busy == 0, report
        newer = store.get_by_call_id("stalled")
        assert newer is not None and newer.state.value == state
    finally:
        child.send_signal(signal.SIGCONT)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0, err[-3000:]
    answered = json.loads(out.strip().splitlines()[-1])
    final = store.get_by_call_id("stalled")
    assert final is not None and final == newer  # the stalled worker changed nothing
    assert answered["type"] == ("Completed" if state == "COMPLETED" else "Indeterminate")
    first = store.attempts(final.id)[0]
    assert first.owner is not None and first.owner.worker_id == "stalled-worker"
    assert first.outcome is None and first.late_outcome == "completed"
    assert first.late_result is not None and "entry_id" in first.late_result
    assert "late_outcome" in [e.kind for e in store.events(final.id)]
    if tool == CHARGE:
        assert final.fence == 2 and final.attempts == 2
        assert ledger.count(kind="keyed", key=final.key) == 1
    else:
        assert final.fence == 1 and len(store.notifications(final.id)) == 1
        assert ledger.count(kind="plain") == 1  # the stalled effect landed; never re-issued


def test_live_worker_keeps_its_lease_while_another_host_recovers(
    postgres_url: str, provider: Any, ledger: ProviderClient
) -> None:
    """A slow call outlives its lease_ttl many times over; renewal keeps host-b's hands off."""
    slow = Kernel(postgres_url, host="host-a", worker_id="slow", lease_ttl=0.6)
    other = Kernel(postgres_url, host="host-b", worker_id="other", deadline_margin=0.1)
    for k in (slow, other):

        @k.tool(id="t.slow", effects=Unsafe(), caps=Caps(), timeout=0.1)
        def slow_tool(ctx: Any, seconds: float) -> str:
            ledger.plain_write({"slow": seconds}).raise_for_status()
            time.sleep(seconds)  # a sync tool is not preempted: only renewal covers this
            return "done"

    slow.launch(background=True)
    outcome: list[Any] = []
    runner = threading.Thread(
        target=lambda: outcome.append(slow.call("t.slow", {"seconds": 3.0}, call_id="slow-1"))
    )
    try:
        runner.start()
        busy = 0
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            report = other.recover()
            busy += report.busy
            assert (report.indeterminate, report.completed) == (0, 0), report
            time.sleep(0.2)
        runner.join(timeout=10)
        assert busy >= 5
        assert [type(o).__name__ for o in outcome] == ["Completed"]
        it = other.store.get_by_call_id("slow-1")
        assert it is not None and (it.state.value, it.fence) == ("COMPLETED", 1)
        assert ledger.count(kind="plain") == 1
    finally:
        slow.close()
        other.close()
