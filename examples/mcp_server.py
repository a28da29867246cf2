"""A poimen kernel served over MCP, and a client calling it; runs offline.

    pip install 'poimen[mcp]'
    python examples/mcp_server.py          # the demo: starts the server below, calls it twice
    python examples/mcp_server.py serve    # only the server, on stdin/stdout, for any MCP client

The server's tools declare their effect class; MCP clients see it as hints (send_receipt is
destructive and not idempotent, lookup_order reads). The client names its call with
``_meta: {"poimen/call_id": ...}``, so calling again after a lost answer (or a crashed server)
returns the recorded outcome and sends no second receipt. Run the demo twice: the second run
is answered from the log in mcp-example.db, and the outbox still holds one receipt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from poimen import Caps, Kernel, ReadOnly, ToolContext, Unsafe
from poimen.integrations.mcp import CALL_ID_META, OUTCOME_META, mcp_server, run_stdio


def outbox_of(db_url: str) -> Path:
    return Path(db_url.removeprefix("sqlite:///")).with_suffix(".outbox.jsonl")


def serve(db_url: str) -> None:
    outbox = outbox_of(db_url)
    with Kernel(db_url) as kernel:

        @kernel.tool(id="send_receipt", effects=Unsafe(), caps=Caps(), timeout=10)
        def send_receipt(ctx: ToolContext, order_id: str, email: str) -> dict[str, Any]:
            """Email the receipt for an order. Sending twice sends two emails."""
            with outbox.open("a", encoding="utf-8") as f:  # stands in for a mail provider
                f.write(json.dumps({"order_id": order_id, "to": email}) + "\n")
            return {"order_id": order_id, "sent_to": email}

        @kernel.tool(id="lookup_order", effects=ReadOnly(), caps=Caps(), timeout=10)
        def lookup_order(ctx: ToolContext, order_id: str) -> dict[str, Any]:
            """Look an order up."""
            return {"order_id": order_id, "status": "paid", "total_cents": 4200}

        kernel.launch()                                  # tools registered as usual
        run_stdio(mcp_server(kernel, scope="shop"))      # or mcp_server(...).streamable_http_app()


async def demo(db_url: str) -> None:
    from mcp import Client, StdioServerParameters

    server = StdioServerParameters(
        command=sys.executable, args=[__file__, "serve", "--db", db_url], env=dict(os.environ)
    )
    async with Client(server) as client:
        print("tools:")
        for tool in (await client.list_tools()).tools:
            a = tool.annotations
            hints = ("read-only" if a and a.read_only_hint else
                     f"{'destructive' if a and a.destructive_hint else 'not destructive'}, "
                     f"{'idempotent' if a and a.idempotent_hint else 'not idempotent'}")
            print(f"  {tool.name:14} {hints}")
        args = {"order_id": "o-17", "email": "ada@example.com"}
        for label in ("call send_receipt", "call it again (the answer was lost)"):
            result = await client.call_tool(
                "send_receipt", args, meta={CALL_ID_META: "order-17/receipt"}
            )
            meta = result.meta or {}
            print(f"{label}: {meta[OUTCOME_META]}, call id {meta[CALL_ID_META]}: "
                  f"{result.content[0].text}")
        found = await client.call_tool("lookup_order", {"order_id": "o-17"})
        print(f"lookup_order: {found.content[0].text}")
    sent = outbox_of(db_url).read_text(encoding="utf-8").splitlines()
    print(f"effects: {len(sent)} receipt in {outbox_of(db_url).name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", choices=("demo", "serve"), default="demo")
    p.add_argument("--db", default=f"sqlite:///{Path('mcp-example.db').resolve()}")
    ns = p.parse_args()
    if ns.mode == "serve":
        serve(ns.db)
    else:
        asyncio.run(demo(ns.db))


if __name__ == "__main__":
    main()
