"""Test helpers shared by the integration and crash suites."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from poimen import IntentState, Kernel, Notification
from poimen._core.intents import Intent
from poimen.testing import kill_at_pause, register_test_tools, spawn_call

TIMEOUT = 0.5  # tool timeout in crash tests: keeps Queryable deadlines short
MARGIN = 0.1


def crash_call(
    tmp_path: Path, db_url: str, provider_url: str, tool: str, args: dict[str, Any],
    call_id: str, point: str, **kw: Any,
) -> str:
    """Run the call in a child process and SIGKILL it at `point`; returns the point reached."""
    pause = tmp_path / f"pause-{call_id}"
    proc = spawn_call(db_url, provider_url, tool, args, call_id, pause_at=point,
                      pause_file=pause, timeout=TIMEOUT, **kw)
    return kill_at_pause(proc, pause)


@contextmanager
def recovering_kernel(
    db_url: str, provider_url: str, seen: list[Notification] | None = None, **kw: Any
) -> Iterator[Kernel]:
    from poimen import CallbackNotifier

    # The crashed children notify through the default `log` notifier; this kernel stands in
    # for that same recipient, so it is named alike (a kernel delivers only to its own names).
    notifiers = [CallbackNotifier(seen.append, name="log")] if seen is not None else []
    k = Kernel(db_url, deadline_margin=MARGIN, notifiers=notifiers, **kw)
    register_test_tools(k, provider_url, timeout=TIMEOUT)
    try:
        yield k
    finally:
        k.close()


def recover_until_settled(k: Kernel, call_id: str, *, within: float = 10.0) -> Intent:
    """Recovery passes until the intent leaves DISPATCHED (Queryable waits for its deadline)."""
    end = time.monotonic() + within
    while True:
        k.recover()
        intent = k.store.get_by_call_id(call_id)
        assert intent is not None, f"no intent for call id {call_id!r}"
        if intent.state != IntentState.DISPATCHED or time.monotonic() > end:
            return intent
        time.sleep(0.1)


@contextmanager
def held_leader(gc: Any) -> Iterator[None]:
    """A leader holding a SQLite group commit's role (its own write waits) while the block
    runs, so that writes made meanwhile queue behind it and commit as one batch after it."""
    held, release = threading.Event(), threading.Event()

    def hold(conn: Any) -> None:
        held.set()
        assert release.wait(10)

    leader = threading.Thread(target=gc.run, args=(hold,))
    leader.start()
    assert held.wait(10)
    try:
        yield
    finally:
        release.set()
        leader.join(10)
