"""SQLite group commit under interrupts: a raising signal handler (Ctrl-C, an alarm) may land
anywhere in a write made on the main thread. The writer must never wedge, and no caller may be
told a wrong answer: a caller told "committed" finds its row in the file, one told "failed"
does not. The interrupted caller gets the interrupt; its own write may or may not be committed.

Real signals, real threads, a real file. The exhaustive tests raise the signal from a trace
function at each point of the writer's code where the interpreter runs signal handlers, one
point per run, so the handler's exception lands everywhere a real signal's could."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import poimen.store._group_commit as group_commit
from poimen.store._group_commit import GroupCommit as _GroupCommit
from tests.interrupts import Injection, Interrupted, every_point, raising_handler

WEDGED = 20.0  # seconds a write may take on a loaded machine before the writer counts as stuck


@pytest.fixture(autouse=True)
def _raising_handler() -> Iterator[None]:
    with raising_handler():
        yield


def _writer(path: Path) -> _GroupCommit:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=OFF")  # what is committed is the question, not fsync
    conn.execute("CREATE TABLE IF NOT EXISTS t (name TEXT PRIMARY KEY)")
    return _GroupCommit(conn)


def _visible(path: Path, names: list[str]) -> set[str]:
    other = sqlite3.connect(path)  # a fresh connection sees committed rows only
    try:
        found = other.execute(
            f"SELECT name FROM t WHERE name IN ({','.join('?' * len(names))})", names
        )
        return {r[0] for r in found}
    finally:
        other.close()


def _insert(name: str) -> Callable[[sqlite3.Connection], str]:
    def op(c: sqlite3.Connection) -> str:
        c.execute("INSERT INTO t VALUES (?)", (name,))
        return name

    return op


@dataclass
class Told:
    """What each caller was told: its name to "ok", "failed" or "interrupted"."""

    answers: dict[str, str] = field(default_factory=dict)
    errors: dict[str, Exception] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call(self, gc: _GroupCommit, name: str, fn: Any = None) -> None:
        try:
            got = gc.run(fn or _insert(name))
        except Interrupted:
            answer = "interrupted"
        except Exception as exc:
            answer = "failed"
            self.errors[name] = exc
        else:
            answer = "ok" if got == name else f"wrong value {got!r}"
        with self.lock:
            self.answers[name] = answer


def _in_thread(fn: Callable[[], None]) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)  # daemon: a wedged writer must not hang pytest
    t.start()
    return t


def _returned_ok(told: Told, threads: list[threading.Thread], names: list[str]) -> None:
    for t in threads:
        t.join(WEDGED)
        assert not t.is_alive(), "a caller beside the main thread never returned"
    assert [told.answers[n] for n in names] == ["ok"] * len(names), told.answers


def _no_wedge(gc: _GroupCommit, path: Path, name: str) -> None:
    """A write from another thread completes, and then one from the main thread."""
    told = Told()
    probe = _in_thread(lambda: told.call(gc, name))
    probe.join(WEDGED)
    assert not probe.is_alive(), "the writer is wedged: a later write never completed"
    assert told.answers[name] == "ok", told.answers
    assert gc.run(_insert(name + "-main")) == name + "-main"
    assert _visible(path, [name, name + "-main"]) == {name, name + "-main"}
    assert not gc._conn.in_transaction, "the writer's connection was left in a transaction"


def _check_told(path: Path, told: Told) -> None:
    """Told "ok": the row is committed. Told "failed": it is not. Interrupted: either."""
    names = list(told.answers)
    seen = _visible(path, names)
    lies = [
        f"{n} told {a} but {'present' if n in seen else 'absent'}"
        for n, a in told.answers.items()
        if (a == "ok") != (n in seen) and a != "interrupted"
    ]
    assert not lies, lies


def _wait_until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WEDGED
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.001)


def test_a_caller_interrupted_while_queued_does_not_wedge_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "gc.db"
    gc = _writer(path)
    held, release = threading.Event(), threading.Event()
    told = Told()

    def hold(c: sqlite3.Connection) -> str:
        c.execute("INSERT INTO t VALUES ('leader')")
        held.set()
        assert release.wait(WEDGED)
        return "leader"

    leader = _in_thread(lambda: told.call(gc, "leader", hold))
    assert held.wait(WEDGED)
    main = threading.main_thread().ident
    assert main is not None

    raised = threading.Event()

    def handler(signum: int, frame: object) -> None:
        if not raised.is_set():
            raised.set()
            raise Interrupted(signum)

    def interrupt_once_queued() -> None:
        _wait_until(lambda: len(gc._queue) > 0, "the main thread's write queued")
        # A signal that comes just before the main thread blocks is handled only when the
        # wait ends: send it again until the handler has run.
        while not raised.wait(0.05):
            signal.pthread_kill(main, signal.SIGUSR1)

    signal.signal(signal.SIGUSR1, handler)
    kicker = _in_thread(interrupt_once_queued)
    told.call(gc, "main")  # waits behind the leader until the signal's handler raises
    kicker.join(WEDGED)
    assert told.answers["main"] == "interrupted"
    release.set()
    leader.join(WEDGED)
    assert told.answers["leader"] == "ok", told.errors
    _no_wedge(gc, path, "later")
    _check_told(path, told)


def _each_point(
    gc: _GroupCommit, path: Path, scenario: Callable[[Injection, str], Told], least: int = 11
) -> None:
    """Run `scenario` with the signal raised at each point of the main thread's path through
    the writer in turn (at least `least` points); after each, the writer takes more writes
    and every answer was true."""
    all_told = Told()

    def checked(inj: Injection) -> None:
        name = f"k{inj.at}"
        told = scenario(inj, name)
        _no_wedge(gc, path, name + "-after")
        _check_told(path, told)
        all_told.answers.update(told.answers)

    assert every_point(group_commit.__file__, checked) >= least
    _check_told(path, all_told)  # nothing told committed was undone later


def test_an_interrupt_anywhere_in_a_lone_write_on_the_main_thread(tmp_path: Path) -> None:
    path = tmp_path / "gc.db"
    gc = _writer(path)

    def scenario(inj: Injection, name: str) -> Told:
        told = Told()
        with inj:
            told.call(gc, name)
        return told

    # A lone write commits inline: its thread id, the lock twice, BEGIN and COMMIT, its op
    # and the role handed on are its whole path.
    _each_point(gc, path, scenario, least=9)


def test_an_interrupt_anywhere_in_a_main_thread_write_that_others_queue_behind(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gc.db"
    gc = _writer(path)

    def scenario(inj: Injection, name: str) -> Told:
        told = Told()
        others: list[threading.Thread] = []

        def lead(c: sqlite3.Connection) -> str:
            c.execute("INSERT INTO t VALUES (?)", (name,))
            for i in range(3):  # three callers queue while this one leads
                others.append(_in_thread(lambda i=i: told.call(gc, f"{name}-{i}")))
            _wait_until(lambda: len(gc._queue) >= 3, "three callers queued")
            return name

        with inj:
            told.call(gc, name, lead)
        _returned_ok(told, others, [f"{name}-{i}" for i in range(len(others))])
        return told

    _each_point(gc, path, scenario)


def test_an_interrupt_anywhere_in_a_main_thread_write_queued_behind_another(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gc.db"
    gc = _writer(path)

    def scenario(inj: Injection, name: str) -> Told:
        told = Told()
        held, main_done = threading.Event(), threading.Event()
        others: list[threading.Thread] = []

        def hold(c: sqlite3.Connection) -> str:
            c.execute("INSERT INTO t VALUES (?)", (name + "-leader",))
            held.set()
            # Commit once the main thread's write and two more are queued behind, or once
            # the main thread gave up.
            _wait_until(lambda: bool(gc._queue) or main_done.is_set(), "main queued")
            for i in range(2):
                others.append(_in_thread(lambda i=i: told.call(gc, f"{name}-{i}")))
            _wait_until(lambda: len(gc._queue) >= 3 or main_done.is_set(), "all queued")
            return name + "-leader"

        leader = _in_thread(lambda: told.call(gc, name + "-leader", hold))
        assert held.wait(WEDGED)
        with inj:
            told.call(gc, name)
        main_done.set()
        leader.join(WEDGED)  # before reading `others`, which the leader fills
        _returned_ok(told, [leader, *others], [name + "-leader", f"{name}-0", f"{name}-1"])
        return told

    _each_point(gc, path, scenario)


@pytest.mark.parametrize("behind_a_leader", [False, True])
def test_an_interrupt_anywhere_in_an_async_submit_on_the_main_thread(
    tmp_path: Path, behind_a_leader: bool
) -> None:
    path = tmp_path / "gc.db"
    gc = _writer(path)

    def scenario(inj: Injection, name: str) -> Told:
        told = Told()
        held, release = threading.Event(), threading.Event()

        def hold(c: sqlite3.Connection) -> str:
            c.execute("INSERT INTO t VALUES (?)", (name + "-leader",))
            held.set()
            assert release.wait(WEDGED)
            return name + "-leader"

        async def main() -> None:
            fut: asyncio.Future[str] | None = None
            try:
                with inj:
                    fut = gc.submit(_insert(name))
            except Interrupted:
                told.answers[name] = "interrupted"
            release.set()
            if fut is not None:
                try:
                    got = await asyncio.wait_for(fut, WEDGED)
                    told.answers[name] = "ok" if got == name else f"wrong {got!r}"
                except Exception:
                    told.answers[name] = "failed"

        leader = _in_thread(lambda: told.call(gc, name + "-leader", hold))
        if behind_a_leader:
            assert held.wait(WEDGED)
        else:  # the writer thread leads
            release.set()
            leader.join(WEDGED)
        asyncio.run(main())
        _returned_ok(told, [leader], [name + "-leader"])
        return told

    _each_point(gc, path, scenario)
