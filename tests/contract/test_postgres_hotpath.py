"""The call path's one-round-trip commits on PostgreSQL: values quoted client-side arrive intact,
event details are the bytes the SQLite store writes, and a lost answer is recognised as our own
commit."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest

from poimen._core.intents import IntentState
from poimen.errors import NotIndeterminateError
from poimen.store import NewDispatch, open_store
from poimen.store.postgres import Connection, PostgresStore
from tests.contract.test_store_contract import A, dispatch

S = IntentState
# Quotes, backslashes, a placeholder, non-ASCII and a float that needs all its digits.
AWKWARD = "it's \\N %s 'é' \\' E'x'"


def test_awkward_values_arrive_intact_and_details_match_the_sqlite_bytes(store_url: str) -> None:
    store = open_store(store_url)
    try:
        now = store.now() + 1e-7
        d = NewDispatch(
            f"in_{AWKWARD}", f"call {AWKWARD}", "t.tool", "idempotent", json.dumps({"s": AWKWARD}),
            "h", AWKWARD, None, A, now + 30, 0.1 + 0.2, now + 5, now,
        )  # fmt: skip
        it, created = store.record_dispatch(d)
        assert created and store.get_by_call_id(d.call_id) == it
        assert (it.id, it.args, it.key, it.timeout_s, it.created_at) == (
            d.intent_id, d.args, AWKWARD, 0.1 + 0.2, now,
        )  # fmt: skip
        assert store.record_outcome(it.id, 1, S.FAILED, result=None, error=AWKWARD, now=now)
        assert [(e.kind, e.at, e.detail) for e in store.events(it.id)] == [
            ("dispatched", now, json.dumps({"attempt": 1, "fence": 1, "key": AWKWARD}, sort_keys=True)),
            ("failed", now, json.dumps({"error": AWKWARD, "fence": 1}, sort_keys=True)),
        ]  # fmt: skip
        [att] = store.attempts(it.id)
        assert (att.outcome, att.error, att.ended_at) == ("failed", AWKWARD, now)
    finally:
        store.close()


class _LosesFirstAnswer(PostgresStore):
    """Commits a call-path write, then reports the connection lost, as a server that committed
    and died before answering would."""

    to_lose = 0

    def _one_trip(self, conn: Connection, name: str, params: Sequence[Any]) -> bool:
        found = super()._one_trip(conn, name, params)
        if self.to_lose:
            self.to_lose -= 1
            raise psycopg.OperationalError("answer lost")
        return found


@pytest.mark.postgres
def test_a_lost_answer_is_recognised_as_our_own_commit(postgres_url: str) -> None:
    store = _LosesFirstAnswer(postgres_url, retry_for=5.0)
    try:
        store.to_lose = 1
        iid = dispatch(store, "c-lost")  # asserts created: the landed try was ours
        store.to_lose = 1
        assert store.record_outcome(iid, 1, S.COMPLETED, result='"ok"', error=None, now=1.0)
        assert store.to_lose == 0
        [att] = store.attempts(iid)
        assert (att.outcome, att.late_outcome) == ("completed", None)
        assert [e.kind for e in store.events(iid)] == ["dispatched", "completed"]
    finally:
        store.close()


@pytest.mark.postgres
def test_a_new_session_prepares_the_call_path_again(postgres_url: str) -> None:
    store = PostgresStore(postgres_url, min_size=1, max_size=1)
    try:
        iid = dispatch(store, "c-1")
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        assert store.record_outcome(iid, 1, S.COMPLETED, result="1", error=None, now=1.0)
        iid = dispatch(store, "c-2")
        assert store.record_outcome(iid, 1, S.COMPLETED, result="2", error=None, now=1.0)
    finally:
        store.close()


def test_statements_dropped_from_a_live_session_are_prepared_again(postgres_url: str) -> None:
    # psycopg prepares a query of its own after 5 runs, and then answers a rolled-back
    # transaction with DEALLOCATE ALL, which takes the call path's statements too.
    store = PostgresStore(postgres_url, min_size=1, max_size=1)
    try:
        first = dispatch(store, "c1")
        for _ in range(6):
            store.get_intent(first)
        with pytest.raises(NotIndeterminateError):  # an operator's refused write rolls back
            store.resolve(first, landed=True, result=None, operator="op", reason="r", now=1.0)
        # The same session, its statements gone.
        with store._connection(5.0, direct=False) as conn:
            names = {r[0] for r in conn.execute("SELECT name FROM pg_prepared_statements")}
        assert not {"poimen_dispatch", "poimen_settle"} & names
        second = dispatch(store, "c2")
        assert store.record_outcome(first, 1, S.COMPLETED, result="1", error=None, now=store.now())
        assert store.record_outcome(second, 1, S.FAILED, result=None, error="x", now=store.now())
        assert [e.kind for e in store.events(first)] == ["dispatched", "completed"]
        assert [e.kind for e in store.events(second)] == ["dispatched", "failed"]
    finally:
        store.close()


@pytest.mark.postgres
def test_the_settled_rows_bytes_are_inlined_into_the_chains_update(postgres_url: str) -> None:
    # Not inlined, each text of the row is a SQL function planned again on every settle, with
    # the chain's head locked (migration 12; docs/performance.md).
    open_store(postgres_url).close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        plan = "\n".join(
            str(r[0])
            for r in conn.execute(
                "EXPLAIN (VERBOSE) SELECT poimen_audit_bytes(i) FROM intents i WHERE id = 'x'"
            )
        )
    assert "convert_to" in plan
    assert "poimen_audit_" not in plan, plan


@pytest.mark.postgres
def test_the_chains_trigger_plans_its_update_once_per_session(postgres_url: str) -> None:
    # The plan cache's default makes a custom plan of the head's UPDATE on every settle, which
    # inlines the row's bytes again each time (migration 13; docs/performance.md).
    open_store(postgres_url).close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT proconfig FROM pg_proc WHERE proname = 'poimen_audit_link'"
        ).fetchone()
    assert row is not None and "plan_cache_mode=force_generic_plan" in (row[0] or []), row
