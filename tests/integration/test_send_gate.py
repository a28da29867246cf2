"""The send gate (docs/design.md §6): every request a tool's handles let out is judged when it
leaves, by the class recorded with the call, the key's age against the provider's window, the
kernel's mode and the attempt's record of writes. Effects are counted outside the log: by the
witness provider's ledger, or by the application's own sink.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest

from poimen import (
    Caps,
    Completed,
    Failed,
    Idempotent,
    Indeterminate,
    IntentState,
    Kernel,
    KeyDerivation,
    Landed,
    NotLanded,
    NotSent,
    Queryable,
    Retry,
    ToolContext,
    Unsafe,
)
from poimen.testing import ProviderClient, ProviderProcess, provider_lookup
from tests.integration.test_lifecycle import closed_port, intent_of

S = IntentState
FAST = Retry(attempts=3, initial=0.01, maximum=0.01, budget=30)


def _hosts(url: str) -> tuple[str, ...]:
    return (f"127.0.0.1:{httpx.URL(url).port}",)


class Rows:
    """The application's own table, written through `ctx.sink`: the witness of sink writes."""

    def __init__(self) -> None:
        self.rows: list[tuple[Any, str | None]] = []
        self.lock = threading.Lock()

    def apply(self, payload: Any, *, key: str | None) -> Any:
        with self.lock:
            self.rows.append((payload, key))
        return len(self.rows)

    def has(self, request_id: str) -> bool:
        with self.lock:
            return any(p.get("rid") == request_id for p, _ in self.rows)


# Defect 1: "never sent" is read from the exception the tool raised, never from one it caught.


def test_an_unsafe_tool_whose_own_client_sent_after_a_caught_not_sent_is_never_rerun(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    refused = closed_port()
    runs: list[int] = []
    with Kernel(store_url, notifiers=[]) as k, httpx.Client(timeout=5) as own:

        @k.tool(id="pay", effects=Unsafe(), caps=Caps(), timeout=5, retry=FAST)
        def pay(ctx: ToolContext, n: int) -> Any:
            runs.append(n)
            try:
                return ctx.http.post(f"http://127.0.0.1:{refused}/pay", json={"n": n}).json()
            except NotSent:
                # Its own client: it sends, and the answer never comes back.
                own.post(f"{provider.url}/plain", json={"n": n})
                raise TimeoutError("the fallback's answer timed out") from None

        out = k.call("pay", {"n": 1}, call_id="c1")
        assert isinstance(out, Indeterminate) and out.reason == "unsafe_unknown_outcome", out
        assert ledger.count(kind="plain") == 1
        assert runs == [1] and intent_of(k, "c1").attempts == 1


def test_a_queryable_tool_whose_own_client_sent_after_a_caught_not_sent_is_looked_up(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    refused = closed_port()
    runs: list[int] = []
    with (
        Kernel(store_url, notifiers=[], deadline_margin=0.1) as k,
        httpx.Client(base_url=provider.url, timeout=5) as own,
    ):

        @k.tool(id="order", effects=Queryable(lookup=provider_lookup(provider.url, own)),
                caps=Caps(), timeout=5, retry=FAST)
        def order(ctx: ToolContext, n: int) -> Any:
            runs.append(n)
            try:
                return ctx.http.post(f"http://127.0.0.1:{refused}/o", json={"n": n}).json()
            except NotSent:
                own.post(f"{provider.url}/requests", json={"n": n},
                         headers={"X-Request-Id": ctx.request_id or ""})
                raise TimeoutError("the fallback's answer timed out")  # noqa: B904

        out = k.call("order", {"n": 1}, call_id="c1")
        assert isinstance(out, Completed), out  # the lookup found it landed
        assert ledger.count(kind="request") == 1
        assert runs == [1]


def test_a_denial_the_tool_caught_does_not_make_its_later_unknown_outcome_a_refusal(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    """An Idempotent tool denied one write (host not in its caps) that then sent its write
    and lost the answer: the outcome is unknown (retried under the key), not FAILED."""
    runs: list[int] = []
    with Kernel(store_url, notifiers=[]) as k:

        @k.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("n")),
                caps=Caps(hosts=_hosts(provider.url)), timeout=5, retry=FAST)
        def charge(ctx: ToolContext, n: int) -> Any:
            runs.append(n)
            try:
                ctx.http.post("http://not-allowed.invalid/audit", json={"n": n})
            except Exception:
                r = ctx.http.post(f"{provider.url}/keyed", json={"n": n})
                if len(runs) == 1:
                    raise TimeoutError("the answer was lost")  # noqa: B904
                return r.json()
            return None

        out = k.call("charge", {"n": 1}, call_id="c1")
        assert isinstance(out, Completed), out
        assert ledger.count(kind="keyed") == 1
        assert len(runs) == 2


# Defect 2: a sink write is a write of the attempt, for every class.


@pytest.mark.parametrize("effect", ["unsafe", "queryable"])
def test_a_sink_write_before_a_refused_connection_makes_the_outcome_unknown(
    store_url: str, effect: str
) -> None:
    refused = closed_port()
    table = Rows()
    runs: list[int] = []
    with Kernel(store_url, notifiers=[], deadline_margin=0.1) as k:
        k.register_sink("rows", table)
        effects: Any = (
            Unsafe()
            if effect == "unsafe"
            else Queryable(lookup=lambda rid: Landed({"rid": rid}) if table.has(rid) else NotLanded())
        )

        @k.tool(id="book", effects=effects, caps=Caps(sinks=("rows",)), timeout=5, retry=FAST)
        def book(ctx: ToolContext, n: int) -> Any:
            runs.append(n)
            ctx.sink("rows").write({"n": n, "rid": ctx.request_id})
            return ctx.http.post(f"http://127.0.0.1:{refused}/notify", json={"n": n}).json()

        out = k.call("book", {"n": 1}, call_id="c1")
        if effect == "unsafe":
            assert isinstance(out, Indeterminate) and out.reason == "unsafe_unknown_outcome", out
        else:
            assert isinstance(out, Completed), out  # the lookup found the row
        assert len(table.rows) == 1 and runs == [1]


# Defect 3: the provider's key window is judged when the request leaves.

# Long enough that a loaded machine decides the retry inside it (its first attempt, a POST
# and two commits, took over 1.5 s at load 17), short enough to wait out.
TTL = 5.0


def _expiring_charge(k: Kernel, provider: ProviderProcess, runs: list[int],
                     second: Any, refused: int = 0) -> None:
    hosts = (*_hosts(provider.url), f"127.0.0.1:{refused}")

    # A request may take up to the tool's timeout to arrive: short against the window.
    @k.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("n"), key_ttl=TTL),
            caps=Caps(hosts=hosts), timeout=0.5, retry=FAST)
    def charge(ctx: ToolContext, n: int) -> Any:
        runs.append(ctx.attempt)
        if len(runs) == 1:
            ctx.http.post(f"{provider.url}/keyed", json={"n": n})  # lands
            raise TimeoutError("the answer was lost")
        swallowed = second(ctx)
        if swallowed is not None:
            return swallowed
        return ctx.http.post(f"{provider.url}/keyed", json={"n": n}).json()


def test_a_retry_decided_inside_the_key_window_is_not_sent_after_it(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    ledger.set_key_ttl(TTL)
    runs: list[int] = []
    with Kernel(store_url, notifiers=[]) as k:
        # The retry is decided at once; its request leaves after the provider forgot the key
        # (a back-off, a slow tool: whatever comes between the decision and the send).
        _expiring_charge(k, provider, runs, lambda ctx: time.sleep(TTL + 0.2))
        out = k.call("charge", {"n": 1}, call_id="c1")
        assert isinstance(out, Indeterminate) and out.reason == "key_expired", out
        assert ledger.count(kind="keyed") == 1
        assert runs == [1, 2]
        denial = k.denials("charge")[-1]
        assert denial.reason.startswith("key_expired") and denial.attempt == 2


def test_an_in_place_rerun_of_a_retry_is_not_sent_after_the_key_window(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    ledger.set_key_ttl(TTL)
    refused = closed_port()
    runs: list[int] = []

    def second(ctx: ToolContext) -> None:
        if len(runs) == 2:  # attempt 2 never leaves: run again in place...
            ctx.http.post(f"http://127.0.0.1:{refused}/x", json={})
        time.sleep(TTL + 0.2)  # ...after the provider forgot the key

    with Kernel(store_url, notifiers=[]) as k:
        _expiring_charge(k, provider, runs, second, refused)
        out = k.call("charge", {"n": 1}, call_id="c1")
        assert isinstance(out, Indeterminate) and out.reason == "key_expired", out
        assert ledger.count(kind="keyed") == 1
        assert runs[:2] == [1, 2]  # [1, 2, 2] unless the machine is slow enough to refuse
        # attempt 2's first request already


@pytest.mark.parametrize("handle", ["http", "transport", "sink"])
def test_every_handle_passes_the_gate(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient, handle: str
) -> None:
    """ctx.http, the httpx transport and ctx.sink: a retry's write leaving after the key's
    window is refused by each (ctx.ahttp sends through ctx.http: see the ReadOnly test)."""
    ledger.set_key_ttl(TTL)
    table = Rows()
    runs: list[int] = []
    url = f"{provider.url}/keyed"
    with Kernel(store_url, notifiers=[]) as k:
        k.register_sink("rows", table)

        @k.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("n"), key_ttl=TTL),
                caps=Caps(hosts=_hosts(provider.url), sinks=("rows",)), timeout=0.5,
                retry=FAST)
        def charge(ctx: ToolContext, n: int) -> Any:
            runs.append(n)
            if len(runs) == 2:
                time.sleep(TTL + 0.2)  # the retry's write leaves after the window
            if handle == "sink":
                got = ctx.sink("rows").write({"n": n})
            elif handle == "transport":
                with httpx.Client(transport=ctx.http.transport) as sdk:
                    got = sdk.post(url, json={"n": n}).json()
            else:
                got = ctx.http.post(url, json={"n": n}).json()
            if len(runs) == 1:
                raise TimeoutError("the answer was lost")
            return got

        out = k.call("charge", {"n": 1}, call_id="c1")
        assert isinstance(out, Indeterminate) and out.reason == "key_expired", out
        assert runs == [1, 1]
        witnessed = len(table.rows) if handle == "sink" else ledger.count(kind="keyed")
        assert witnessed == 1
        [denial] = k.denials("charge")
        assert denial.reason.startswith("key_expired") and denial.attempt == 2


def test_a_tool_that_swallows_a_refused_send_does_not_complete_the_call(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    """The refusal decides the attempt: a tool that catches it and returns is not COMPLETED
    (its first attempt may have landed; an operator decides)."""
    ledger.set_key_ttl(TTL)
    runs: list[int] = []

    def second(ctx: ToolContext) -> Any:
        time.sleep(TTL + 0.2)
        try:
            return ctx.http.post(f"{provider.url}/keyed", json={"n": 1}).json()
        except Exception as exc:
            return {"charged": False, "why": str(exc)}  # "it failed: tell the model"

    with Kernel(store_url, notifiers=[]) as k:
        _expiring_charge(k, provider, runs, second)
        out = k.call("charge", {"n": 1}, call_id="c1")
        assert isinstance(out, Indeterminate) and out.reason == "key_expired", out
        assert ledger.count(kind="keyed") == 1


def test_a_retry_inside_the_key_window_is_sent(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    ledger.set_key_ttl(60.0)
    runs: list[int] = []
    with Kernel(store_url, notifiers=[]) as k:

        @k.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("n"), key_ttl=60.0),
                caps=Caps(hosts=_hosts(provider.url)), timeout=5, retry=FAST)
        def charge(ctx: ToolContext, n: int) -> Any:
            runs.append(ctx.attempt)
            r = ctx.http.post(f"{provider.url}/keyed", json={"n": n})
            if len(runs) == 1:
                raise TimeoutError("the answer was lost")
            return r.json()

        out = k.call("charge", {"n": 1}, call_id="c1")
        assert isinstance(out, Completed) and out.result["duplicate"] is True, out
        assert ledger.count(kind="keyed") == 1 and runs == [1, 2]


def test_an_approved_call_sends_once_however_long_it_waited(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    """Approved after the key's window: its first send goes (nothing went out under the key
    before: the provider has nothing to forget); once its answer is lost, nothing more."""
    ledger.set_key_ttl(1.0)
    runs: list[int] = []
    with Kernel(store_url, notifiers=[]) as k:

        @k.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("n"), key_ttl=1.0),
                caps=Caps(hosts=_hosts(provider.url)), timeout=0.3, requires_approval=True)
        def charge(ctx: ToolContext, n: int) -> Any:
            runs.append(ctx.attempt)
            ctx.http.post(f"{provider.url}/keyed", json={"n": n})
            raise TimeoutError("the answer was lost")

        out = k.call("charge", {"n": 1}, call_id="c1")
        assert out.reason == "awaiting_approval"  # type: ignore[union-attr]
        it = intent_of(k, "c1")
        while k.store.now() - it.created_at <= 1.5:
            time.sleep(0.1)  # the approval comes after the key's window
        k.approve(it.id, operator="ana", reason="ok")
        k.recover()
        assert k.outcome("c1") == Indeterminate(it.id, "key_expired")
        assert runs == [1] and ledger.count(kind="keyed") == 1


def test_an_approved_calls_key_age_counts_its_wait_for_approval(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    """The key's age counts from the call's creation, its wait for approval included: once a
    write went out under the key, another one that could arrive after the window (counted
    from the creation) does not leave, though its attempt has only just started."""
    sent: list[int] = []
    with Kernel(store_url, notifiers=[]) as k:

        @k.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("n"), key_ttl=TTL),
                caps=Caps(hosts=_hosts(provider.url)), timeout=0.3, requires_approval=True)
        def charge(ctx: ToolContext, n: int) -> Any:
            for part in (1, 2):
                ctx.http.post(f"{provider.url}/keyed", json={"n": n, "part": part})
                sent.append(part)
            return "done"

        k.call("charge", {"n": 1}, call_id="c1")
        it = intent_of(k, "c1")
        while k.store.now() - it.created_at <= TTL + 0.5:
            time.sleep(0.1)  # approved after the key's window
        k.approve(it.id, operator="ana", reason="ok")
        k.recover()
        assert k.outcome("c1") == Indeterminate(it.id, "key_expired")
        assert sent == [1] and ledger.count(kind="keyed") == 1
        denial = k.denials("charge")[-1]
        assert denial.reason.startswith("key_expired") and denial.attempt == 1


@pytest.mark.parametrize("handle", ["http", "transport", "ahttp", "sink"])
def test_a_refused_send_with_nothing_sent_before_fails_the_call(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient, handle: str
) -> None:
    """A ReadOnly tool's write is refused by the gate, through every handle: nothing left,
    FAILED, audited."""
    from poimen import ReadOnly

    table = Rows()
    url = f"{provider.url}/plain"
    with Kernel(store_url, notifiers=[]) as k:
        k.register_sink("rows", table)
        caps = Caps(hosts=_hosts(provider.url), sinks=("rows",))

        @k.tool(id="peek", effects=ReadOnly(), caps=caps, timeout=5)
        def peek(ctx: ToolContext) -> Any:
            if handle == "sink":
                return ctx.sink("rows").write({"n": 1})
            if handle == "http":
                return ctx.http.post(url, json={"n": 1}).json()
            with httpx.Client(transport=ctx.http.transport) as sdk:
                return sdk.post(url, json={"n": 1}).json()

        @k.tool(id="apeek", effects=ReadOnly(), caps=caps, timeout=5)
        async def apeek(ctx: ToolContext) -> Any:
            return (await ctx.ahttp.post(url, json={"n": 1})).json()

        tool = "apeek" if handle == "ahttp" else "peek"
        out = (asyncio.run(k.acall(tool, {}, call_id="c1")) if handle == "ahttp"
               else k.call(tool, {}, call_id="c1"))
        assert isinstance(out, Failed) and "read_only" in out.error, out
        assert table.rows == [] and ledger.count() == 0
        assert [d.reason.split(":")[0] for d in k.denials(tool)] == ["read_only"]
