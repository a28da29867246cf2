"""An OpenAI Agents SDK run stopped by a call still Pending, resumed once the call has settled.

    python examples/openai_agents_pending.py

Offline: the SDK's `ScriptedModel` stands in for the LLM (tracing is off: nothing is exported),
and poimen.testing's provider process for a courier API that is down at first (every booking
answered 503, nothing booked). The booking is Queryable: poimen cannot trust "not booked"
before the request's deadline, so the call is Pending. Told so, the model asks for it again
(a new call id, the same call): the call the log holds is still Pending, so `needs_approval`
stops the run with an interruption. The application waits for the call (`resume_pending`:
poimen asks the API after the deadline and books once) and resumes the `RunState`, whose tool
answers from the log (docs/integrations/openai-agents.md, "Asked again, and Pending").
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from agents import Agent, Runner, set_tracing_disabled
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call

from poimen import Caps, Kernel, Queryable, ToolContext
from poimen.integrations.openai_agents import poimen_tools, resume_pending
from poimen.testing import ProviderClient, ProviderProcess, provider_lookup, provider_result

BOOKING = {"order_id": "o-7", "address": "1 Quay St"}


def model(call: ModelCall) -> Any:
    """Asks for a courier; told it is still in progress, asks again; then says the answer."""
    outputs = [i["output"] for i in call.input if i.get("type") == "function_call_output"]
    if len(outputs) < 2 and not any(o.startswith("{") for o in outputs):
        return [function_call("book_courier", BOOKING, call_id=f"call-{len(outputs) + 1}")]
    return [assistant_message(f"The tool said: {outputs[-1]}")]


async def main(tmp: Path) -> None:
    set_tracing_disabled(True)
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

        await kernel.alaunch()
        session_id = "session-7"
        tools = poimen_tools(kernel, scope=session_id, pending_wait=0.5)
        agent = Agent(name="dispatcher", model=ScriptedModel([ModelStep.respond(model)] * 4),
                      tools=tools)
        result = await Runner.run(agent, "Book a courier for order o-7.")
        while result.interruptions:
            print(f"the run stopped: {[i.tool_name for i in result.interruptions]} still Pending")
            api.set_faults(None)  # the courier API is back
            state = result.to_state()  # or RunState.from_string(agent, saved)
            approvals = await resume_pending(kernel, state, scope=session_id)  # waits, lets through
            assert approvals == []  # an approval asked for would go to `decide`
            result = await Runner.run(agent, state)
        print(f"the agent: {result.final_output}")
        print(f"bookings the courier took: {api.count()}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(Path(tmp)))
