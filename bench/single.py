"""Items 1 and 2: one caller on SQLite FULL, poimen against the raw two-commit floor."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from bench._util import fresh, per_call_us
from poimen import Caps, Idempotent, IntentState, Kernel, KeyDerivation, ToolContext
from poimen._runtime import engine_of
from poimen.store import NewDispatch, Store
from poimen.store.sqlite import SqliteStore

TOOL = "bench.noop"
ARGS_JSON = '{"amount_cents":1200,"order_id":"o-1"}'


def fsync_us(path: Path, writes: int) -> float:
    """The disk's own latency: a 4 KiB write then fsync, as a commit's WAL append waits for
    one, on the same disk as the floor; the median of `writes`, in µs."""
    block = b"\0" * 4096
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        took = []
        for i in range(writes):
            t0 = time.perf_counter()
            os.pwrite(fd, block, (i % 64) * 4096)
            os.fsync(fd)
            took.append(time.perf_counter() - t0)
        return statistics.median(took) * 1e6
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def floor_connection(path: Path, synchronous: str = "FULL") -> sqlite3.Connection:
    """A fresh floor database: WAL, one table, one connection."""
    fresh(path)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute(
        "CREATE TABLE calls (call_id TEXT PRIMARY KEY, tool_id TEXT NOT NULL, "
        "args TEXT NOT NULL, state TEXT NOT NULL, result TEXT)"
    )
    return conn


def floor_call(conn: sqlite3.Connection, call_id: str) -> None:
    """The floor's call: the call's record, then its outcome, each its own commit."""
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(
        "INSERT INTO calls VALUES (?, ?, ?, 'DISPATCHED', NULL)", (call_id, TOOL, ARGS_JSON)
    )
    conn.execute("COMMIT")
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(
        "UPDATE calls SET state = 'COMPLETED', result = 'null' WHERE call_id = ?", (call_id,)
    )
    conn.execute("COMMIT")


def floor_sqlite(path: Path, calls: int, warmup: int) -> float:
    """The physical floor: raw sqlite3, WAL, synchronous=FULL, two commits per call
    (the call's record, then its outcome), one connection, on the same disk as poimen."""
    conn = floor_connection(path)
    try:
        for i in range(warmup):
            floor_call(conn, f"w{i}")
        t0 = time.perf_counter()
        for i in range(calls):
            floor_call(conn, f"c{i}")
        return per_call_us(time.perf_counter() - t0, calls)
    finally:
        conn.close()


def noop_kernel(path: Path, *, new: bool = True, **store_opts: Any) -> Kernel:
    """A kernel on a SQLite log (default settings: WAL, FULL) with the no-op tools;
    `new` starts from an empty file."""
    kernel = Kernel(SqliteStore(fresh(path) if new else path, **store_opts), notifiers=[])

    @kernel.tool(
        id=TOOL,
        effects=Idempotent(key=KeyDerivation.fields("order_id", "amount_cents")),
        caps=Caps(),
        timeout=10.0,
    )
    def noop(ctx: ToolContext, order_id: str, amount_cents: int) -> None:
        return None

    @kernel.tool(
        id=TOOL + ".async",
        effects=Idempotent(key=KeyDerivation.fields("order_id", "amount_cents")),
        caps=Caps(),
        timeout=10.0,
    )
    async def anoop(ctx: ToolContext, order_id: str, amount_cents: int) -> None:
        return None

    return kernel


def args(i: int) -> dict[str, Any]:
    return {"order_id": f"o-{i}", "amount_cents": 1200}


def poimen_call(path: Path, calls: int, warmup: int) -> float:
    kernel = noop_kernel(path)
    try:
        for i in range(warmup):
            kernel.call(TOOL, args(i), call_id=f"w{i}")
        t0 = time.perf_counter()
        for i in range(calls):
            out = kernel.call(TOOL, args(i), call_id=f"c{i}")
        elapsed = time.perf_counter() - t0
        assert type(out).__name__ == "Completed", out
        return per_call_us(elapsed, calls)
    finally:
        kernel.close()


def store_call(store: Store, d: NewDispatch) -> None:
    """The store's two commits of one call, without the kernel."""
    intent, _ = store.record_dispatch(d)
    store.record_outcome(
        intent.id, intent.fence, IntentState.COMPLETED, result="null", error=None, now=store.now()
    )


def poimen_store_only(path: Path, calls: int, warmup: int) -> float:
    """The store's two commits alone (record_dispatch, record_outcome) with dispatch records
    prepared beforehand: the kernel's Python is left out, the log's own SQL is not."""
    kernel = noop_kernel(path)
    store = kernel.store
    try:
        ds = [engine_of(kernel).prepare(TOOL, args(i), f"c{i}")[1] for i in range(warmup + calls)]
        for d in ds[:warmup]:
            store_call(store, d)
        t0 = time.perf_counter()
        for d in ds[warmup:]:
            store_call(store, d)
        return per_call_us(time.perf_counter() - t0, calls)
    finally:
        kernel.close()


def poimen_store_awaited(path: Path, calls: int, warmup: int) -> float:
    """`poimen_store_only` from an event loop (arecord_dispatch + arecord_outcome): the same
    two commits, made by the store's writer thread while the loop awaits each."""
    kernel = noop_kernel(path)
    store = kernel.store
    ds = [engine_of(kernel).prepare(TOOL, args(i), f"c{i}")[1] for i in range(warmup + calls)]

    async def one(d: NewDispatch) -> None:
        intent, _ = await store.arecord_dispatch(d)
        await store.arecord_outcome(
            intent.id,
            intent.fence,
            IntentState.COMPLETED,
            result="null",
            error=None,
            now=store.now(),
        )

    async def main() -> float:
        for d in ds[:warmup]:
            await one(d)
        t0 = time.perf_counter()
        for d in ds[warmup:]:
            await one(d)
        return per_call_us(time.perf_counter() - t0, calls)

    try:
        return asyncio.run(main())
    finally:
        kernel.close()


def poimen_acall(path: Path, calls: int, warmup: int) -> float:
    kernel = noop_kernel(path)

    async def main() -> float:
        for i in range(warmup):
            await kernel.acall(TOOL + ".async", args(i), call_id=f"w{i}")
        t0 = time.perf_counter()
        for i in range(calls):
            await kernel.acall(TOOL + ".async", args(i), call_id=f"c{i}")
        return per_call_us(time.perf_counter() - t0, calls)

    try:
        return asyncio.run(main())
    finally:
        kernel.close()


def fsync_through_a_thread_us(path: Path, writes: int) -> tuple[float, float]:
    """What an async commit pays beyond its SQL, on this machine: a 4 KiB write + fsync made
    on the loop's own thread, against the same made by a parked thread (woken by a lock
    released, as the SQLite writer is) that answers the awaiting loop through
    `call_soon_threadsafe` (the loop's self-pipe), as an `acall`'s commit is. Both medians in
    µs, interleaved in turns of 50; `acall` makes two such commits where `call` commits on
    its own thread, so the difference, twice, is what the crossing adds to a call."""
    block = b"\0" * 4096
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    go = threading.Lock()
    go.acquire()
    box: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None], int] | None] = []

    def write(i: int) -> None:
        os.pwrite(fd, block, (i % 64) * 4096)
        os.fsync(fd)

    def parked() -> None:
        while True:
            go.acquire()
            item = box.pop()
            if item is None:
                return
            loop, fut, i = item
            write(i)
            loop.call_soon_threadsafe(fut.set_result, None)

    thread = threading.Thread(target=parked, daemon=True)
    thread.start()
    turn = 50

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        inline, crossed = [], []
        for _ in range(max(1, writes // turn)):
            t0 = time.perf_counter()
            for i in range(turn):
                write(i)
            inline.append(per_call_us(time.perf_counter() - t0, turn))
            t0 = time.perf_counter()
            for i in range(turn):
                fut = loop.create_future()
                box.append((loop, fut, i))
                go.release()
                await fut
            crossed.append(per_call_us(time.perf_counter() - t0, turn))
        return statistics.median(inline), statistics.median(crossed)

    try:
        return asyncio.run(main())
    finally:
        box.append(None)
        go.release()
        thread.join()
        os.close(fd)
        path.unlink(missing_ok=True)
