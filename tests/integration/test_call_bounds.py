"""Bounds on the call path (issue 29): back-off never exceeds its maximum, and a custom key
derivation must give one key for one set of arguments. Effects are counted by the witness
provider's ledger."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from poimen import (
    Caps,
    Completed,
    Idempotent,
    Indeterminate,
    IntentState,
    Kernel,
    KeyDerivation,
    Pending,
    Queryable,
    Retry,
    ToolContext,
    Unknown,
)
from poimen.errors import NondeterministicKeyError
from poimen.testing import ProviderClient, ProviderProcess
from tests.integration.test_lifecycle import intent_of

S = IntentState


def test_lookups_that_keep_answering_unknown_are_spaced_by_at_most_the_maximum(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    asked: list[str] = []

    def lookup(rid: str) -> Unknown:
        asked.append(rid)
        return Unknown("the provider's status page is down")

    # lookup_backoff * 2**n would be hours after a few answers: the maximum bounds it.
    with Kernel(store_url, notifiers=[], lookup_backoff=100.0, max_backoff=0.05,
                lookup_limit=5, deadline_margin=0.0) as k:

        @k.tool(id="order", effects=Queryable(lookup=lookup), caps=Caps(), timeout=0.2)
        def order(ctx: ToolContext, n: int) -> Any:
            with httpx.Client(timeout=5) as own:
                own.post(f"{provider.url}/requests", json={"n": n},
                         headers={"X-Request-Id": ctx.request_id or ""})
            raise TimeoutError("the answer was lost")

        out = k.call("order", {"n": 1}, call_id="c1")
        assert isinstance(out, Pending) and out.reason.startswith("lookup_unknown"), out
        spacings: dict[int, float] = {}  # unknown answers so far -> the wait before the next
        while (it := intent_of(k, "c1")).state == S.DISPATCHED:
            assert it.next_check_at is not None
            spacings[it.unknown_count] = it.next_check_at - it.updated_at
            k.recover()
        assert (it.state, it.reason) == (S.INDETERMINATE, "lookup_unknown_limit")
        assert len(asked) == 5 and sorted(spacings) == [1, 2, 3, 4]
        assert max(spacings.values()) <= 0.05 + 1e-6, spacings
        assert ledger.count(kind="request") == 1  # never sent again


def test_call_path_retries_wait_at_most_the_policys_maximum(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    runs: list[int] = []
    hosts = (f"127.0.0.1:{httpx.URL(provider.url).port}",)
    with Kernel(store_url, notifiers=[]) as k:
        # Uncapped, the first wait would be up to 1e9 s: past the budget, so the call path
        # would leave the retry to recovery instead of retrying now.
        @k.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("n")),
                caps=Caps(hosts=hosts), timeout=5,
                retry=Retry(attempts=3, initial=1e9, maximum=0.01, budget=60))
        def charge(ctx: ToolContext, n: int) -> Any:
            runs.append(ctx.attempt)
            r = ctx.http.post(f"{provider.url}/keyed", json={"n": n})
            if len(runs) < 3:
                raise TimeoutError("the answer was lost")
            return r.json()

        out = k.call("charge", {"n": 1}, call_id="c1")
        assert isinstance(out, Completed), out
        assert runs == [1, 2, 3]
        assert ledger.count(kind="keyed") == 1


def test_retry_delay_never_exceeds_the_maximum() -> None:
    import random

    class Top(random.Random):
        def uniform(self, a: float, b: float) -> float:
            return b

    policy = Retry(attempts=100, initial=0.2, maximum=10.0)
    assert [policy.delay(n, Top()) for n in (1, 2, 3)] == [0.2, 0.4, 0.8]
    assert {policy.delay(n, Top()) for n in range(7, 100)} == {10.0}


class Drifting:
    """A key function that reads a counter: no name in its code says so, so registration
    lets it through."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, args: Any) -> Any:
        self.n += 1
        return [args["n"], self.n]


def test_a_custom_key_that_differs_when_derived_again_is_refused_before_anything_is_sent(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    hosts = (f"127.0.0.1:{httpx.URL(provider.url).port}",)
    runs: list[int] = []
    with Kernel(store_url, notifiers=[]) as k:

        @k.tool(id="charge", effects=Idempotent(key=KeyDerivation.custom(Drifting())),
                caps=Caps(hosts=hosts), timeout=5)
        def charge(ctx: ToolContext, n: int) -> Any:
            runs.append(n)
            return ctx.http.post(f"{provider.url}/keyed", json={"n": n}).json()

        with pytest.raises(NondeterministicKeyError, match="two keys"):
            k.call("charge", {"n": 1}, call_id="c1")
        assert runs == [] and k.store.get_by_call_id("c1") is None
        assert ledger.count(kind="keyed") == 0


def test_a_custom_key_that_is_stable_is_used(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    hosts = (f"127.0.0.1:{httpx.URL(provider.url).port}",)
    with Kernel(store_url, notifiers=[]) as k:

        @k.tool(id="charge",
                effects=Idempotent(key=KeyDerivation.custom(lambda a: ["order", a["n"]])),
                caps=Caps(hosts=hosts), timeout=5)
        def charge(ctx: ToolContext, n: int) -> Any:
            return ctx.http.post(f"{provider.url}/keyed", json={"n": n}).json()

        out = k.call("charge", {"n": 1}, call_id="c1")
        assert isinstance(out, Completed) and out.result["key"] == intent_of(k, "c1").key
        assert ledger.count(kind="keyed") == 1
        assert not isinstance(out, Indeterminate)
