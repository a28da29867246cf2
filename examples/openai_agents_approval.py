"""An OpenAI Agents SDK run stopped by a refund awaiting approval, resumed with the approver's
decision: approve, edit or reject; and a large refund that two operators must approve.

    python examples/openai_agents_approval.py

Offline: the SDK's `ScriptedModel` stands in for the LLM (tracing is off: nothing is exported),
and poimen.testing's provider process for the payments API, counting the refunds it takes.
Each refund needs an approval (`requires_approval`, asked through the SDK's `needs_approval`):
the run stops with `result.interruptions`, and `decide` records the decision on that call's
intent, audited with the operator, and gives it to the `RunState` that resumes the run
(docs/integrations/openai-agents.md, "Approvals").
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from agents import Agent, Runner, set_tracing_disabled
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext
from poimen.integrations.openai_agents import decide, poimen_tools
from poimen.testing import ProviderClient, ProviderProcess


def tell(call: ModelCall) -> Any:
    """The model's last turn: what the tool answered."""
    outputs = [i["output"] for i in call.input if i.get("type") == "function_call_output"]
    return [assistant_message(f"The tool said: {outputs[-1]}")]


def pay(ctx: ToolContext, url: str, order_id: str, amount_cents: int) -> dict[str, Any]:
    """The refund, through the kernel's keyed handle."""
    ctx.http.post(f"{url}/keyed", json={"refund": order_id, "cents": amount_cents}).raise_for_status()
    return {"refunded": order_id, "cents": amount_cents}


async def main(tmp: Path) -> None:
    set_tracing_disabled(True)
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
            session_id = f"session-{order_id}"
            ask = {"order_id": order_id, "amount_cents": 250_00}
            model = ScriptedModel([[function_call("refund", ask, call_id="model-call-1")],
                                   ModelStep.respond(tell)])
            agent = Agent(name="assistant", model=model, tools=poimen_tools(kernel, scope=session_id))
            result = await Runner.run(agent, f"Refund order {order_id}.")
            print(f"refund of {order_id}: the run stopped, "
                  f"{[i.tool_name for i in result.interruptions]} awaiting approval")
            state = result.to_state()  # or RunState.from_string(agent, saved)
            for item in state.get_interruptions():  # "approve"; "edit" with the edited args; "reject"
                await decide(kernel, state, item, scope=session_id, decision=decision,
                             operator="ann", reason=reason, args=args)
            result = await Runner.run(agent, state)
            print(f"  {decision} by ann: the agent: {result.final_output}")
            print(f"  refunds the provider took: {ProviderClient(payments.url).count()}")
        # Four eyes: the resumed run stops again until two distinct operators approved.
        ask = {"order_id": "o-4", "amount_cents": 2500_00}
        model = ScriptedModel([[function_call("refund_large", ask, call_id="model-call-1")],
                               ModelStep.respond(tell)])
        agent = Agent(name="assistant", model=model, tools=poimen_tools(kernel, scope="session-o-4"))
        result = await Runner.run(agent, "Refund order o-4 in full.")
        for operator in ("ann", "bob"):
            state = result.to_state()
            for item in state.get_interruptions():  # the same call, until it is decided
                print(f"{item.tool_name}: awaiting approval; {operator} approves")
                await decide(kernel, state, item, scope="session-o-4", decision="approve",
                             operator=operator, reason="checked")
            result = await Runner.run(agent, state)
        print(f"  approved by ann and bob: the agent: {result.final_output}")
        print(f"  refunds the provider took: {ProviderClient(payments.url).count()}")
        taken = [e["body"] for e in ProviderClient(payments.url).entries()]
        print(f"the provider's ledger: {taken}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(Path(tmp)))
