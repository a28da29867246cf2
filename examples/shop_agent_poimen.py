"""examples/shop_agent.py with poimen: the same agent, model and calls, its tools registered
with effect classes and run through a Kernel.

    poimen crashtest -- python examples/shop_agent_poimen.py

The charge is Idempotent: poimen derives its key from the order and the amount, the same on
every attempt, and sends it as the Idempotency-Key. The receipt is Unsafe: after a crash it is
never sent again; an operator decides. The log is at `POIMEN_DB` (a fresh one per case under
`poimen crashtest`); the conversation's scope makes the restarted agent's calls the same calls.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.models.function import FunctionModel

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext, Unsafe
from poimen.integrations.pydantic_ai import PoimenToolset

SHOP_API = os.environ.get("POIMEN_CRASHTEST_URL", "http://127.0.0.1:8080")
CAPS = Caps(hosts=(SHOP_API.removeprefix("http://"),))


def make_kernel() -> Kernel:
    kernel = Kernel(os.environ.get("POIMEN_DB", "sqlite:///shop.db"), notifiers=[])

    @kernel.tool(id="charge", caps=CAPS, timeout=10,
                 effects=Idempotent(key=KeyDerivation.fields("order_id", "amount_cents")))
    def charge(ctx: ToolContext, order_id: str, amount_cents: int) -> Any:
        """Charge the order's card."""
        r = ctx.http.post(f"{SHOP_API}/v1/charges", json={"order_id": order_id,
                                                          "amount_cents": amount_cents})
        r.raise_for_status()
        return r.json()

    @kernel.tool(id="send_receipt", effects=Unsafe(), caps=CAPS, timeout=10)
    def send_receipt(ctx: ToolContext, to: str, order_id: str) -> Any:
        """Email the receipt."""
        r = ctx.http.post(f"{SHOP_API}/v1/messages", json={"to": to, "order_id": order_id})
        r.raise_for_status()
        return r.json()

    return kernel


def main() -> None:
    from shop_agent import scripted_llm  # the same scripted model as the agent without poimen

    with make_kernel() as kernel:
        kernel.launch()  # the restart's recovery: settles what a killed run left unfinished
        agent = Agent(FunctionModel(scripted_llm),
                      toolsets=[PoimenToolset(kernel, scope="order-42")])
        print(agent.run_sync("Charge order o-42 and send Ann the receipt.").output)


if __name__ == "__main__":
    main()
