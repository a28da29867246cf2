"""A LangGraph agent whose tool node calls poimen's tools, on a SQLite checkpointer.

    python examples/langgraph_agent.py

Offline: a scripted chat model stands in for the LLM, and poimen.testing's provider process
for the email service. The call id is the thread id and the model's tool-call id, which the
checkpointer saved before the tool ran: a thread killed mid-call and resumed from its
checkpoint runs the same call id, and poimen answers it from the log
(docs/integrations/langgraph.md).
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

from poimen import Caps, Kernel, ToolContext, Unsafe
from poimen.integrations.langgraph import poimen_tools
from poimen.testing import ProviderClient, ProviderProcess


class ScriptedChat(BaseChatModel):
    """Asks for one email, then says what the tool answered."""

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        last = messages[-1]
        if last.type == "tool":
            reply = AIMessage(content=f"The tool said: {last.content}")
        else:
            call = {"name": "send_email", "id": "call-1",
                    "args": {"to": "bob@example.com", "subject": "Your order shipped"}}
            reply = AIMessage(content="", tool_calls=[call])
        return ChatResult(generations=[ChatGeneration(message=reply)])

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, BaseMessage]:
        return self  # the script decides the calls


def main(tmp: Path) -> None:
    chat_model, thread_id = ScriptedChat(), "thread-42"
    conn = sqlite3.connect(tmp / "checkpoints.db", check_same_thread=False)
    with ProviderProcess(tmp / "ledger.db") as mail, \
            Kernel(f"sqlite:///{tmp / 'agent.db'}", notifiers=[]) as kernel:

        @kernel.tool(id="send_email", effects=Unsafe(), caps=Caps(hosts=("127.0.0.1",)), timeout=10)
        def send_email(ctx: ToolContext, to: str, subject: str) -> dict[str, Any]:
            """Send an email. Not idempotent: sending twice sends two emails."""
            ctx.http.post(f"{mail.url}/plain", json={"to": to, "subject": subject}).raise_for_status()
            return {"sent": True, "to": to}

        kernel.launch()
        tools = poimen_tools(kernel)  # after registering the tools; kernel.launch() at start-up
        model = chat_model.bind_tools(tools)  # the agent node calls it; ToolNode(tools) runs the calls

        def agent(state: MessagesState) -> dict[str, Any]:
            return {"messages": [model.invoke(state["messages"])]}

        builder = StateGraph(MessagesState)
        builder.add_node("agent", agent)
        builder.add_node("tools", ToolNode(tools))
        builder.add_edge(START, "agent")
        builder.add_conditional_edges("agent", tools_condition)
        builder.add_edge("tools", "agent")
        inputs = {"messages": [("user", "Tell Bob his order shipped.")]}
        graph = builder.compile(checkpointer=SqliteSaver(conn))
        state = graph.invoke(inputs, {"configurable": {"thread_id": thread_id}})
        print(f"the agent: {state['messages'][-1].content}")
        print(f"emails sent: {ProviderClient(mail.url).count()}")
        print(f"the call in poimen's log: {kernel.store.list_intents()[0].call_id}")
    conn.close()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
