"""A LangGraph shop agent for `poimen crashtest`: a scripted chat model (tests/integrations/
fake_chat.py) asks for a charge, then the receipt, one call per turn, with fixed tool-call ids;
the graph's SQLite checkpointer (in $POIMEN_CRASHTEST_DIR) lets a restart resume the thread.

    python -m tests.crashtest.agents.langgraph_shop naive|poimen

naive: LangChain `@tool` functions posting to $POIMEN_CRASHTEST_URL (the charge with a new
Idempotency-Key per attempt). poimen: the tools of examples/shop_agent_poimen.py (a Kernel on
POIMEN_DB; the charge Idempotent, the receipt Unsafe), given to the graph by `poimen_tools`.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
from langchain_core.messages import BaseMessage
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.sqlite import SqliteSaver

from poimen.integrations.langgraph import poimen_tools
from tests.crashtest.agents.plain_shop import example_kernel
from tests.integrations.fake_chat import build_graph

URL = os.environ["POIMEN_CRASHTEST_URL"]
PLAN = [
    ("charge", {"order_id": "o-42", "amount_cents": 1200}, "call-charge"),
    ("send_receipt", {"to": "ann@example.com", "order_id": "o-42"}, "call-receipt"),
]
CONFIG: Any = {"configurable": {"thread_id": "order-42"}}


def script(messages: list[BaseMessage]) -> dict[str, Any]:
    done = sum(m.type == "tool" for m in messages)
    if done < len(PLAN):
        name, args, call_id = PLAN[done]
        return {"content": "", "tool_calls": [{"name": name, "args": args, "id": call_id}]}
    return {"content": "charged and receipt sent"}


def post(path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    r = httpx.post(f"{URL}{path}", json=body, headers=headers or {})
    r.raise_for_status()
    return r.json()


@tool
def charge(order_id: str, amount_cents: int) -> Any:
    """Charge the order's card."""
    return post("/v1/charges", {"order_id": order_id, "amount_cents": amount_cents},
                {"Idempotency-Key": uuid.uuid4().hex})


@tool
def send_receipt(to: str, order_id: str) -> Any:
    """Email the receipt."""
    return post("/v1/messages", {"to": to, "order_id": order_id})


def run(tools: list[BaseTool]) -> None:
    conn = sqlite3.connect(Path(os.environ["POIMEN_CRASHTEST_DIR"]) / "checkpoints.db",
                           check_same_thread=False)
    try:
        graph = build_graph(script, tools, SqliteSaver(conn))
        state = graph.get_state(CONFIG)
        if state.next:  # a killed run's thread: resume it from its checkpoint
            graph.invoke(None, CONFIG)
        elif not state.values:
            graph.invoke({"messages": [("user", "charge order o-42, send the receipt")]}, CONFIG)
    finally:
        conn.close()


def main(mode: str) -> None:
    if mode == "naive":
        run([charge, send_receipt])
        return
    with example_kernel() as k:
        k.launch()  # the restart's recovery: settles what a killed run left unfinished
        run(list(poimen_tools(k)))


if __name__ == "__main__":
    main(sys.argv[1])
