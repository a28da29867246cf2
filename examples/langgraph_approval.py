"""A LangGraph thread stopped by a refund awaiting approval, resumed with the approver's
decision: approve, edit or reject; and a large refund that two operators must approve.

    python examples/langgraph_approval.py

Offline: a scripted chat model stands in for the LLM, and poimen.testing's provider process for
the payments API, counting the refunds it takes. Each refund needs an approval
(`requires_approval`): the thread stops with LangGraph's `interrupt`, and
`Command(resume=decision)` applies the decision to that call's intent, audited with the
operator (docs/integrations/langgraph.md, "Approvals").
"""

from __future__ import annotations

import sqlite3
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext
from poimen.integrations.langgraph import poimen_tools
from poimen.testing import ProviderClient, ProviderProcess


class ScriptedChat(BaseChatModel):
    """Refunds 250.00 of the order the user names, then says what the tool answered."""

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

        kernel.launch()
        tools = poimen_tools(kernel)
        model = ScriptedChat().bind_tools(tools)

        def agent(state: MessagesState) -> dict[str, Any]:
            return {"messages": [model.invoke(state["messages"])]}

        builder = StateGraph(MessagesState)
        builder.add_node("agent", agent)
        builder.add_node("tools", ToolNode(tools))
        builder.add_edge(START, "agent")
        builder.add_conditional_edges("agent", tools_condition)
        builder.add_edge("tools", "agent")
        graph = builder.compile(checkpointer=SqliteSaver(conn))

        approve = {"decision": "approve", "operator": "ann", "reason": "checked"}
        edit = {"decision": "edit", "operator": "ann", "reason": "half of it",
                "args": {"order_id": "o-2", "amount_cents": 125_00}}  # the edited call runs
        reject = {"decision": "reject", "operator": "ann", "reason": "duplicate"}  # nothing is sent
        for order_id, decision in (("o-1", approve), ("o-2", edit), ("o-3", reject)):
            inputs = {"messages": [("user", f"Refund order {order_id}.")]}
            config = {"configurable": {"thread_id": f"thread-{order_id}"}}
            state = graph.invoke(inputs, config)
            asked = state["__interrupt__"][0].value["poimen"]  # the call, its "args" and "reason"
            print(f"{asked['tool']} {asked['args']}: {asked['outcome']} ({asked['reason']})")
            state = graph.invoke(Command(resume=decision), config)  # approve, edit or reject
            outcome = kernel.outcome(asked["call_id"])
            print(f"  {decision['decision']} by ann: {type(outcome).__name__}; "
                  f"the agent: {state['messages'][-1].content}")
            print(f"  refunds the provider took: {ProviderClient(payments.url).count()}")
        # Four eyes: the thread stops again until two distinct operators approved.
        config = {"configurable": {"thread_id": "thread-o-4"}}
        state = graph.invoke({"messages": [("user", "Refund order in full o-4.")]}, config)
        for operator in ("ann", "bob"):
            asked = state["__interrupt__"][0].value["poimen"]
            print(f"{asked['tool']}: approvals {asked['approvals']}")
            state = graph.invoke(Command(resume={"decision": "approve", "operator": operator,
                                                 "reason": "checked"}), config)
        print(f"  approved by ann and bob: {type(kernel.outcome(asked['call_id'])).__name__}")
        print(f"  refunds the provider took: {ProviderClient(payments.url).count()}")
        taken = [e["body"] for e in ProviderClient(payments.url).entries()]
        print(f"the provider's ledger: {taken}")
    conn.close()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
