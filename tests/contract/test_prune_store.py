"""`Store.prune`'s two rules (docs/design.md sections 9 and 10), on both backends: a batch is
deleted only if its history is still the one the caller read (and archived), so nothing
committed meanwhile is lost; and an undo intent is never pruned while its original remains."""

from __future__ import annotations

import pytest

from poimen._core.intents import IntentState
from poimen.call_ids import undo_of
from poimen.store import Store, open_store
from tests.contract import test_store_contract
from tests.contract.test_store_contract import dispatch

S = IntentState
store = test_store_contract.store  # the conformance suite's fixture
LATER = 10**11  # a window's end after everything written here


def settled(store: Store, call_id: str) -> str:
    iid = dispatch(store, call_id)
    assert store.record_outcome(iid, 1, S.COMPLETED, result="{}", error=None, now=store.now())
    return iid


def prune_all(store: Store) -> list[str]:
    found = store.prune_candidates(after_id="", before=LATER, limit=1000)
    return store.prune(store.histories(found), before=LATER)


def denials_of(store: Store, intent_id: str) -> list[object]:
    return [d for d in store.denials() if d.intent_id == intent_id]


@pytest.mark.parametrize("write", ["event", "denial"])
def test_an_intent_written_to_after_its_history_was_read_is_not_deleted(
    store: Store, store_url: str, write: str
) -> None:
    ids = [settled(store, f"c{n}") for n in range(3)]
    read = store.histories(store.prune_candidates(after_id="", before=LATER, limit=10))
    other = open_store(store_url)  # another connection writes between the read and the delete
    try:
        if write == "event":  # an undo's note: it changes no state, nor updated_at
            other.record_event(ids[1], "undo_requested", actor="ann", detail={}, now=1.0)
        else:  # a tool still running after its call settled
            other.record_denial(tool_id="t.tool", intent_id=ids[1], attempt=1,
                                action="http", target="x", reason="late", now=1.0)
    finally:
        other.close()
    kept = store.get_intent(ids[1])
    after = (store.events(ids[1]), store.attempts(ids[1]), denials_of(store, ids[1]))
    assert kept is not None and len(after[0]) + len(after[2]) == 3
    assert sorted(store.prune(read, before=LATER)) == sorted([ids[0], ids[2]])
    assert store.get_intent(ids[1]) == kept  # the changed one stays, untouched
    assert (store.events(ids[1]), store.attempts(ids[1]), denials_of(store, ids[1])) == after
    assert prune_all(store) == [ids[1]]  # read again, it goes


def test_an_undo_intent_stays_while_its_original_remains(store: Store) -> None:
    long = "r/" + "\u00e9" * 254  # its undo call id is shortened to a hash
    assert undo_of(long).startswith("undo/sha256:")
    originals = {c: settled(store, c) for c in ("c1", "c2", long)}
    undos = {c: settled(store, undo_of(c, n)) for c, n in (("c1", 1), ("c2", 2), (long, 1))}
    # The original names its undo in its undo events: the hashed call id is found by them.
    store.record_event(originals[long], "undo_requested", actor="ann",
                       detail={"undo_call_id": undo_of(long)}, now=1.0)
    stay = [originals["c1"], originals[long]]
    # The originals stay (e.g. kept by their key window): only c2 and its undo go.
    found = [i for i in store.prune_candidates(after_id="", before=LATER, limit=100)
             if i.id not in stay]
    assert sorted(store.prune(store.histories(found), before=LATER)) == sorted(
        [originals["c2"], undos["c2"]])
    for c in ("c1", long):
        assert store.get_intent(undos[c]) is not None, c
    # Once its original goes, an undo intent goes: in the same batch, or in a later one.
    assert sorted(prune_all(store)) == sorted([*stay, undos["c1"], undos[long]])
