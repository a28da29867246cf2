"""A PydanticAI run that stops on a call whose outcome is unknown, and resumes with the
operator's decision (PoimenToolset(..., defer=True): PydanticAI's deferred tools).

    python examples/pydantic_ai_deferred.py

Offline: PydanticAI's `FunctionModel` stands in for the LLM, and poimen.testing's provider
process for the email service: the email goes out, then the connection breaks before the
answer, so the outcome is unknown (docs/integrations/pydantic-ai.md).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import httpx
from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from poimen import Caps, Kernel, ToolContext, Unsafe
from poimen.integrations.pydantic_ai import PoimenToolset, deferred_results
from poimen.testing import ProviderClient, ProviderProcess

BOB = {"to": "bob@example.com", "subject": "Your order shipped"}


def fake_llm(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Asks for the email once, then reports what it was told."""
    results = [p for m in messages for p in getattr(m, "parts", []) if isinstance(p, ToolReturnPart)]
    if not results:
        return ModelResponse(parts=[ToolCallPart("send_email", BOB, tool_call_id="call-1")])
    return ModelResponse(parts=[TextPart(f"Tool said: {results[-1].model_response_str()}")])


async def main(tmp: Path) -> None:
    with ProviderProcess(tmp / "ledger.db") as mail, \
            Kernel(f"sqlite:///{tmp / 'agent.db'}", notifiers=[]) as kernel:

        @kernel.tool(id="send_email", effects=Unsafe(), caps=Caps(), timeout=10)
        def send_email(ctx: ToolContext, to: str, subject: str) -> dict[str, Any]:
            """Send an email. Not idempotent: sending twice sends two emails."""
            httpx.post(f"{mail.url}/plain", json={"to": to, "subject": subject})
            raise ConnectionResetError("the connection broke before the answer")

        await kernel.alaunch()
        agent = Agent(FunctionModel(fake_llm),
                      toolsets=[PoimenToolset(kernel, scope="conversation-7", defer=True)])
        prompt = "Tell Bob his order shipped."
        result = await agent.run(prompt, output_type=[str, DeferredToolRequests])
        # ... store result.all_messages() and result.output; the operator resolves ...
        assert isinstance(result.output, DeferredToolRequests)
        details = result.output.metadata["call-1"]["poimen"]
        print(f"1. the run stopped: send_email is {details['outcome']} ({details['intent_id']})")
        sent = ProviderClient(mail.url).count()
        print(f"2. the operator finds {sent} email in the provider's log and resolves the call")
        await kernel.aresolve(details["intent_id"], landed=True, operator="ann",
                              reason="the email is in the provider's log")
        results = await deferred_results(kernel, result.output, timeout=0)  # the decided ones
        resumed = await agent.run(message_history=result.all_messages(), deferred_tool_results=results)
        print(f"3. the run resumed: {resumed.output}")
        print(f"   emails sent: {ProviderClient(mail.url).count()}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(Path(tmp)))
