"""Undo beside retention, on each backend, counted by the witness provider's ledger: an undone
call stays undone whatever retention removed (its `undone` event says so, and its undo intent
is kept while it remains), and a prune never loses the events an undo writes while it runs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext, Unsafe
from poimen.operator._prune import prune, read_archive
from poimen.store import open_store
from poimen.testing import ProviderClient, ProviderProcess
from tests.contract.test_store_contract import raw
from tests.integration.test_retention import DAY, age
from tests.integration.test_undo import statuses

PAY, UNPAY = "t.pay", "t.unpay"


@pytest.fixture
def k(store_url: str, provider: ProviderProcess) -> Iterator[Kernel]:
    """A payment the provider remembers by its key for 90 days (so retention keeps it that
    long), reversed by an Unsafe call the provider counts each time it arrives."""
    kernel = Kernel(store_url, notifiers=[])
    u = httpx.URL(provider.url)
    caps = Caps(hosts=(f"{u.host}:{u.port}",))

    @kernel.tool(id=PAY, effects=Idempotent(key=KeyDerivation.fields("order"), key_ttl=90 * DAY),
                 caps=caps, timeout=10, undo=UNPAY,
                 undo_args=lambda args, result: {"order": args["order"]})
    def pay(ctx: ToolContext, order: str) -> Any:
        return ctx.http.post(f"{provider.url}/keyed", json={"pay": order}).json()

    @kernel.tool(id=UNPAY, effects=Unsafe(), caps=caps, timeout=10)
    def unpay(ctx: ToolContext, order: str) -> Any:
        return ctx.http.post(f"{provider.url}/plain", json={"unpay": order}).json()

    try:
        yield kernel
    finally:
        kernel.close()


def unpays(ledger: ProviderClient, order: str) -> int:
    return sum(1 for e in ledger.entries(kind="plain") if e["body"].get("unpay") == order)


def paid_and_undone(k: Kernel, store_url: str, ledger: ProviderClient) -> None:
    """run/1 paid, then undone; both intents 40 days old."""
    k.call(PAY, {"order": "o1"}, call_id="run/1")
    assert k.undo("run/", operator="ann").complete and unpays(ledger, "o1") == 1
    for call_id in ("run/1", "undo/run/1"):
        age(store_url, call_id, 40)


def test_an_undo_intent_is_kept_while_its_original_remains(
    k: Kernel, store_url: str, ledger: ProviderClient
) -> None:
    paid_and_undone(k, store_url, ledger)
    # The payment stays for its key window; its undo must stay with it.
    report = prune(k.store, older_than=30 * DAY, key_ttls={PAY: 90 * DAY})
    assert report.pruned == 0 and k.store.get_by_call_id("undo/run/1") is not None
    again = k.undo("run/", operator="bob")
    assert statuses(again) == [("run/1", "already_undone")] and again.complete
    assert unpays(ledger, "o1") == 1
    # Once the payment goes, its undo goes too (with it or in a later run).
    for _ in range(2):
        prune(k.store, older_than=30 * DAY)
    assert k.store.get_by_call_id("run/1") is None
    assert k.store.get_by_call_id("undo/run/1") is None


def test_an_original_with_an_undone_event_is_undone_without_its_undo_intent(
    k: Kernel, store_url: str, ledger: ProviderClient
) -> None:
    """A log pruned by an earlier poimen may have lost the undo intent: the original's
    `undone` event alone says that it was reversed."""
    paid_and_undone(k, store_url, ledger)
    undo_intent = k.store.get_by_call_id("undo/run/1")
    assert undo_intent is not None
    for table in ("attempts", "intents"):  # its history is in its row; nothing to unlock
        raw(store_url, f"DELETE FROM {table} WHERE {'id' if table == 'intents' else 'intent_id'}"
            " = ?", (undo_intent.id,))
    assert k.store.get_by_call_id("undo/run/1") is None
    plan = k.undo("run/", dry_run=True)
    assert statuses(plan) == [("run/1", "already_undone")]
    assert plan.steps[0].undo_intent_id == undo_intent.id
    again = k.undo("run/", operator="bob")
    assert statuses(again) == [("run/1", "already_undone")] and again.complete
    assert unpays(ledger, "o1") == 1
    assert k.store.get_by_call_id("undo/run/1") is None  # no new undo was made
    assert [e.kind for e in k.store.events(k.store.get_by_call_id("run/1").id)  # type: ignore[union-attr]
            ].count("undo_requested") == 1


def test_a_prune_keeps_an_intent_whose_undo_writes_while_it_runs(
    k: Kernel, store_url: str, ledger: ProviderClient, tmp_path: Any
) -> None:
    """The undo's events land between the prune's archive read and its delete (a second
    connection writes them at exactly that point): the intent and its events stay in the log,
    and what the archive holds is what the log held when it was read."""
    k.call(PAY, {"order": "o1"}, call_id="run/1")
    age(store_url, "run/1", 40)
    original = k.store.get_by_call_id("run/1")
    assert original is not None
    other = open_store(store_url)  # a second connection

    class UndoMidway:
        """The store as prune sees it; its delete comes after an undo's event."""

        def __getattr__(self, name: str) -> Any:
            return getattr(k.store, name)

        def prune(self, *args: Any, **kw: Any) -> Any:
            other.record_event(original.id, "undo_requested", actor="bob",
                               detail={"undo_call_id": "undo/run/1"}, now=other.now())
            return k.store.prune(*args, **kw)

    archive = tmp_path / "archive.jsonl"
    try:
        report = prune(UndoMidway(), older_than=30 * DAY, archive=archive,  # type: ignore[arg-type]
                       key_ttls={})
    finally:
        other.close()
    assert report.pruned == 0
    assert [e.kind for e in k.store.events(original.id)] == [
        "dispatched", "completed", "undo_requested"]
    lines = read_archive(archive)
    assert [e["kind"] for line in lines for e in line["events"]] == ["dispatched", "completed"]
    # The next prune archives the whole history, then deletes it.
    report = prune(k.store, older_than=30 * DAY, archive=archive)
    assert report.pruned == 1 and k.store.get_intent(original.id) is None
    assert [e["kind"] for e in read_archive(archive)[-1]["events"]] == [
        "dispatched", "completed", "undo_requested"]


def test_a_call_id_used_again_after_a_prune_is_not_taken_as_undone_by_the_old_undo(
    k: Kernel, store_url: str, ledger: ProviderClient
) -> None:
    """The old call went, its younger undo intent is still there, and the call id is used
    again (a new call, docs/retention.md): the old undo is not this call's undo."""
    k.call(PAY, {"order": "o1"}, call_id="run/1")
    assert k.undo("run/", operator="ann").complete and unpays(ledger, "o1") == 1
    age(store_url, "run/1", 100)  # past its key window; its undo is young
    assert prune(k.store, older_than=30 * DAY, key_ttls={PAY: 90 * DAY}).pruned == 1
    assert k.store.get_by_call_id("undo/run/1") is not None
    k.call(PAY, {"order": "o1"}, call_id="run/1")
    report = k.undo("run/", operator="ann")
    assert statuses(report) == [("run/1", "stopped")]
    assert "made before the call itself" in str(report.steps[0].reason)
    assert unpays(ledger, "o1") == 1
