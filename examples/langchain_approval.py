"""A LangChain agent (`create_agent`) whose refunds are approved in LangChain's
human-in-the-loop protocol: approve, edit or reject, and four eyes for a large refund; each
decision recorded on the call's intent in poimen's log.

    python examples/langchain_approval.py

Offline: a scripted chat model stands in for the LLM, and poimen.testing's provider process for
the payments API, counting the refunds it takes. `PoimenHumanInTheLoop` stops the thread with
LangChain's `HITLRequest`; `Command(resume={"decisions": [...]})` answers it, each decision
naming its operator (docs/integrations/langgraph.md, "LangChain agents").
"""

from __future__ import annotations

import sqlite3
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.types import Command

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext
from poimen.integrations.langchain import PoimenHumanInTheLoop
from poimen.integrations.langgraph import poimen_tools
from poimen.testing import ProviderClient, ProviderProcess


class ScriptedChat(BaseChatModel):
    """Refunds 250.00 of the order the user names (all of it, asked "in full"), then says
    what the tool answered."""

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        last = messages[-1]
        if last.type == "tool":
            reply = AIMessage(content=f"The tool said: {last.content}")
        else:
            order_id = str(last.content).split()[-1].rstrip(".")
            large = "in full" in str(last.content)
            call = {"name": "refund_large" if large else "refund", "id": "call-1",
                    "args": {"order_id": order_id, "amount_cents": 2500_00 if large else 250_00}}
            reply = AIMessage(content="", tool_calls=[call])
        return ChatResult(generations=[ChatGeneration(message=reply)])

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, BaseMessage]:
        return self  # the script decides the calls


def pay(ctx: ToolContext, url: str, order_id: str, amount_cents: int) -> dict[str, Any]:
    """The refund, through the kernel's keyed handle."""
    ctx.http.post(f"{url}/keyed", json={"refund": order_id, "cents": amount_cents}).raise_for_status()
    return {"refunded": order_id, "cents": amount_cents}


def main(tmp: Path) -> None:
    conn = sqlite3.connect(tmp / "checkpoints.db", check_same_thread=False)
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

        kernel.launch()
        agent = create_agent(ScriptedChat(), tools=poimen_tools(kernel),
                             middleware=[PoimenHumanInTheLoop(kernel)],
                             checkpointer=SqliteSaver(conn))

        approve = {"type": "approve", "operator": "ann", "reason": "checked"}
        edit = {"type": "edit", "operator": "ann", "reason": "half of it",  # the edited call runs
                "edited_action": {"name": "refund", "args": {"order_id": "o-2",
                                                             "amount_cents": 125_00}}}
        reject = {"type": "reject", "operator": "ann", "message": "duplicate"}  # nothing is sent
        for order_id, decision in (("o-1", approve), ("o-2", edit), ("o-3", reject)):
            config = {"configurable": {"thread_id": f"thread-{order_id}"}}
            state = agent.invoke({"messages": [("user", f"Refund order {order_id}.")]}, config)
            [action] = state["__interrupt__"][0].value["action_requests"]  # LangChain's request
            print(f"{action['name']} {action['args']}: asked")
            state = agent.invoke(Command(resume={"decisions": [decision]}), config)
            print(f"  {decision['type']} by ann: the agent: {state['messages'][-1].content}")
            print(f"  refunds the provider took: {ProviderClient(payments.url).count()}")

        # Four eyes: the thread stops again until two distinct operators approved.
        config = {"configurable": {"thread_id": "thread-o-4"}}
        state = agent.invoke({"messages": [("user", "Refund order in full o-4.")]}, config)
        for operator in ("ann", "bob"):
            print(f"asked: {state['__interrupt__'][0].value['action_requests'][0]['description']}")
            state = agent.invoke(Command(resume={"decisions": [
                {"type": "approve", "operator": operator, "reason": "checked"}]}), config)
        print(f"  approved by ann and bob: the agent: {state['messages'][-1].content}")
        print(f"  refunds the provider took: {ProviderClient(payments.url).count()}")
        taken = [e["body"] for e in ProviderClient(payments.url).entries()]
        print(f"the provider's ledger: {taken}")
    conn.close()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
