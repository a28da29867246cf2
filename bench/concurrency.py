"""Item 3: calls/s with 1, 4, 16 and 64 concurrent callers on SQLite FULL (group commit)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from bench.single import TOOL, args, noop_kernel


def threads(path: Path, callers: int, total: int, warmup: int) -> float:
    """`callers` threads, each calling Kernel.call in a loop; returns calls/s."""
    kernel = noop_kernel(path)
    per = max(1, total // callers)
    start = threading.Barrier(callers + 1)
    errors: list[BaseException] = []

    def caller(c: int) -> None:
        try:
            start.wait()
            for i in range(per):
                kernel.call(TOOL, args(i), call_id=f"t{c}-{i}")
        except BaseException as exc:  # reported by the main thread, never swallowed
            errors.append(exc)

    try:
        for i in range(warmup):
            kernel.call(TOOL, args(i), call_id=f"w{i}")
        workers = [threading.Thread(target=caller, args=(c,)) for c in range(callers)]
        for w in workers:
            w.start()
        start.wait()
        t0 = time.perf_counter()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - t0
    finally:
        kernel.close()
    if errors:
        raise errors[0]
    return per * callers / elapsed


def tasks(path: Path, callers: int, total: int, warmup: int) -> float:
    """`callers` asyncio tasks on one loop, each awaiting Kernel.acall; returns calls/s."""
    kernel = noop_kernel(path)
    per = max(1, total // callers)
    tool = TOOL + ".async"

    async def caller(c: int) -> None:
        for i in range(per):
            await kernel.acall(tool, args(i), call_id=f"a{c}-{i}")

    async def main() -> float:
        for i in range(warmup):
            await kernel.acall(tool, args(i), call_id=f"w{i}")
        t0 = time.perf_counter()
        await asyncio.gather(*(caller(c) for c in range(callers)))
        return per * callers / (time.perf_counter() - t0)

    try:
        return asyncio.run(main())
    finally:
        kernel.close()
