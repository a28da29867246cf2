"""Recovery by class after a real SIGKILL; effects counted in the provider's ledger (docs/design.md §8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from poimen import IntentState, KeyDerivation, Notification
from poimen.testing import CHARGE, EMAIL, SHIP, ProviderClient, ProviderProcess
from tests.helpers import crash_call, recover_until_settled, recovering_kernel

S = IntentState
ORDER = {"order_id": "o-17", "amount_cents": 4200}


@pytest.mark.parametrize("point", ["after_effect", "mid_call"], ids=["landed", "not_landed"])
def test_idempotent_kill_then_recover_gives_exactly_one_effect(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient, point: str
) -> None:
    crash_call(tmp_path, store_url, provider.url, CHARGE, ORDER, "c1", point)
    assert ledger.count(kind="keyed") == (1 if point == "after_effect" else 0)
    with recovering_kernel(store_url, provider.url) as k:
        before = k.store.get_by_call_id("c1")
        assert before is not None and before.state == S.DISPATCHED
        report = k.recover()
        intent = k.store.get_by_call_id("c1")
        assert intent is not None
        assert intent.state == S.COMPLETED
        assert report.completed == 1
        derived = KeyDerivation.fields("order_id", "amount_cents").derive(CHARGE, ORDER)
        assert intent.key == derived
        entries = ledger.entries(kind="keyed")
        assert [e["key"] for e in entries] == [derived]
        assert len(k.store.attempts(intent.id)) == 2


@pytest.mark.parametrize(
    ("point", "attempts"), [("after_effect", 1), ("mid_call", 2)], ids=["landed", "never_arrived"]
)
def test_queryable_asks_the_provider_then_completes_or_retries_once(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient,
    point: str, attempts: int,
) -> None:
    crash_call(tmp_path, store_url, provider.url, SHIP, {"order_id": "o", "address": "x"},
               "q1", point)
    with recovering_kernel(store_url, provider.url) as k:
        intent = recover_until_settled(k, "q1")
        assert intent.state == S.COMPLETED
        assert ledger.count(kind="request", request_id=intent.request_id) == 1
        assert ledger.count(kind="request") == 1
        assert len(k.store.attempts(intent.id)) == attempts
        kinds = [e.kind for e in k.store.events(intent.id)]
        if point == "after_effect":
            assert "landed_by_lookup" in kinds and "retry" not in kinds
            assert json.loads(intent.result or "null")["body"]["order_id"] == "o"
        else:
            assert kinds.count("retry") == 1


def test_unsafe_kill_becomes_indeterminate_notified_and_never_retried(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    crash_call(tmp_path, store_url, provider.url, EMAIL, {"to": "a@b.c", "subject": "s"},
               "u1", "after_effect")
    assert ledger.count(kind="plain") == 1
    seen: list[Notification] = []
    with recovering_kernel(store_url, provider.url, seen) as k:
        report = k.recover()
        intent = k.store.get_by_call_id("u1")
        assert intent is not None
        assert intent.state == S.INDETERMINATE
        assert intent.reason == "unsafe_unknown_outcome"
        assert report.indeterminate == 1
        assert [json.loads(n.payload)["intent_id"] for n in seen] == [intent.id]
        events = k.store.events(intent.id)
        for _ in range(2):  # a second and a third pass change nothing
            again = k.recover()
            assert again.indeterminate == 0 and again.completed == 0
        assert ledger.count(kind="plain") == 1
        assert len(k.store.attempts(intent.id)) == 1
        assert k.store.events(intent.id) == events
        assert len(seen) == 1
        assert len(k.store.notifications(intent.id)) == 1


def test_recovery_twice_and_another_process_derive_the_same_key(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    crash_call(tmp_path, store_url, provider.url, CHARGE, ORDER, "k1", "mid_call")
    with recovering_kernel(store_url, provider.url) as k:
        child_key = k.store.get_by_call_id("k1").key  # type: ignore[union-attr]
        k.recover()
        k.recover()
        intent = k.store.get_by_call_id("k1")
        assert intent is not None and intent.key == child_key
        assert KeyDerivation.fields("order_id", "amount_cents").derive(CHARGE, ORDER) == child_key
        assert ledger.count(kind="keyed", key=child_key) == 1


def test_provider_deduplicates_on_key_only_never_on_content(
    provider: ProviderProcess, ledger: ProviderClient
) -> None:
    body = {"order_id": "o", "amount_cents": 1}
    assert ledger.keyed_write("k-1", body).status_code == 201
    assert ledger.keyed_write("k-2", body).status_code == 201  # same content, other key
    assert ledger.keyed_write("k-1", {"other": True}).status_code == 200  # same key
    assert ledger.count(kind="keyed") == 2
