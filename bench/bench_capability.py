"""Item 6: what layer 2 (keyed capability) costs: per write, per call, per audit event.

    python -m bench.bench_capability [--quick] [--json PATH]

- a guarded sink write (token MAC check, key check, guard suspended around the sink) against
  the same sink's `apply` called directly, inside the same running Idempotent call;
- a guarded `ctx.http` POST against a plain httpx POST to the same local HTTP server;
- the per-call setup of a guarded Idempotent call (scope, context, guard enter/exit, revoke)
  against the unguarded path, for a tool that writes nothing;
- the audit hook's cost per audit event when no guarded tool runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from bench._util import Row, fresh
from poimen import Caps, Completed, Idempotent, Kernel, KeyDerivation, ToolContext
from poimen._capability import guard as _guard
from poimen._capability.context import ToolContext as _Ctx
from poimen._engine import runners as _runners
from poimen._runtime import engine_of
from poimen.store.sqlite import SqliteStore

GROUP = "6 capability"
KEY = KeyDerivation.fields("n")


class _MemorySink:
    def __init__(self) -> None:
        self.applied: dict[str | None, Any] = {}

    def apply(self, payload: Any, *, key: str | None) -> Any:
        self.applied[key] = payload
        return None


class _Ok(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else delayed ACKs turn every round trip into 40 ms

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:
        pass


def measure(workdir: Path, *, writes: int, http_writes: int, calls: int) -> dict[str, float]:
    """One repetition; every figure in microseconds (the hook in nanoseconds)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    ).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/w"
    kernel = Kernel(SqliteStore(fresh(workdir / "capability.db")), notifiers=[])
    sink = _MemorySink()
    kernel.register_sink("mem", sink)
    out: dict[str, float] = {}
    caps = Caps(hosts=(f"127.0.0.1:{server.server_address[1]}",), sinks=("mem",))

    @kernel.tool(id="bench.writer", effects=Idempotent(key=KEY), caps=caps, timeout=60.0)
    def writer(ctx: ToolContext, n: int) -> None:
        handle = ctx.sink("mem")
        assert ctx.key is not None
        for i in range(200):  # warm-up
            handle.write(i)
            sink.apply(i, key=ctx.key)
        t0 = time.perf_counter()
        for i in range(writes):
            handle.write(i)
        t1 = time.perf_counter()
        for i in range(writes):
            sink.apply(i, key=ctx.key)
        t2 = time.perf_counter()
        out["sink_guarded"] = (t1 - t0) / writes * 1e6
        out["sink_direct"] = (t2 - t1) / writes * 1e6
        # Interleaved, so drift in the server or the machine hits both sides alike. The plain
        # client runs with the guard suspended: the bench, not the tool, makes those writes.
        guarded = direct_total = 0.0
        for i in range(20 + http_writes):
            t0 = time.perf_counter()
            ctx.http.post(url, json={"i": i})
            t1 = time.perf_counter()
            token = _guard.suspend()
            try:
                direct.post(url, json={"i": i}, headers={"Idempotency-Key": ctx.key})
            finally:
                _guard.resume(token)
            t2 = time.perf_counter()
            if i >= 20:
                guarded += t1 - t0
                direct_total += t2 - t1
        out["http_guarded"] = guarded / http_writes * 1e6
        out["http_direct"] = direct_total / http_writes * 1e6

    direct = httpx.Client()
    try:
        result = kernel.call("bench.writer", {"n": 1}, call_id="w")
        assert isinstance(result, Completed), result
        out.update(_per_call(kernel, calls))
        out["hook_ns"] = _hook_ns(calls * 20)
    finally:
        direct.close()
        kernel.close()
        server.shutdown()
        server.server_close()
    return out


def _per_call(kernel: Kernel, calls: int) -> dict[str, float]:
    """Layer 2's share of one call: the engine's tool context + guard + end, tool does nothing."""
    engine = engine_of(kernel)
    t = engine.tools["bench.writer"]
    intent = kernel.store.get_by_call_id("w")
    assert intent is not None and intent.key is not None

    def nothing(ctx: ToolContext) -> None:
        return None

    def guarded() -> None:
        ctx = _runners.context(engine, t, intent)
        scope = ctx._scope
        assert scope is not None
        try:
            _guard.run(scope, nothing, ctx, {})
        finally:
            scope.end()

    def plain() -> None:
        ctx = _Ctx(
            tool_id=t.id,
            intent_id=intent.id,
            call_id=intent.call_id,
            attempt=intent.attempts,
            key=intent.key,
            request_id=None,
        )
        nothing(ctx)

    return {"call_guarded": _loop(guarded, calls), "call_plain": _loop(plain, calls)}


def _loop(fn: Callable[[], None], n: int) -> float:
    for _ in range(min(n, 1000)):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def _hook_ns(n: int) -> float:
    """One audit event's extra cost: the hook is a Python call that reads a context variable."""
    _guard.install()
    hook = _guard._hook
    args = ("path", "r", 0)
    t0 = time.perf_counter()
    for _ in range(n):
        hook("open", args)
    return (time.perf_counter() - t0) / n * 1e9


def rows(*, reps: int, quick: bool, workdir: Path) -> list[Row]:
    writes, http_writes, calls = (200, 20, 500) if quick else (20_000, 1000, 50_000)
    runs = [
        measure(workdir, writes=writes, http_writes=http_writes, calls=calls) for _ in range(reps)
    ]

    def col(name: str) -> list[float]:
        return [r[name] for r in runs]

    sink_over = [r["sink_guarded"] - r["sink_direct"] for r in runs]
    http_over = [r["http_guarded"] - r["http_direct"] for r in runs]
    call_over = [r["call_guarded"] - r["call_plain"] for r in runs]
    # Per repetition, guarded and plain POSTs were interleaved: compare them pairwise.
    http_ratio = _median([r["http_guarded"] / r["http_direct"] for r in runs])
    call_med = _median(call_over)
    return [
        Row(GROUP, "sink write, direct sink.apply", "us/write", col("sink_direct")),
        Row(
            GROUP,
            "sink write through ctx.sink (token + key check)",
            "us/write",
            col("sink_guarded"),
        ),
        Row(
            GROUP,
            "guarded sink write overhead",
            "us/write",
            sink_over,
            target="<= 5 us per write",
            met=_median(sink_over) <= 5.0,
        ),
        Row(GROUP, "HTTP POST, plain httpx client (local server)", "us/write", col("http_direct")),
        Row(
            GROUP,
            "HTTP POST through ctx.http (key header + checks)",
            "us/write",
            col("http_guarded"),
            ratio=http_ratio,
            ratio_of="x plain",
            target="<= 1.10x plain",
            met=http_ratio <= 1.10,
        ),
        Row(
            GROUP,
            "guarded ctx.http overhead",
            "us/write",
            http_over,
            note="interleaved with the plain POSTs; local round trips are noisy",
        ),
        Row(
            GROUP,
            "layer-2 setup per Idempotent call (no writes)",
            "us/call",
            call_over,
            target="<= 3 us (10% of the ~30 us call budget)",
            met=call_med <= 3.0,
            extra={"guarded_us": col("call_guarded"), "plain_us": col("call_plain")},
        ),
        Row(
            GROUP, "audit hook per audit event, no guarded tool running", "ns/event", col("hook_ns")
        ),
    ]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_capability")
    p.add_argument("--quick", action="store_true", help="tiny sizes: the numbers mean nothing")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", type=Path, help="also write the JSON here")
    ns = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="poimen-bench-cap-") as d:
        result = rows(reps=2 if ns.quick else ns.reps, quick=ns.quick, workdir=Path(d))
    doc = {"group": GROUP, "rows": [r.as_json() for r in result]}
    text = json.dumps(doc, indent=2)
    if ns.json:
        ns.json.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
