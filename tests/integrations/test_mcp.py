"""poimen under MCP: a kernel's tools served over MCP to a real in-process client session,
a remote MCP server's tools imported as poimen tools, and a stdio server process SIGKILLed
after an Unsafe tool's effect."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters, types
from mcp.server import Server
from mcp.shared.exceptions import MCPError

from poimen import (
    Caps,
    Completed,
    Idempotent,
    Indeterminate,
    Kernel,
    KeyDerivation,
    ReadOnly,
    ToolContext,
    Unsafe,
)
from poimen.errors import DefiniteFailure, RegistrationError
from poimen.integrations.mcp import (
    CALL_ID_META,
    OUTCOME_META,
    RETRYABLE_META,
    import_mcp_tools,
    mcp_server,
)
from poimen.testing import ProviderClient, ProviderProcess, register_test_tools

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def kernel(tmp_path: Path, provider: ProviderProcess) -> Iterator[Kernel]:
    k = Kernel(f"sqlite:///{tmp_path / 'intents.db'}", notifiers=[])
    register_test_tools(k, provider.url)

    @k.tool(id="orders.lookup", effects=ReadOnly(), caps=Caps(), timeout=5)
    def lookup(ctx: ToolContext, order_id: str) -> dict[str, Any]:
        """Look an order up."""
        return {"order_id": order_id, "status": "shipped"}

    @k.tool(id="flaky", effects=Unsafe(), caps=Caps(), timeout=5)
    def flaky(ctx: ToolContext, to: str) -> None:
        """Send a message through a link that drops answers."""
        raise ConnectionResetError("the link dropped before the answer")

    @k.tool(id="refused", effects=Unsafe(), caps=Caps(), timeout=5)
    def refused(ctx: ToolContext, to: str) -> None:
        raise DefiniteFailure("no such mailbox")

    try:
        yield k
    finally:
        k.close()


def run(server: Server[Any], body: Callable[[Client], Awaitable[Any]]) -> Any:
    async def go() -> Any:
        async with Client(server) as client:
            return await body(client)

    return asyncio.run(go())


def meta(result: types.CallToolResult) -> dict[str, Any]:
    return dict(result.meta or {})


def plain_to(ledger: ProviderClient, to: str) -> int:
    return sum(1 for e in ledger.entries(kind="plain") if e["body"].get("to") == to)


def test_tools_are_listed_with_schema_description_and_hints_from_their_class(
    kernel: Kernel,
) -> None:
    listed = run(mcp_server(kernel), lambda c: c.list_tools())
    tools = {t.name: t for t in listed.tools}
    specs = {s.name: s for s in kernel.specs()}
    assert set(tools) == set(specs)
    for name, tool in tools.items():
        assert tool.input_schema == {"type": "object", **specs[name].parameters}
        assert tool.description == specs[name].description
    hints = {
        kernel.tool_id(n): (a.read_only_hint, a.destructive_hint, a.idempotent_hint)
        for n, t in tools.items()
        if (a := t.annotations) is not None
    }
    assert hints["test.charge"] == (False, False, True)  # Idempotent
    assert hints["test.ship"] == (False, True, False)  # Queryable: a repeat is a second effect
    assert hints["test.email"] == (False, True, False)  # Unsafe
    assert hints["orders.lookup"] == (True, None, None)  # ReadOnly
    assert tools["orders_lookup"].description == "Look an order up."
    # Only the tools named are served.
    only = run(mcp_server(kernel, tools=["orders.lookup"]), lambda c: c.list_tools())
    assert [t.name for t in only.tools] == ["orders_lookup"]


def test_a_completed_call_answers_its_result_as_structured_content(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    result = run(mcp_server(kernel), lambda c: c.call_tool(
        "test_email", {"to": "a@example.com", "subject": "hi"},
        meta={CALL_ID_META: "msg-1"}))
    assert not result.is_error
    out = kernel.outcome("mcp/msg-1")
    assert isinstance(out, Completed)
    assert result.structured_content == out.result and "entry_id" in out.result
    assert result.content[0].text == out.for_model()
    assert meta(result)[CALL_ID_META] == "mcp/msg-1"
    assert meta(result)[OUTCOME_META] == "completed"
    assert plain_to(ledger, "a@example.com") == 1


def test_a_client_call_id_in_meta_names_the_call_across_sessions(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    server = mcp_server(kernel, scope="support")
    args = {"to": "b@example.com", "subject": "hi"}

    async def call(c: Client) -> types.CallToolResult:
        return await c.call_tool("test_email", args, meta={CALL_ID_META: "turn-7/call-1"})

    first = run(server, call)
    again = run(server, call)  # another session, the same call: answered from the log
    assert first.structured_content == again.structured_content
    assert meta(first)["poimen/intent_id"] == meta(again)["poimen/intent_id"]
    assert meta(again)[CALL_ID_META] == "support/turn-7/call-1"
    assert plain_to(ledger, "b@example.com") == 1


def test_without_a_client_call_id_each_session_has_its_own_ids(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    # A JSON-RPC request id is numbered per session: two sessions each send their first call
    # as id 1 (2, ...), so it cannot name a call. Two sessions making the same calls must
    # make distinct calls, and so must one session making a call twice.
    server = mcp_server(kernel)
    args = {"to": "c@example.com", "subject": "hi"}

    async def twice(c: Client) -> list[str]:
        one = await c.call_tool("test_email", args)
        two = await c.call_tool("test_email", args)
        return [meta(one)[CALL_ID_META], meta(two)[CALL_ID_META]]

    ids = run(server, twice) + run(server, twice)
    assert len(set(ids)) == 4, ids
    assert plain_to(ledger, "c@example.com") == 4


def test_over_http_derived_ids_are_scoped_by_the_mcp_session(kernel: Kernel) -> None:
    import socket
    import threading

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
    server = uvicorn.Server(uvicorn.Config(mcp_server(kernel).streamable_http_app(),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < end, "the HTTP server did not start"
        time.sleep(0.01)

    async def call(mode: str) -> str:
        async with Client(url, mode=mode) as c:
            r = await c.call_tool("orders_lookup", {"order_id": "o-1"})
            return str(meta(r)[CALL_ID_META])

    try:
        one, two = asyncio.run(call("legacy")), asyncio.run(call("legacy"))
        modern = asyncio.run(call("auto"))  # the per-request protocol has no session
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert one.startswith("mcp/") and two.startswith("mcp/") and one != two
    assert one.endswith("/1") and two.endswith("/1")  # each session counts its own calls
    assert modern.startswith("mcp-") and modern.endswith("/1")


def test_an_indeterminate_call_answers_the_standard_text_and_is_not_an_error(
    kernel: Kernel,
) -> None:
    result = run(mcp_server(kernel), lambda c: c.call_tool(
        "flaky", {"to": "d@example.com"}, meta={CALL_ID_META: "f-1"}))
    out = kernel.outcome("mcp/f-1")
    assert isinstance(out, Indeterminate)
    assert not result.is_error
    assert result.structured_content is None
    assert [c.text for c in result.content] == [out.for_model()]
    assert "Do NOT call it again" in result.content[0].text
    assert meta(result)[OUTCOME_META] == "indeterminate"
    assert meta(result)[RETRYABLE_META] is False
    assert meta(result)["poimen/intent_id"] == out.intent_id


def test_after_an_operator_resolves_the_same_call_id_answers_the_decision(
    kernel: Kernel,
) -> None:
    server = mcp_server(kernel)
    call_meta = {CALL_ID_META: "f-2"}
    first = run(server, lambda c: c.call_tool("flaky", {"to": "r@example.com"}, meta=call_meta))
    assert meta(first)[OUTCOME_META] == "indeterminate"
    kernel.resolve(meta(first)["poimen/intent_id"], landed=True, result={"delivered": True},
                   operator="ops@example.com", reason="the message is in the outbox")
    again = run(server, lambda c: c.call_tool("flaky", {"to": "r@example.com"}, meta=call_meta))
    assert meta(again)[OUTCOME_META] == "resolved" and not again.is_error
    assert again.structured_content == {"delivered": True}
    assert "Do not call it again" in again.content[0].text
    # The same call id with other arguments names another call: refused, nothing recorded.
    other = run(server, lambda c: c.call_tool("flaky", {"to": "s@example.com"}, meta=call_meta))
    assert other.is_error and "other arguments" in other.content[0].text


def test_a_failed_call_is_an_error_result_the_model_may_correct(kernel: Kernel) -> None:
    result = run(mcp_server(kernel), lambda c: c.call_tool("refused", {"to": "x"}))
    assert result.is_error
    assert "no such mailbox" in result.content[0].text
    assert meta(result)[OUTCOME_META] == "failed" and meta(result)[RETRYABLE_META] is True


def test_bad_input_is_refused_before_anything_is_recorded(kernel: Kernel) -> None:
    server = mcp_server(kernel)
    result = run(server, lambda c: c.call_tool(
        "test_email", {"to": "e@example.com"}, meta={CALL_ID_META: "bad-1"}))
    assert result.is_error and "subject" in result.content[0].text
    assert kernel.outcome("mcp/bad-1") is None

    async def refused(c: Client) -> None:
        with pytest.raises(MCPError, match="no tool is named 'nope'"):
            await c.call_tool("nope", {})
        with pytest.raises(MCPError, match="poimen/call_id"):
            await c.call_tool("orders_lookup", {"order_id": "o"}, meta={CALL_ID_META: 7})

    async def not_served(c: Client) -> None:
        with pytest.raises(MCPError, match="no tool is named"):
            await c.call_tool("orders_lookup", {"order_id": "o"})

    run(server, refused)
    run(mcp_server(kernel, tools=["test.email"]), not_served)


def test_a_tools_filter_by_id_serves_and_runs_that_tool_only(
    kernel: Kernel, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    """An id and a model-facing name never name two tools: the filter by the read-only tool's
    id serves it, and a call through it never reaches the Unsafe refund."""
    import hashlib

    import httpx

    # The id the refund's name would take once "billing_refund" is taken.
    lookup_id = f"billing_refund_{hashlib.sha256(b'billing.refund').hexdigest()[:8]}"
    looked: list[str] = []

    def look(ctx: ToolContext, order_id: str) -> str:
        looked.append(order_id)
        return "refundable"

    kernel.tool(id=lookup_id, effects=ReadOnly(), caps=Caps(), timeout=5)(look)
    kernel.tool(id="billing_refund", effects=ReadOnly(), caps=Caps(), timeout=5)(look)

    @kernel.tool(id="billing.refund", effects=Unsafe(), caps=Caps(), timeout=5)
    def refund(ctx: ToolContext, order_id: str) -> Any:
        with httpx.Client(base_url=provider.url, timeout=5) as client:
            return client.post("/plain", json={"to": order_id}).json()

    async def list_and_call(c: Client) -> Any:
        [tool] = (await c.list_tools()).tools
        return tool.name, await c.call_tool(tool.name, {"order_id": "o-9"},
                                            meta={CALL_ID_META: "f-1"})

    name, result = run(mcp_server(kernel, tools=[lookup_id]), list_and_call)
    assert name == lookup_id and not result.is_error
    assert plain_to(ledger, "o-9") == 0 and looked == ["o-9"]
    assert kernel.store.get_by_call_id("mcp/f-1").tool_id == lookup_id  # type: ignore[union-attr]


# Importing a remote server's tools.


def remote_server(seen: list[dict[str, Any]], *, fail: bool = False) -> Server[Any]:
    """A plain MCP server (not poimen) whose tools claim every safety hint there is."""
    claims = types.ToolAnnotations(read_only_hint=True, idempotent_hint=True,
                                   destructive_hint=False)
    schema = {"type": "object", "properties": {
        "to": {"type": "string", "format": "email"},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["to"]}

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[
            types.Tool(name="notify", description="Notify someone.", input_schema=schema,
                       annotations=claims),
            types.Tool(name="status", description="Read a status.", annotations=claims,
                       input_schema={"type": "object", "properties": {}})])

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        seen.append({"name": params.name, "arguments": params.arguments,
                     "call_id": (params.meta or {}).get(CALL_ID_META)})
        if fail:
            return types.CallToolResult(content=[types.TextContent(text="upstream timed out")],
                                        is_error=True)
        return types.CallToolResult(content=[types.TextContent(text="sent")],
                                    structured_content={"sent": len(seen)})

    return Server("remote", on_list_tools=list_tools, on_call_tool=call_tool)


def test_imported_tools_are_unsafe_whatever_the_remote_claims(kernel: Kernel) -> None:
    seen: list[dict[str, Any]] = []

    async def body(c: Client) -> Any:
        specs = await import_mcp_tools(kernel, c, prefix="remote.")
        out = await kernel.acall("remote.notify", {"to": "f@example.com"}, call_id="n-1")
        return specs, out

    specs, out = run(remote_server(seen), body)
    assert {s.id: s.effect for s in specs} == {"remote.notify": "unsafe",
                                                "remote.status": "unsafe"}
    notify = kernel.spec("remote.notify")
    assert notify.description == "Notify someone."
    assert notify.parameters["required"] == ["to"]
    assert notify.parameters["properties"]["priority"]["maximum"] == 5
    assert out == Completed(out.intent_id, {"sent": 1})
    # Optional arguments left out are not sent; the intent id names the call remotely.
    assert seen == [{"name": "notify", "arguments": {"to": "f@example.com"},
                     "call_id": out.intent_id}]
    # Served again over MCP, they carry poimen's hints, not the remote's.
    listed = run(mcp_server(kernel, tools=["remote.notify"]), lambda c: c.list_tools())
    assert listed.tools[0].annotations.destructive_hint is True
    assert listed.tools[0].annotations.idempotent_hint is False


def test_an_application_declares_what_it_trusts_per_tool(kernel: Kernel, tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []
    key = Idempotent(key=KeyDerivation.fields("to"))

    async def body(c: Client) -> Any:
        await import_mcp_tools(kernel, c, declare={"notify": key, "status": ReadOnly()})
        one = await kernel.acall("notify", {"to": "g@example.com", "priority": 2},
                                 call_id="k-1")
        # Recovery runs tools from its own thread: the call is carried to this loop.
        two = await asyncio.to_thread(kernel.call, "status", {}, call_id="s-1")
        return one, two

    one, two = run(remote_server(seen), body)
    assert kernel.spec("notify").effect == "idempotent"
    assert kernel.spec("status").effect == "readonly"
    assert isinstance(one, Completed) and isinstance(two, Completed)
    intent_key = seen[0]["call_id"]
    assert intent_key and intent_key != one.intent_id  # the Idempotent key, not the intent id
    assert seen[1]["name"] == "status"
    with Kernel(f"sqlite:///{tmp_path / 'other.db'}", notifiers=[], worker_id="other") as k2:
        async def typo(c: Client) -> None:
            with pytest.raises(RegistrationError, match="no tool named 'nofity'"):
                await import_mcp_tools(k2, c, declare={"nofity": ReadOnly()})

        run(remote_server(seen), typo)
        assert k2.specs() == []


def test_an_imported_tool_whose_session_loop_has_stopped_is_not_sent(
    kernel: Kernel,
) -> None:
    from poimen import Failed

    seen: list[dict[str, Any]] = []
    run(remote_server(seen), lambda c: import_mcp_tools(kernel, c, prefix="gone."))
    out = kernel.call("gone.notify", {"to": "l@example.com"}, call_id="gone-1")
    assert isinstance(out, Failed) and "no longer runs" in out.error
    assert seen == []


def test_arguments_are_checked_against_the_remote_schema_before_recording(
    kernel: Kernel,
) -> None:
    from poimen.errors import ArgumentError

    seen: list[dict[str, Any]] = []

    async def body(c: Client) -> None:
        await import_mcp_tools(kernel, c)
        with pytest.raises(ArgumentError, match="priority"):
            await kernel.acall("notify", {"to": "h@example.com", "priority": 9},
                               call_id="v-1")
        with pytest.raises(ArgumentError, match="extra"):
            await kernel.acall("notify", {"to": "h@example.com", "extra": 1}, call_id="v-2")

    run(remote_server(seen), body)
    assert kernel.outcome("v-1") is None and kernel.outcome("v-2") is None
    assert seen == []


def test_a_remote_error_leaves_an_imported_unsafe_call_indeterminate(kernel: Kernel) -> None:
    # The remote may report an error after its effect: poimen does not take it for "nothing
    # happened" unless told.
    seen: list[dict[str, Any]] = []

    async def body(c: Client) -> Any:
        await import_mcp_tools(kernel, c)
        return await kernel.acall("notify", {"to": "i@example.com"}, call_id="e-1")

    out = run(remote_server(seen, fail=True), body)
    assert isinstance(out, Indeterminate)
    assert len(seen) == 1


def test_a_remote_poimen_servers_indeterminate_stays_indeterminate(
    kernel: Kernel, tmp_path: Path
) -> None:
    local = Kernel(f"sqlite:///{tmp_path / 'local.db'}", notifiers=[], worker_id="local")

    async def body(c: Client) -> Any:
        await import_mcp_tools(local, c, tools=["flaky"])
        return await local.acall("flaky", {"to": "j@example.com"}, call_id="chain-1")

    try:
        out = run(mcp_server(kernel), body)
        assert isinstance(out, Indeterminate), out
        assert local.spec("flaky").effect == "unsafe"
    finally:
        local.close()
    # The remote's log holds the call under the id the importer sent.
    assert isinstance(kernel.outcome(f"mcp/{out.intent_id}"), Indeterminate)


# A server process killed after an Unsafe tool's effect.


def stdio_params(db_url: str, provider_url: str, env: dict[str, str], *options: str
                 ) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "tests.integrations.mcp_runner", "--db", db_url, "--provider", provider_url,
              *options],
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", **env},
        cwd=str(ROOT),
    )


def wait_for_pause(marker: Path, within: float = 60.0) -> int:
    end = time.monotonic() + within
    while not marker.exists():
        if time.monotonic() > end:
            raise TimeoutError("the server did not reach its pause point")
        time.sleep(0.01)
    return int(marker.read_text(encoding="ascii").split()[0])


def test_a_server_killed_after_the_effect_answers_the_same_call_id_without_a_second_effect(
    tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    db_url = f"sqlite:///{tmp_path / 'server.db'}"
    marker = tmp_path / "paused"
    args = {"to": "k@example.com", "subject": "invoice"}
    call_meta = {CALL_ID_META: "conv-3/call-1"}

    async def killed() -> None:
        paused = {"POIMEN_PAUSE_AT": "after_effect", "POIMEN_PAUSE_FILE": str(marker)}
        async with Client(stdio_params(db_url, provider.url, paused)) as c:
            call = asyncio.ensure_future(c.call_tool("test_email", args, meta=call_meta))
            pid = await asyncio.to_thread(wait_for_pause, marker)
            assert plain_to(ledger, "k@example.com") == 1  # the effect happened
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(MCPError, match="Connection closed"):
                await call

    async def again() -> types.CallToolResult:
        async with Client(stdio_params(db_url, provider.url, {})) as c:
            return await c.call_tool("test_email", args, meta=call_meta)

    asyncio.run(killed())
    result = asyncio.run(again())
    assert plain_to(ledger, "k@example.com") == 1
    assert not result.is_error
    assert meta(result)[OUTCOME_META] == "indeterminate"
    assert meta(result)[RETRYABLE_META] is False
    text = result.content[0].text
    assert text == Indeterminate(meta(result)["poimen/intent_id"], "").for_model()
    assert "Do NOT call it again" in text


def test_the_example_runs_offline(tmp_path: Path) -> None:
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "mcp_server.py"), "--db",
         f"sqlite:///{tmp_path / 'example.db'}"],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.split() == ["send_receipt", "destructive,", "not", "idempotent"]
               for line in lines), done.stdout
    assert sum(line.startswith("call ") and "completed" in line for line in lines) == 2
    assert "effects: 1 receipt in example.outbox.jsonl" in lines, done.stdout


# Approvals asked of the client's user by MCP elicitation.

@pytest.mark.parametrize("mode", ["legacy", "auto"])
def test_an_approval_is_elicited_from_the_client_and_bound_to_the_call(
    mode: str, kernel: Kernel, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    import httpx

    @kernel.tool(id="gated", effects=Unsafe(), caps=Caps(), timeout=5, requires_approval=True)
    def gated(ctx: ToolContext, to: str) -> Any:
        return httpx.post(f"{provider.url}/plain", json={"to": to, "subject": "x"}).json()

    answers: list[dict[str, Any]] = [
        {"decision": "approve", "operator": "ann", "reason": "checked"},
        {"decision": "edit", "operator": "ann", "reason": "eve", "args": '{"to": "eve"}'},
        {"decision": "reject", "operator": "ann", "reason": "no"},
    ]
    asked: list[str] = []

    async def elicit(context: Any, params: Any) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content=answers.pop(0))

    async def body() -> list[types.CallToolResult]:
        async with Client(mcp_server(kernel), elicitation_callback=elicit, mode=mode) as c:
            return [await c.call_tool("gated", {"to": to}, meta={CALL_ID_META: f"g-{n}"})
                    for n, to in enumerate(("bob", "joe", "zed"))]

    approved, edited, rejected = asyncio.run(body())
    assert len(asked) == 3 and "'gated'" in asked[0]
    assert meta(approved)[OUTCOME_META] == "completed" and not approved.is_error
    assert meta(edited)[OUTCOME_META] == "completed"
    assert rejected.is_error and "rejected by ann" in rejected.content[0].text  # type: ignore[union-attr]
    assert sorted(e["body"]["to"] for e in ledger.entries(kind="plain")) == ["bob", "eve"]
    # Asked again with the same call id: the log answers, nobody is asked, nothing is sent.
    again = run(mcp_server(kernel), lambda c: c.call_tool("gated", {"to": "bob"},
                                                          meta={CALL_ID_META: "g-0"}))
    assert meta(again)[OUTCOME_META] == "completed" and ledger.count(kind="plain") == 2
    # The edited call's id answers with the edited call, not with the original's "edited".
    again = run(mcp_server(kernel), lambda c: c.call_tool("gated", {"to": "joe"},
                                                          meta={CALL_ID_META: "g-1"}))
    assert meta(again)[OUTCOME_META] == "completed" and not again.is_error
    assert meta(again)["poimen/intent_id"] == meta(edited)["poimen/intent_id"]


def four_eyes_tool(kernel: Kernel, provider: ProviderProcess) -> None:
    import httpx

    @kernel.tool(id="four_eyes", effects=Unsafe(), caps=Caps(), timeout=5,
                 requires_approval=True, approvers=2)
    def four_eyes(ctx: ToolContext, to: str) -> Any:
        return httpx.post(f"{provider.url}/plain", json={"to": to, "subject": "x"}).json()


# How a server asks its client: an elicitation request on the session (the initialize
# handshake), or an input_required result answered by calling again (MCP 2026-07-28).
MODES = pytest.mark.parametrize("mode", ["legacy", "auto"])


def elicited(kernel: Kernel, answers: list[dict[str, Any]], asked: list[str],
             calls: list[tuple[dict[str, Any], str]], mode: str) -> list[types.CallToolResult]:
    """The calls made through one session whose user answers `answers` in turn (declines
    when none is left), keeping what they were asked."""
    async def elicit(context: Any, params: Any) -> types.ElicitResult:
        asked.append(params.message)
        if not answers:
            return types.ElicitResult(action="decline")
        return types.ElicitResult(action="accept", content=answers.pop(0))

    async def body() -> list[types.CallToolResult]:
        async with Client(mcp_server(kernel), elicitation_callback=elicit, mode=mode) as c:
            return [await c.call_tool("four_eyes", args, meta={CALL_ID_META: call_id})
                    for args, call_id in calls]

    return asyncio.run(body())


@MODES
def test_four_eyes_by_elicitation_asks_until_two_distinct_operators_approved(
    mode: str, kernel: Kernel, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    four_eyes_tool(kernel, provider)
    ann = {"decision": "approve", "operator": "ann", "reason": "checked"}
    bob = {"decision": "approve", "operator": "bob", "reason": "checked too"}
    asked: list[str] = []
    # ann twice does not count: the user is asked again, and bob's approval sends it.
    [result] = elicited(kernel, [ann, dict(ann), bob], asked, [({"to": "bob"}, "fe-1")], mode)
    assert meta(result)[OUTCOME_META] == "completed" and ledger.count(kind="plain") == 1
    assert len(asked) == 3 and "approved so far by ann" in asked[1]
    assert "approved so far by ann" in asked[2]
    # A user who declines after one approval: the call awaits; called again, asked again.
    asked.clear()
    first, again = elicited(kernel, [ann], asked, [({"to": "zed"}, "fe-2")] * 2, mode)
    assert meta(first)[OUTCOME_META] == "pending"
    assert meta(first)["poimen/reason"] == "awaiting_approval"
    assert meta(again)[OUTCOME_META] == "pending" and len(asked) == 3
    [done] = elicited(kernel, [bob], asked, [({"to": "zed"}, "fe-2")], mode)
    assert meta(done)[OUTCOME_META] == "completed" and ledger.count(kind="plain") == 2


@MODES
def test_four_eyes_with_an_edit_asks_the_second_user_about_the_edited_call(
    mode: str, kernel: Kernel, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    four_eyes_tool(kernel, provider)
    edit = {"decision": "edit", "operator": "ann", "reason": "eve", "args": '{"to": "eve"}'}
    bob = {"decision": "approve", "operator": "bob", "reason": "checked"}
    asked: list[str] = []
    [result] = elicited(kernel, [edit, bob], asked, [({"to": "bob"}, "fe-3")], mode)
    assert '{"to": "eve"}' in asked[1] and meta(result)[OUTCOME_META] == "completed"
    assert [e["body"]["to"] for e in ledger.entries(kind="plain")] == ["eve"]
