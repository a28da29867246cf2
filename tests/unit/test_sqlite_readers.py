"""SQLite reads share a small pool of connections: however many threads read, the store holds
a bounded number of connections to the file (a real file, real threads)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from poimen.errors import StoreError
from poimen.store.sqlite import SqliteStore
from tests.contract.test_store_contract import dispatch


def _open_on(path: Path) -> int:
    """File descriptors of this process open on `path` (Linux: /proc/self/fd)."""
    fds = Path("/proc/self/fd")
    n = 0
    for fd in os.listdir(fds):
        try:
            if os.readlink(fds / fd) == str(path):
                n += 1
        except OSError:  # closed since the listing
            continue
    return n


def test_two_hundred_reading_threads_share_a_few_connections(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    store = SqliteStore(path)
    try:
        ids = [dispatch(store) for _ in range(5)]
        start = threading.Barrier(200)
        wrong: list[str] = []

        def reader() -> None:
            start.wait()
            for i in ids:
                it = store.get_intent(i)
                if it is None or it.id != i:
                    wrong.append(i)

        threads = [threading.Thread(target=reader) for _ in range(200)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert wrong == []
        # The writer's connection and at most 8 readers', whatever the number of threads.
        assert len(store._conns) <= 1 + 8
        if Path("/proc/self/fd").is_dir():
            assert 1 <= _open_on(path.resolve()) <= 1 + 8
    finally:
        store.close()
    assert store._conns == []


def test_the_reader_pool_size_is_checked(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="readers"):
        SqliteStore(tmp_path / "log.db", readers=0)
    one = SqliteStore(tmp_path / "log.db", readers=1)
    try:
        threads = [threading.Thread(target=one.counts) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(one._conns) <= 2
    finally:
        one.close()
