"""The witness provider's injected faults (poimen.testing._faults), against a real provider
process."""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from poimen.testing._faults import Faults
from poimen.testing._provider import ProviderClient, ProviderProcess


def test_a_fault_follows_the_seed_and_the_request_never_the_order() -> None:
    f = Faults.parse("before=0.2,after=0.2,lost=0.2,refuse=0.1,latency=0.5,max_latency=0.1,seed=3")
    keys = [(f"keyed/k{i}", n) for i in range(300) for n in range(2)]
    picks = {k: f.write(*k) for k in keys}
    assert {k: f.write(*k) for k in reversed(keys)} == picks  # another order, the same faults
    picks_list = list(picks.values())
    kinds = Counter(p.kind for p in picks_list)
    assert all(kinds[k] > 0 for k in (None, "before", "after", "lost", "refuse")), kinds
    assert any(p.delay > 0 for p in picks_list) and all(p.delay <= 0.1 for p in picks_list)
    other = Faults.parse("before=0.2,after=0.2,lost=0.2,refuse=0.1,seed=4")
    assert [other.write(f"keyed/k{i}", 0).kind for i in range(50)] != [
        f.write(f"keyed/k{i}", 0).kind for i in range(50)]


@pytest.mark.parametrize("spec", ["before=2", "nope=0.1", "before", "before=0.6,after=0.6",
                                  "max_latency=-1"])
def test_a_bad_spec_is_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        Faults.parse(spec)


def test_a_spec_reads_back() -> None:
    f = Faults.parse("lost=0.25,seed=9")
    assert Faults.parse(f.spec()) == f
    assert Faults.parse("") == Faults()


@pytest.fixture
def faulty(tmp_path: Path) -> Iterator[tuple[ProviderClient, Path]]:
    ledger = tmp_path / "ledger.db"
    with ProviderProcess(ledger, faults="") as p, ProviderClient(p.url) as c:
        yield c, ledger


def received(ledger: Path) -> list[tuple[str, str | None]]:
    with sqlite3.connect(ledger) as db:
        return db.execute("SELECT kind, fault FROM received ORDER BY id").fetchall()


@pytest.mark.parametrize(("fault", "status", "landed"), [
    ("before", 503, 0), ("refuse", 409, 0), ("after", 503, 1), (None, 201, 1),
])
def test_each_write_fault_lands_or_not_as_it_says(
    faulty: tuple[ProviderClient, Path], fault: str | None, status: int, landed: int
) -> None:
    client, ledger = faulty
    client.set_faults(f"{fault}=1" if fault else "")
    assert client.keyed_write("k", {"a": 1}).status_code == status
    assert client.request_write("r", {"a": 1}).status_code == status
    assert client.plain_write({"a": 1}).status_code == status
    assert [client.count(kind=k) for k in ("keyed", "request", "plain")] == [landed] * 3
    assert received(ledger) == [("keyed", fault), ("request", fault), ("plain", fault)]


def test_a_lost_response_lands_and_the_connection_closes(
    faulty: tuple[ProviderClient, Path],
) -> None:
    client, ledger = faulty
    client.set_faults("lost=1")
    with pytest.raises(httpx.RemoteProtocolError):
        client.plain_write({"a": 1})
    assert client.count(kind="plain") == 1
    assert received(ledger) == [("plain", "lost")]


def test_lookup_errors_and_faults_off(faulty: tuple[ProviderClient, Path]) -> None:
    client, ledger = faulty
    client.request_write("r", {"a": 1})
    client.set_faults("lookup_error=1")
    assert client.lookup("r").status_code == 503
    client.set_faults(None)
    assert client.lookup("r").status_code == 200
    client.plain_write({"a": 2})
    assert len(received(ledger)) == 1  # with faults off, writes are no longer recorded


def test_without_faults_nothing_is_recorded_as_received(tmp_path: Path) -> None:
    with ProviderProcess(tmp_path / "l.db") as p, ProviderClient(p.url) as c:
        c.plain_write({"a": 1})
    assert received(tmp_path / "l.db") == []
