"""A PydanticAI run ended by a refund awaiting approval, resumed with the approver's decision:
approve, edit or reject; and a large refund that two operators must approve.

    python examples/pydantic_ai_approval.py

Offline: PydanticAI's `FunctionModel` stands in for the LLM, and poimen.testing's provider
process for the payments API, counting the refunds it takes. Each refund needs an approval
(`requires_approval`): the run ends with PydanticAI's `DeferredToolRequests`, and `decide`
records the decision on that call's intent, audited with the operator, and adds it to the
`DeferredToolResults` that resume the run (docs/integrations/pydantic-ai.md, "Approvals").
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from pydantic_ai import Agent, DeferredToolRequests, DeferredToolResults
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext
from poimen.integrations.pydantic_ai import PoimenToolset, decide
from poimen.testing import ProviderClient, ProviderProcess


def fake_llm(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Refunds 250.00 of the order the user names, then says what the tool answered."""
    parts = [p for m in messages for p in getattr(m, "parts", [])]
    results = [p for p in parts if isinstance(p, ToolReturnPart)]
    if results:
        return ModelResponse(parts=[TextPart(f"The tool said: {results[-1].model_response_str()}")])
    prompt = next(p for p in parts if isinstance(p, UserPromptPart))
    order_id = str(prompt.content).split()[-1].rstrip(".")
    large = "in full" in str(prompt.content)
    ask = {"order_id": order_id, "amount_cents": 2500_00 if large else 250_00}
    tool = "refund_large" if large else "refund"
    return ModelResponse(parts=[ToolCallPart(tool, ask, tool_call_id="call-1")])


def pay(ctx: ToolContext, url: str, order_id: str, amount_cents: int) -> dict[str, Any]:
    """The refund, through the kernel's keyed handle."""
    ctx.http.post(f"{url}/keyed", json={"refund": order_id, "cents": amount_cents}).raise_for_status()
    return {"refunded": order_id, "cents": amount_cents}


async def main(tmp: Path) -> None:
    with ProviderProcess(tmp / "ledger.db") as payments, \
            Kernel(f"sqlite:///{tmp / 'agent.db'}", notifiers=[]) as kernel:

        @kernel.tool(id="refund", effects=Idempotent(key=KeyDerivation.fields("order_id")),
                     caps=Caps(hosts=("127.0.0.1",)), timeout=10, requires_approval=True)
        def refund(ctx: ToolContext, order_id: str, amount_cents: int) -> dict[str, Any]:
            """Refund an order. An operator approves each refund first."""
            return pay(ctx, payments.url, order_id, amount_cents)

        @kernel.tool(id="refund_large", effects=Idempotent(key=KeyDerivation.fields("order_id")),
                     caps=Caps(hosts=("127.0.0.1",)), timeout=10, requires_approval=True,
                     approvers=2)
        def refund_large(ctx: ToolContext, order_id: str, amount_cents: int) -> dict[str, Any]:
            """Refund a whole order. Two operators approve each one (four eyes)."""
            return pay(ctx, payments.url, order_id, amount_cents)

        await kernel.alaunch()
        for order_id, decision, reason, args in (
            ("o-1", "approve", "checked", None),
            ("o-2", "edit", "half of it", {"order_id": "o-2", "amount_cents": 125_00}),
            ("o-3", "reject", "duplicate", None),
        ):
            toolset = PoimenToolset(kernel, scope=f"conversation-{order_id}")
            agent = Agent(FunctionModel(fake_llm), toolsets=[toolset],
                          output_type=[str, DeferredToolRequests])
            first = await agent.run(f"Refund order {order_id}.")
            requests = first.output
            assert isinstance(requests, DeferredToolRequests)
            print(f"refund of {order_id}: the run ended, "
                  f"{[c.tool_name for c in requests.approvals]} awaiting approval")
            results = DeferredToolResults()
            for call in requests.approvals:  # "approve"; "edit" with the edited args; "reject"
                await decide(kernel, results, requests, call.tool_call_id, decision=decision,
                             operator="ann", reason=reason, args=args)
            result = await agent.run(message_history=first.all_messages(), deferred_tool_results=results)
            print(f"  {decision} by ann: the agent: {result.output}")
            print(f"  refunds the provider took: {ProviderClient(payments.url).count()}")
        # Four eyes: the run ends asking again until two distinct operators approved.
        agent = Agent(FunctionModel(fake_llm), output_type=[str, DeferredToolRequests],
                      toolsets=[PoimenToolset(kernel, scope="conversation-o-4")])
        result = await agent.run("Refund order in full o-4.")
        for operator in ("ann", "bob"):
            requests = result.output
            [call] = requests.approvals
            print(f"{call.tool_name}: approvals "
                  f"{requests.metadata[call.tool_call_id]['poimen']['approvals']}")
            results = DeferredToolResults()
            await decide(kernel, results, requests, call.tool_call_id, decision="approve",
                         operator=operator, reason="checked")
            result = await agent.run(message_history=result.all_messages(),
                                     deferred_tool_results=results)
        print(f"  approved by ann and bob: the agent: {result.output}")
        print(f"  refunds the provider took: {ProviderClient(payments.url).count()}")
        taken = [e["body"] for e in ProviderClient(payments.url).entries()]
        print(f"the provider's ledger: {taken}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(Path(tmp)))
