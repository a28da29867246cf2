"""How a call's own retries are spaced: jittered exponential back-off (`Backoff`) within a time
budget."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from poimen._core.backoff import Backoff, seconds
from poimen.errors import PoimenError, RegistrationError


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """The call path's retries of one tool.

    A retry happens only where the tool's class makes it safe (an Idempotent tool after an
    unknown outcome, a Queryable one whose request did not land) or where nothing was sent.
    `attempts` counts them all, the first included; the n-th wait is a random time up to
    ``min(maximum, initial * 2 ** (n - 1))`` ("full jitter", so that callers failing together
    do not retry together); the call path stops retrying once `budget` seconds have passed
    since the call began and leaves the rest to recovery.
    """

    attempts: int = 5
    initial: float = 0.2
    maximum: float = 10.0
    budget: float = 60.0
    backoff: Backoff = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (
            isinstance(self.attempts, bool)
            or not isinstance(self.attempts, int)
            or self.attempts < 1
        ):
            raise RegistrationError(
                f"Retry(attempts=...) must be a whole number of at least 1, not {self.attempts!r}",
                field="attempts",
            )
        if not seconds(self.budget):
            raise RegistrationError(
                f"Retry(budget=...) must be a non-negative number of seconds, not {self.budget!r}",
                field="budget",
            )
        try:
            backoff = Backoff(initial=self.initial, maximum=self.maximum, jitter="full")
        except PoimenError as exc:
            name = exc.data.get("field")
            raise RegistrationError(
                f"Retry({name}=...) must be a non-negative number of seconds, "
                f"not {getattr(self, str(name))!r}",
                field=name,
            ) from exc
        object.__setattr__(self, "backoff", backoff)

    def delay(self, n: int, rand: random.Random | None = None) -> float:
        """The wait before retry number `n` (1 for the first retry)."""
        return self.backoff.delay(n, rand)
