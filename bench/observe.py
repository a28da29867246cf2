"""Item 7: what observing a kernel costs per `Kernel.call` (docs/observability.md).

    python -m bench.observe [--quick] [--json PATH]

One no-op Idempotent tool, one caller, interleaved in one run:
- no observer: the kernel calls no hook (as without the ``otel`` extra: nothing of
  OpenTelemetry is imported or called);
- the OpenTelemetry observer with no SDK configured (the API's no-op tracer and meter);
- the OpenTelemetry observer with the SDK: a tracer provider with a batch processor (spans
  dropped by the exporter) and a meter provider;
- poimen's logging observer with the loggers at INFO (the happy path logs at DEBUG: nothing
  is written);
- the SDK's own floor: the span and the metric point poimen makes for a completed call,
  made by hand around the same calls of a kernel without observers (`ByHand`), to set
  poimen's added cost against, one caller and 64 async ones.
At synchronous=OFF, so that the observers' CPU shows above the disk; and again at FULL,
poimen's default, as a user sees it; and 64 async callers at FULL, with the SDK and
without (with ``--sampled``, also with the SDK recording a tenth of the traces). Ratios compare medians of this run; the one-caller cases take turns every 50 calls.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import statistics
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
#: Calls per turn of a case: small enough that the cases see the same load.
CHUNK = 50
#: Turns of each async case per repetition.
ROUNDS = 3
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

    @k.tool(
        id=TOOL + ".async",
        effects=Idempotent(key=KeyDerivation.fields("n")),
        caps=Caps(),
        timeout=10,
    )
    async def anoop(ctx: ToolContext, n: int) -> None:
        return None

    return k


class _Calls:
    """One kernel, kept open for the whole run, called in chunks: the cases take turns chunk
    by chunk, so that each sees the same load (a shared machine's load changes within the
    second a 2,000-call run takes)."""

    def __init__(self, k: Kernel, name: str, by_hand: ByHand | None = None) -> None:
        self.k, self.name, self.n, self.by_hand = k, name, 0, by_hand

    def __call__(self, calls: int) -> float:
        """Seconds for `calls` more calls."""
        k, start, hand = self.k, self.n, self.by_hand
        t0 = time.perf_counter()
        for i in range(start, start + calls):
            if hand is not None:
                out = hand.call(k, TOOL, {"n": i}, f"{self.name}{i}")
                continue
            out = k.call(TOOL, {"n": i}, call_id=f"{self.name}{i}")
        elapsed = time.perf_counter() - t0
        self.n += calls
        assert isinstance(out, Completed), out
        return elapsed


def _tasks(
    k: Kernel, callers: int, total: int, warmup: int, by_hand: ByHand | None = None
) -> float:
    """`callers` asyncio tasks on one loop, each awaiting acall in a loop; seconds for
    `total` calls (rounded down to a multiple of `callers`)."""
    per = max(1, total // callers)
    tool = TOOL + ".async"

    async def caller(c: int) -> None:
        for i in range(per):
            if by_hand is not None:
                await by_hand.acall(k, tool, {"n": i}, f"a{c}-{i}")
            else:
                await k.acall(tool, {"n": i}, call_id=f"a{c}-{i}")

    async def main() -> float:
        for i in range(warmup):
            await k.acall(tool, {"n": i}, call_id=f"w{i}")
        t0 = time.perf_counter()
        await asyncio.gather(*(caller(c) for c in range(callers)))
        return time.perf_counter() - t0

    try:
        return asyncio.run(main())
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


#: The sampled case's share of traces recorded.
SAMPLED = 0.1


def _sdk(ratio: float | None = None, processor: Any = None) -> tuple[Any, Any]:
    """A tracer provider (recording every trace, or `ratio` of them: ParentBased on a
    TraceIdRatioBased sampler, as docs/observability.md suggests; a batch span processor
    unless another is given) and a meter provider."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    tp = TracerProvider() if ratio is None else TracerProvider(ParentBased(TraceIdRatioBased(ratio)))
    tp.add_span_processor((processor or BatchSpanProcessor)(_Drop()))
    return tp, MeterProvider(metric_readers=[InMemoryMetricReader()])


class ByHand:
    """The SDK alone making, around a call, what poimen makes for a completed one: the
    call's span with its attributes (the GenAI ones and poimen's), current while the call
    runs, its outcome set at the end, and the call duration point (the calls and attempts
    counts are poimen's own, read when the SDK collects). What a user would pay wrapping
    `Kernel.call` themselves: the floor poimen's observer is set against, measured beside
    the same calls (a bare loop of the same work runs about twice as fast: its code and
    data stay in the CPU's caches)."""

    def __init__(self, tp: Any, mp: Any) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import SpanKind

        self._attach, self._detach, self._current = (
            context.attach,
            context.detach,
            trace.set_span_in_context,
        )
        self._kind = SpanKind.INTERNAL
        self._tracer = tp.get_tracer("by hand")
        self._duration = mp.get_meter("by hand").create_histogram("by_hand.call.duration")

    def _start(self, tool: str, call_id: str) -> tuple[Any, Any, float]:
        span = self._tracer.start_span(
            f"execute_tool {tool}",
            kind=self._kind,
            attributes={
                "poimen.tool_id": tool,
                "poimen.effect": "idempotent",
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": tool,
                "gen_ai.tool.type": "function",
                "poimen.call_id": call_id,
                "gen_ai.tool.call.id": call_id,
            },
        )
        return span, self._attach(self._current(span)), time.perf_counter()

    def _end(self, started: tuple[Any, Any, float], tool: str, out: Any) -> None:
        span, token, began = started
        self._detach(token)
        span.set_attributes({"poimen.outcome": "completed", "poimen.intent_id": out.intent_id})
        span.end()
        self._duration.record(
            time.perf_counter() - began, {"poimen.tool_id": tool, "poimen.outcome": "completed"}
        )

    def call(self, k: Kernel, tool: str, args: dict[str, Any], call_id: str) -> Any:
        started = self._start(tool, call_id)
        out = k.call(tool, args, call_id=call_id)
        self._end(started, tool, out)
        return out

    async def acall(self, k: Kernel, tool: str, args: dict[str, Any], call_id: str) -> Any:
        started = self._start(tool, call_id)
        out = await k.acall(tool, args, call_id=call_id)
        self._end(started, tool, out)
        return out


def available() -> str | None:
    try:
        import opentelemetry.sdk.trace  # noqa: F401

        import poimen.otel  # noqa: F401
    except Exception as exc:
        return f"the OpenTelemetry SDK is not installed ({exc})"
    return None


def rows(*, reps: int, quick: bool, workdir: Path, sampled: bool = False) -> list[Row]:
    from poimen.otel import OpenTelemetry

    calls, warmup = (20, 5) if quick else (2000, 300)
    callers, total = (4, 64) if quick else (64, 4032)
    per_round = total // ROUNDS // callers * callers
    tp, mp = _sdk()
    floor_tp, floor_mp = _sdk()
    sampled_tp, sampled_mp = _sdk(SAMPLED)
    quiet = logging.getLogger("poimen")
    before = quiet.level, quiet.propagate, list(quiet.handlers)

    def sdk() -> list[Any]:
        return [OpenTelemetry(tracer_provider=tp, meter_provider=mp)]

    def sampled_observers() -> list[Any]:
        return [OpenTelemetry(tracer_provider=sampled_tp, meter_provider=sampled_mp)]

    def at_info(run: Callable[[int], float]) -> Callable[[int], float]:
        def logged(n: int) -> float:
            quiet.setLevel(logging.INFO)
            quiet.propagate = False
            quiet.handlers[:] = [logging.NullHandler()]
            try:
                return run(n)
            finally:
                quiet.setLevel(before[0])
                quiet.propagate = before[1]
                quiet.handlers[:] = before[2]

        return logged

    kernels: list[Kernel] = []

    by_hand = ByHand(floor_tp, floor_mp)

    def one(
        name: str, sync: str, observers: list[Any], log: bool = False, hand: bool = False
    ) -> Callable[[int], float]:
        k = _kernel(workdir / f"{name}.db", sync, observers, log)
        kernels.append(k)
        run = _Calls(k, name, by_hand if hand else None)
        return at_info(run) if log else run

    def tasks(
        name: str, observers: Callable[[], list[Any]], hand: bool = False
    ) -> Callable[[], float]:
        return lambda: _tasks(
            _kernel(workdir / f"{name}.db", "FULL", observers(), False),
            callers,
            per_round,
            warmup,
            by_hand if hand else None,
        )

    chunked: dict[str, Callable[[int], float]] = {
        "none": one("none", "OFF", []),
        "noop": one("noop", "OFF", [OpenTelemetry()]),
        "sdk": one("sdk", "OFF", sdk()),
        "log": one("log", "OFF", [], log=True),
        "floor": one("floor", "OFF", [], hand=True),
        "none_full": one("none_full", "FULL", []),
        "sdk_full": one("sdk_full", "FULL", sdk()),
        "log_full": one("log_full", "FULL", [], log=True),
    }
    whole: dict[str, Callable[[], float]] = {
        "tasks": tasks("tasks", list),
        "tasks_sdk": tasks("tasks_sdk", sdk),
        "tasks_floor": tasks("tasks_floor", list, hand=True),
    }
    if sampled:
        whole["tasks_sampled"] = tasks("tasks_sampled", sampled_observers)
    chunk = min(CHUNK, calls)
    samples: dict[str, list[float]] = {name: [] for name in (*chunked, *whole)}
    try:
        for run in chunked.values():
            run(warmup)
        for rep in range(reps):
            gc.collect()
            spent = dict.fromkeys(chunked, 0.0)
            for c in range(calls // chunk):
                order = list(chunked) if (rep + c) % 2 == 0 else list(reversed(chunked))
                for name in order:
                    spent[name] += chunked[name](chunk)
            for name, seconds in spent.items():
                samples[name].append(per_call_us(seconds, calls // chunk * chunk))
            # The async cases take turns in rounds, each first in turn: a round is a kernel's
            # life, too long to interleave in chunks, and the load changes between rounds.
            took = dict.fromkeys(whole, 0.0)
            names = list(whole)
            for r in range(ROUNDS):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    gc.collect()
                    took[name] += whole[name]()
            for name, seconds in took.items():
                samples[name].append(per_round * ROUNDS / seconds)
    finally:
        for k in kernels:
            k.close()
        for p in (tp, mp, floor_tp, floor_mp, sampled_tp, sampled_mp):
            p.shutdown()
    return _rows(samples, callers)


def _rows(samples: dict[str, list[float]], callers: int) -> list[Row]:
    def row(key: str, name: str, note: str = "", unit: str = "µs/call") -> Row:
        return Row(GROUP, name, unit, samples[key], note=note)

    def vs(r: Row, base: Row, target: float | None = None, at_least: bool = False) -> Row:
        r.ratio, r.ratio_of = r.median / base.median, "x no observer"
        if target is not None:
            r.target = f"{'≥' if at_least else '≤'} {target:.2f}x"
            r.met = r.ratio >= target if at_least else r.ratio <= target
        return r

    off = "SQLite synchronous=OFF: the observers' CPU above the disk"
    base = row("none", "Kernel.call, no observer", off)
    noop = vs(
        row(
            "noop",
            "Kernel.call, OpenTelemetry observer, no SDK configured",
            "the API's no-op tracer and meter: the observer asks for nothing",
        ),
        base,
        1.03,
    )
    sdk = vs(
        row(
            "sdk",
            "Kernel.call, OpenTelemetry observer, SDK tracer + meter",
            "batch span processor, spans dropped; 1 span and 1 histogram point per call",
        ),
        base,
    )
    log = vs(
        row(
            "log",
            "Kernel.call, transitions logged at INFO",
            "the happy path's records are DEBUG: not built",
        ),
        base,
    )
    floor = vs(
        row(
            "floor",
            "SDK floor: Kernel.call wrapped by hand in the same span and point",
            "start_span, attach, the call, detach, set_attributes, end, histogram.record",
        ),
        base,
    )
    added = Row(
        GROUP,
        "OpenTelemetry SDK observer: added per call, against the floor's",
        "µs/call",
        [s - n for s, n in zip(samples["sdk"], samples["none"], strict=True)],
        note="each repetition's difference from no observer, synchronous=OFF",
    )
    floor_added = statistics.median(
        f - n for f, n in zip(samples["floor"], samples["none"], strict=True)
    )
    added.extra["floor_added"] = floor_added
    added.ratio, added.ratio_of = added.median / floor_added, "x the floor's"
    added.target, added.met = "≤ 1.5x the floor's", added.ratio <= 1.5
    full = row("none_full", "Kernel.call at FULL, no observer")
    sdk_full = vs(
        row(
            "sdk_full",
            "Kernel.call at FULL, OpenTelemetry observer, SDK tracer + meter",
            "poimen's default durability, as a user sees it",
        ),
        full,
        1.10,
    )
    log_full = vs(row("log_full", "Kernel.call at FULL, transitions logged at INFO"), full, 1.05)
    tasks = row("tasks", f"{callers} async callers at FULL, no observer", unit="calls/s")
    tasks_sdk = vs(
        row(
            "tasks_sdk",
            f"{callers} async callers at FULL, OpenTelemetry SDK tracer + meter",
            unit="calls/s",
        ),
        tasks,
        0.9,
        at_least=True,
    )
    tasks_floor = vs(
        row(
            "tasks_floor",
            f"{callers} async callers at FULL, each acall wrapped by hand (the SDK floor)",
            "the best ratio an SDK span and point per call leave the event loop's thread",
            unit="calls/s",
        ),
        tasks,
    )
    # Paired by repetition: the rounds of one repetition saw the same load.
    tasks_vs_floor = Row(
        GROUP,
        f"{callers} async callers at FULL, SDK observer against the floor",
        "x",
        [s / f for s, f in zip(samples["tasks_sdk"], samples["tasks_floor"], strict=True)],
        note="each repetition's calls/s with poimen's observer over the by-hand floor's",
    )
    tasks_vs_floor.ratio, tasks_vs_floor.ratio_of = tasks_vs_floor.median, "x the floor's rate"
    out = [
        *(base, noop, sdk, log, floor, added, full, sdk_full, log_full),
        *(tasks, tasks_sdk, tasks_floor, tasks_vs_floor),
    ]
    if "tasks_sampled" in samples:
        sampled = row(
            "tasks_sampled",
            f"{callers} async callers at FULL, SDK, {SAMPLED:.0%} of traces sampled",
            "ParentBased(TraceIdRatioBased): the other calls' spans are not recorded",
            unit="calls/s",
        )
        out.append(vs(sampled, tasks))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.observe", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the bench runs")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument(
        "--sampled",
        action="store_true",
        help="also the async callers with a tenth of the traces sampled",
    )
    ns = p.parse_args(argv)
    why = available()
    if why:
        print(f"skipped: {why}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="poimen-bench-observe-") as tmp:
        got = rows(
            reps=ns.reps or (2 if ns.quick else 5),
            quick=ns.quick,
            workdir=Path(tmp),
            sampled=ns.sampled,
        )
    for r in got:
        ratio = f"  {r.ratio:.3f} {r.ratio_of}" if r.ratio is not None else ""
        met = "" if r.met is None else f"  target {r.target}: {'met' if r.met else 'NOT met'}"
        print(f"{r.name:72} {r.median:10.1f} {r.unit}{ratio}{met}")
    if ns.json:
        ns.json.write_text(json.dumps([r.as_json() for r in got], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
