"""The PostgreSQL store under interrupts: a raising signal handler landing anywhere in a write
or a read made on the main thread leaves no session in a transaction, no connection lost to the
pool and no session unusable, and a caller told "committed" finds its write in the log.

Real signals, the real server, one pooled session (so a session spoiled by an interrupt is the
one the next call gets). See tests/interrupts.py for where the signal is raised."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import poimen.store.postgres as postgres_store
from poimen._core.intents import IntentState
from poimen.store.postgres import PostgresStore
from tests.contract.test_store_contract import A, dispatch
from tests.interrupts import Injection, Interrupted, every_point, raising_handler

from ..conftest import POSTGRES_URL

pytestmark = pytest.mark.postgres
S = IntentState


@pytest.fixture(autouse=True)
def _raising_handler() -> Iterator[None]:
    with raising_handler():
        yield


def _sessions_in_transaction(app: str) -> int:
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        row = admin.execute(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = %s "
            "AND state LIKE 'idle in transaction%%'",
            (app,),
        ).fetchone()
    return int(row[0]) if row else 0


# Between the pool (or the store's kept sessions) handing out a connection and the `try` that
# gives it back there is a point where a signal's exception loses the connection: no Python
# code can close it (psycopg_pool's own `connection()` has the same). The store then works on
# with one connection fewer, and on direct connections once the pool is empty.
_LENT = {
    f"_connection line {n}"
    for n, line in enumerate(Path(postgres_store.__file__).read_text().splitlines(), 1)
    if ".getconn(timeout=" in line or "conn = idle.pop()" in line
}


def _each_point(
    postgres_url: str, call: Callable[[PostgresStore], Any], landed: Callable[[PostgresStore], bool]
) -> None:
    """Interrupt `call` at each point in turn, on a store with one pooled session; after each,
    the store still serves a write from that session, nothing is left in a transaction, and a
    call that returned really landed."""

    def scenario(inj: Injection) -> None:
        app = f"poimen-intr-{uuid.uuid4().hex[:8]}"
        store = PostgresStore(f"{postgres_url}?application_name={app}", min_size=1, max_size=1)
        try:
            returned = False
            try:
                with inj:
                    call(store)
                returned = True
            except Interrupted:
                pass
            assert _sessions_in_transaction(app) == 0, "a session was left in a transaction"
            if inj.where not in _LENT:  # every session idle, in the pool or kept by the store
                stats = store._pool.get_stats()
                kept = len(store._idle)
                assert stats.get("pool_available", 0) + kept == stats.get("pool_size"), stats
            dispatch(store)  # the session still takes a write
            assert not returned or landed(store), "the call returned but its write is not in the log"
        finally:
            store.close()

    assert every_point(postgres_store.__file__, scenario) > 10


def test_an_interrupt_anywhere_in_a_dispatch(postgres_url: str) -> None:
    ids: list[str] = []

    def call(s: PostgresStore) -> None:
        ids.append(dispatch(s))

    _each_point(postgres_url, call, lambda s: s.get_intent(ids[-1]) is not None)


def test_an_interrupt_anywhere_in_an_outcome(postgres_url: str) -> None:
    ids: list[str] = []

    def call(s: PostgresStore) -> None:
        ids.append(dispatch(s))
        s.record_outcome(ids[-1], 1, S.COMPLETED, result="1", error=None, now=s.now())

    def landed(s: PostgresStore) -> bool:
        it = s.get_intent(ids[-1])
        return it is not None and it.state == S.COMPLETED

    _each_point(postgres_url, call, landed)


def test_an_interrupt_anywhere_in_a_claim(postgres_url: str) -> None:
    ids: list[str] = []

    def call(s: PostgresStore) -> None:
        ids.append(dispatch(s))
        now = s.now()
        claimed = s.claim(
            ids[-1], 1, A, lease_expires_at=now + 30, new_attempt=True, deadline_at=None, now=now
        )
        assert claimed is not None

    def landed(s: PostgresStore) -> bool:
        it = s.get_intent(ids[-1])
        return it is not None and it.fence == 2

    _each_point(postgres_url, call, landed)
