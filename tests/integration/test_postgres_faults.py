"""Faults between poimen and PostgreSQL (issue 4, acceptance 5, and the store's start-up errors).

Connections are really cut: `pg_terminate_backend` on the store's sessions, and a database that
stops accepting connections. Effects are counted in the provider's ledger.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest

from poimen import Kernel
from poimen._core.effects import Idempotent, KeyDerivation, Unsafe
from poimen._core.tools import Caps
from poimen.errors import StoreUnavailableError
from poimen.store import open_store
from poimen.store.postgres import PostgresStore
from poimen.testing import CHARGE, EMAIL, SHIP, ProviderClient, register_test_tools

from ..conftest import POSTGRES_URL

pytestmark = pytest.mark.postgres


def _admin() -> psycopg.Connection[Any]:
    return psycopg.connect(POSTGRES_URL, autocommit=True)


def _terminate(admin: psycopg.Connection[Any], app: str) -> int:
    row = admin.execute(
        "SELECT COUNT(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE application_name = %s",
        (app,),
    ).fetchone()
    return int(row[0]) if row else 0


@pytest.fixture
def app_url(postgres_url: str) -> Iterator[tuple[str, str]]:
    """The test database's URL, tagged with an application name we can terminate by."""
    app = f"poimen-fault-{uuid.uuid4().hex[:8]}"
    yield f"{postgres_url}?application_name={app}", app


def test_terminated_connections_lose_nothing_and_duplicate_nothing(
    app_url: tuple[str, str],
    provider: Any,
    ledger: ProviderClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, app = app_url
    kernel = Kernel(PostgresStore(url, max_size=4, retry_for=20.0), deadline_margin=0.1)
    register_test_tools(kernel, provider.url, timeout=2.0)
    stop = threading.Event()
    killed: list[int] = []

    def killer() -> None:
        with _admin() as admin:
            while not stop.wait(random.uniform(0.03, 0.1)):
                killed.append(_terminate(admin, app))

    outcomes: dict[str, Any] = {}
    errors: list[str] = []

    def caller(t: int) -> None:
        for i in range(40):
            n = t * 100 + i
            tool, args = [
                (CHARGE, {"order_id": f"f-{n}", "amount_cents": n}),
                (SHIP, {"order_id": f"f-{n}", "address": "x"}),
                (EMAIL, {"to": f"f-{n}@example.com", "subject": "hi"}),
            ][n % 3]
            try:
                outcomes[f"f-{n}"] = (tool, args, kernel.call(tool, args, call_id=f"f-{n}"))
            except Exception as exc:  # collected and reported: every call must answer
                errors.append(f"f-{n}: {type(exc).__name__}: {exc}")

    caplog.set_level(logging.WARNING, logger="poimen.store.postgres")
    k = threading.Thread(target=killer)
    k.start()
    callers = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    try:
        for c in callers:
            c.start()
        for c in callers:
            c.join(timeout=120)
    finally:
        stop.set()
        k.join()
    try:
        assert not errors, errors[:10]
        assert sum(killed) > 0, "no connection was ever terminated"
        assert any("retrying" in r.getMessage() for r in caplog.records), "no write was retried"
        # Whatever was left unsettled by a lost connection, recovery finishes now.
        kernel.recover()
        store = kernel.store
        assert store.list_unfinished(after_id="", limit=10) == []
        plain: dict[str, int] = {}
        for e in ledger.entries(kind="plain"):
            plain[e["body"]["to"]] = plain.get(e["body"]["to"], 0) + 1
        assert len(outcomes) == 160
        for call_id, (tool, args, _outcome) in outcomes.items():
            it = store.get_by_call_id(call_id)
            assert it is not None, f"{call_id} lost"
            assert len(store.attempts(it.id)) >= 1
            if tool == CHARGE:
                assert (it.state.value, ledger.count(kind="keyed", key=it.key)) == ("COMPLETED", 1)
            elif tool == SHIP:
                n = ledger.count(kind="request", request_id=it.request_id)
                assert (it.state.value, n) == ("COMPLETED", 1), call_id
            else:
                # Unsafe: one effect at most, never re-issued; unsettled means INDETERMINATE.
                assert plain.get(args["to"], 0) == 1, call_id
                assert it.state.value in ("COMPLETED", "INDETERMINATE"), call_id
        assert sum(plain.values()) == sum(1 for t, _, _ in outcomes.values() if t == EMAIL)
    finally:
        kernel.close()


def _allow_connections(dbname: str, allow: bool) -> None:
    with _admin() as admin:
        admin.execute(f"ALTER DATABASE {dbname} ALLOW_CONNECTIONS {'true' if allow else 'false'}")
        if not allow:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (dbname,),
            )


@pytest.mark.parametrize("effects", ["idempotent", "unsafe"])
def test_outcome_that_cannot_be_written_stays_dispatched_and_is_recovered(
    postgres_url: str, provider: Any, ledger: ProviderClient, effects: str
) -> None:
    dbname = urlsplit(postgres_url).path.lstrip("/")
    kernel = Kernel(PostgresStore(postgres_url, retry_for=1.0, connect_timeout=1.0))
    u = urlsplit(provider.url)
    caps = Caps(hosts=(f"{u.hostname}:{u.port}",))
    cut, cut_done = threading.Event(), threading.Event()

    def cutter() -> None:
        # The cut runs outside the tool: the tool itself may open no connection of its own.
        if cut.wait(30):
            _allow_connections(dbname, False)
            cut_done.set()

    effect = (
        Idempotent(key=KeyDerivation.fields("order_id")) if effects == "idempotent" else Unsafe()
    )

    @kernel.tool(id="t.pay", effects=effect, caps=caps, timeout=5.0)
    def pay(ctx: Any, order_id: str) -> dict[str, Any]:
        if not cut.is_set():
            cut.set()
            assert cut_done.wait(10)
        if ctx.key is not None:
            r = ctx.http.post(f"{provider.url}/keyed", json={"order_id": order_id})
        else:
            r = ledger.plain_write({"order_id": order_id})
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    threading.Thread(target=cutter, daemon=True).start()
    try:
        with pytest.raises(StoreUnavailableError, match="record_outcome") as err:
            kernel.call("t.pay", {"order_id": "o-cut"}, call_id="cut-1")
        assert isinstance(err.value.__cause__, psycopg.OperationalError | Exception)
        assert (
            isinstance(err.value.__cause__, psycopg.OperationalError)
            or type(err.value.__cause__).__name__ == "PoolTimeout"
        )
        assert len(ledger.entries()) == 1  # the effect happened; only its outcome is lost
    finally:
        _allow_connections(dbname, True)
    try:
        probe = open_store(postgres_url)
        it = probe.get_by_call_id("cut-1")
        probe.close()
        assert it is not None and it.state.value == "DISPATCHED"
        report = kernel.recover()
        assert report.scanned == 1 and report.busy == 0
        done = kernel.store.get_by_call_id("cut-1")
        assert done is not None
        assert len(ledger.entries()) == 1  # recovered without a second effect
        if effects == "idempotent":
            assert done.state.value == "COMPLETED" and done.attempts == 2
        else:
            assert done.state.value == "INDETERMINATE"
            assert len(kernel.store.notifications(done.id)) == 1
    finally:
        kernel.close()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (
            "postgresql://postgres@127.0.0.1:1/test",
            "cannot connect to PostgreSQL at 127.0.0.1:1/test",
        ),
        (None, "does not exist"),
    ],
)
def test_database_down_at_start_is_a_clear_error(url: str | None, says: str) -> None:
    if url is None:
        url = urlsplit(POSTGRES_URL)._replace(path="/poimen_no_such_db").geturl()
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=says) as err:
        Kernel(url)
    assert isinstance(err.value.__cause__, psycopg.OperationalError)
    assert "Traceback" not in str(err.value) and "\n" not in str(err.value)
    assert time.monotonic() - started < 10


def test_clock_refresh_survives_a_terminated_session(app_url: tuple[str, str]) -> None:
    url, app = app_url
    store = PostgresStore(url, clock_refresh=0.0)
    try:
        with _admin() as admin:
            server = admin.execute("SELECT extract(epoch FROM clock_timestamp())::float8")
            row = server.fetchone()
            assert row is not None and abs(store.now() - row[0]) < 1.0
            assert _terminate(admin, app) >= 1
        store.now()  # the refresh meets a dead session: it keeps the last offset
        assert abs(store.now() - time.time()) < 1.0
        assert store.list_unfinished(after_id="", limit=1) == []  # and the pool recovered
    finally:
        store.close()
