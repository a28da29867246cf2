"""`Store.record_event`: an audit event that changes no state (who asked for an undo, which
intent undid a call), written once even when it is written again or its COMMIT's answer is
lost. Both backends."""

from __future__ import annotations

import json

import pytest

from poimen._intents import IntentState
from poimen.errors import IntentNotFoundError, ReadOnlyStoreError, StoreError
from poimen.store import Store, open_store
from poimen.store.postgres import PostgresStore
from tests.contract import test_store_contract
from tests.contract.test_store_contract import dispatch
from tests.integration.test_postgres_lost_commit import CommitCutter, cutter  # noqa: F401

S = IntentState
store = test_store_contract.store  # the conformance suite's fixture


def test_an_event_is_appended_once_and_changes_nothing_else(
    store: Store, store_url: str
) -> None:
    iid = dispatch(store, "c1")
    before = store.get_intent(iid)
    detail = {"undo_call_id": "undo/c1", "operator": "ann", "reason": None}
    assert store.record_event(iid, "undo_requested", actor="ann", detail=detail, now=1.0)
    assert not store.record_event(iid, "undo_requested", actor="ann", detail=detail, now=2.0)
    assert store.record_event(iid, "undo_requested", actor="bob", detail=detail, now=3.0)
    events = [e for e in store.events(iid) if e.kind == "undo_requested"]
    assert [(e.actor, e.at, e.from_state, e.to_state) for e in events] == [
        ("ann", 1.0, None, None), ("bob", 3.0, None, None)]
    assert json.loads(events[0].detail or "") == {"undo_call_id": "undo/c1", "operator": "ann"}
    assert store.get_intent(iid) == before  # state, fence, lease: untouched
    with pytest.raises(IntentNotFoundError):
        store.record_event("in_nope", "undone", actor="ann", detail={}, now=1.0)

    ro = open_store(store_url, readonly=True)
    try:
        with pytest.raises((ReadOnlyStoreError, StoreError)):
            ro.record_event(iid, "undone", actor="ann", detail={}, now=4.0)
    finally:
        ro.close()
    assert len(store.events(iid)) == len(events) + 1  # + dispatched


@pytest.mark.postgres
def test_a_lost_commit_of_an_event_is_not_written_twice(
    cutter: tuple[CommitCutter, str],  # noqa: F811
) -> None:
    proxy, url = cutter
    store = PostgresStore(url, retry_for=10.0)
    try:
        iid = dispatch(store, "c1")
        proxy.arm(skip=0)  # the event's COMMIT reaches the server, its answer does not
        store.record_event(iid, "undone", actor="ann", detail={"undo_intent_id": "x"}, now=1.0)
        assert proxy.cuts == 1
        assert [e.kind for e in store.events(iid)] == ["dispatched", "undone"]
    finally:
        store.close()
