"""Retention on a filled log of each backend: `poimen prune` removes exactly the settled
intents past the window (archived first when asked), never an unfinished, Indeterminate,
young, undelivered or key-window one, and the history stays append-only for everything else."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from poimen import (
    CallbackNotifier,
    Caps,
    Idempotent,
    IntentState,
    Kernel,
    KeyDerivation,
    Notification,
    ToolContext,
    Unsafe,
)
from poimen.operator._ops import OperatorInputError
from poimen.operator._prune import MIN_AGE, prune, read_archive
from tests.contract.test_store_contract import raw, refusal
from tests.integration.operator_app import poimen_json
from tests.integration.test_lifecycle import intent_of, orphan

S = IntentState
DAY = 86400.0


def age(store_url: str, call_id: str, days: float) -> None:
    raw(store_url, "UPDATE intents SET updated_at = updated_at - ?, created_at = created_at - ? "
        "WHERE call_id = ?", (days * DAY, days * DAY, call_id))


def filled(store_url: str) -> tuple[Kernel, dict[str, str]]:
    """A log with one intent of every kind retention must tell apart; returns call id -> what."""
    def accept(n: Notification) -> None:
        if json.loads(n.payload)["call_id"] == "old-undelivered":
            raise ConnectionError("the receiver is down")  # this one is never delivered

    k = Kernel(store_url, notifiers=[CallbackNotifier(accept)])

    @k.tool(id="ok", effects=Unsafe(), caps=Caps(), timeout=1)
    def ok(ctx: ToolContext, n: int) -> int:
        if n < 0:
            raise ConnectionResetError("reset")
        return n

    @k.tool(id="pay", effects=Idempotent(key=KeyDerivation.fields("n"), key_ttl=90 * DAY),
            caps=Caps(), timeout=1)
    def pay(ctx: ToolContext, n: int) -> int:
        return n

    kinds: dict[str, str] = {}
    for i in range(7):  # old and settled: pruned
        k.call("ok", {"n": i}, call_id=f"old-{i}")
        kinds[f"old-{i}"] = "prune"
    failed = k.call("ok", {"n": -1}, call_id="old-resolved")  # Indeterminate, then resolved
    k.resolve(failed.intent_id, landed=False, operator="ann", reason="checked")
    kinds["old-resolved"] = "prune"
    k.call("ok", {"n": -2}, call_id="old-indeterminate")  # unresolved: kept
    kinds["old-indeterminate"] = "keep"
    orphan(k, "ok", "unsafe", {"n": 9}, "old-dispatched")  # unfinished: kept
    kinds["old-dispatched"] = "keep"
    k.call("ok", {"n": 1}, call_id="young")  # inside the window: kept
    kinds["young"] = "keep"
    k.call("pay", {"n": 1}, call_id="old-keyed")  # inside its tool's key window: kept
    kinds["old-keyed"] = "keep-key"
    for call_id in kinds:
        if call_id != "young":
            age(store_url, call_id, 40)
    k.deliver_notifications()
    # A settled intent whose operator notification was never delivered is kept too.
    late = k.call("ok", {"n": -3}, call_id="old-undelivered")
    k.resolve(late.intent_id, landed=True, operator="ann", reason="seen")
    age(store_url, "old-undelivered", 40)
    kinds["old-undelivered"] = "keep"
    k.store.record_denial(tool_id="ok", intent_id=None, attempt=None, action="dispatch",
                          target="x", reason="sandbox", now=k.store.now() - 40 * DAY)
    return k, kinds


def test_prune_removes_exactly_what_is_settled_and_old_and_archives_it_first(
    store_url: str, tmp_path: Path
) -> None:
    k, kinds = filled(store_url)
    try:
        before = {c: (k.store.events(intent_of(k, c).id), k.store.attempts(intent_of(k, c).id))
                  for c in kinds}
        archive = tmp_path / "archive.jsonl"
        report = prune(k.store, older_than=30 * DAY, archive=archive, batch=3,
                       key_ttls={"pay": 90 * DAY})
        gone = {c for c, what in kinds.items() if what == "prune"}
        assert report.pruned == len(gone) and report.kept_for_key_window == 1
        assert report.denials == 1
        for c in kinds:
            it = k.store.get_by_call_id(c)
            assert (it is None) == (c in gone), c
            if it is not None:  # what stays is untouched
                assert (k.store.events(it.id), k.store.attempts(it.id)) == before[c]
        lines = read_archive(archive)
        assert sorted(line["intent"]["call_id"] for line in lines) == sorted(gone)
        for line in lines:
            events, attempts = before[line["intent"]["call_id"]]
            assert [e["kind"] for e in line["events"]] == [e.kind for e in events]
            assert len(line["attempts"]) == len(attempts)
        resolved = next(x for x in lines if x["intent"]["call_id"] == "old-resolved")
        assert resolved["intent"]["state"] == "RESOLVED_NOT_LANDED"
        assert any(e["actor"] == "ann" for e in resolved["events"])
        # Outside a prune the history is still append-only (an intent whose history is in
        # the tables: the happy path's is in its intent row).
        kept = intent_of(k, "old-indeterminate").id
        assert raw(store_url, "SELECT COUNT(*) FROM events WHERE intent_id = ?", (kept,))[0][0]
        with pytest.raises(refusal(store_url), match="append-only"):
            raw(store_url, "DELETE FROM events WHERE intent_id = ?", (kept,))
        if store_url.startswith("sqlite"):
            assert raw(store_url, "SELECT COUNT(*) FROM poimen_pruning") == [(0,)]
        # A pruned call id used again is a new call: it runs again (documented).
        again = k.call("ok", {"n": 0}, call_id="old-0")
        assert intent_of(k, "old-0").id == again.intent_id
        # Nothing more to do; without the key windows the keyed one would go now.
        assert prune(k.store, older_than=30 * DAY, key_ttls={"pay": 90 * DAY}).pruned == 0
        assert prune(k.store, older_than=30 * DAY).pruned == 1
    finally:
        k.close()


def test_a_window_shorter_than_the_call_id_promise_is_refused(store_url: str) -> None:
    with Kernel(store_url, notifiers=[]) as k:
        with pytest.raises(OperatorInputError, match="re-used call id"):
            prune(k.store, older_than=MIN_AGE - 1)
        assert prune(k.store, older_than=60, allow_short=True).pruned == 0


def test_the_cli_prunes_with_an_archive(store_url: str, tmp_path: Path) -> None:
    k, _ = filled(store_url)
    k.close()
    archive = tmp_path / "a.jsonl"
    out: Any = poimen_json("prune", "--older-than", "30d", "--archive", str(archive),
                           "--batch", "2", db=store_url)
    assert out["pruned"] >= 7 and archive.exists()
    assert all(json.loads(line)["intent"]["state"] != "DISPATCHED"
               for line in archive.read_text().splitlines())
    with Kernel(store_url, notifiers=[]) as k2:
        assert k2.store.get_by_call_id("old-dispatched") is not None
        assert k2.store.get_by_call_id("old-indeterminate") is not None
