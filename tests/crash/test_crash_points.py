"""A child killed at every crash point of every class leaves a log that opens and recovers.

The provider's ledger is the witness: at most one effect per call, exactly one where the class
promises it, and Unsafe never re-issued.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from poimen import IntentState, Notification
from poimen.testing import CHARGE, EMAIL, SHIP, ProviderClient, ProviderProcess, spawn_call
from tests.helpers import TIMEOUT, crash_call, recover_until_settled, recovering_kernel

S = IntentState
ARGS = {
    CHARGE: {"order_id": "o-1", "amount_cents": 100},
    SHIP: {"order_id": "o-1", "address": "1 Main St"},
    EMAIL: {"to": "x@y.z", "subject": "s"},
}
KIND = {CHARGE: "keyed", SHIP: "request", EMAIL: "plain"}
POINTS = ["after_dispatch_commit", "mid_call", "after_effect"]


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("tool", [CHARGE, SHIP, EMAIL])
def test_kill_at_each_point_then_recover(
    tmp_path: Path, sqlite_url: str, provider: ProviderProcess, ledger: ProviderClient,
    tool: str, point: str,
) -> None:
    crash_call(tmp_path, sqlite_url, provider.url, tool, ARGS[tool], "c", point)
    landed = 1 if point == "after_effect" else 0
    assert ledger.count(kind=KIND[tool]) == landed
    seen: list[Notification] = []
    with recovering_kernel(sqlite_url, provider.url, seen) as k:
        intent = recover_until_settled(k, "c")
        if tool == EMAIL:
            assert intent.state == S.INDETERMINATE
            assert ledger.count(kind="plain") == landed  # never re-issued
            assert len(seen) == 1
        else:
            assert intent.state == S.COMPLETED
            assert ledger.count(kind=KIND[tool]) == 1
            assert seen == []


@pytest.mark.parametrize("tool", [CHARGE, SHIP, EMAIL])
def test_kill_before_the_dispatch_commit_records_nothing_and_does_nothing(
    tmp_path: Path, sqlite_url: str, provider: ProviderProcess, ledger: ProviderClient, tool: str
) -> None:
    proc = spawn_call(sqlite_url, provider.url, tool, ARGS[tool], "c",
                      crash_at="before_dispatch_commit", timeout=TIMEOUT)
    proc.communicate(timeout=30)
    assert proc.returncode == -9
    with recovering_kernel(sqlite_url, provider.url) as k:
        assert k.store.get_by_call_id("c") is None
        assert k.recover().scanned == 0
    assert ledger.count() == 0


def test_outbox_survives_a_kill_between_the_state_change_and_the_delivery(
    tmp_path: Path, sqlite_url: str, provider: ProviderProcess,
) -> None:
    # The Unsafe call fails with an unknown outcome (nothing listens on the port): it becomes
    # INDETERMINATE with its notification in the outbox, and the child dies before delivery.
    dead = "http://127.0.0.1:9"
    crash_call(tmp_path, sqlite_url, dead, EMAIL, ARGS[EMAIL], "n1", "before_notify")
    seen: list[Notification] = []
    with recovering_kernel(sqlite_url, provider.url, seen) as k:
        intent = k.store.get_by_call_id("n1")
        assert intent is not None and intent.state == S.INDETERMINATE
        [pending] = k.store.notifications(intent.id)
        assert pending.delivered_at is None
        k.launch(background=False)
        assert [n.delivery_id for n in seen] == [pending.delivery_id]
        [done] = k.store.notifications(intent.id)
        assert done.delivered_at is not None
        k.recover()
        assert len(seen) == 1
