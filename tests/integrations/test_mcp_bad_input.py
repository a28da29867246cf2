"""`import_mcp_tools` and `Kernel.register` against servers and tools that cannot be
registered: each is refused with `RegistrationError`, in bounded time, and nothing of it (nor
of the other tools of the same import) is registered: registration is all or nothing."""

from __future__ import annotations

import asyncio
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, types
from mcp.server import Server

from poimen import Caps, Completed, Kernel, ToolContext, Unsafe
from poimen.errors import RegistrationError
from poimen.integrations.mcp import MAX_PAGES, import_mcp_tools

GOOD = types.Tool(
    name="good", description="A tool that is fine.",
    input_schema={"type": "object", "properties": {"n": {"type": "integer"}}},
)


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[Kernel]:
    with Kernel(f"sqlite:///{tmp_path / 'intents.db'}", notifiers=[]) as k:
        yield k


def server(pages: Any) -> Server[Any]:
    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        cursor = getattr(params, "cursor", None)
        return pages(cursor)

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        return types.CallToolResult(content=[types.TextContent(text="ok")])

    return Server("remote", on_list_tools=list_tools, on_call_tool=call_tool)


def refused(kernel: Kernel, srv: Server[Any]) -> RegistrationError:
    """Import from `srv`, bounded by a generous time, and return the refusal."""

    async def go() -> RegistrationError:
        async with Client(srv) as client:
            with pytest.raises(RegistrationError) as e:
                await asyncio.wait_for(import_mcp_tools(kernel, client), timeout=100)
            return e.value

    error = asyncio.run(go())
    assert list(kernel.registered()) == [] and kernel.specs() == []  # nothing, not half
    return error


def test_a_tool_list_that_never_ends_is_refused(kernel: Kernel) -> None:
    again = refused(kernel, server(lambda c: types.ListToolsResult(tools=[GOOD], next_cursor="p")))
    assert "cursor" in str(again)
    count = [0]

    def fresh(cursor: str | None) -> types.ListToolsResult:
        count[0] += 1
        return types.ListToolsResult(tools=[], next_cursor=f"p{count[0]}")

    endless = refused(kernel, server(fresh))
    assert str(MAX_PAGES) in str(endless) and count[0] == MAX_PAGES


def _listing(*tools: types.Tool) -> Server[Any]:
    return server(lambda c: types.ListToolsResult(tools=list(tools)))


def test_an_argument_named_ctx_is_refused(kernel: Kernel) -> None:
    bad = types.Tool(name="bad", input_schema={"type": "object", "properties": {
        "ctx": {"type": "string"}}})
    e = refused(kernel, _listing(GOOD, bad))
    assert "'ctx'" in str(e) and e.data["tool_id"] == "bad"


@pytest.mark.parametrize("ref", ["#/$defs/Missing", "#/definitions/x/y", "https://schemas.example/x"])
def test_a_ref_that_does_not_resolve_is_refused_and_nothing_is_half_registered(
    kernel: Kernel, ref: str
) -> None:
    bad = types.Tool(name="bad", input_schema={
        "type": "object",
        "properties": {"item": {"$ref": ref}},
        "$defs": {"Item": {"type": "string"}},
    })
    e = refused(kernel, _listing(GOOD, bad))
    assert ref in str(e) and e.data["field"] == "item"


def test_a_ref_that_resolves_is_imported_and_checked(kernel: Kernel) -> None:
    ok = types.Tool(name="ok", input_schema={
        "type": "object",
        "properties": {"item": {"$ref": "#/$defs/Item"}},
        "$defs": {"Item": {"type": "string"}},
    })

    async def go() -> Any:
        async with Client(_listing(ok)) as client:
            await import_mcp_tools(kernel, client)
            return await kernel.acall("ok", {"item": "x"}, call_id="ref-1")

    assert isinstance(asyncio.run(go()), Completed)


def test_a_local_tool_whose_arguments_have_no_schema_is_not_half_registered(
    kernel: Kernel,
) -> None:
    with pytest.raises(RegistrationError, match="no JSON schema"):

        @kernel.tool(id="t.cb", effects=Unsafe(), caps=Caps(), timeout=5)
        def cb(ctx: ToolContext, fn: typing.Callable[[int], int]) -> int:
            return 1

    assert "t.cb" not in kernel.registered() and kernel.specs() == []

    @kernel.tool(id="t.cb", effects=Unsafe(), caps=Caps(), timeout=5)  # the id is free
    def fixed(ctx: ToolContext, n: int) -> int:
        return n

    assert [s.id for s in kernel.specs()] == ["t.cb"]
