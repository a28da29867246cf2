"""Keyed capability (docs/capability.md): the kernel supplies the key; unkeyed writes are denied
and audited. Effects are counted in the provider process's ledger, which deduplicates on the
supplied key only. Run with `pytest -k keyed_capability`."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import os
import re
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
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
    NotLanded,
    Queryable,
    ToolContext,
    Unsafe,
)
from poimen._capability.context import WriteToken
from poimen.errors import CapabilityDeniedError, NondeterministicKeyError, RegistrationError
from poimen.testing import CHARGE, EMAIL, SHIP, ProviderClient, ProviderProcess
from tests.helpers import crash_call, recovering_kernel

TOOL = "cap.charge"
KEY = KeyDerivation.fields("order_id", "amount_cents")
ORDER = {"order_id": "o-1", "amount_cents": 1200}


class LedgerSink:
    """An application sink over the provider: apply the payload under the given key."""

    def __init__(self, url: str) -> None:
        self.client = ProviderClient(url)

    def apply(self, payload: Any, *, key: str | None) -> Any:
        r = self.client.keyed_write(key, payload) if key else self.client.plain_write(payload)
        r.raise_for_status()
        return r.json()


def _host_port(url: str) -> tuple[str, int]:
    u = httpx.URL(url)
    assert u.host and u.port
    return u.host, u.port


def register_cap_tools(k: Kernel, url: str, tmp_path: Path, stash: dict[str, Any]) -> None:
    """`cap.charge` (Idempotent) writes one way per `how`; `how` is not part of the key.
    `stash` carries objects between the test and the tool."""
    host, port = _host_port(url)
    caps = Caps(hosts=(f"{host}:{port}",), sinks=("ledger",))
    sink = LedgerSink(url)
    k.register_sink("ledger", sink)
    k.register_sink("other", sink)
    k.on_close(sink.client.close)

    @k.tool(id=TOOL, effects=Idempotent(key=KEY), caps=caps, timeout=5.0)
    def charge(ctx: ToolContext, order_id: str, amount_cents: int, how: str = "handle") -> Any:
        body = {"order_id": order_id, "amount_cents": amount_cents}
        match how:
            case "handle":
                return ctx.http.post(f"{url}/keyed", json=body).json()
            case "sink":
                return ctx.sink("ledger").write(body)
            case "sdk":  # a client library built on httpx, given the handle's transport
                with httpx.Client(transport=ctx.http.transport) as sdk:
                    return sdk.post(f"{url}/keyed", json=body).json()
            case "sdk_own_key":
                with httpx.Client(transport=ctx.http.transport) as sdk:
                    return sdk.post(
                        f"{url}/keyed", json=body, headers={"Idempotency-Key": "sdk-key"}
                    ).json()
            case "own_key":
                return ctx.http.post(
                    f"{url}/keyed", json=body, headers={"idempotency-key": "my-own-key"}
                ).json()
            case "own_key_sink":
                return ctx.sink("ledger").write(body, key="my-own-key")
            case "no_key":
                return ctx.http.post(
                    f"{url}/keyed", json=body, headers={"Idempotency-Key": ""}
                ).json()
            case "raw_http_with_kernel_key":
                assert ctx.key is not None
                with httpx.Client() as c:
                    return c.post(
                        f"{url}/keyed", json=body, headers={"Idempotency-Key": ctx.key}
                    ).json()
            case "raw_http_no_key":
                with httpx.Client() as c:
                    return c.post(f"{url}/plain", json=body).json()
            case "wrapped_by_library":  # an SDK that turns every error into its own
                try:
                    with httpx.Client() as c:
                        return c.post(f"{url}/plain", json=body).json()
                except Exception as exc:
                    raise RuntimeError("payments SDK: request failed") from exc
            case "raw_socket":
                data = json.dumps(body).encode()
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    s.connect((host, port))
                    s.sendall(
                        b"POST /plain HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)
                    )
                    return s.recv(4096).decode()
                finally:
                    s.close()
            case "file":
                with open(tmp_path / "charge.json", "w") as f:
                    f.write(json.dumps(body))
                return None
            case "file_write_only":  # an existing file, no flag but O_WRONLY
                fd = os.open(tmp_path / "existing.txt", os.O_WRONLY)
                try:
                    os.write(fd, b"after")
                finally:
                    os.close(fd)
                return None
            case "spawn":
                subprocess.run([sys.executable, "-c", "pass"], check=True)
                return None
            case "other_host":
                return ctx.http.post("http://payments.invalid/keyed", json=body).json()
            case "other_sink":
                return ctx.sink("other").write(body)
            case "handle_then_own_key":  # one keyed write went out before the rogue one
                ctx.http.post(f"{url}/keyed", json=body)
                return ctx.http.post(
                    f"{url}/keyed", json=body, headers={"Idempotency-Key": "my-own-key"}
                ).json()
            case "stash":
                stash["http"], stash["sink"] = ctx.http, ctx.sink("ledger")
                return ctx.http.post(f"{url}/keyed", json=body).json()
            case "committed_before_raise":
                try:
                    ctx.http.post(f"{url}/plain", json=body, headers={"Idempotency-Key": "x"})
                except CapabilityDeniedError as exc:
                    reader = stash["reader"]  # another connection, opened before the call
                    stash["seen"] = reader.execute(
                        "SELECT tool_id, intent_id FROM denials WHERE id = ?", (exc.denial_id,)
                    ).fetchall()
                return None
        raise AssertionError(how)


@pytest.fixture
def stash() -> dict[str, Any]:
    return {}


@pytest.fixture
def kernel(
    store_url: str, provider: ProviderProcess, tmp_path: Path, stash: dict[str, Any]
) -> Iterator[Kernel]:
    k = Kernel(store_url)
    register_cap_tools(k, provider.url, tmp_path, stash)
    try:
        yield k
    finally:
        k.close()


# 1. An Idempotent registration without a key derivation fails mypy --strict, naming the field.


def _mypy(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    src = tmp_path / "snippet.py"
    src.write_text(textwrap.dedent(body))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--cache-dir",
            str(tmp_path / ".mypy_cache"),
            "--config-file",
            "/dev/null",
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_idempotent_without_key_fails_mypy_strict_and_ctx_key_is_read_only(
    tmp_path: Path,
) -> None:
    result = _mypy(
        tmp_path,
        """\
        from poimen import Caps, Idempotent, KeyDerivation, ToolContext, ToolRegistration

        bad = ToolRegistration(id="t", effects=Idempotent(), caps=Caps(), timeout=1.0)
        good = ToolRegistration(
            id="t", effects=Idempotent(key=KeyDerivation.fields("x")), caps=Caps(), timeout=1.0
        )

        def tool(ctx: ToolContext) -> None:
            ctx.key = "my-own-key"
        """,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, result.stdout
    assert re.search(r':3: error: Missing named argument "key" for "Idempotent"', errors[0])
    assert re.search(r':9: error: Property "key" defined in "ToolContext" is read-only', errors[1])
    with pytest.raises(TypeError, match="key"):
        Idempotent()  # type: ignore[call-arg]
    ctx = ToolContext(tool_id="t", intent_id="i", call_id="c", attempt=1, key="k", request_id=None)
    with pytest.raises(AttributeError):
        ctx.key = "my-own-key"  # type: ignore[misc]
    assert ctx.key == "k"


# 2. Happy path: one ledger entry under the kernel-derived key.


@pytest.mark.parametrize("how", ["handle", "sink", "sdk"])
def test_write_through_handle_lands_once_under_the_kernel_key(
    kernel: Kernel, ledger: ProviderClient, how: str
) -> None:
    out = kernel.call(TOOL, {**ORDER, "how": how}, call_id="c1")
    assert isinstance(out, Completed), out
    intent = kernel.store.get_intent(out.intent_id)
    assert intent is not None and intent.state == IntentState.COMPLETED
    derived = KEY.derive(TOOL, {**ORDER, "how": how})
    assert intent.key == derived
    assert [e["key"] for e in ledger.entries()] == [derived]
    assert kernel.denials() == []


def test_test_charge_writes_through_its_handle(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    with recovering_kernel(store_url, provider.url) as k:
        out = k.call(CHARGE, ORDER, call_id="c1")
        assert isinstance(out, Completed), out
        intent = k.store.get_intent(out.intent_id)
        assert intent is not None
        assert [e["key"] for e in ledger.entries()] == [intent.key]
        assert k.denials() == []


# 3. The same arguments under a new call id: the same key, still one entry.


def test_duplicate_call_derives_the_same_key_and_the_ledger_keeps_one_entry(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    first = kernel.call(TOOL, ORDER, call_id="c1")
    second = kernel.call(TOOL, ORDER, call_id="c2")
    assert isinstance(first, Completed) and isinstance(second, Completed)
    assert first.intent_id != second.intent_id
    a, b = kernel.store.get_intent(first.intent_id), kernel.store.get_intent(second.intent_id)
    assert a is not None and b is not None and a.key is not None
    assert a.key == b.key
    assert second.result["duplicate"] is True
    assert ledger.count() == 1
    assert ledger.count(kind="keyed", key=a.key) == 1


# 4. Out-of-band writes: denied at call time, audited with the tool id, the ledger unchanged.

DENIED = [
    ("own_key", "http", "key_mismatch"),
    ("own_key_sink", "sink", "key_mismatch"),
    ("sdk_own_key", "http", "key_mismatch"),
    ("no_key", "http", "no_key"),
    ("raw_http_with_kernel_key", "connect", "out_of_band"),
    ("raw_http_no_key", "connect", "out_of_band"),
    ("wrapped_by_library", "connect", "out_of_band"),
    ("raw_socket", "connect", "out_of_band"),
    ("file", "file_write", "out_of_band"),
    ("file_write_only", "file_write", "out_of_band"),
    ("spawn", "spawn", "out_of_band"),
    ("other_host", "http", "host_not_in_caps"),
    ("other_sink", "sink", "sink_not_in_caps"),
]


@pytest.mark.parametrize(("how", "action", "reason"), DENIED, ids=[d[0] for d in DENIED])
def test_out_of_band_write_is_denied_and_audited(
    kernel: Kernel, ledger: ProviderClient, tmp_path: Path, how: str, action: str, reason: str
) -> None:
    kernel.call(TOOL, {**ORDER, "order_id": "warm-up"}, call_id="w")  # pool warm, one entry
    (tmp_path / "existing.txt").write_text("before")
    before = ledger.entries()
    since = kernel.store.now()
    out = kernel.call(TOOL, {**ORDER, "how": how}, call_id="c1")
    # A denied write never left: the call fails for good instead of being retried.
    assert isinstance(out, Failed), out
    assert "capability denied" in out.error and reason in out.error
    intent = kernel.store.get_intent(out.intent_id)
    assert intent is not None and intent.state == IntentState.FAILED
    assert len(kernel.store.attempts(intent.id)) == 1
    denials = kernel.denials(tool_id=TOOL)
    assert [(d.tool_id, d.intent_id, d.attempt, d.action) for d in denials] == [
        (TOOL, intent.id, 1, action)
    ]
    assert denials[0].reason.startswith(reason)
    assert kernel.denials(tool_id=TOOL, since=since) == denials
    assert kernel.denials(tool_id=SHIP) == []
    assert ledger.entries() == before
    assert not (tmp_path / "charge.json").exists()
    assert (tmp_path / "existing.txt").read_text() == "before"


def test_denial_is_committed_before_the_exception_reaches_the_tool(
    sqlite_url: str, provider: ProviderProcess, tmp_path: Path
) -> None:
    stash: dict[str, Any] = {}
    with Kernel(sqlite_url) as k:
        register_cap_tools(k, provider.url, tmp_path, stash)
        stash["reader"] = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
        try:
            out = k.call(TOOL, {**ORDER, "how": "committed_before_raise"}, call_id="c1")
        finally:
            stash["reader"].close()
        assert isinstance(out, Completed)  # the tool caught the denial and carried on
        assert stash["seen"] == [(TOOL, out.intent_id)]


def test_handles_outlive_their_call_only_as_denials(
    kernel: Kernel, ledger: ProviderClient, provider: ProviderProcess, stash: dict[str, Any]
) -> None:
    out = kernel.call(TOOL, {**ORDER, "how": "stash"}, call_id="c1")
    assert isinstance(out, Completed)
    before = ledger.entries()
    with pytest.raises(CapabilityDeniedError, match="revoked_token") as e1:
        stash["http"].post(f"{provider.url}/keyed", json={"late": 1})
    with pytest.raises(CapabilityDeniedError, match="revoked_token"):
        stash["sink"].write({"late": 2})
    assert e1.value.denial_id is not None
    denials = kernel.denials(tool_id=TOOL)
    assert [(d.intent_id, d.reason.split(":")[0]) for d in denials] == [
        (out.intent_id, "revoked_token"),
        (out.intent_id, "revoked_token"),
    ]
    assert ledger.entries() == before


def test_forged_and_foreign_tokens_are_denied(
    kernel: Kernel, ledger: ProviderClient, provider: ProviderProcess
) -> None:
    """A token whose MAC was not made with the kernel's secret, or that belongs to another
    live call, is refused even though the handle object is real."""
    url = provider.url
    seen: dict[str, Any] = {}
    a_inside, a_release = threading.Event(), threading.Event()

    @kernel.tool(
        id="cap.hold",
        effects=Idempotent(key=KeyDerivation.fields("n")),
        caps=Caps(hosts=(":".join(map(str, _host_port(url))),)),
        timeout=5.0,
    )
    def hold(ctx: ToolContext, n: int, mode: str) -> None:
        if mode == "hold":
            seen["http"] = ctx.http
            a_inside.set()
            assert a_release.wait(10)
            return
        handle = ctx.http
        if mode == "forge":
            real = handle._token
            assert real is not None
            for fake in (
                dataclasses.replace(real, key="my-own-key"),
                WriteToken(real.tool_id, real.intent_id, real.attempt, real.key, os.urandom(32)),
            ):
                handle._token = fake
                try:
                    handle.post(f"{url}/keyed", json={"n": n})
                except CapabilityDeniedError as exc:
                    seen.setdefault("forge", "")
                    seen["forge"] += exc.reason.split(":")[0] + ";"
            return
        try:
            seen["http"].post(f"{url}/keyed", json={"n": n})
        except CapabilityDeniedError as exc:
            seen["foreign"] = exc.reason.split(":")[0]

    @kernel.tool(
        id="cap.mint",
        effects=Idempotent(key=KeyDerivation.fields("n")),
        caps=Caps(hosts=(":".join(map(str, _host_port(url))),)),
        timeout=5.0,
    )
    def mint(ctx: ToolContext, n: int) -> None:
        # A handle built from poimen's private parts, mirroring this call with its own key.
        from poimen._capability.context import Issuer
        from poimen._capability.handles import HttpHandle

        rogue = Issuer(kernel.store)
        scope = rogue.scope(
            ctx.tool_id,
            ctx.intent_id,
            ctx.attempt,
            "rogue-key",
            kernel.registered()["cap.mint"].caps,
        )
        try:
            HttpHandle(rogue, scope, 5.0).post(f"{url}/keyed", json={"n": n})
        except CapabilityDeniedError as exc:
            seen["rogue"] = exc.reason.split(":")[0]

    holder = threading.Thread(
        target=kernel.call, args=("cap.hold", {"n": 1, "mode": "hold"}), kwargs={"call_id": "a"}
    )
    holder.start()
    try:
        assert a_inside.wait(10)
        kernel.call("cap.hold", {"n": 2, "mode": "foreign"}, call_id="b")
        kernel.call("cap.hold", {"n": 3, "mode": "forge"}, call_id="c")
        kernel.call("cap.mint", {"n": 4}, call_id="d")
    finally:
        a_release.set()
        holder.join(10)
    assert seen["foreign"] == "other_call_token"
    assert seen["forge"] == "forged_token;forged_token;"
    assert seen["rogue"] == "forged_token"
    b, c = kernel.store.get_by_call_id("b"), kernel.store.get_by_call_id("c")
    assert b is not None and c is not None
    assert [(d.intent_id, d.reason.split(":")[0]) for d in kernel.denials("cap.hold")] == [
        (b.id, "other_call_token"),
        (c.id, "forged_token"),
        (c.id, "forged_token"),
    ]
    d = kernel.store.get_by_call_id("d")
    assert d is not None
    assert [(x.intent_id, x.reason.split(":")[0]) for x in kernel.denials("cap.mint")] == [
        (d.id, "forged_token")
    ]
    assert ledger.count() == 0


def test_guard_is_scoped_to_the_running_tool(
    with_plain_tools: Kernel, ledger: ProviderClient, provider: ProviderProcess, tmp_path: Path
) -> None:
    """While an Idempotent tool runs, other threads (the kernel's commits among them) and a
    Queryable call write freely; the tool's own raw write is still denied."""
    kernel = with_plain_tools
    inside, release = threading.Event(), threading.Event()
    results: dict[str, Any] = {}

    @kernel.tool(
        id="cap.slow", effects=Idempotent(key=KeyDerivation.fields("n")), caps=Caps(), timeout=5.0
    )
    def slow(ctx: ToolContext, n: int) -> None:
        inside.set()
        assert release.wait(10)
        try:
            (tmp_path / "mine.txt").write_text("x")
        except CapabilityDeniedError as exc:
            results["own"] = exc.action

    t = threading.Thread(
        target=lambda: results.setdefault("slow", kernel.call("cap.slow", {"n": 1}, call_id="s"))
    )
    t.start()
    try:
        assert inside.wait(10)
        (tmp_path / "other-thread.txt").write_text("fine")
        with httpx.Client() as c:
            assert c.post(f"{provider.url}/plain", json={"other": "thread"}).status_code == 201
        # Kernel writes on this thread, a Queryable call and the Unsafe test tool all pass.
        results["ship"] = kernel.call("cap.ship", {"n": 1}, call_id="q")
    finally:
        release.set()
        t.join(10)
    assert results["own"] == "file_write"
    assert isinstance(results["slow"], Completed)
    assert isinstance(results["ship"], Completed)
    assert (tmp_path / "other-thread.txt").read_text() == "fine"
    assert [d.tool_id for d in kernel.denials()] == ["cap.slow"]
    assert ledger.count(kind="plain") == 3  # this thread's write and cap.ship's two


@pytest.fixture
def with_plain_tools(kernel: Kernel, provider: ProviderProcess, tmp_path: Path) -> Kernel:
    url = provider.url
    caps = Caps()  # not even a host: this layer does not restrict these classes

    def writes(ctx: ToolContext, n: int) -> int:
        ctx.http.post(f"{url}/plain", json={"via": "ctx.http", "n": n}).raise_for_status()
        ctx.sink("other").write({"via": "sink", "n": n}, key=f"own-{ctx.tool_id}-{n}")
        with httpx.Client() as c:
            c.post(f"{url}/plain", json={"via": "raw", "n": n}).raise_for_status()
        (tmp_path / f"{ctx.tool_id}-{n}.txt").write_text("written")
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        return n

    kernel.tool(
        id="cap.ship", effects=Queryable(lookup=lambda rid: NotLanded()), caps=caps, timeout=5.0
    )(writes)
    kernel.tool(id="cap.email", effects=Unsafe(), caps=caps, timeout=5.0)(writes)
    return kernel


# 7. Queryable and Unsafe tools write through plain handles and are never denied here.


def test_a_call_made_inside_a_guarded_tool_is_guarded_by_its_own_class(
    with_plain_tools: Kernel, ledger: ProviderClient, tmp_path: Path
) -> None:
    """An Idempotent tool that calls the kernel: the kernel's writes and the inner Unsafe tool
    are not the outer tool's writes; after the inner call the outer tool is guarded again."""
    k = with_plain_tools
    seen: dict[str, Any] = {}

    @k.tool(
        id="cap.outer", effects=Idempotent(key=KeyDerivation.fields("n")), caps=Caps(), timeout=10.0
    )
    def outer(ctx: ToolContext, n: int) -> Any:
        seen["inner"] = k.call("cap.email", {"n": n}, call_id=f"inner-{n}")
        seen["nested_idempotent"] = k.call(TOOL, {**ORDER, "how": "file"}, call_id=f"i2-{n}")
        try:
            (tmp_path / "outer.txt").write_text("x")
        except CapabilityDeniedError as exc:
            seen["outer"] = exc.tool_id
        return n

    assert isinstance(k.call("cap.outer", {"n": 5}, call_id="o"), Completed)
    assert seen["inner"] == Completed(seen["inner"].intent_id, 5)
    assert isinstance(seen["nested_idempotent"], Failed)  # guarded by its own scope
    assert seen["outer"] == "cap.outer"
    assert (tmp_path / "cap.email-5.txt").read_text() == "written"
    assert ledger.count(kind="plain") == 2
    assert [d.tool_id for d in k.denials()] == [TOOL, "cap.outer"]


@pytest.mark.parametrize("tool", ["cap.ship", "cap.email"])
def test_queryable_and_unsafe_tools_are_not_denied(
    with_plain_tools: Kernel, ledger: ProviderClient, tmp_path: Path, tool: str
) -> None:
    k = with_plain_tools
    out = k.call(tool, {"n": 7}, call_id="p1")
    assert out == Completed(out.intent_id, 7)
    assert sorted(e["body"]["via"] for e in ledger.entries()) == ["ctx.http", "raw", "sink"]
    assert ledger.count(kind="keyed", key=f"own-{tool}-7") == 1  # the tool's own key passes
    assert (tmp_path / f"{tool}-7.txt").read_text() == "written"
    assert k.denials() == []


def test_test_ship_and_test_email_keep_their_plain_clients(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    with recovering_kernel(store_url, provider.url) as k:
        assert isinstance(k.call(SHIP, {"order_id": "o", "address": "a"}, call_id="s"), Completed)
        assert isinstance(k.call(EMAIL, {"to": "a@b.c", "subject": "s"}, call_id="e"), Completed)
        assert ledger.count() == 2
        assert k.denials() == []


# Async tools: the guard follows the tool's task, not its neighbours.


def test_async_tools_are_guarded_per_task(
    kernel: Kernel, ledger: ProviderClient, provider: ProviderProcess, tmp_path: Path
) -> None:
    k = kernel
    url = provider.url
    late_write = asyncio.Event()
    outcomes: dict[str, Any] = {}

    async def late(path: Path) -> None:
        await late_write.wait()
        try:
            path.write_text("late")
        except CapabilityDeniedError as exc:
            outcomes["late"] = exc.reason.split(":")[0]

    host, port = _host_port(url)

    @k.tool(
        id="cap.acharge",
        effects=Idempotent(key=KEY),
        caps=Caps(hosts=(f"{host}:{port}",)),
        timeout=5.0,
    )
    async def acharge(ctx: ToolContext, order_id: str, amount_cents: int) -> Any:
        outcomes["task"] = asyncio.get_running_loop().create_task(late(tmp_path / "late.txt"))
        r = await ctx.ahttp.post(f"{url}/keyed", json={"order_id": order_id})
        try:
            tmp_path.joinpath("own.txt").write_text("x")
        except CapabilityDeniedError as exc:
            outcomes["own"] = exc.reason.split(":")[0]
        return r.json()

    async def neighbour() -> None:
        await asyncio.sleep(0)
        (tmp_path / "neighbour.txt").write_text("fine")

    async def main() -> None:
        out, _ = await asyncio.gather(k.acall("cap.acharge", ORDER, call_id="a1"), neighbour())
        outcomes["out"] = out
        outcomes["sync_under_acall"] = await k.acall(
            TOOL, {**ORDER, "order_id": "o-2", "how": "file"}, call_id="a2"
        )
        late_write.set()
        await outcomes["task"]

    asyncio.run(main())
    out = outcomes["out"]
    assert isinstance(out, Completed), out
    intent = k.store.get_intent(out.intent_id)
    assert intent is not None
    assert [e["key"] for e in ledger.entries()] == [intent.key]
    assert outcomes["own"] == "out_of_band"
    assert outcomes["late"] == "call_ended"  # a task the tool left behind, after the call
    assert isinstance(outcomes["sync_under_acall"], Failed)
    assert (tmp_path / "neighbour.txt").read_text() == "fine"
    assert not (tmp_path / "late.txt").exists() and not (tmp_path / "own.txt").exists()
    reasons = [(d.tool_id, d.reason.split(":")[0]) for d in k.denials()]
    assert reasons == [
        ("cap.acharge", "out_of_band"),
        (TOOL, "out_of_band"),
        ("cap.acharge", "call_ended"),
    ]


# 5. Recovery is a write under the same key, and it succeeds.


@pytest.mark.parametrize("point", ["mid_call", "after_effect"], ids=["not_landed", "landed"])
def test_recovery_retry_is_a_write_under_the_same_key(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient, point: str
) -> None:
    crash_call(tmp_path, store_url, provider.url, CHARGE, ORDER, "c1", point)
    with recovering_kernel(store_url, provider.url) as k:
        report = k.recover()
        intent = k.store.get_by_call_id("c1")
        assert intent is not None
        assert intent.state == IntentState.COMPLETED and report.completed == 1
        assert intent.key == KeyDerivation.fields("order_id", "amount_cents").derive(CHARGE, ORDER)
        assert [e["key"] for e in ledger.entries()] == [intent.key]
        assert len(k.store.attempts(intent.id)) == 2
        assert k.denials() == []


# 6. Determinism of the key.


def test_key_is_identical_over_100_derivations_from_the_recorded_arguments(
    kernel: Kernel,
) -> None:
    out = kernel.call(TOOL, ORDER, call_id="c1")
    intent = kernel.store.get_intent(out.intent_id)
    assert intent is not None and intent.key is not None
    recorded = json.loads(intent.args)
    keys = {KEY.derive(TOOL, json.loads(intent.args)) for _ in range(100)}
    assert keys == {intent.key}
    assert {KEY.derive(TOOL, dict(reversed(list(recorded.items())))) for _ in range(100)} == keys


def test_timestamp_argument_is_refused_or_ignored(
    kernel: Kernel, ledger: ProviderClient, provider: ProviderProcess
) -> None:
    url = provider.url
    host, port = _host_port(url)
    caps = Caps(hosts=(f"{host}:{port}",))

    def pay(ctx: ToolContext, order_id: str, sent_at: dt.datetime) -> Any:
        return ctx.http.post(f"{url}/keyed", json={"order_id": order_id}).json()

    # Refused: the key would change with the clock.
    for derivation in (KeyDerivation.all_args(), KeyDerivation.fields("order_id", "sent_at")):
        with pytest.raises(RegistrationError, match=r"'sent_at'.*time-like"):
            kernel.tool(id="cap.pay", effects=Idempotent(key=derivation), caps=caps, timeout=5.0)(
                pay
            )
    with pytest.raises(NondeterministicKeyError, match="time"):
        KeyDerivation.custom(lambda a: [a["order_id"], __import__("time").time()])
    assert "cap.pay" not in kernel.registered()

    # Ignored: excluded from the key, so two calls at two times are one effect.
    kernel.tool(
        id="cap.pay",
        effects=Idempotent(key=KeyDerivation.all_args(exclude=("sent_at",))),
        caps=caps,
        timeout=5.0,
    )(pay)
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    outs = [
        kernel.call(
            "cap.pay", {"order_id": "o-9", "sent_at": t0 + dt.timedelta(seconds=s)}, call_id=f"p{s}"
        )
        for s in (0, 61)
    ]
    intents = [kernel.store.get_intent(o.intent_id) for o in outs]
    assert all(isinstance(o, Completed) for o in outs)
    assert intents[0] is not None and intents[1] is not None
    assert intents[0].args != intents[1].args and intents[0].key == intents[1].key
    assert ledger.count(kind="keyed", key=intents[0].key) == 1 and ledger.count() == 1


def test_keyed_capability_denial_after_a_write_went_out_is_indeterminate(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    # FAILED would claim nothing happened; the first write landed, so an operator decides.
    out = kernel.call(TOOL, {**ORDER, "how": "handle_then_own_key"}, call_id="c1")
    assert out == Indeterminate(out.intent_id, "capability_denied_after_write")
    intent = kernel.store.get_intent(out.intent_id)
    assert intent is not None and intent.state == IntentState.INDETERMINATE
    assert [e["key"] for e in ledger.entries()] == [intent.key]
    assert len(kernel.store.attempts(intent.id)) == 1
    assert len(kernel.store.notifications(intent.id)) == 1
    [denial] = kernel.denials(tool_id=TOOL)
    assert denial.reason.startswith("key_mismatch")
