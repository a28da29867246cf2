"""A remote MCP server's tools imported as poimen tools: each call journalled, recovered by the
class the application declares for it (Unsafe unless declared).

    python examples/mcp_import.py

Offline: the remote server (a CRM) runs in this process and the client talks to it in memory;
with a real one, give `Client` its URL (docs/integrations/mcp.md).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from mcp import Client, types
from mcp.server import Server

from poimen import Idempotent, Kernel, KeyDerivation, ReadOnly
from poimen.integrations.mcp import import_mcp_tools


def crm_server(log: list[str]) -> Server[Any]:
    """A plain MCP server, not poimen: it knows nothing of call ids."""
    obj = {"type": "object"}
    tools = [
        types.Tool(name="find_contact", description="Find a contact by email.", input_schema={
            **obj, "properties": {"email": {"type": "string"}}, "required": ["email"]}),
        types.Tool(name="tag_contact", description="Tag a contact (tagging twice is harmless).",
                   input_schema={**obj, "properties": {"id": {"type": "string"},
                                                       "tag": {"type": "string"}},
                                 "required": ["id", "tag"]}),
        types.Tool(name="send_campaign", description="Email every contact with a tag.",
                   input_schema={**obj, "properties": {"tag": {"type": "string"}},
                                 "required": ["tag"]}),
    ]

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools)

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        log.append(f"{params.name} {params.arguments}")
        return types.CallToolResult(content=[types.TextContent(text="ok")],
                                    structured_content={"ok": True})

    return Server("crm", on_list_tools=list_tools, on_call_tool=call_tool)


async def main(tmp: Path) -> None:
    log: list[str] = []
    crm = crm_server(log)
    with Kernel(f"sqlite:///{tmp / 'agent.db'}", notifiers=[]) as kernel:
        async with Client(crm) as session:      # or Client("https://tools.example/mcp"), an mcp.ClientSession
            await import_mcp_tools(kernel, session, prefix="crm.", declare={
                "find_contact": ReadOnly(), "tag_contact": Idempotent(key=KeyDerivation.all_args())})
            out = await kernel.acall("crm.send_campaign", {"tag": "new"}, call_id="run-4/step-2")
            print(f"crm.send_campaign: {type(out).__name__}")
            again = await kernel.acall("crm.send_campaign", {"tag": "new"}, call_id="run-4/step-2")
            print(f"the same call id again: {type(again).__name__}, answered from the log")
        for spec in kernel.specs():
            print(f"  {spec.id:18} {spec.effect}")
    print("the CRM received:", *log)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(Path(tmp)))
