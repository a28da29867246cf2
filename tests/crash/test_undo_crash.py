"""`Kernel.undo` killed (a real SIGKILL of a child process) at every point of an undo
sequence, then run again: each effect is reversed exactly once, counted by the witness
provider's ledger. An Idempotent undo is re-issued under its key; an Unsafe undo whose outcome
the kill made unknown becomes Indeterminate and stops the sequence until an operator decides.
Both backends."""

from __future__ import annotations

from pathlib import Path

import pytest

from poimen import IntentState
from poimen.operator import _ops as op
from poimen.testing import ProviderClient, ProviderProcess, kill_at_pause
from tests.integration.undo_app import (
    CHARGE,
    EMAIL,
    make_kernel,
    refunds,
    retractions,
    spawn,
)

S = IntentState
# In the order an undo passes them.
POINTS = ["before_dispatch_commit", "mid_call", "after_effect", "undo_landed", "between_undos"]
LANDED_AT = {"after_effect", "undo_landed", "between_undos"}  # the first undo's effect happened


@pytest.mark.parametrize("newest", ["idempotent", "unsafe"])
@pytest.mark.parametrize("point", POINTS)
def test_an_undo_killed_anywhere_resumes_and_reverses_each_effect_once(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient,
    point: str, newest: str,
) -> None:
    with make_kernel(store_url, provider.url) as k:
        k.call(CHARGE, {"order": "o1", "cents": 100}, call_id="run-1/1")
        k.call(EMAIL, {"to": "bob"}, call_id="run-1/2")
        if newest == "idempotent":
            k.call(CHARGE, {"order": "o3", "cents": 300}, call_id="run-1/3")
        else:
            k.call(EMAIL, {"to": "carol"}, call_id="run-1/3")

    def newest_reversed() -> int:
        return refunds(ledger, "o3") if newest == "idempotent" else retractions(ledger, "carol")

    def all_reversed() -> tuple[int, int, int]:
        return refunds(ledger, "o1"), retractions(ledger, "bob"), newest_reversed()

    pause = tmp_path / "pause"
    child = spawn(store_url, provider.url, ["undo", "--scope", "run-1/", "--operator", "ann"],
                  POIMEN_PAUSE_AT=point, POIMEN_PAUSE_FILE=str(pause))
    assert kill_at_pause(child, pause) == point
    landed = 1 if point in LANDED_AT else 0
    assert all_reversed() == (0, 0, landed)  # killed in the first undo, the newest call's

    with make_kernel(store_url, provider.url) as k:
        report = k.undo("run-1/", operator="bob")
        first = report.steps[0]
        if newest == "unsafe" and point in ("mid_call", "after_effect"):
            # Whether the retraction went out is unknown: never re-issued, the sequence stops.
            assert first.status == "stopped" and "unknown" in str(first.reason)
            assert [s.status for s in report.steps[1:]] == ["not_reached", "not_reached"]
            assert all_reversed() == (0, 0, landed)
            undo_intent = k.store.get_by_call_id("undo/run-1/3")
            assert undo_intent is not None and undo_intent.state == S.INDETERMINATE
            assert undo_intent.reason == "unsafe_unknown_outcome"
            k.resolve(undo_intent.id, landed=bool(landed), operator="cy",
                      reason="checked the provider's outbox")
            report = k.undo("run-1/", operator="bob")
            first = report.steps[0]
            # Not landed: a second undo is made under a call id of its own.
            assert first.undo_call_id == ("undo/run-1/3" if landed else "undo#2/run-1/3")
        assert report.complete, report.summary()
        assert all_reversed() == (1, 1, 1)
        assert first.status == ("already_undone" if point in ("undo_landed", "between_undos")
                                or (newest == "unsafe" and landed) else "undone")

        # Each original shows the one undo that reversed it.
        for n in (1, 2, 3):
            original = k.store.get_by_call_id(f"run-1/{n}")
            assert original is not None and original.state == S.COMPLETED
            by = op.show(k.store, original.id).undone_by
            assert len(by) == 1, (n, by)
            undo_intent = k.store.get_intent(by[0]["undo_intent_id"])
            assert undo_intent is not None
            assert undo_intent.state in (S.COMPLETED, S.RESOLVED_LANDED)
            assert op.show(k.store, undo_intent.id).undoes == original

        # Once more: nothing is sent again.
        assert k.undo("run-1/", operator="bob").complete
        assert all_reversed() == (1, 1, 1)
