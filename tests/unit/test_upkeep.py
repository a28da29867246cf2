"""A kernel's background duties (poimen._engine.upkeep)."""

from __future__ import annotations

import threading

import pytest

from poimen._engine.upkeep import Duty


# The thread's end is meant: pytest reports any exception that ends a thread.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_duty_whose_thread_died_is_started_again_by_ensure() -> None:
    ran = threading.Event()
    rounds: list[int] = []

    def fn() -> None:
        rounds.append(1)
        if len(rounds) == 1:
            raise SystemExit  # not an Exception: the duty's thread ends
        ran.set()

    duty = Duty("test", fn, lambda: 0.0)
    duty.ensure()
    first = duty._thread
    assert first is not None
    first.join(30)
    assert not first.is_alive()
    duty.ensure()  # the thread it started has ended: a new one
    assert duty._thread is not first
    assert ran.wait(30)
    duty.stop(30)
