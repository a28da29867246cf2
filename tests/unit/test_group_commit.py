"""SQLite group commit: batched callers, each released only after its own commit, and one
caller's failure does not sink the others in its batch (a real file, real threads)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from poimen.store._group_commit import GroupCommit as _GroupCommit


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    return conn


def _visible(path: Path, name: str) -> int:
    other = sqlite3.connect(path)  # another connection sees committed rows only
    try:
        return int(other.execute("SELECT COUNT(*) FROM t WHERE name = ?", (name,)).fetchone()[0])
    finally:
        other.close()


def test_a_failing_caller_does_not_sink_its_batch(tmp_path: Path) -> None:
    path = tmp_path / "gc.db"
    conn = _connect(path)
    conn.execute("CREATE TABLE t (name TEXT PRIMARY KEY)")
    statements: list[str] = []
    conn.set_trace_callback(statements.append)
    gc = _GroupCommit(conn)
    leading, release = threading.Event(), threading.Event()
    results: dict[str, object] = {}
    seen_after_return: dict[str, int] = {}

    def hold(c: sqlite3.Connection) -> str:
        c.execute("INSERT INTO t VALUES ('first')")
        leading.set()
        assert release.wait(10)
        return "first"

    def insert(name: str) -> object:
        def op(c: sqlite3.Connection) -> str:
            c.execute("INSERT INTO t VALUES (?)", (name,))
            return name

        return op

    def fail(c: sqlite3.Connection) -> None:
        c.execute("INSERT INTO t VALUES ('doomed')")
        raise ValueError("this caller's write is refused")

    def caller(name: str, fn: object) -> None:
        try:
            results[name] = gc.run(fn)  # type: ignore[arg-type]
        except ValueError as exc:
            results[name] = exc
        seen_after_return[name] = _visible(path, name)

    first = threading.Thread(target=caller, args=("first", hold))
    first.start()
    assert leading.wait(10)  # the first caller leads and holds its transaction open
    others = [
        threading.Thread(target=caller, args=("b", insert("b"))),
        threading.Thread(target=caller, args=("doomed", fail)),
        threading.Thread(target=caller, args=("d", insert("d"))),
    ]
    for t in others:
        t.start()
    while len(gc._queue) < 3:  # all three queue behind the leader: one batch
        threading.Event().wait(0.01)
    release.set()
    for t in [first, *others]:
        t.join(10)
    assert results["first"] == "first" and results["b"] == "b" and results["d"] == "d"
    assert isinstance(results["doomed"], ValueError)
    # Each caller's row was committed before its call returned; the failed one never was.
    assert seen_after_return == {"first": 1, "b": 1, "d": 1, "doomed": 0}
    assert [r[0] for r in conn.execute("SELECT name FROM t ORDER BY name")] == ["b", "d", "first"]
    # The batch was re-run with one savepoint per caller after the failure.
    assert sum(s == "SAVEPOINT op" for s in statements) == 3
    conn.close()


@pytest.mark.parametrize("callers", [8, 32])
def test_every_caller_returns_after_its_own_commit(tmp_path: Path, callers: int) -> None:
    path = tmp_path / "gc.db"
    conn = _connect(path)
    conn.execute("CREATE TABLE t (name TEXT PRIMARY KEY)")
    gc = _GroupCommit(conn)
    missing: list[str] = []
    start = threading.Barrier(callers)

    def caller(n: int) -> None:
        start.wait()
        for i in range(20):
            name = f"{n}-{i}"
            gc.run(lambda c, name=name: c.execute("INSERT INTO t VALUES (?)", (name,)))
            if _visible(path, name) != 1:
                missing.append(name)

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert missing == []
    assert conn.execute("SELECT COUNT(*) FROM t").fetchone()[0] == callers * 20
    conn.close()
