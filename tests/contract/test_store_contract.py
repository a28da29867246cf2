"""One conformance suite for the Store protocol, run against SQLite and PostgreSQL (`store_url`)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from poimen._core.audit import sqlite_link
from poimen._core.intents import IntentState, Owner
from poimen.errors import (
    IllegalTransitionError,
    IntentNotFoundError,
    NotIndeterminateError,
    SchemaTooNewError,
)
from poimen.store import NewDispatch, NewNotification, Store, open_store
from poimen.store._base import latest_version, migrations

S = IntentState
A = Owner("worker-a", "host-a", 101, "1000")
B = Owner("worker-b", "host-b", 202, "2000")


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = open_store(store_url)
    try:
        yield s
    finally:
        s.close()


def raw(url: str, sql: str, params: Sequence[Any] = ()) -> list[Any]:
    """Run SQL behind the store's back (`?` placeholders), committed at once. On SQLite the
    connection links history rows into the audit chain as the store's writer does."""
    if url.startswith("sqlite:///"):
        conn = sqlite3.connect(url[len("sqlite:///") :], isolation_level=None)
        conn.create_function("poimen_link", -1, sqlite_link)
        try:
            return conn.execute(sql, params).fetchall()
        finally:
            conn.close()
    import psycopg

    with psycopg.connect(url, autocommit=True) as pg:
        cur = pg.execute(sql.replace("?", "%s"), params)
        return cur.fetchall() if cur.description else []


def refusal(url: str) -> type[Exception]:
    """The error each backend raises when a trigger refuses a change."""
    if url.startswith("sqlite:///"):
        return sqlite3.IntegrityError
    import psycopg.errors

    return psycopg.errors.RestrictViolation


def dispatch(
    store: Store,
    call_id: str | None = None,
    *,
    owner: Owner = A,
    effect: str = "idempotent",
    lease: float = 30.0,
    intent_id: str | None = None,
) -> str:
    now = store.now()
    d = NewDispatch(
        intent_id=intent_id or f"in_{uuid.uuid4().hex}",
        call_id=call_id or f"call-{uuid.uuid4().hex}",
        tool_id="t.tool",
        effect=effect,
        args='{"x":1}',
        args_hash="h1",
        key="k_1" if effect == "idempotent" else None,
        request_id="rq_1" if effect == "queryable" else None,
        owner=owner,
        lease_expires_at=now + lease,
        timeout_s=1.0,
        deadline_at=now + 2.0,
        now=now,
    )
    intent, created = store.record_dispatch(d)
    assert created
    return intent.id


def note(intent_id: str) -> NewNotification:
    return NewNotification(f"{intent_id}:indeterminate", "indeterminate", '{"x": 1}')


def claim(store: Store, intent_id: str, fence: int, owner: Owner = B, *, new_attempt: bool = True):  # type: ignore[no-untyped-def]
    now = store.now()
    return store.claim(
        intent_id,
        fence,
        owner,
        lease_expires_at=now + 30,
        new_attempt=new_attempt,
        deadline_at=None,
        now=now,
    )


# Transitions and the call path.


def test_dispatch_writes_intent_attempt_and_event_in_one_commit(store: Store) -> None:
    iid = dispatch(store, "c-1", effect="queryable")
    it = store.get_intent(iid)
    assert it is not None and it == store.get_by_call_id("c-1")
    assert (it.state, it.fence, it.attempts, it.owner) == (S.DISPATCHED, 1, 1, A)
    assert it.request_id == "rq_1" and it.key is None
    [att] = store.attempts(iid)
    assert (att.number, att.fence, att.owner, att.outcome) == (1, 1, A, None)
    [ev] = store.events(iid)
    assert (ev.kind, ev.from_state, ev.to_state, ev.actor) == (
        "dispatched",
        None,
        "DISPATCHED",
        "worker-a",
    )
    assert json.loads(ev.detail or "{}") == {"attempt": 1, "fence": 1, "request_id": "rq_1"}


def test_same_call_id_returns_the_recorded_intent_and_writes_nothing(store: Store) -> None:
    iid = dispatch(store, "c-dup")
    now = store.now()
    again = NewDispatch(
        "in_other", "c-dup", "t.tool", "idempotent", "{}", "h2", "k", None, B, now, 1, now, now
    )
    existing, created = store.record_dispatch(again)
    assert not created and existing.id == iid and existing.owner == A
    assert store.get_intent("in_other") is None
    assert len(store.attempts(iid)) == 1 and len(store.events(iid)) == 1


@pytest.mark.parametrize("state", [S.COMPLETED, S.FAILED])
def test_outcome_settles_intent_and_attempt(store: Store, state: IntentState) -> None:
    iid = dispatch(store)
    result, error = ("[1]", None) if state == S.COMPLETED else (None, "refused")
    assert store.record_outcome(iid, 1, state, result=result, error=error, now=store.now())
    it = store.get_intent(iid)
    assert it is not None
    assert (it.state, it.result, it.error, it.lease_expires_at) == (state, result, error, None)
    [att] = store.attempts(iid)
    assert att.outcome == state.value.lower() and att.ended_at is not None
    assert [e.kind for e in store.events(iid)] == ["dispatched", state.value.lower()]
    assert store.list_unfinished(after_id="", limit=10) == []


def test_illegal_transitions_are_refused(store: Store) -> None:
    iid = dispatch(store)
    with pytest.raises(IllegalTransitionError):
        store.record_outcome(iid, 1, S.RESOLVED_LANDED, result=None, error=None, now=store.now())
    with pytest.raises(NotIndeterminateError):
        store.resolve(iid, landed=True, result=None, operator="op", reason="r", now=store.now())
    with pytest.raises(IntentNotFoundError):
        store.resolve("in_nope", landed=False, result=None, operator="op", reason="r", now=1.0)
    assert store.record_outcome(iid, 1, S.COMPLETED, result="1", error=None, now=store.now())
    # A terminal intent accepts nothing more.
    assert claim(store, iid, 1) is None
    assert not store.mark_indeterminate(iid, 1, "x", note(iid), store.now())
    assert not store.complete_landed(iid, 1, "2", store.now())
    assert not store.defer(iid, 1, next_check_at=1.0, unknown_count=1, reason="r", now=1.0)
    it = store.get_intent(iid)
    assert it is not None and (it.state, it.result, it.fence) == (S.COMPLETED, "1", 1)
    assert store.notifications(iid) == []


def test_indeterminate_then_resolved_once(store: Store) -> None:
    iid = dispatch(store, effect="unsafe")
    assert store.mark_indeterminate(iid, 1, "unsafe_unknown_outcome", note(iid), store.now())
    assert not store.mark_indeterminate(iid, 1, "unsafe_unknown_outcome", note(iid), store.now())
    assert len(store.notifications(iid)) == 1
    it = store.resolve(
        iid, landed=True, result='{"ok":1}', operator="ann", reason="saw it", now=store.now()
    )
    assert (it.state, it.result) == (S.RESOLVED_LANDED, '{"ok":1}')
    with pytest.raises(NotIndeterminateError):
        store.resolve(iid, landed=False, result=None, operator="bob", reason="r", now=store.now())
    ev = store.events(iid)[-1]
    assert (ev.kind, ev.from_state, ev.to_state, ev.actor) == (
        "resolved",
        "INDETERMINATE",
        "RESOLVED_LANDED",
        "ann",
    )
    assert json.loads(ev.detail or "{}")["reason"] == "saw it"


# Fences, claims, late outcomes.


def test_claim_bumps_fence_and_opens_a_new_attempt(store: Store) -> None:
    iid = dispatch(store)
    it = claim(store, iid, 1)
    assert it is not None and (it.fence, it.attempts, it.owner) == (2, 2, B)
    assert claim(store, iid, 1) is None  # the old fence is spent
    assert [(a.number, a.fence, a.owner) for a in store.attempts(iid)] == [(1, 1, A), (2, 2, B)]
    again = claim(store, iid, 2, A, new_attempt=False)
    assert again is not None and (again.fence, again.attempts, again.owner) == (3, 2, A)
    assert [e.kind for e in store.events(iid)] == ["dispatched", "retry", "claimed"]


def test_stale_owner_outcome_is_refused_and_kept_as_evidence(store: Store) -> None:
    iid = dispatch(store)
    assert claim(store, iid, 1) is not None
    assert not store.record_outcome(
        iid, 1, S.COMPLETED, result='"late"', error=None, now=store.now()
    )
    it = store.get_intent(iid)
    assert it is not None and (it.state, it.fence, it.result) == (S.DISPATCHED, 2, None)
    first, second = store.attempts(iid)
    assert (first.late_outcome, first.late_result, first.outcome) == ("completed", '"late"', None)
    assert second.late_outcome is None
    assert store.events(iid)[-1].kind == "late_outcome"
    assert store.record_outcome(iid, 2, S.COMPLETED, result='"new"', error=None, now=store.now())
    it = store.get_intent(iid)
    assert it is not None and (it.state, it.result) == (S.COMPLETED, '"new"')


def test_stale_owner_cannot_overwrite_an_indeterminate_decision(store: Store) -> None:
    iid = dispatch(store, effect="unsafe")
    assert store.mark_indeterminate(iid, 1, "unsafe_unknown_outcome", note(iid), store.now())
    assert not store.record_outcome(iid, 1, S.FAILED, result=None, error="boom", now=store.now())
    it = store.get_intent(iid)
    assert it is not None and it.state == S.INDETERMINATE
    [att] = store.attempts(iid)
    assert (att.late_outcome, att.late_result) == ("failed", "boom")


def test_racing_claims_have_exactly_one_winner(store: Store) -> None:
    ids = [dispatch(store) for _ in range(5)]
    barrier = threading.Barrier(8)
    wins: list[tuple[str, str]] = []
    lock = threading.Lock()

    def racer(n: int) -> None:
        me = Owner(f"w{n}", "h", n, "1")
        barrier.wait()
        for iid in ids:
            if claim(store, iid, 1, me) is not None:
                with lock:
                    wins.append((iid, me.worker_id))

    threads = [threading.Thread(target=racer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(w[0] for w in wins) == sorted(ids)
    for iid, winner in wins:
        it = store.get_intent(iid)
        assert it is not None and (it.fence, it.owner and it.owner.worker_id) == (2, winner)
        assert len(store.attempts(iid)) == 2


def test_a_stale_owner_cannot_make_a_claimed_intent_indeterminate(store: Store) -> None:
    # Recovery claimed the intent (fence 2) while its first owner still ran: the first owner's
    # verdict of an unknown outcome is stale and must change nothing the new owner holds.
    iid = dispatch(store, effect="unsafe")
    assert claim(store, iid, 1) is not None
    assert not store.mark_indeterminate(iid, 1, "unsafe_unknown_outcome", note(iid), store.now())
    assert not store.defer(iid, 1, next_check_at=1.0, unknown_count=1, reason="r", now=1.0)
    it = store.get_intent(iid)
    assert it is not None and (it.state, it.fence, it.owner) == (S.DISPATCHED, 2, B)
    assert (it.reason, it.unknown_count) != ("unsafe_unknown_outcome", 1)
    assert store.notifications(iid) == []
    assert store.mark_indeterminate(iid, 2, "unsafe_unknown_outcome", note(iid), store.now())


def test_complete_landed_is_a_cas_on_the_fence(store: Store) -> None:
    iid = dispatch(store, effect="queryable")
    assert claim(store, iid, 1, new_attempt=False) is not None
    assert not store.complete_landed(iid, 1, '"x"', store.now())
    assert store.complete_landed(iid, 2, '"x"', store.now())
    it = store.get_intent(iid)
    assert it is not None and (it.state, it.reason, it.result) == (
        S.COMPLETED,
        "landed_by_lookup",
        '"x"',
    )


def test_record_unknown_marks_the_attempt_once(store: Store) -> None:
    iid = dispatch(store)
    assert store.record_unknown(iid, 1, "TimeoutError", store.now())
    assert not store.record_unknown(iid, 1, "again", store.now())
    [att] = store.attempts(iid)
    assert (att.outcome, att.error) == ("unknown", "TimeoutError")
    it = store.get_intent(iid)
    assert it is not None and it.state == S.DISPATCHED


# Leases and deferral.


def test_renew_extends_only_the_owners_undeferred_leases(store: Store) -> None:
    mine, deferred, theirs = dispatch(store), dispatch(store), dispatch(store, owner=B)
    assert store.defer(
        deferred, 1, next_check_at=store.now() + 5, unknown_count=1, reason="r", now=store.now()
    )
    until = store.now() + 999
    assert store.renew_leases("worker-a", [mine, deferred, theirs], until, store.now()) == 1
    assert store.renew_leases("worker-a", [], until, store.now()) == 0
    got = {i: store.get_intent(i) for i in (mine, deferred, theirs)}
    assert got[mine] is not None and got[mine].lease_expires_at == until
    assert got[deferred] is not None and got[deferred].lease_expires_at != until
    assert got[theirs] is not None and got[theirs].lease_expires_at != until
    assert store.record_outcome(mine, 1, S.COMPLETED, result=None, error=None, now=store.now())
    assert store.renew_leases("worker-a", [mine], until + 1, store.now()) == 0  # settled


def test_a_lease_that_has_run_out_is_never_renewed(store: Store) -> None:
    # Its owner counts as gone from the moment it ran out: another worker may be deciding on
    # it with what it read then, so a late renewal must not bring the owner back.
    iid = dispatch(store, lease=0.5)
    lease = store.get_intent(iid).lease_expires_at  # type: ignore[union-attr]
    assert lease is not None
    assert store.renew_leases("worker-a", [iid], lease + 60, lease + 0.1) == 0
    assert store.get_intent(iid).lease_expires_at == lease  # type: ignore[union-attr]
    assert store.renew_leases("worker-a", [iid], lease + 60, lease - 0.1) == 1


def test_a_takeover_seizes_only_the_lease_it_judged(store: Store) -> None:
    # The recoverer judged the lease run out; the owner's renewal, sent by its clock before
    # that, applied in between: the seize on the judged lease must lose to it.
    iid = dispatch(store, lease=0.5)
    judged = store.get_intent(iid).lease_expires_at  # type: ignore[union-attr]
    assert judged is not None
    assert store.renew_leases("worker-a", [iid], judged + 60, judged - 0.1) == 1
    assert not store.seize(iid, 1, judged)
    assert store.get_intent(iid).lease_expires_at == judged + 60  # type: ignore[union-attr]

    # A seize that wins leaves a lease no renewal brings back, whatever its clock.
    other = dispatch(store, lease=0.5)
    before = store.get_intent(other)
    assert before is not None and before.lease_expires_at is not None
    history = (store.attempts(other), store.events(other))
    assert not store.seize(other, 2, before.lease_expires_at)  # another fence
    assert store.seize(other, 1, before.lease_expires_at)
    after = store.get_intent(other)
    assert after is not None and after.lease_expires_at is not None
    assert after.lease_expires_at <= before.lease_expires_at - 0.5
    assert after.fence == 1 and after.owner == before.owner
    assert (store.attempts(other), store.events(other)) == history  # no history of its own
    assert store.renew_leases("worker-a", [other], store.now() + 60, 0.0) == 0
    assert not store.seize(other, 1, before.lease_expires_at)  # judged on a stale read
    # A later recoverer judges the seized lease, as a crashed one left it, and takes it.
    assert store.seize(other, 1, after.lease_expires_at)
    assert claim(store, other, 1, new_attempt=False) is not None


def test_defer_sets_next_check_and_lease_together(store: Store) -> None:
    iid = dispatch(store, effect="queryable")
    at = store.now() + 7.5
    assert store.defer(
        iid, 1, next_check_at=at, unknown_count=2, reason="lookup_unknown: 503", now=store.now()
    )
    assert not store.defer(
        iid, 0, next_check_at=at, unknown_count=3, reason="stale", now=store.now()
    )
    it = store.get_intent(iid)
    assert it is not None
    assert (it.next_check_at, it.lease_expires_at, it.unknown_count, it.reason) == (
        at,
        at,
        2,
        "lookup_unknown: 503",
    )
    assert store.events(iid)[-1].kind == "deferred"
    c = claim(store, iid, 1, new_attempt=False)
    assert c is not None and c.next_check_at is None


def test_list_unfinished_pages_in_id_order_over_dispatched_only(store: Store) -> None:
    ids = sorted(dispatch(store, intent_id=f"in_{n:04d}") for n in range(7))
    assert store.record_outcome(ids[3], 1, S.COMPLETED, result=None, error=None, now=store.now())
    page1 = store.list_unfinished(after_id="", limit=4)
    page2 = store.list_unfinished(after_id=page1[-1].id, limit=4)
    assert [i.id for i in page1 + page2] == [i for i in ids if i != ids[3]]
    assert store.list_unfinished(after_id=ids[-1], limit=4) == []


def test_list_and_count_filters(store: Store) -> None:
    a, b = dispatch(store), dispatch(store, effect="unsafe")
    assert store.mark_indeterminate(b, 1, "r", note(b), store.now())
    assert [i.id for i in store.list_intents(state=S.INDETERMINATE)] == [b]
    assert {i.id for i in store.list_intents(tool_id="t.tool")} == {a, b}
    assert store.list_intents(tool_id="other") == []
    assert store.list_intents(since=store.now() + 60) == []
    assert len(store.list_intents(limit=1)) == 1
    assert store.counts() == {("t.tool", "DISPATCHED"): 1, ("t.tool", "INDETERMINATE"): 1}


def test_now_is_a_wall_clock(store: Store) -> None:
    assert abs(store.now() - time.time()) < 5


# Outbox, denials, events.


def test_outbox_delivery_bookkeeping(store: Store) -> None:
    iid = dispatch(store, effect="unsafe")
    now = store.now()
    assert store.mark_indeterminate(iid, 1, "unsafe_unknown_outcome", note(iid), now)
    assert not store.add_notification(iid, note(iid), now)  # one delivery id, one row
    assert store.add_notification(iid, NewNotification("extra", "reminder", "{}"), now)
    due = store.due_notifications(now + 1, 10)
    assert [n.delivery_id for n in due] == [f"{iid}:indeterminate", "extra"]
    first = due[0]
    store.mark_delivery_failed(first.id, "*", "HTTP 500", now + 100)
    [failed] = [n for n in store.notifications(iid) if n.id == first.id]
    assert (failed.attempts, failed.last_error, failed.next_attempt_at) == (
        1,
        "HTTP 500",
        now + 100,
    )
    assert [n.delivery_id for n in store.due_notifications(now + 1, 10)] == ["extra"]
    store.mark_delivered(first.id, "*", now + 101)
    store.mark_delivered(first.id, "*", now + 102)  # delivered once stays delivered once
    [done] = [n for n in store.notifications() if n.id == first.id]
    assert (done.delivered_at, done.attempts) == (now + 101, 2)
    assert [n.delivery_id for n in store.due_notifications(now + 200, 10)] == ["extra"]


def test_delivery_is_per_notifier(store: Store) -> None:
    iid = dispatch(store, effect="unsafe")
    now = store.now()
    two = NewNotification(f"{iid}:indeterminate", "indeterminate", "{}", ("log", "webhook:a"))
    assert store.mark_indeterminate(iid, 1, "unsafe_unknown_outcome", two, now)
    assert store.due_deliveries([], now + 1, 10) == []  # no notifiers: nothing to deliver
    assert store.due_deliveries(["other"], now + 1, 10) == []
    due = store.due_deliveries(["log", "webhook:a", "*"], now + 1, 10)
    assert sorted(d.notifier for _, d in due) == ["log", "webhook:a"]
    [(n, _)] = store.due_deliveries(["log"], now + 1, 10)
    store.mark_delivered(n.id, "log", now + 2)
    store.mark_delivery_failed(n.id, "webhook:a", "HTTP 500", now + 50)
    [note_row] = store.notifications(iid)
    assert note_row.delivered_at is None and note_row.attempts == 2  # webhook:a still owes it
    assert store.due_deliveries(["log", "webhook:a"], now + 10, 10) == []
    [(_, again)] = store.due_deliveries(["log", "webhook:a"], now + 60, 10)
    assert (again.notifier, again.attempts, again.last_error) == ("webhook:a", 1, "HTTP 500")
    store.mark_delivered(n.id, "webhook:a", now + 61)
    [note_row] = store.notifications(iid)
    assert note_row.delivered_at == now + 61 and note_row.attempts == 3
    assert [(d.notifier, d.delivered_at) for d in store.deliveries(iid)] == [
        ("log", now + 2),
        ("webhook:a", now + 61),
    ]


def test_denials_are_recorded_and_filtered(store: Store) -> None:
    now = store.now()
    d1 = store.record_denial(
        tool_id="t.a",
        intent_id="in_1",
        attempt=1,
        action="http",
        target="https://x",
        reason="no key",
        now=now,
    )
    d2 = store.record_denial(
        tool_id="t.b",
        intent_id=None,
        attempt=None,
        action="dispatch",
        target="c-9",
        reason="shadow mode",
        now=now + 10,
    )
    assert d2.id > d1.id and d1.reason == "no key"
    assert store.denials() == [d1, d2]
    assert store.denials(tool_id="t.b") == [d2]
    assert store.denials(since=now + 5) == [d2]
    assert store.denials(limit=1) == [d1]


@pytest.mark.parametrize("table", ["events", "denials"])
def test_history_tables_are_append_only(store: Store, store_url: str, table: str) -> None:
    iid = dispatch(store)
    store.record_denial(
        tool_id="t", intent_id=iid, attempt=1, action="a", target="t", reason="r", now=store.now()
    )
    # An event of its own: the happy path's events are in the intent row (store/_inline.py).
    assert store.record_event(iid, "noted", actor="t", detail={}, now=store.now())
    before = raw(store_url, f"SELECT COUNT(*) FROM {table}")
    assert before[0][0] > 0
    changes = [f"UPDATE {table} SET at = 0", f"DELETE FROM {table}"]
    if not store_url.startswith("sqlite:///"):  # SQLite has no TRUNCATE
        changes.append(f"TRUNCATE {table}")
    for sql in changes:
        with pytest.raises(refusal(store_url), match="append-only"):
            raw(store_url, sql)
    assert raw(store_url, f"SELECT COUNT(*) FROM {table}") == before


# Schema versions.


def test_schema_is_versioned_and_migrate_is_idempotent(store: Store, store_url: str) -> None:
    dialect = "sqlite" if store_url.startswith("sqlite") else "postgres"
    latest = latest_version(dialect)
    assert store.schema_version() == latest
    assert store.migrate() == latest
    rows = raw(store_url, "SELECT version FROM poimen_schema ORDER BY version")
    assert [r[0] for r in rows] == [v for v, _ in migrations(dialect)]


@pytest.mark.parametrize("migrate", [True, False])
def test_newer_schema_is_refused(store: Store, store_url: str, migrate: bool) -> None:
    newer = store.schema_version() + 1
    raw(store_url, "INSERT INTO poimen_schema (version, applied_at) VALUES (?, ?)", (newer, 0.0))
    with pytest.raises(SchemaTooNewError, match=f"schema version {newer}") as err:
        open_store(store_url, migrate=migrate)
    assert (err.value.found, err.value.known) == (newer, newer - 1)  # type: ignore[attr-defined]


def test_concurrent_migrators_leave_one_schema(store_url: str) -> None:
    # Imports done, every process waits for one start time, then all migrate at once.
    code = (
        "import sys, time; from poimen.store import open_store; "
        "time.sleep(max(0.0, float(sys.argv[2]) - time.time())); "
        "s = open_store(sys.argv[1]); print(s.schema_version()); s.close()"
    )
    start = str(time.time() + 2.5)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, store_url, start],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [o[1] for o in outs]
    dialect = "sqlite" if store_url.startswith("sqlite") else "postgres"
    latest = latest_version(dialect)
    assert {o[0].strip() for o in outs} == {str(latest)}
    rows = raw(store_url, "SELECT version FROM poimen_schema ORDER BY version")
    assert [r[0] for r in rows] == [v for v, _ in migrations(dialect)]
    s = open_store(store_url)
    try:
        dispatch(s)
        assert len(s.list_unfinished(after_id="", limit=10)) == 1
    finally:
        s.close()
