"""A PydanticAI agent that sends email through poimen, killed mid-call and run again.

    python examples/pydantic_ai_agent.py

Runs offline: PydanticAI's `FunctionModel` stands in for the LLM, and poimen's test provider
(a real HTTP server in its own process, with a ledger) stands in for the email service.

1. The agent runs in a child process that is SIGKILLed right after the email went out,
   before poimen recorded the outcome.
2. The agent runs again on the same conversation. The model, asked again, issues the same
   call under a new tool-call id; poimen's call id (the conversation, the tool, the
   arguments) is the same, so the model is told the outcome is unknown instead of a second
   email being sent.
3. An operator checks the mailbox and resolves the call; `kernel.outcome` then gives the
   decision in the words the model is told.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from poimen import Caps, Kernel, ToolContext, Unsafe, call_ids
from poimen.integrations.pydantic_ai import PoimenToolset
from poimen.testing import ProviderClient, ProviderProcess

CONVERSATION = "conversation-42"  # keep it with the conversation's history
BOB = {"to": "bob@example.com", "subject": "Your order shipped"}


def make_kernel(db: str, provider_url: str) -> Kernel:
    kernel = Kernel(f"sqlite:///{db}", notifiers=[])
    host = provider_url.removeprefix("http://")

    @kernel.tool(id="send_email", effects=Unsafe(), caps=Caps(hosts=(host,)), timeout=10)
    def send_email(ctx: ToolContext, to: str, subject: str) -> dict[str, Any]:
        """Send an email. Not idempotent: sending twice sends two emails."""
        r = ctx.http.post(f"{provider_url}/plain", json={"to": to, "subject": subject})
        r.raise_for_status()
        return {"sent": True, "to": to}

    return kernel


def fake_llm(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Asks for the email until a tool result comes back, then reports what it was told."""
    results = [p for p in messages[-1].parts if isinstance(p, ToolReturnPart)]
    if not results:  # a fresh tool-call id each time, as a real model mints
        return ModelResponse(parts=[ToolCallPart("send_email", BOB, tool_call_id=uuid.uuid4().hex)])
    return ModelResponse(parts=[TextPart(f"Tool said: {results[-1].model_response_str()}")])


async def run_agent(db: str, provider_url: str) -> str:
    kernel = make_kernel(db, provider_url)
    model, conversation_id, prompt = FunctionModel(fake_llm), CONVERSATION, "Tell Bob it shipped."
    history: list[ModelMessage] = []  # the conversation's messages so far (a new one here)
    try:
        await kernel.alaunch()  # after registering the tools: settles what a killed run left unfinished
        agent = Agent(model, toolsets=[PoimenToolset(kernel, scope=conversation_id)])
        result = await agent.run(prompt, message_history=history)
        return result.output
    finally:
        kernel.close()


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--agent":  # the child process
        print(asyncio.run(run_agent(sys.argv[2], sys.argv[3])))
        return
    with tempfile.TemporaryDirectory() as tmp, ProviderProcess(Path(tmp) / "ledger.db") as mail:
        db = str(Path(tmp) / "agent.db")
        emails = ProviderClient(mail.url)

        print("1. The agent runs and is killed right after the email went out.")
        env = {**os.environ, "POIMEN_CRASH_AT": "after_effect"}
        child = subprocess.run([sys.executable, __file__, "--agent", db, mail.url], env=env)
        print(f"   agent exit code {child.returncode}; emails sent: {emails.count(kind='plain')}")

        print("2. The agent runs again on the same conversation.")
        print(f"   {asyncio.run(run_agent(db, mail.url))}")
        print(f"   emails sent: {emails.count(kind='plain')}")

        print("3. An operator finds the email in the sent folder and resolves the call.")
        kernel = make_kernel(db, mail.url)
        try:
            outcome = kernel.outcome(call_ids.derived(CONVERSATION, "send_email", BOB))
            assert outcome is not None
            kernel.resolve(outcome.intent_id, landed=True, operator="ann",
                           reason="found in the sent folder")
            now = kernel.outcome(call_ids.derived(CONVERSATION, "send_email", BOB))
            assert now is not None
            print(f"   the model is told now: {now.for_model()}")
        finally:
            kernel.close()
        emails.close()


if __name__ == "__main__":
    main()
