"""An OpenAI Agents SDK agent that sends email through poimen, with a session.

    python examples/openai_agents_agent.py

Offline: the SDK's `ScriptedModel` stands in for the LLM (tracing is off: nothing is exported),
and poimen.testing's provider process for the email service. The call id is the session's
scope, the tool, the arguments and how many such calls the session already answered, so a run
killed mid-call and run again in the same session finds its call in the log instead of sending
a second email (docs/integrations/openai-agents.md; examples/pydantic_ai_agent.py shows the kill).
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from agents import Agent, Runner, SQLiteSession, set_tracing_disabled
from agents.testing import ScriptedModel, assistant_message, function_call

from poimen import Caps, Kernel, ToolContext, Unsafe
from poimen.integrations.openai_agents import poimen_tools
from poimen.testing import ProviderClient, ProviderProcess

BOB = {"to": "bob@example.com", "subject": "Your order shipped"}


async def main(tmp: Path) -> None:
    set_tracing_disabled(True)
    with ProviderProcess(tmp / "ledger.db") as mail, \
            Kernel(f"sqlite:///{tmp / 'agent.db'}", notifiers=[]) as kernel:

        @kernel.tool(id="send_email", effects=Unsafe(), caps=Caps(hosts=("127.0.0.1",)), timeout=10)
        def send_email(ctx: ToolContext, to: str, subject: str) -> dict[str, Any]:
            """Send an email. Not idempotent: sending twice sends two emails."""
            ctx.http.post(f"{mail.url}/plain", json={"to": to, "subject": subject}).raise_for_status()
            return {"sent": True, "to": to}

        session_id = "session-42"
        session = SQLiteSession(session_id, tmp / "sessions.db")
        prompt = "Tell Bob his order shipped."
        model = ScriptedModel([[function_call("send_email", BOB, call_id="model-call-1")],
                               [assistant_message("Bob knows his order shipped.")]])
        await kernel.alaunch()  # after registering the tools: settles what a killed run left unfinished
        agent = Agent(name="assistant", model=model, tools=poimen_tools(kernel, scope=session_id))
        result = await Runner.run(agent, prompt, session=session)
        print(f"the agent: {result.final_output}")
        print(f"emails sent: {ProviderClient(mail.url).count()}")
        print(f"the call in poimen's log: {kernel.store.list_intents()[0].call_id}")

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(Path(tmp)))
