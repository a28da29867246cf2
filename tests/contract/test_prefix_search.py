"""Every call-id prefix search finds exactly the call ids that start with the prefix, whatever
characters follow it (U+10FFFF, the last code point, included) and whatever characters the
prefix ends with. Both backends: `search_call_id` (undo's scope, `poimen search`) and the
sandbox's intent and record listings (`poimen diff`)."""

from __future__ import annotations

import pytest

from poimen.store import Store, open_store
from poimen.store import _sandbox as records
from poimen.store._sandbox import SandboxCall
from tests.contract import test_store_contract
from tests.contract.test_store_contract import dispatch

store = test_store_contract.store  # the conformance suite's fixture

TOP = "\U0010ffff"  # the last code point: an MCP client may put it in its ids
# Call ids around each prefix: the ones starting with it, then the ones that do not.
CASES = [
    ("mcp/", ["mcp/" + TOP, "mcp/" + TOP + "x", "mcp/a", "mcp/\U0001f600", "mcp/"],
     ["mcp", "mcp0", "mcq/", "mc/" + TOP]),
    ("s" + TOP, ["s" + TOP, "s" + TOP + TOP, "s" + TOP + "a"], ["s", "t", "s\ufffd"]),
    (TOP, [TOP, TOP + "a", TOP + TOP], ["\U0010fffe", "z"]),
    ("a\ud7ff", ["a\ud7ff", "a\ud7ffb"], ["a\ue000", "a\ud7fe"]),
]


@pytest.mark.parametrize(("prefix", "inside", "outside"), CASES)
def test_a_prefix_search_finds_every_call_id_that_starts_with_the_prefix(
    store: Store, prefix: str, inside: list[str], outside: list[str]
) -> None:
    ids = {c: dispatch(store, c) for c in inside + outside}
    found = {i.call_id for i in store.search_call_id(prefix, limit=100)}
    assert found == set(inside)
    assert {i.id for i in records.intents(store, prefix)} == {ids[c] for c in inside}


def test_the_sandbox_records_are_searched_by_the_same_rule(store_url: str) -> None:
    s = open_store(store_url)
    try:
        for n, c in enumerate(["mcp/" + TOP, "mcp/a", "mcq/" + TOP]):
            records.record(s, SandboxCall(
                id=f"sb_{n}", call_id=c, mode="shadow", tool_id="t.tool", effect="unsafe",
                args="{}", args_hash="h", answer="would_have_called", source=None,
                outcome=None, divergence=None, created_at=1.0))
        assert {r.call_id for r in records.sandbox_calls(s, "mcp/")} == {"mcp/" + TOP, "mcp/a"}
    finally:
        s.close()
