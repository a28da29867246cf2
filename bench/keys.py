"""Item 6: key derivation per call, and the whole argument path of a call before its commit."""

from __future__ import annotations

import time
from pathlib import Path

from bench._util import per_call_us
from bench.single import TOOL, args, noop_kernel
from poimen import KeyDerivation
from poimen._runtime import engine_of

SMALL = {"order_id": "o-12345", "amount_cents": 1200, "note": "gift"}


def derive(n: int, derivation: KeyDerivation) -> float:
    """µs per `derivation.derive` over a small recorded argument dict."""
    derive = derivation.derive
    t0 = time.perf_counter()
    for _ in range(n):
        derive(TOOL, SMALL)
    return per_call_us(time.perf_counter() - t0, n)


def prepare(path: Path, n: int) -> float:
    """µs per Engine.prepare: encode, validate, canonical text, digest and key (no I/O)."""
    kernel = noop_kernel(path)
    try:
        a = args(1)
        prepare = engine_of(kernel).prepare
        t0 = time.perf_counter()
        for i in range(n):
            prepare(TOOL, a, f"c{i}")
        return per_call_us(time.perf_counter() - t0, n)
    finally:
        kernel.close()
