"""PostgreSQL's `now()` is the server's clock (issue 20, defect 13): measured against this host's
elapsed-time clock, so a step of the host's wall clock between two measurements never moves it,
and a stall of the elapsed-time clock (a suspended host) is noticed and measured again.
The real clocks are never changed: the store's view of them is."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

import poimen.store.postgres as pg
from poimen.store.postgres import PostgresStore

pytestmark = pytest.mark.postgres
HOUR = 3600.0
# How far `now()` may be from the server's clock: far above a round trip on a loaded machine,
# far below the steps below.
MARGIN = 60.0


class Clocks(SimpleNamespace):
    """The `time` module as the store sees it: real, plus the steps a test makes."""

    def __init__(self) -> None:
        super().__init__(wall_step=0.0, elapsed_step=0.0, sleep=time.sleep)

    def time(self) -> float:
        return time.time() + self.wall_step

    def monotonic(self) -> float:
        return time.monotonic() + self.elapsed_step


@pytest.fixture
def clocks(monkeypatch: pytest.MonkeyPatch) -> Clocks:
    c = Clocks()
    monkeypatch.setattr(pg, "time", c)
    return c


@pytest.fixture
def store(postgres_url: str, clocks: Clocks) -> Iterator[PostgresStore]:
    s = PostgresStore(postgres_url)  # measures once now, then every 60 s
    yield s
    s.close()


def near_server_clock(store: PostgresStore, url: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        q = "SELECT extract(epoch FROM clock_timestamp())::float8"
        before: Any = conn.execute(q).fetchone()
        ours = store.now()
        after: Any = conn.execute(q).fetchone()
    return bool(before[0] - MARGIN <= ours <= after[0] + MARGIN)


@pytest.mark.parametrize("step", [HOUR, -HOUR])
def test_a_wall_clock_step_does_not_move_now(
    store: PostgresStore, postgres_url: str, clocks: Clocks, step: float
) -> None:
    assert near_server_clock(store, postgres_url)
    clocks.wall_step = step  # the host's clock jumps, before the next measurement is due
    assert near_server_clock(store, postgres_url)


def test_a_stalled_elapsed_clock_is_measured_again(
    store: PostgresStore, postgres_url: str, clocks: Clocks
) -> None:
    """A suspended host: its elapsed-time clock stood still for an hour while the wall clock
    (and the server's) went on. The disagreement makes the store measure the server again."""
    assert near_server_clock(store, postgres_url)
    clocks.elapsed_step = -HOUR
    assert near_server_clock(store, postgres_url)
