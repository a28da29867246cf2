"""Shared fixtures: real SQLite files, the real PostgreSQL server, a provider process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture(params=["sqlite"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty intent log on each backend the suite runs against."""
    return f"sqlite:///{tmp_path / 'intents.db'}"


@pytest.fixture
def provider(tmp_path: Path) -> Iterator[ProviderProcess]:
    with ProviderProcess(tmp_path / "ledger.db") as p:
        yield p


@pytest.fixture
def ledger(provider: ProviderProcess) -> Iterator[ProviderClient]:
    with ProviderClient(provider.url) as c:
        yield c
