"""Shared fixtures: real SQLite files, the real PostgreSQL server, a provider process."""

from __future__ import annotations

import contextlib
import functools
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from poimen.testing import ProviderClient, ProviderProcess

# In CI a missing PostgreSQL is a failure, never a skip.
REQUIRE_POSTGRES = os.environ.get("POIMEN_REQUIRE_POSTGRES") == "1"
POSTGRES_URL = os.environ.get("POIMEN_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


def need_postgres(reason: str = "PostgreSQL is absent") -> None:
    """Skip loudly where PostgreSQL is absent; fail instead when CI requires it."""
    if REQUIRE_POSTGRES:
        pytest.fail(f"POIMEN_REQUIRE_POSTGRES=1 but {reason}")
    pytest.skip(f"{reason} (set POIMEN_TEST_POSTGRES to run these)")


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'intents.db'}"


@functools.cache
def postgres_problem() -> str | None:
    """Why the test server cannot be used, or None when it can."""
    try:
        import psycopg
    except ImportError:
        return "psycopg is not installed (pip install 'poimen[postgres]')"
    try:
        psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
    except psycopg.Error as exc:
        return f"PostgreSQL at {POSTGRES_URL} is absent: {str(exc).splitlines()[0]}"
    return None


@contextlib.contextmanager
def fresh_postgres_database() -> Iterator[str]:
    """A new, empty database on the test server (from template0), dropped afterwards."""
    problem = postgres_problem()
    if problem is not None:
        need_postgres(problem)
    import psycopg

    name = f"poimen_t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name} TEMPLATE template0")
    parts = urlsplit(POSTGRES_URL)
    try:
        yield urlunsplit(parts._replace(path=f"/{name}"))
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database, for tests that are about PostgreSQL itself."""
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture
def postgres_store(postgres_url: str) -> Iterator[Any]:
    """An open PostgresStore on `postgres_url`, for reading what the processes under test did."""
    from poimen.store import open_store

    store = open_store(postgres_url)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty intent log on each backend the suite runs against."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'intents.db'}"
        return
    with fresh_postgres_database() as url:
        yield url


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[ProviderProcess]:
    with ProviderProcess(tmp_path / "ledger.db") as p:
        yield p


@pytest.fixture
def ledger(provider: ProviderProcess) -> Iterator[ProviderClient]:
    with ProviderClient(provider.url) as c:
        yield c
