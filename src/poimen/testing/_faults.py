"""Faults the witness provider injects into its writes and lookups, for the kill soak.

A spec is text, ``before=0.05,after=0.05,lost=0.05,refuse=0.02,latency=0.3,max_latency=0.3,
lookup_error=0.05,seed=7``: each a probability per request except `max_latency` (seconds) and
`seed`. A write meets at most one fault:

- ``before``: 503, nothing applied (an error before the effect);
- ``after``: applied, then 503 (an error after the effect);
- ``lost``: applied, then the connection closes without a response (a lost response);
- ``refuse``: 409, nothing applied (a definite refusal: the caller may record FAILED);
- ``latency``: a random delay up to `max_latency` before the write is applied.

The fault of a request is a function of the seed, the request's identity (key, request id or
body) and how many times that identity arrived before, never of the order in which requests of
different calls arrive: the same seed gives the same faults to the same calls, however the
threads interleave.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, fields
from typing import Final

__all__ = ["Fault", "FaultCounter", "Faults"]

KINDS: Final = ("before", "after", "lost", "refuse")


@dataclass(frozen=True, slots=True)
class Fault:
    """What happens to one request: `kind` (None: no fault) after `delay` seconds."""

    kind: str | None
    delay: float


@dataclass(frozen=True, slots=True)
class Faults:
    """Probabilities of each fault (see the module's docstring)."""

    before: float = 0.0
    after: float = 0.0
    lost: float = 0.0
    refuse: float = 0.0
    latency: float = 0.0
    max_latency: float = 0.0
    lookup_error: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("seed", "max_latency"):
                if f.name == "max_latency" and value < 0:
                    raise ValueError(f"max_latency must be >= 0, got {value!r}")
                continue
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{f.name} is a probability, got {value!r}")
        if sum(getattr(self, k) for k in KINDS) > 1.0:
            raise ValueError("before + after + lost + refuse must not exceed 1")

    @classmethod
    def parse(cls, text: str) -> Faults:
        """A spec as the module's docstring writes it; empty text: no faults."""
        known = {f.name: f.type for f in fields(cls)}
        values: dict[str, float | int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, raw = item.partition("=")
            if not sep or name not in known:
                raise ValueError(f"unknown fault {item!r}; expected name=value, names: "
                                 f"{', '.join(known)}")
            values[name] = int(raw) if name == "seed" else float(raw)
        return cls(**values)  # type: ignore[arg-type]

    def spec(self) -> str:
        """This as a spec `parse` reads back."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    def _rng(self, identity: str, n: int) -> random.Random:
        # A string seed is hashed (SHA-512) by `random`: stable across processes and runs.
        return random.Random(f"{self.seed}/{identity}/{n}")

    def write(self, identity: str, n: int) -> Fault:
        """The fault of the `n`-th arrival (from 0) of a write of this identity."""
        rng = self._rng(identity, n)
        delay = rng.uniform(0.0, self.max_latency) if rng.random() < self.latency else 0.0
        draw = rng.random()
        for kind in KINDS:
            p = getattr(self, kind)
            if draw < p:
                return Fault(kind, delay)
            draw -= p
        return Fault(None, delay)

    def lookup(self, identity: str, n: int) -> bool:
        """Whether the `n`-th lookup of this request id answers 503."""
        return self._rng(f"lookup/{identity}", n).random() < self.lookup_error


class FaultCounter:
    """How many times each identity arrived: the `n` of `Faults.write`."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def next(self, identity: str) -> int:
        with self._lock:
            n = self._seen.get(identity, 0)
            self._seen[identity] = n + 1
            return n
