"""SQLite group commit: batched callers, each released only after its own commit, and one
caller's failure does not sink the others in its batch (a real file, real threads)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from poimen.store._group_commit import GroupCommit as _GroupCommit
from tests.helpers import held_leader


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


class Refused(Exception):
    """An op's own failure."""


class Halt(BaseException):
    """An op's own failure that is no Exception."""


def _insert(name: str) -> Callable[[sqlite3.Connection], str]:
    def op(c: sqlite3.Connection) -> str:
        c.execute("INSERT INTO t VALUES (?)", (name,))
        return name

    return op


def _after_insert(name: str, exc: BaseException) -> Callable[[sqlite3.Connection], None]:
    def op(c: sqlite3.Connection) -> None:
        c.execute("INSERT INTO t VALUES (?)", (name,))
        raise exc

    return op


# Each op's answer does not depend on how it is committed: its value, or its own error.
OPS: list[Callable[[sqlite3.Connection], object]] = [
    _insert("a"),
    _insert("a"),  # the same row again: the op's own IntegrityError
    _after_insert("refused", Refused("this write is refused")),
    lambda c: None,  # writes nothing
    _after_insert("halted", Halt("stopped")),
    _insert("b"),
    lambda c: c.execute("SELECT COUNT(*) FROM t").fetchone()[0],  # what the op's batch sees
]


def _told(call: Callable[[], object]) -> tuple[str, object]:
    try:
        return "ok", call()
    except (Exception, Halt) as exc:
        return type(exc).__name__, str(exc)


def _rows(conn: sqlite3.Connection) -> list[str]:
    return [r[0] for r in conn.execute("SELECT name FROM t ORDER BY name")]


def _fresh(path: Path) -> _GroupCommit:
    conn = _connect(path)
    conn.execute("CREATE TABLE t (name TEXT PRIMARY KEY)")
    return _GroupCommit(conn)


def _behind_a_leader(gc: _GroupCommit, fns: list[Any]) -> list[tuple[str, object]]:
    """`fns` queued in order behind a held leader, then committed as one batch."""
    told: list[tuple[str, object]] = [("", None)] * len(fns)

    def call(i: int) -> None:
        told[i] = _told(lambda: gc.run(fns[i]))

    threads = []
    with held_leader(gc):
        for i in range(len(fns)):
            threads.append(threading.Thread(target=call, args=(i,)))
            threads[-1].start()
            while len(gc._queue) <= i:  # queued in this order
                threading.Event().wait(0.002)
    for t in threads:
        t.join(10)
    return told


def test_a_lone_caller_is_told_what_a_batch_tells_it(tmp_path: Path) -> None:
    """A caller that finds nobody leading commits its write at once; on the main thread or
    another, it is told what the same write tells its caller in a batch of one or of many,
    and the same rows are committed."""
    main = _fresh(tmp_path / "main.db")
    on_main = [_told(lambda fn=fn: main.run(fn)) for fn in OPS]  # type: ignore[misc]
    other = _fresh(tmp_path / "other.db")
    on_other: list[tuple[str, object]] = []
    for fn in OPS:
        t = threading.Thread(target=lambda fn=fn: on_other.append(_told(lambda: other.run(fn))))
        t.start()
        t.join(10)
    one = _fresh(tmp_path / "one.db")
    in_ones = [_behind_a_leader(one, [fn])[0] for fn in OPS]
    many = _fresh(tmp_path / "many.db")
    in_one_batch = _behind_a_leader(many, OPS)

    assert on_main == [
        ("ok", "a"),
        ("IntegrityError", "UNIQUE constraint failed: t.name"),
        ("Refused", "this write is refused"),
        ("ok", None),
        ("Halt", "stopped"),
        ("ok", "b"),
        ("ok", 2),
    ]
    assert on_other == on_main and in_ones == on_main and in_one_batch == on_main
    for gc in (main, other, one, many):
        assert _rows(gc._conn) == ["a", "b"]
        assert gc._holder is None and not gc._queue and not gc._conn.in_transaction


def test_a_dead_connection_tells_a_lone_caller_what_it_tells_a_batch(tmp_path: Path) -> None:
    lone = _fresh(tmp_path / "lone.db")
    lone._conn.close()
    batched = _fresh(tmp_path / "batched.db")

    def close(c: sqlite3.Connection) -> None:
        c.close()

    told = _behind_a_leader(batched, [close, _insert("x")])
    expected = (
        "StoreError",
        "commit failed: ProgrammingError('Cannot operate on a closed database.')",
    )
    assert told == [expected, expected]
    assert _told(lambda: lone.run(_insert("x"))) == expected
    assert lone._holder is None  # the role passed on: the next caller is told the same
    assert _told(lambda: lone.run(_insert("y"))) == expected


def test_lone_and_batched_callers_together_are_each_told_their_own_answer(
    tmp_path: Path,
) -> None:
    """Threads, the main thread and an event loop's tasks write at once: some find nobody
    leading and commit alone, the rest batch; each is told its own write's answer, and
    exactly the writes told "ok" are committed, each before its caller was told."""
    path = tmp_path / "gc.db"
    gc = _fresh(path)
    gc.run(_insert("taken"))
    told: dict[str, tuple[str, object]] = {}
    late: list[str] = []
    start = threading.Barrier(9)

    def ops(who: str) -> list[tuple[str, Callable[[sqlite3.Connection], object]]]:
        return [
            (f"{who}-{i}", _insert(f"{who}-{i}"))
            if i % 4
            else (f"{who}-{i}", _after_insert(f"{who}-{i}", Refused(who)))
            if i % 8
            else (f"{who}-{i}", _insert("taken"))
            for i in range(40)
        ]

    def sync_caller(who: str) -> None:
        start.wait()
        for name, fn in ops(who):
            told[name] = _told(lambda fn=fn: gc.run(fn))  # type: ignore[misc]
            if (told[name][0] == "ok") != (_visible(path, name) == 1):
                late.append(name)

    async def async_caller(who: str) -> None:
        start.wait()
        for name, fn in ops(who):
            try:
                told[name] = ("ok", await gc.submit(fn))
            except Exception as exc:
                told[name] = (type(exc).__name__, str(exc))
            if (told[name][0] == "ok") != (_visible(path, name) == 1):
                late.append(name)

    begins: list[str] = []
    gc._conn.set_trace_callback(lambda s: begins.append(s) if s == "BEGIN IMMEDIATE" else None)
    threads = [threading.Thread(target=sync_caller, args=(f"t{n}",)) for n in range(7)]
    threads.append(threading.Thread(target=lambda: asyncio.run(async_caller("loop"))))
    for t in threads:
        t.start()
    sync_caller("main")
    for t in threads:
        t.join(60)
    whos = [f"t{n}" for n in range(7)] + ["loop", "main"]
    expected = {
        name: ("ok", name)
        if int(name.rsplit("-", 1)[1]) % 4
        else ("Refused", name.rsplit("-", 1)[0])
        if int(name.rsplit("-", 1)[1]) % 8
        else ("IntegrityError", "UNIQUE constraint failed: t.name")
        for who in whos
        for name in (f"{who}-{i}" for i in range(40))
    }
    assert told == expected
    assert late == []
    assert len(begins) < len(expected)  # some writes were batched
    assert _rows(gc._conn) == sorted(
        ["taken", *(n for n, (what, _) in expected.items() if what == "ok")]
    )
