"""Back-off, once: the waits of the call path's retries (`Retry`), of a Queryable call's lookups
after "unknown" answers, of the outbox's redelivery, and of the PostgreSQL store's reconnects."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from poimen.errors import PoimenError


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    """Exponential back-off: the n-th wait (n from 1) is ``min(maximum, initial * 2 ** (n - 1))``,
    spread by `jitter`. Its values are checked here, once, with a `PoimenError` naming the
    field."""

    initial: float
    """The first wait, in seconds (a non-negative number)."""

    maximum: float
    """No wait is longer than this many seconds before jitter (a non-negative number)."""

    jitter: Literal["none", "full", "spread"] = "none"
    """How a wait is spread so that callers failing together do not retry together:
    ``"none"``, the capped wait itself (what the log records as a time to come back);
    ``"full"``, uniform between 0 and it; ``"spread"``, uniform between half of it and one and
    a half times it."""

    def __post_init__(self) -> None:
        for name in ("initial", "maximum"):
            v = getattr(self, name)
            if not seconds(v):
                raise PoimenError(
                    f"back-off {name} must be a non-negative number of seconds, not {v!r}",
                    field=name,
                )
        if self.jitter not in ("none", "full", "spread"):
            raise PoimenError(
                f"back-off jitter must be none, full or spread, not {self.jitter!r}",
                field="jitter",
            )

    def cap(self, n: int) -> float:
        """The n-th wait before jitter (1 for the first)."""
        cap: float = min(self.maximum, self.initial * 2 ** min(max(n - 1, 0), 62))
        return cap

    def delay(self, n: int, rand: random.Random | None = None) -> float:
        """The n-th wait (1 for the first), jittered."""
        cap = self.cap(n)
        match self.jitter:
            case "full":
                return (rand or _rand).uniform(0, cap)
            case "spread":
                return cap * (0.5 + (rand or _rand).random())
            case _:
                return cap


def seconds(v: object, *, positive: bool = False) -> bool:
    """Whether `v` is a finite number of seconds (not a bool), at least 0 (above 0: `positive`)."""
    return (
        not isinstance(v, bool)
        and isinstance(v, int | float)
        and math.isfinite(v)
        and (v > 0 if positive else v >= 0)
    )


_rand = random.Random()

#: The outbox: a notifier that failed is tried again after 1 s, 2 s, 4 s, ... at most 5 min.
OUTBOX = Backoff(initial=1.0, maximum=300.0)

#: The PostgreSQL store's reconnects within its retry budget: 20 ms doubling to 1 s, spread.
RECONNECT = Backoff(initial=0.02, maximum=1.0, jitter="spread")
