"""poimen's logging decides per record: logging configured after the kernel was made, or
after it was launched, gets the records from then on (docs/observability.md#logs)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import pytest

from poimen import Indeterminate, Kernel
from poimen.events import RecoveryPassFinishedEvent
from tests.integration.test_observability import add_tools, orphan


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(getattr(record, "poimen", None), dict):
            self.records.append(record)

    def events(self) -> list[str]:
        return [r.poimen["event"] for r in self.records]  # type: ignore[attr-defined]


@pytest.fixture
def records() -> Iterator[Records]:
    """A handler on the ``poimen`` logger, left at WARNING (the default) until a test
    configures it."""
    log = logging.getLogger("poimen")
    handler = Records()
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    log.propagate = False
    yield handler
    log.removeHandler(handler)
    log.setLevel(level)
    log.propagate = propagate


def test_logging_configured_after_the_kernel_was_made_gets_the_next_calls_records(
    store_url: str, records: Records
) -> None:
    with Kernel(store_url, notifiers=[]) as k:
        add_tools(k)
        assert isinstance(k.call("t.boom", {"n": 1}, call_id="late-0"), Indeterminate)
        assert records.events() == []  # nothing asked for: nothing built
        assert k._engine.observer is None

        logging.getLogger("poimen").setLevel(logging.INFO)
        assert isinstance(k.call("t.boom", {"n": 2}, call_id="late-1"), Indeterminate)
        assert records.events() == ["unknown_outcome", "indeterminate"]

        # Per record: turned down again, nothing; up to DEBUG, the happy path too.
        logging.getLogger("poimen").setLevel(logging.WARNING)
        k.call("t.boom", {"n": 3}, call_id="late-2")
        assert len(records.records) == 2
        logging.getLogger("poimen").setLevel(logging.DEBUG)
        k.call("t.ok", {"n": 4}, call_id="late-3")
        assert records.events()[2:] == ["dispatched", "completed"]


def test_logging_configured_after_launch_gets_the_background_passes_records(
    store_url: str, records: Records
) -> None:
    passes = threading.Semaphore(0)
    k = Kernel(store_url, notifiers=[], recover_interval=0.05)
    try:
        add_tools(k)
        k.on(RecoveryPassFinishedEvent, lambda e: passes.release())
        k.launch(background=True)
        assert passes.acquire(timeout=60)
        logging.getLogger("poimen").setLevel(logging.INFO)
        orphan(k, "late-orphan", "t.ok", {"n": 5}, "idempotent")  # recovery takes it over
        for _ in range(600):
            if "takeover" in records.events():
                break
            passes.acquire(timeout=1)
        assert "takeover" in records.events(), records.events()
        assert records.records[-1].name == "poimen.recovery"
    finally:
        k.close()


def test_log_events_false_stays_silent_whatever_is_configured_later(
    store_url: str, records: Records
) -> None:
    with Kernel(store_url, notifiers=[], log_events=False) as k:
        add_tools(k)
        logging.getLogger("poimen").setLevel(logging.DEBUG)
        k.call("t.boom", {"n": 1}, call_id="quiet-1")
        k.recover()
        assert records.events() == [] and k._engine.observer is None
