"""A LangGraph thread stopped by a call still Pending, resumed once the call has settled.

    python examples/langgraph_pending.py

Offline: a scripted chat model stands in for the LLM, and poimen.testing's provider process for
a courier API that is down at first (every booking answered 503, nothing booked). The booking
is Queryable: poimen cannot trust "not booked" before the request's deadline, so the call is
Pending; the thread stops with LangGraph's `interrupt`, the application waits for the call
(poimen asks the API after the deadline and books once), then resumes the thread, whose tool
node answers from the log (docs/integrations/langgraph.md, "Pending").
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

from poimen import Caps, Kernel, Queryable, ToolContext
from poimen.integrations.langgraph import poimen_tools
from poimen.testing import ProviderClient, ProviderProcess, provider_lookup, provider_result


class ScriptedChat(BaseChatModel):
    """Asks for one courier, then says what the tool answered."""

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        last = messages[-1]
        if last.type == "tool":
            reply = AIMessage(content=f"The tool said: {last.content}")
        else:
            call = {"name": "book_courier", "id": "call-1",
                    "args": {"order_id": "o-7", "address": "1 Quay St"}}
            reply = AIMessage(content="", tool_calls=[call])
        return ChatResult(generations=[ChatGeneration(message=reply)])

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, BaseMessage]:
        return self  # the script decides the calls


def main(tmp: Path) -> None:
    conn = sqlite3.connect(tmp / "checkpoints.db", check_same_thread=False)
    with ProviderProcess(tmp / "ledger.db", faults="before=1") as courier, \
            Kernel(f"sqlite:///{tmp / 'agent.db'}", notifiers=[]) as kernel:
        api = ProviderClient(courier.url)

        @kernel.tool(id="book_courier", effects=Queryable(lookup=provider_lookup(courier.url)),
                     caps=Caps(hosts=("127.0.0.1",)), timeout=2)
        def book_courier(ctx: ToolContext, order_id: str, address: str) -> dict[str, Any]:
            """Book a courier for an order. The API finds a booking by its request id."""
            headers = {"X-Request-Id": str(ctx.request_id)}  # minted by poimen, one per call
            body = {"order_id": order_id, "address": address}
            return provider_result(ctx.http.post(f"{courier.url}/requests", json=body, headers=headers))

        kernel.launch()
        tools = poimen_tools(kernel, pending_wait=1)  # a call still Pending after 1 s stops the thread
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
        inputs = {"messages": [("user", "Book a courier for order o-7.")]}
        config = {"configurable": {"thread_id": "thread-7"}}

        state = graph.invoke(inputs, config)
        for i in state.get("__interrupt__", []):
            asked = i.value["poimen"]
            print(f"the thread stopped: {asked['tool']} is {asked['outcome']} ({asked['reason']})")
            api.set_faults(None)  # the courier API is back
            kernel.wait_sync(i.value["poimen"]["call_id"])  # or: await kernel.wait(call_id)
        state = graph.invoke(Command(resume=True), config)
        *_, answer, reply = state["messages"]
        print(f"resumed: the tool node answered from the log: {answer.artifact['outcome']}")
        print(f"the agent: {reply.content}")
        print(f"bookings the courier took: {api.count()}")
    conn.close()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
