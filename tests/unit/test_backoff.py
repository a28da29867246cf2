"""One `Backoff` behind every wait that grows: the call path's retries, lookups after "unknown",
the outbox's redelivery and the PostgreSQL store's reconnects (docs/design.md §6)."""

from __future__ import annotations

import random

import pytest

from poimen import Retry
from poimen._core.backoff import OUTBOX, RECONNECT, Backoff
from poimen._core.decide import Policy
from poimen.errors import PoimenError, RegistrationError


class Top(random.Random):
    """A random source that always draws the top of its range."""

    def uniform(self, a: float, b: float) -> float:
        return b

    def random(self) -> float:
        return 1.0


class Bottom(random.Random):
    def uniform(self, a: float, b: float) -> float:
        return a

    def random(self) -> float:
        return 0.0


def test_the_waits_double_from_initial_up_to_maximum() -> None:
    b = Backoff(initial=0.5, maximum=3.0)
    assert [b.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert b.delay(10**6) == 3.0  # no overflow for a long run of failures


def test_each_use_keeps_its_numbers() -> None:
    # The outbox: 1 s, 2 s, 4 s, ... at most 5 minutes, as the log records the next try.
    assert [OUTBOX.delay(n) for n in (1, 2, 3, 9, 10)] == [1.0, 2.0, 4.0, 256.0, 300.0]
    # Reconnects: 20 ms doubling to 1 s, spread between half and one and a half of it.
    assert [RECONNECT.cap(n) for n in (1, 2, 6, 7)] == [0.02, 0.04, 0.64, 1.0]
    assert RECONNECT.delay(7, Top()) == 1.5 and RECONNECT.delay(7, Bottom()) == 0.5
    # Lookups after "unknown": lookup_backoff doubling up to max_backoff, no jitter.
    policy = Policy(max_attempts=5, lookup_limit=8, lookup_backoff=1.0, max_backoff=5.0)
    assert [policy.lookup.delay(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    # The call path's retries: full jitter up to the capped wait.
    retry = Retry(initial=0.2, maximum=10.0)
    assert [retry.delay(n, Top()) for n in (1, 2, 3, 7)] == [0.2, 0.4, 0.8, 10.0]
    assert retry.delay(7, Bottom()) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"initial": -1.0, "maximum": 1.0}, "initial"),
        ({"initial": 1.0, "maximum": float("inf")}, "maximum"),
        ({"initial": True, "maximum": 1.0}, "initial"),
        ({"initial": 1.0, "maximum": "1"}, "maximum"),
        ({"initial": 1.0, "maximum": 1.0, "jitter": "some"}, "jitter"),
    ],
)
def test_a_value_out_of_range_is_refused_naming_it(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(PoimenError, match=field) as caught:
        Backoff(**kwargs)  # type: ignore[arg-type]
    assert caught.value.data["field"] == field


def test_retry_refuses_its_back_off_values_as_a_registration_error() -> None:
    with pytest.raises(RegistrationError, match=r"Retry\(maximum=\.\.\.\)") as caught:
        Retry(maximum=-2.0)
    assert caught.value.data["field"] == "maximum"
