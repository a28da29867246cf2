"""A PydanticAI shop agent, written without poimen: it charges an order, then emails the receipt.

    poimen crashtest -- python examples/shop_agent.py

The model is PydanticAI's `FunctionModel`, scripted (one tool call per turn), so every run makes
the same calls. The tools are plain httpx calls to the payment and mail APIs at `SHOP_API`
(`POIMEN_CRASHTEST_URL` under `poimen crashtest`, whose witness records what they do). The
charge sends a new Idempotency-Key on every attempt: the key is there, and useless.
docs/crash-testing.md crash-tests it, then the same agent with poimen
(examples/shop_agent_poimen.py).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import httpx
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

SHOP_API = os.environ.get("POIMEN_CRASHTEST_URL", "http://127.0.0.1:8080")
PLAN = [
    ("charge", {"order_id": "o-42", "amount_cents": 1200}),
    ("send_receipt", {"to": "ann@example.com", "order_id": "o-42"}),
]


def scripted_llm(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The next call of the plan after each tool result; then the answer."""
    done = sum(isinstance(p, ToolReturnPart) for m in messages for p in m.parts)
    if done < len(PLAN):
        tool, args = PLAN[done]
        return ModelResponse(parts=[ToolCallPart(tool, args)])
    return ModelResponse(parts=[TextPart("Charged and receipt sent.")])


agent = Agent(FunctionModel(scripted_llm))


@agent.tool_plain
def charge(order_id: str, amount_cents: int) -> Any:
    """Charge the order's card."""
    r = httpx.post(f"{SHOP_API}/v1/charges", json={"order_id": order_id,
                                                   "amount_cents": amount_cents},
                   headers={"Idempotency-Key": uuid.uuid4().hex})
    r.raise_for_status()
    return r.json()


@agent.tool_plain
def send_receipt(to: str, order_id: str) -> Any:
    """Email the receipt."""
    r = httpx.post(f"{SHOP_API}/v1/messages", json={"to": to, "order_id": order_id})
    r.raise_for_status()
    return r.json()


if __name__ == "__main__":
    print(agent.run_sync("Charge order o-42 and send Ann the receipt.").output)
