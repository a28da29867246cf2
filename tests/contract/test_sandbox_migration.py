"""Migration 6 (sandbox records) on a filled log, on both backends: every row kept, the new
table append-only, and a sandbox kernel working on the migrated log."""

from __future__ import annotations

import pytest

from poimen import Caps, IntentState, Kernel, Pending, ToolContext, Unsafe
from poimen.store import _sandbox as records
from poimen.store import open_store
from poimen.store._base import DENIAL_COLUMNS, EVENT_COLUMNS, INTENT_COLUMNS
from tests.contract.test_migrations import write_log_before
from tests.contract.test_store_contract import raw, refusal

S = IntentState


def write_log_before_sandbox(url: str) -> None:
    write_log_before(url, records.SANDBOX_VERSION)


def _every_row(table: str) -> str:
    # Migration 7 adds a column to intents: the rows compared are those of version 6.
    # The columns of version 5 (version 10 adds the audit chain's links to some tables).
    cols = {"intents": INTENT_COLUMNS, "events": EVENT_COLUMNS,
            "denials": DENIAL_COLUMNS}.get(table, "*")
    return f"SELECT {cols} FROM {table} ORDER BY 1, 2"


def test_a_filled_log_keeps_every_row_through_migration_6(store_url: str) -> None:
    write_log_before_sandbox(store_url)
    tables = ("intents", "attempts", "events", "outbox", "deliveries", "denials")
    before = {t: raw(store_url, _every_row(t)) for t in tables}
    old = open_store(store_url, readonly=True)
    try:
        assert old.schema_version() < records.SANDBOX_VERSION
        assert not records.has_records(old) and records.sandbox_calls(old, None) == []
    finally:
        old.close()

    with Kernel(store_url, mode="shadow", notifiers=[]) as k:  # migrates, then records
        assert k.store.schema_version() >= records.SANDBOX_VERSION
        assert {t: raw(store_url, _every_row(t)) for t in tables} == before

        @k.tool(id="t.other", effects=Unsafe(), caps=Caps(), timeout=1)
        def other(ctx: ToolContext) -> None:
            raise AssertionError("a shadow kernel never runs an Unsafe tool")

        out = k.call("t.other", {}, call_id="shadow-1")
        assert isinstance(out, Pending) and out.reason == "would_have_called"
        # The old intents answer as before; the Indeterminate one is still for an operator.
        c = k.store.get_by_call_id("call-c")
        assert c is not None and c.state == S.INDETERMINATE
        [kept] = records.sandbox_calls(k.store, None)
        assert (kept.call_id, kept.tool_id, kept.effect, kept.answer) == (
            "shadow-1", "t.other", "unsafe", "would_have_called")
        assert records.get(k.store, "shadow-1") == kept
    for sql in ("UPDATE sandbox_calls SET answer = 'live'", "DELETE FROM sandbox_calls"):
        with pytest.raises(refusal(store_url), match="append-only"):
            raw(store_url, sql)
    # Recovery reads intents only: the migrated log's unfinished intent is still the one.
    store = open_store(store_url)
    try:
        assert [i.call_id for i in store.list_unfinished(after_id="", limit=10)] == ["call-b"]
        assert [i.call_id for i in records.intents(store, "call-")] == [
            "call-a", "call-b", "call-c"]
        a = store.get_by_call_id("call-a")
        assert a is not None and (a.state, a.result) == (S.COMPLETED, "42")
    finally:
        store.close()
