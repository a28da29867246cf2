"""Refunds served over MCP, each approved by the client's user through MCP elicitation:
approve, edit or reject, and four eyes for a large refund; each decision recorded on the
call's intent in poimen's log.

    python examples/mcp_approval.py

Offline: the MCP client talks to the server in this process, and its elicitation callback
stands in for the user's approval form; poimen.testing's provider process stands in for the
payments API, counting the refunds it takes (docs/integrations/mcp.md, "Approvals").
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from mcp import Client, types

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext
from poimen.integrations.mcp import CALL_ID_META, OUTCOME_META, mcp_server
from poimen.testing import ProviderClient, ProviderProcess


def pay(ctx: ToolContext, url: str, order_id: str, amount_cents: int) -> dict[str, Any]:
    """The refund, through the kernel's keyed handle."""
    ctx.http.post(f"{url}/keyed", json={"refund": order_id, "cents": amount_cents}).raise_for_status()
    return {"refunded": order_id, "cents": amount_cents}


async def main(tmp: Path) -> None:
    with ProviderProcess(tmp / "ledger.db") as payments, \
            Kernel(f"sqlite:///{tmp / 'agent.db'}", notifiers=[]) as kernel:
        key = Idempotent(key=KeyDerivation.fields("order_id"))
        caps = Caps(hosts=("127.0.0.1",))

        @kernel.tool(id="refund", effects=key, caps=caps, timeout=10, requires_approval=True)
        def refund(ctx: ToolContext, order_id: str, amount_cents: int) -> dict[str, Any]:
            """Refund an order. An operator approves each refund first."""
            return pay(ctx, payments.url, order_id, amount_cents)

        @kernel.tool(id="refund_large", effects=key, caps=caps, timeout=10,
                     requires_approval=True, approvers=2)
        def refund_large(ctx: ToolContext, order_id: str, amount_cents: int) -> dict[str, Any]:
            """Refund a whole order. Two operators approve each one (four eyes)."""
            return pay(ctx, payments.url, order_id, amount_cents)

        await kernel.alaunch()
        answers: list[dict[str, Any]] = []  # what the user answers, next first

        async def ask_the_user(context: Any, params: types.ElicitRequestParams) -> Any:
            print(f"  asked: {params.message}")
            return types.ElicitResult(action="accept", content=answers.pop(0))

        approve = {"decision": "approve", "operator": "ann", "reason": "checked"}
        edit = {"decision": "edit", "operator": "ann", "reason": "half of it",  # the edited call runs
                "args": '{"order_id": "o-2", "amount_cents": 12500}'}
        reject = {"decision": "reject", "operator": "ann", "reason": "duplicate"}  # nothing is sent
        bob = {"decision": "approve", "operator": "bob", "reason": "checked too"}
        async with Client(mcp_server(kernel, scope="shop"), elicitation_callback=ask_the_user) as c:
            for tool, order_id, cents, given in (
                ("refund", "o-1", 250_00, [approve]),
                ("refund", "o-2", 250_00, [edit]),
                ("refund", "o-3", 250_00, [reject]),
                ("refund_large", "o-4", 2500_00, [approve, bob]),  # four eyes: asked twice
            ):
                answers[:] = given
                result = await c.call_tool(tool, {"order_id": order_id, "amount_cents": cents},
                                           meta={CALL_ID_META: f"turn-1/{order_id}"})
                print(f"{tool} {order_id}: {(result.meta or {})[OUTCOME_META]}: "
                      f"{result.content[0].text}")  # type: ignore[union-attr]
                print(f"  refunds the provider took: {ProviderClient(payments.url).count()}")
        taken = [e["body"] for e in ProviderClient(payments.url).entries()]
        print(f"the provider's ledger: {taken}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(Path(tmp)))
