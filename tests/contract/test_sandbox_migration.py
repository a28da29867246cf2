"""Migration 6 (sandbox records) on a filled log, on both backends: every row kept, the new
table append-only, and a sandbox kernel working on the migrated log."""

from __future__ import annotations

import sqlite3

import pytest

from poimen import Caps, IntentState, Kernel, Pending, ToolContext, Unsafe
from poimen.store import _sandbox as records
from poimen.store import open_store
from poimen.store._base import migrations
from poimen.store.sqlite import _statements
from tests.contract.test_migrations import write_v2_log
from tests.contract.test_store_contract import raw, refusal

S = IntentState


def write_log_before_sandbox(url: str) -> None:
    """A log filled by older versions (version 1 rows, a version 2 outbox), then migrated by
    every version before 5 as those versions did, one transaction each."""
    write_v2_log(url)
    dialect = "sqlite" if url.startswith("sqlite") else "postgres"
    for version, sql in migrations(dialect):
        if not 2 < version < records.SANDBOX_VERSION:
            continue
        if url.startswith("sqlite:///"):
            conn = sqlite3.connect(url[len("sqlite:///") :], isolation_level=None)
            try:
                conn.execute("BEGIN")
                for stmt in _statements(sql):
                    conn.execute(stmt)
                conn.execute("COMMIT")
            finally:
                conn.close()
        else:
            import psycopg

            with psycopg.connect(url, autocommit=True) as pg:
                pg.execute(sql.encode("utf-8"))
        raw(url, "INSERT INTO poimen_schema (version, applied_at) VALUES (?, ?)", (version, 0.0))


def test_a_filled_log_keeps_every_row_through_migration_6(store_url: str) -> None:
    write_log_before_sandbox(store_url)
    tables = ("intents", "attempts", "events", "outbox", "deliveries", "denials")
    before = {t: raw(store_url, f"SELECT * FROM {t} ORDER BY 1, 2") for t in tables}
    old = open_store(store_url, readonly=True)
    try:
        assert old.schema_version() < records.SANDBOX_VERSION
        assert not records.has_records(old) and records.sandbox_calls(old, None) == []
    finally:
        old.close()

    with Kernel(store_url, mode="shadow", notifiers=[]) as k:  # migrates, then records
        assert k.store.schema_version() >= records.SANDBOX_VERSION
        assert {t: raw(store_url, f"SELECT * FROM {t} ORDER BY 1, 2") for t in tables} == before

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
