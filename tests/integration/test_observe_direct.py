"""A call's hooks go straight to the one guarded observer that wants them (poimen's own), with
no fan-out between: such an observer's failure must still never reach the caller; and the
look for logging configured later answers from the logging module's own cache
(docs/observability.md, "What it costs")."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

from poimen import Completed, Kernel
from poimen._observe import LOGGER_NAMES, logging_wanted
from poimen.events import CallFinishedEvent
from poimen.otel import OpenTelemetry
from tests.integration.test_observability import Telemetry, add_tools, sdk_telemetry


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    yield from sdk_telemetry()


class _Raises(SpanProcessor):
    """An SDK part that raises where the SDK does not catch it (a span's start and end)."""

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        raise RuntimeError("processor bug")

    def on_end(self, span: Any) -> None:
        raise RuntimeError("processor bug")


def test_the_one_opentelemetry_observer_is_called_without_a_fan_out(
    store_url: str, telemetry: Telemetry
) -> None:
    otel = telemetry.observer()
    with Kernel(store_url, notifiers=[], observers=[otel]) as k:
        obs = k._engine.observer
        assert obs is not None
        assert obs.calls[0].__self__ is otel and obs.attempts[1].__self__ is otel
        assert obs.dispatched.__self__ is otel and obs.settled.__self__ is otel
        seen: list[str] = []
        k.on(CallFinishedEvent, lambda e: seen.append(e.call_id))
        assert obs.calls[0].__self__ is obs  # two want calls: the fan-out
        add_tools(k)
        assert isinstance(k.call("t.ok", {"n": 1}, call_id="two"), Completed)
    assert seen == ["two"]
    assert telemetry.one("execute_tool t.ok", call_id="two")


def test_an_sdk_that_raises_does_not_break_a_call(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    tp = TracerProvider()
    tp.add_span_processor(_Raises())
    try:
        with Kernel(store_url, notifiers=[], observers=[OpenTelemetry(tracer_provider=tp)]) as k:
            add_tools(k)
            with caplog.at_level(logging.ERROR, logger="poimen.observe"):
                assert isinstance(k.call("t.ok", {"n": 1}, call_id="raises"), Completed)
            assert isinstance(k.call("t.ok", {"n": 2}, call_id="after"), Completed)
    finally:
        tp.shutdown()
    failed = [r.getMessage() for r in caplog.records if r.name == "poimen.observe"]
    assert any("OpenTelemetry failed on call_started" in m for m in failed), failed


@pytest.fixture
def poimen_loggers() -> Iterator[list[logging.Logger]]:
    loggers = [logging.getLogger(n) for n in ("poimen", *sorted(LOGGER_NAMES))]
    before = [(lg.level, lg.disabled) for lg in loggers]
    logging.getLogger("poimen").setLevel(logging.WARNING)
    yield loggers
    for lg, (level, disabled) in zip(loggers, before, strict=True):
        lg.setLevel(level)
        lg.disabled = disabled


def test_the_look_for_logging_sees_every_change_of_a_level(
    poimen_loggers: list[logging.Logger],
) -> None:
    assert not logging_wanted() and not logging_wanted()  # the second from the cache
    logging.getLogger("poimen.recovery").setLevel(logging.INFO)
    assert logging_wanted()
    logging.getLogger("poimen.recovery").setLevel(logging.NOTSET)
    assert not logging_wanted()
    logging.disable(logging.CRITICAL)
    try:
        logging.getLogger("poimen").setLevel(logging.INFO)
        assert not logging_wanted()
    finally:
        logging.disable(logging.NOTSET)
    assert logging_wanted()


def test_a_disabled_logger_enabled_again_is_seen(poimen_loggers: list[logging.Logger]) -> None:
    logging.getLogger("poimen").setLevel(logging.INFO)
    for lg in poimen_loggers:
        lg.disabled = True
    assert not logging_wanted()
    for lg in poimen_loggers:
        lg.disabled = False  # no level changed: the logging module's cache is kept
    assert logging_wanted()
