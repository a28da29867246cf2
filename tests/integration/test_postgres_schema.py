"""PostgreSQL schemas: a log per schema selected in the URL, refused when newer (acceptance 6).

The dialect-neutral checks (concurrent migrators, newer-schema refusal) are in
tests/contract/test_store_contract.py and run here too; these are the PostgreSQL-only parts.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from poimen._core.intents import Owner
from poimen.errors import SchemaTooNewError
from poimen.store import NewDispatch, open_store
from poimen.store._base import latest_version, migrations

pytestmark = pytest.mark.postgres


def _in_schema(url: str, schema: str) -> str:
    return f"{url}?options=-csearch_path%3D{schema}"


def _dispatch(store: Any, call_id: str) -> None:
    now = store.now()
    owner = Owner("w", "h", 1, "1")
    store.record_dispatch(
        NewDispatch(
            f"in_{call_id}",
            call_id,
            "t",
            "unsafe",
            "{}",
            "h",
            None,
            None,
            owner,
            now + 30,
            1.0,
            now + 2,
            now,
        )
    )


def test_each_schema_holds_its_own_log_and_migrators_race_per_schema(postgres_url: str) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute("CREATE SCHEMA tenant_a")
        admin.execute("CREATE SCHEMA tenant_b")
    urls = [_in_schema(postgres_url, s) for s in ("tenant_a", "tenant_b")]
    barrier = threading.Barrier(6)
    stores: list[Any] = []
    errors: list[Exception] = []

    def migrator(url: str) -> None:
        barrier.wait()
        try:
            stores.append(open_store(url))
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=migrator, args=(urls[n % 2],)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        a, b = open_store(urls[0]), open_store(urls[1])
        _dispatch(a, "only-in-a")
        assert a.get_by_call_id("only-in-a") is not None
        assert b.get_by_call_id("only-in-a") is None
        a.close()
        b.close()
    finally:
        for s in stores:
            s.close()
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        for schema in ("tenant_a", "tenant_b"):
            rows = admin.execute(f"SELECT version FROM {schema}.poimen_schema").fetchall()
            assert rows == [(v,) for v, _ in migrations("postgres")]
        assert admin.execute("SELECT to_regclass('public.intents')").fetchone() == (None,)


def test_newer_schema_refusal_names_the_database_and_changes_nothing(postgres_url: str) -> None:
    store = open_store(postgres_url)
    _dispatch(store, "kept")
    store.close()
    newer = latest_version("postgres") + 1
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute("INSERT INTO poimen_schema (version, applied_at) VALUES (%s, 0)", (newer,))
    dbname = postgres_url.rsplit("/", 1)[1]
    with pytest.raises(SchemaTooNewError, match=f"{dbname} has schema version {newer}, newer than"):
        open_store(postgres_url)
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        assert admin.execute("SELECT call_id FROM intents").fetchall() == [("kept",)]
        assert admin.execute("SELECT max(version) FROM poimen_schema").fetchone() == (newer,)
