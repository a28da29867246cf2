"""Item 7: what observing a kernel costs per `Kernel.call` (docs/observability.md).

    python -m bench.observe [--quick] [--json PATH]

One no-op Idempotent tool, one caller, interleaved in one run:
- no observer: the kernel uses its store as is (as without the ``otel`` extra: nothing of
  OpenTelemetry is imported or called);
- the OpenTelemetry observer with no SDK configured (the API's no-op tracer and meter);
- the OpenTelemetry observer with the SDK: a tracer provider with a batch processor (spans
  dropped by the exporter) and a meter provider;
- poimen's logging observer with the loggers at INFO (the happy path logs at DEBUG: nothing
  is written, each event is built and checked).
At synchronous=OFF, so that the observers' CPU shows above the disk; and the SDK case again
at FULL, poimen's default, as a user sees it. Ratios compare medians of this run.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench._util import Row, fresh, per_call_us
from poimen import Caps, Completed, Idempotent, Kernel, KeyDerivation, ToolContext
from poimen.store.sqlite import SqliteStore

GROUP = "7 observability"
TOOL = "bench.observed"


def _kernel(path: Path, synchronous: str, observers: Sequence[Any], log_events: bool) -> Kernel:
    k = Kernel(
        SqliteStore(fresh(path), synchronous=synchronous),
        notifiers=[],
        observers=list(observers),
        log_events=log_events,
    )

    @k.tool(id=TOOL, effects=Idempotent(key=KeyDerivation.fields("n")), caps=Caps(), timeout=10)
    def noop(ctx: ToolContext, n: int) -> None:
        return None

    return k


def _timed(k: Kernel, calls: int, warmup: int) -> float:
    try:
        for i in range(warmup):
            k.call(TOOL, {"n": i}, call_id=f"w{i}")
        t0 = time.perf_counter()
        for i in range(calls):
            out = k.call(TOOL, {"n": i}, call_id=f"c{i}")
        elapsed = time.perf_counter() - t0
        assert isinstance(out, Completed), out
        return per_call_us(elapsed, calls)
    finally:
        k.close()


class _Drop:
    """A span exporter that keeps nothing: the SDK's work without an exporter's."""

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def _sdk() -> tuple[Any, Any]:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    tp = TracerProvider()
    tp.add_span_processor(BatchSpanProcessor(_Drop()))  # type: ignore[arg-type]
    return tp, MeterProvider(metric_readers=[InMemoryMetricReader()])


def available() -> str | None:
    try:
        import opentelemetry.sdk.trace  # noqa: F401

        import poimen.otel  # noqa: F401
    except Exception as exc:
        return f"the OpenTelemetry SDK is not installed ({exc})"
    return None


def rows(*, reps: int, quick: bool, workdir: Path) -> list[Row]:
    from poimen.otel import OpenTelemetry

    calls, warmup = (20, 5) if quick else (2000, 300)
    tp, mp = _sdk()
    quiet = logging.getLogger("poimen")
    before = quiet.level, quiet.propagate, list(quiet.handlers)

    def logged(path: Path, sync: str) -> float:
        quiet.setLevel(logging.INFO)
        quiet.propagate = False
        quiet.handlers[:] = [logging.NullHandler()]
        try:
            return _timed(_kernel(path, sync, [], True), calls, warmup)
        finally:
            quiet.setLevel(before[0])
            quiet.propagate = before[1]
            quiet.handlers[:] = before[2]

    cases: dict[str, Callable[[], float]] = {
        "none": lambda: _timed(_kernel(workdir / "o0.db", "OFF", [], False), calls, warmup),
        "noop": lambda: _timed(
            _kernel(workdir / "o1.db", "OFF", [OpenTelemetry()], False), calls, warmup
        ),
        "sdk": lambda: _timed(
            _kernel(
                workdir / "o2.db",
                "OFF",
                [OpenTelemetry(tracer_provider=tp, meter_provider=mp)],
                False,
            ),
            calls,
            warmup,
        ),
        "log": lambda: logged(workdir / "o3.db", "OFF"),
        "none_full": lambda: _timed(
            _kernel(workdir / "o4.db", "FULL", [], False), calls, warmup
        ),
        "sdk_full": lambda: _timed(
            _kernel(
                workdir / "o5.db",
                "FULL",
                [OpenTelemetry(tracer_provider=tp, meter_provider=mp)],
                False,
            ),
            calls,
            warmup,
        ),
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for rep in range(reps):
            order = list(cases) if rep % 2 == 0 else list(reversed(cases))
            for name in order:
                gc.collect()
                samples[name].append(cases[name]())
    finally:
        tp.shutdown()
        mp.shutdown()
    off = "SQLite synchronous=OFF: the observers' CPU above the disk"
    base = Row(GROUP, "Kernel.call, no observer", "µs/call", samples["none"], note=off)
    out = [
        base,
        Row(
            GROUP,
            "Kernel.call, OpenTelemetry observer, no SDK configured",
            "µs/call",
            samples["noop"],
            note="the API's no-op tracer and meter",
        ),
        Row(
            GROUP,
            "Kernel.call, OpenTelemetry observer, SDK tracer + meter",
            "µs/call",
            samples["sdk"],
            note="batch span processor, spans dropped; 2 spans, 2 span events per call",
        ),
        Row(
            GROUP,
            "Kernel.call, transitions logged at INFO",
            "µs/call",
            samples["log"],
            note="the happy path's records are DEBUG: built, checked, not written",
        ),
    ]
    for r in out[1:]:
        r.ratio, r.ratio_of = r.median / base.median, "x no observer"
    full = Row(GROUP, "Kernel.call at FULL, no observer", "µs/call", samples["none_full"])
    sdk_full = Row(
        GROUP,
        "Kernel.call at FULL, OpenTelemetry observer, SDK tracer + meter",
        "µs/call",
        samples["sdk_full"],
        note="poimen's default durability, as a user sees it",
    )
    sdk_full.ratio, sdk_full.ratio_of = sdk_full.median / full.median, "x no observer"
    return [*out, full, sdk_full]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.observe", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the bench runs")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--json", type=Path, help="write the rows here")
    ns = p.parse_args(argv)
    why = available()
    if why:
        print(f"skipped: {why}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="poimen-bench-observe-") as tmp:
        got = rows(reps=ns.reps or (2 if ns.quick else 5), quick=ns.quick, workdir=Path(tmp))
    for r in got:
        ratio = f"  {r.ratio:.3f} {r.ratio_of}" if r.ratio is not None else ""
        print(f"{r.name:66} {r.median:9.1f} {r.unit}{ratio}")
    if ns.json:
        ns.json.write_text(json.dumps([r.as_json() for r in got], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
