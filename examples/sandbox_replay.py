"""Test a changed agent against yesterday's run, without touching the world.

    python examples/sandbox_replay.py

Runs offline: PydanticAI's `FunctionModel` stands in for the LLM, and poimen's test provider
(a real HTTP server in its own process, with a ledger) stands in for the payment and email
services.

1. Yesterday: the agent charges an order and emails the customer, for real. Its intent log
   is the recording.
2. Today: a changed agent (a new prompt made it email the wrong address) is replayed against
   that recording. Every call is answered from the recording by call id and no tool body
   runs: the ledger does not move. The changed call diverges and is answered "not in the
   recording" (`on_divergence="record"`), so the run goes on.
3. The intent diff (what `poimen diff` prints) shows exactly that step, with its effect class.
4. The changed agent shadows the live one instead: the charge gets the live run's outcome, the
   other email is recorded as "would have called" and not sent.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import httpx
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext, Unsafe
from poimen.integrations.pydantic_ai import PoimenToolset
from poimen.sandbox import diff
from poimen.testing import ProviderClient, ProviderProcess

CONVERSATION = "conversation-42"  # the scope: one conversation's calls
ORDER = {"order_id": "o-17", "amount_cents": 4200}
PROMPT = "Charge order o-17 and tell the customer."


def register_tools(kernel: Kernel, provider_url: str) -> Kernel:
    host = provider_url.removeprefix("http://")

    @kernel.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("order_id")),
                 caps=Caps(hosts=(host,)), timeout=10)
    def charge(ctx: ToolContext, order_id: str, amount_cents: int) -> dict[str, Any]:
        """Charge an order (the provider deduplicates on the key)."""
        r = ctx.http.post(f"{provider_url}/keyed", json={"order": order_id, "cents": amount_cents})
        return {"charged": order_id, "duplicate": r.json()["duplicate"]}

    @kernel.tool(id="send_email", effects=Unsafe(), caps=Caps(hosts=(host,)), timeout=10)
    def send_email(ctx: ToolContext, to: str, subject: str) -> dict[str, Any]:
        """Send an email. Not idempotent: sending twice sends two emails."""
        httpx.post(f"{provider_url}/plain", json={"to": to, "subject": subject})
        return {"sent": True, "to": to}

    return kernel


def scripted_llm(email_to: str) -> FunctionModel:
    """Charge, then email, then say what the tools said."""

    def llm(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        results = [p for m in messages for p in getattr(m, "parts", [])
                   if isinstance(p, ToolReturnPart)]
        if not results:
            return ModelResponse(parts=[ToolCallPart("charge", ORDER, tool_call_id="a")])
        if len(results) == 1:
            args = {"to": email_to, "subject": "Your order o-17"}
            return ModelResponse(parts=[ToolCallPart("send_email", args, tool_call_id="b")])
        return ModelResponse(parts=[TextPart(" | ".join(r.model_response_str() for r in results))])

    return FunctionModel(llm)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, ProviderProcess(Path(tmp) / "ledger.db") as world:
        os.chdir(tmp)
        ledger = ProviderClient(world.url)

        print("1. Yesterday's agent runs for real; a copy of its log is the recording.")
        with register_tools(Kernel("sqlite:///live.db", notifiers=[]), world.url) as kernel:
            agent = Agent(scripted_llm("bob@example.com"),
                          toolsets=[PoimenToolset(kernel, scope=CONVERSATION)])
            print(f"   the model was told: {agent.run_sync(PROMPT).output}")
        shutil.copy("live.db", "yesterday.db")
        print(f"   effects in the world: {len(ledger.entries())}")

        print("2. Today's changed agent is replayed against yesterday's log.")
        new_model = scripted_llm("eve@example.com")  # a new prompt made it email the wrong address
        kernel = Kernel(
            "sqlite:///replay-2024-06-01.db",        # the replay's own log: a new one per run
            mode="replay",
            recording="sqlite:///yesterday.db",      # or postgresql://reader@db/prod
            scope="conversation-42/",                # the run (call-id prefix) to replay; None: all
            on_divergence="record",                  # default "raise"
        )
        # register the same tools as the live agent, then run the changed agent on conversation-42
        register_tools(kernel, world.url)
        agent = Agent(new_model, toolsets=[PoimenToolset(kernel, scope="conversation-42")])
        with kernel:
            print(f"   the model was told: {agent.run_sync(PROMPT).output}")
        print(f"   effects in the world: {len(ledger.entries())}")

        print("3. The intent diff:")
        print("   $ poimen diff --recording sqlite:///yesterday.db "
              "--run sqlite:///replay-2024-06-01.db --scope conversation-42/")
        d = diff("sqlite:///yesterday.db", "sqlite:///replay-2024-06-01.db",
                 scope=f"{CONVERSATION}/")
        for line in d.text().splitlines():
            print(f"   {line}")

        print("4. Or the changed agent shadows the live one: the charge gets the live outcome,")
        print("   the other email is recorded as 'would have called'.")
        kernel = Kernel("sqlite:///shadow.db", mode="shadow", live="sqlite:///live.db")  # or postgresql://reader@db/prod
        register_tools(kernel, world.url)
        agent = Agent(new_model, toolsets=[PoimenToolset(kernel, scope="conversation-42")])
        with kernel:
            print(f"   the model was told: {agent.run_sync(PROMPT).output}")
        print(f"   effects in the world: {len(ledger.entries())}")
        ledger.close()
        os.chdir(Path(tmp).parent)


if __name__ == "__main__":
    main()
