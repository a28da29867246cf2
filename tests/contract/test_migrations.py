"""A log written by an older schema keeps every row through each migration, on both backends."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from poimen._core.intents import IntentState, Owner
from poimen.errors import ReadOnlyStoreError, StoreError
from poimen.store import open_store
from poimen.store._base import latest_version, migrations
from poimen.store.sqlite import _statements
from tests.contract.test_store_contract import claim, dispatch, raw, refusal

S = IntentState
A = Owner("worker-a", "host-a", 101, "1000")

# A version-1 log as a version-1 poimen wrote it: one intent settled after a retry, one
# unfinished, one Indeterminate; events numbered from 1 with AUTOINCREMENT.
V1_ROWS = [
    "INSERT INTO intents (id, call_id, tool_id, effect, args, args_hash, key, request_id, state, "
    "fence, owner_id, owner_host, owner_pid, owner_start, lease_expires_at, timeout_s, "
    "deadline_at, next_check_at, unknown_count, attempts, result, error, reason, created_at, "
    "updated_at) VALUES "
    "('in_a', 'call-a', 't.tool', 'idempotent', '{\"x\":1}', 'h1', 'k_a', NULL, 'COMPLETED', 2, "
    "'w', 'h', 1, '1', NULL, 5.0, 15.0, NULL, 0, 2, '42', NULL, NULL, 10.0, 12.0), "
    "('in_b', 'call-b', 't.tool', 'queryable', '{\"x\":2}', 'h2', NULL, 'rq_b', 'DISPATCHED', 1, "
    "'w', 'h', 1, '1', 99.0, 5.0, 16.0, NULL, 0, 1, NULL, NULL, NULL, 11.0, 11.0), "
    "('in_c', 'call-c', 't.other', 'unsafe', '{}', 'h3', NULL, NULL, 'INDETERMINATE', 1, "
    "'w', 'h', 1, '1', NULL, 5.0, 17.0, NULL, 0, 1, NULL, NULL, 'unsafe_unknown_outcome', "
    "12.0, 13.0)",
    "INSERT INTO attempts (intent_id, number, fence, owner_id, owner_host, owner_pid, "
    "owner_start, started_at, ended_at, outcome, result, error, late_outcome, late_result) VALUES "
    "('in_a', 1, 1, 'w', 'h', 1, '1', 10.0, 10.5, 'unknown', NULL, 'timeout', NULL, NULL), "
    "('in_a', 2, 2, 'r', 'h', 2, '2', 11.0, 12.0, 'completed', '42', NULL, NULL, NULL), "
    "('in_b', 1, 1, 'w', 'h', 1, '1', 11.0, NULL, NULL, NULL, NULL, NULL, NULL), "
    "('in_c', 1, 1, 'w', 'h', 1, '1', 12.0, NULL, NULL, NULL, NULL, NULL, NULL)",
    "INSERT INTO events (intent_id, at, kind, from_state, to_state, actor, detail) VALUES "
    "('in_a', 10.0, 'dispatched', NULL, 'DISPATCHED', 'w', '{\"fence\":1}'), "
    "('in_b', 11.0, 'dispatched', NULL, 'DISPATCHED', 'w', '{\"fence\":1}'), "
    "('in_a', 11.0, 'retry', 'DISPATCHED', 'DISPATCHED', 'r', '{\"fence\":2}'), "
    "('in_a', 12.0, 'completed', 'DISPATCHED', 'COMPLETED', 'kernel', '{\"fence\":2}'), "
    "('in_c', 12.0, 'dispatched', NULL, 'DISPATCHED', 'w', '{\"fence\":1}'), "
    "('in_c', 13.0, 'indeterminate', 'DISPATCHED', 'INDETERMINATE', 'kernel', NULL)",
    "INSERT INTO denials (at, tool_id, intent_id, attempt, action, target, reason) VALUES "
    "(10.2, 't.tool', 'in_a', 1, 'http', 'POST x', 'no_key')",
]


def write_v1_log(url: str) -> None:
    """Apply migration 1 only, record version 1, and fill it with V1_ROWS."""
    [(version, sql)] = [
        m for m in migrations("sqlite" if url.startswith("sqlite") else "postgres") if m[0] == 1
    ]
    if url.startswith("sqlite:///"):
        conn = sqlite3.connect(url[len("sqlite:///") :], isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            for stmt in _statements(sql):
                conn.execute(stmt)
        finally:
            conn.close()
    else:
        import psycopg

        with psycopg.connect(url, autocommit=True) as pg:
            pg.execute(sql.encode("utf-8"))
    raw(url, "CREATE TABLE poimen_schema (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)")
    raw(url, "INSERT INTO poimen_schema (version, applied_at) VALUES (?, ?)", (version, 0.0))
    for stmt in V1_ROWS:
        raw(url, stmt)


def test_a_version_1_log_keeps_every_row_through_migration(store_url: str) -> None:
    write_v1_log(store_url)
    store = open_store(store_url)
    try:
        dialect = "sqlite" if store_url.startswith("sqlite") else "postgres"
        assert store.schema_version() == latest_version(dialect) > 1

        a = store.get_intent("in_a")
        assert a is not None and a == store.get_by_call_id("call-a")
        assert (a.state, a.fence, a.attempts, a.result, a.key) == (S.COMPLETED, 2, 2, "42", "k_a")
        atts = store.attempts("in_a")
        assert [(t.number, t.fence, t.outcome, t.error) for t in atts] == [
            (1, 1, "unknown", "timeout"),
            (2, 2, "completed", None),
        ]
        assert [e.kind for e in store.events("in_a")] == ["dispatched", "retry", "completed"]
        assert [e.kind for e in store.events("in_c")] == ["dispatched", "indeterminate"]
        assert [i.id for i in store.list_unfinished(after_id="", limit=10)] == ["in_b"]
        assert [i.id for i in store.list_intents(state=S.INDETERMINATE)] == ["in_c"]
        assert [i.id for i in store.list_intents(tool_id="t.tool")] == ["in_a", "in_b"]
        assert [i.id for i in store.list_intents(since=11.5)] == ["in_c"]
        assert store.counts() == {
            ("t.tool", "COMPLETED"): 1,
            ("t.tool", "DISPATCHED"): 1,
            ("t.other", "INDETERMINATE"): 1,
        }
        [den] = store.denials()
        assert (den.tool_id, den.intent_id, den.reason) == ("t.tool", "in_a", "no_key")

        # The migrated log goes on working: a call, a claim of the old unfinished intent,
        # event ids still increasing after the old ones, the history still append-only.
        old_max = raw(store_url, "SELECT MAX(id) FROM events")[0][0]
        new = dispatch(store, "call-new")
        assert claim(store, "in_b", 1) is not None
        assert [t.number for t in store.attempts("in_b")] == [1, 2]
        # The new call's history is in its row until an event of its own spills it.
        assert store.record_event(new, "noted", actor="t", detail={}, now=20.0)
        assert [e.kind for e in store.events(new)] == ["dispatched", "noted"]
        assert min(e.id for e in store.events(new)) > old_max
        assert [e.kind for e in store.events("in_b")] == ["dispatched", "retry"]
        with pytest.raises(refusal(store_url), match="append-only"):
            raw(store_url, "DELETE FROM events")
        with pytest.raises(refusal(store_url), match="append-only"):
            raw(store_url, "UPDATE denials SET at = 0")
        assert raw(store_url, "SELECT COUNT(*) FROM events")[0][0] == 6 + 1 + 2
        with pytest.raises(Exception, match=r"(?i)unique|duplicate"):
            raw(
                store_url,
                "INSERT INTO intents (id, call_id, tool_id, effect, args, args_hash, "
                "state, fence, timeout_s, created_at, updated_at) VALUES "
                "('in_z', 'call-a', 't', 'unsafe', '{}', 'h', 'COMPLETED', 1, 1.0, 1.0, 1.0)",
            )
    finally:
        store.close()


def test_a_migration_that_fails_names_the_log_and_changes_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'log.db'}"
    write_v1_log(url)
    raw(url, "CREATE TABLE intents_v2 (x)")  # in the way of migration 2
    before = raw(url, "SELECT id, state FROM intents ORDER BY id")
    with pytest.raises(StoreError, match=r"schema version 2 failed, nothing was changed"):
        open_store(url)
    assert raw(url, "SELECT MAX(version) FROM poimen_schema") == [(1,)]
    assert raw(url, "SELECT id, state FROM intents ORDER BY id") == before


OUTBOX_ROWS = (
    "INSERT INTO outbox (delivery_id, intent_id, kind, payload, created_at, delivered_at, "
    "attempts, next_attempt_at, last_error) VALUES "
    "('in_c:indeterminate', 'in_c', 'indeterminate', '{}', 13.0, 14.0, 1, 13.0, NULL), "
    "('in_c:indeterminate_reminder:1', 'in_c', 'indeterminate_reminder', '{}', 20.0, NULL, 2, "
    "25.0, 'WebhookDeliveryError: answered 500')"
)


def write_v2_log(url: str) -> None:
    """A version-2 log: version 1 filled with V1_ROWS, migration 2 applied, and an outbox
    with one delivered notification and one still pending after two failed tries."""
    write_v1_log(url)
    apply_by_hand(url, 2)
    raw(url, OUTBOX_ROWS)


def apply_by_hand(url: str, version: int) -> None:
    """Apply migration `version` in one transaction and record it, as that poimen did."""
    dialect = "sqlite" if url.startswith("sqlite") else "postgres"
    [(_, sql)] = [m for m in migrations(dialect) if m[0] == version]
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


def write_log_before(url: str, version: int) -> None:
    """A log filled by older versions (version 1 rows, a version 2 outbox), then migrated by
    every version before `version` as those versions did, one transaction each."""
    write_v2_log(url)
    for v in range(3, version):
        apply_by_hand(url, v)


def test_a_version_2_log_keeps_its_outbox_through_migration_3(store_url: str) -> None:
    write_v2_log(store_url)
    before = raw(
        store_url, "SELECT id, delivery_id, delivered_at, attempts FROM outbox ORDER BY id"
    )
    store = open_store(store_url)
    try:
        assert store.schema_version() >= 3
        assert (
            raw(store_url, "SELECT id, delivery_id, delivered_at, attempts FROM outbox ORDER BY id")
            == before
        )
        assert [i.id for i in store.list_intents()] == ["in_a", "in_b", "in_c"]
        assert [e.kind for e in store.events("in_c")] == ["dispatched", "indeterminate"]
        [delivered, pending] = store.notifications("in_c")
        assert delivered.delivered_at == 14.0 and pending.delivered_at is None
        # The pending row was written for no notifier in particular: any kernel delivers it.
        [old] = store.deliveries("in_c")
        assert (old.notification_id, old.notifier, old.attempts, old.last_error) == (
            pending.id,
            "*",
            2,
            "WebhookDeliveryError: answered 500",
        )
        assert store.due_deliveries(["webhook:x"], 24.0, 10) == []  # not due before 25
        [(n, d)] = store.due_deliveries(["webhook:x", "*"], 26.0, 10)
        assert n.id == pending.id and d.notifier == "*"
        store.mark_delivered(pending.id, "*", 27.0)
        assert [n.delivered_at for n in store.notifications("in_c")] == [14.0, 27.0]
    finally:
        store.close()


def test_a_read_only_store_never_migrates_nor_writes(store_url: str) -> None:
    write_v2_log(store_url)
    ro = open_store(store_url, readonly=True)
    try:
        assert ro.schema_version() == 2  # an older log is read as it is, never migrated
        assert [i.id for i in ro.list_intents()] == ["in_a", "in_b", "in_c"]
        with pytest.raises(ReadOnlyStoreError):
            ro.resolve("in_c", landed=False, result=None, operator="a", reason="x", now=1.0)
        with pytest.raises(ReadOnlyStoreError):
            ro.migrate()
        with pytest.raises(ReadOnlyStoreError):
            ro.abandon("in_b", operator="a", reason="x", now=1.0)
    finally:
        ro.close()
    it = open_store(store_url, readonly=True)
    try:
        c = it.get_intent("in_c")
        assert c is not None and c.state == S.INDETERMINATE
    finally:
        it.close()
