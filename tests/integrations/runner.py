"""An agent process for the kill tests: builds one framework's agent over poimen's test tools
with that framework's own fake model, and runs one conversation.

    python -m tests.integrations.runner pydantic-ai|openai-agents|langgraph|langchain --db URL
        --provider URL --scope S --tool-call-id ID --report PATH [--naive]
        [--checkpoint PATH --resume]

The model asks for one `test_email` (Unsafe: a plain POST to the provider; `--tool ship`:
`test_ship`, Queryable) under the tool-call id given, then answers "done"; the report (JSON)
holds the tool results the model was given. `--reask`: told that the call has no result yet
(Pending, Indeterminate), the model asks for it again once, under `<id>-again`.
`--tool gated` needs an operator's approval: the first run ends asking for it and saves its
state to `--saved` (once); `--decide approve|reject` resumes that saved state with the decision.
`--pending-wait` bounds the integration's wait for a Pending call. `--naive` uses the model's
tool-call id as the call id (the baseline poimen's rule replaces). LangGraph (`langchain`: an
agent of LangChain's `create_agent` whose approvals go through `PoimenHumanInTheLoop`) runs on
a SQLite checkpointer; `--resume` continues the thread from its checkpoint, and a thread stopped by an
interrupt (a Pending call) is resumed once the call has settled (`--lookup-back`: after the
provider's lookup is set back to truthful, the test having made it fail); so is an Agents SDK
run stopped by an interruption for a Pending call (`resume_pending`).
"""

# No `from __future__ import annotations`: PydanticAI reads the naive tool's annotations.

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from poimen import Completed, Kernel
from poimen.testing import EMAIL, ProviderClient, register_test_tools

TO = {"to": "bob@example.com", "subject": "hello"}
ARGS = {"email": ("test_email", TO), "ship": ("test_ship", {"order_id": "o-1", "address": "x"}),
        "gated": ("mail_gated", TO)}
NO_RESULT = ("This action is still in progress", "The outcome of this action is unknown")


def _asks(a: argparse.Namespace, answers: list[str]) -> str | None:
    """The tool-call id of the model's next call, or None when it is done."""
    if not answers:
        return str(a.tool_call_id)
    if a.reask and len(answers) == 1 and answers[0].startswith(NO_RESULT):
        return f"{a.tool_call_id}-again"
    return None


def _text(outcome: Any) -> str:
    return json.dumps(outcome.result) if isinstance(outcome, Completed) else outcome.for_model()


def run_pydantic_ai(kernel: Kernel, a: argparse.Namespace, seen: list[str]) -> str:
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
    )
    from pydantic_ai.models.function import AgentInfo, FunctionModel
    from pydantic_ai.toolsets import AbstractToolset, FunctionToolset

    from poimen.integrations.pydantic_ai import PoimenToolset

    name, args = ARGS[a.tool]

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        last = messages[-1]
        returns = [p for p in last.parts if isinstance(p, ToolReturnPart)] if isinstance(
            last, ModelRequest) else []
        seen.extend(p.model_response_str() for p in returns)
        ask = _asks(a, seen)
        if ask is not None and (returns or not seen):
            return ModelResponse(parts=[ToolCallPart(name, args, tool_call_id=ask)])
        return ModelResponse(parts=[TextPart("done")])

    if a.tool == "gated":
        return _pydantic_ai_approval(kernel, a, FunctionModel(model))
    toolset: AbstractToolset[Any]
    if a.naive:
        toolset = FunctionToolset()

        @toolset.tool
        async def test_email(ctx: RunContext[Any], to: str, subject: str) -> str:
            assert ctx.tool_call_id is not None
            args = {"to": to, "subject": subject}
            return _text(await kernel.acall(EMAIL, args, call_id=ctx.tool_call_id))
    else:
        toolset = PoimenToolset(kernel, scope=a.scope, pending_wait=a.pending_wait)
    agent = Agent(FunctionModel(model), toolsets=[toolset])
    return str(asyncio.run(agent.run("email bob")).output)


def _pydantic_ai_approval(kernel: Kernel, a: argparse.Namespace, model: Any) -> str:
    """The first run ends asking for an approval, and its state is saved (once: what a later
    run resumes is the state from before any decision); `--decide` resumes the saved state
    with the decision."""
    from pydantic import TypeAdapter
    from pydantic_ai import Agent, DeferredToolRequests, DeferredToolResults
    from pydantic_ai.messages import ModelMessagesTypeAdapter

    from poimen.integrations.pydantic_ai import PoimenToolset, decide

    agent = Agent(model, toolsets=[PoimenToolset(kernel, scope=a.scope)],
                  output_type=[str, DeferredToolRequests])
    saved, requests_type = Path(a.saved), TypeAdapter(DeferredToolRequests)
    if not a.decide:
        result = asyncio.run(agent.run("email bob"))
        assert isinstance(result.output, DeferredToolRequests)
        if not saved.exists():
            saved.write_text(json.dumps({
                "messages": json.loads(ModelMessagesTypeAdapter.dump_json(result.all_messages())),
                "requests": json.loads(requests_type.dump_json(result.output))}))
        return "approval: " + result.output.metadata[a.tool_call_id]["poimen"]["reason"]
    state = json.loads(saved.read_text())
    history = ModelMessagesTypeAdapter.validate_python(state["messages"])
    requests = requests_type.validate_python(state["requests"])

    async def resume() -> Any:
        results = DeferredToolResults()
        for call in requests.approvals:
            await decide(kernel, results, requests, call.tool_call_id, decision=a.decide,
                         operator="ann", reason="checked")
        return await agent.run(message_history=history, deferred_tool_results=results)

    return str(asyncio.run(resume()).output)


def run_openai_agents(kernel: Kernel, a: argparse.Namespace, seen: list[str]) -> str:
    from agents import Agent, FunctionTool, Runner, set_tracing_disabled
    from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call
    from agents.tool_context import ToolContext

    from poimen.integrations.openai_agents import poimen_tools

    set_tracing_disabled(True)

    name, args = ARGS[a.tool]

    def answer(call: ModelCall) -> Any:
        items = call.input if isinstance(call.input, list) else []
        outputs = [str(i["output"]) for i in items if i.get("type") == "function_call_output"]
        seen[:] = outputs
        ask = _asks(a, seen)
        return [function_call(name, args, call_id=ask)] if ask else [assistant_message("done")]

    model = ScriptedModel([ModelStep.respond(answer) for _ in range(4)])
    if a.tool == "gated":
        return _openai_agents_approval(kernel, a, model)
    if a.naive:
        async def invoke(ctx: ToolContext[Any], raw: str) -> str:
            return _text(await kernel.acall(EMAIL, json.loads(raw), call_id=ctx.tool_call_id))

        schema = kernel.spec(EMAIL).parameters
        tools = [FunctionTool(name="test_email", description="", params_json_schema=schema,
                              on_invoke_tool=invoke)]
    else:
        tools = list(poimen_tools(kernel, scope=a.scope, pending_wait=a.pending_wait))
    agent = Agent(name="mailer", model=model, tools=tools)

    async def go() -> str:
        result, stops = await Runner.run(agent, "email bob"), []
        while result.interruptions:  # a call still Pending: resumed once it has settled
            from poimen.integrations.openai_agents import resume_pending

            stops.append("interrupt: Pending")
            if a.lookup_back:
                ProviderClient(a.provider).set_lookup_mode("truthful")
            state = result.to_state()
            assert await resume_pending(kernel, state, scope=a.scope, timeout=120) == []
            result = await Runner.run(agent, state)
        seen[:0] = stops  # the model's step rewrites `seen` with the outputs it was given
        return str(result.final_output)

    return asyncio.run(go())


def _openai_agents_approval(kernel: Kernel, a: argparse.Namespace, model: Any) -> str:
    """As `_pydantic_ai_approval`, with the SDK's `RunState` saved as a string."""
    from agents import Agent, Runner, RunState

    from poimen.integrations.openai_agents import decide, poimen_tools

    agent = Agent(name="mailer", model=model, tools=list(poimen_tools(kernel, scope=a.scope)))
    saved = Path(a.saved)

    async def go() -> str:
        if not a.decide:
            result = await Runner.run(agent, "email bob")
            if not saved.exists():
                saved.write_text(result.to_state().to_string())
            return f"approval: {[i.tool_name for i in result.interruptions]}"
        state = await RunState.from_string(agent, saved.read_text())
        for item in state.get_interruptions():
            await decide(kernel, state, item, scope=a.scope, decision=a.decide, operator="ann",
                         reason="checked")
        return str((await Runner.run(agent, state)).final_output)

    return asyncio.run(go())


def run_langgraph(kernel: Kernel, a: argparse.Namespace, seen: list[str]) -> str:
    import sqlite3

    from langgraph.checkpoint.sqlite import SqliteSaver
    from langgraph.types import Command

    from poimen.integrations.langgraph import poimen_tools
    from tests.integrations.fake_chat import build_graph

    name, args = ARGS[a.tool]

    def script(messages: list[Any]) -> dict[str, Any]:
        if messages[-1].type != "tool":
            return {"content": "", "tool_calls": [{"name": name, "args": args, "id": a.tool_call_id}]}
        seen.append(str(messages[-1].content))
        return {"content": "done"}

    conn = sqlite3.connect(a.checkpoint, check_same_thread=False)
    try:
        tools = poimen_tools(kernel, pending_wait=a.pending_wait)
        if a.framework == "langchain":  # create_agent, approvals by the HITL middleware
            from langchain.agents import create_agent

            from poimen.integrations.langchain import PoimenHumanInTheLoop
            from tests.integrations.fake_chat import ScriptedChat

            graph: Any = create_agent(ScriptedChat(script=script), tools=tools,
                                      middleware=[PoimenHumanInTheLoop(kernel)],
                                      checkpointer=SqliteSaver(conn))
        else:
            graph = build_graph(script, tools, SqliteSaver(conn))
        config: Any = {"configurable": {"thread_id": a.scope}}
        state: Any = graph.invoke(
            None if a.resume else {"messages": [("user", "email bob")]}, config)
        while state.get("__interrupt__"):
            [i] = state["__interrupt__"]
            seen.append(f"interrupt: {i.value['poimen']['reason']}")
            if i.value["poimen"]["reason"] == "awaiting_approval":
                if not a.decide:
                    break  # the approver is asked: this run ends here
                answer: Any = {"decision": a.decide, "operator": "ann", "reason": "checked"}
                if a.framework == "langchain":
                    answer = {"decisions": [{"type": a.decide, "operator": "ann",
                                             "reason": "checked"}]}
            else:  # a Pending call: resumed once it has settled
                if a.lookup_back:
                    ProviderClient(a.provider).set_lookup_mode("truthful")
                kernel.wait_sync(i.value["poimen"]["call_id"], timeout=120)
                answer = True
            state = graph.invoke(Command(resume=answer), config)
        return str(state["messages"][-1].content)
    finally:
        conn.close()


RUN = {"pydantic-ai": run_pydantic_ai, "openai-agents": run_openai_agents,
       "langgraph": run_langgraph, "langchain": run_langgraph}


def _gated(kernel: Kernel, provider: str) -> None:
    import httpx

    from poimen import Caps, ToolContext, Unsafe
    from poimen._engine import crashpoints as _crashpoints

    @kernel.tool(id="mail.gated", effects=Unsafe(), caps=Caps(), timeout=5,
                 requires_approval=True)
    def gated(ctx: ToolContext, to: str, subject: str) -> Any:
        """Send an email once an operator approved it."""
        _crashpoints.hit("mid_call")
        return httpx.post(f"{provider}/plain", json={"to": to, "subject": subject}).json()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("framework", choices=sorted(RUN))
    p.add_argument("--db", required=True)
    p.add_argument("--provider", required=True)
    p.add_argument("--scope", required=True)
    p.add_argument("--tool-call-id", required=True)
    p.add_argument("--report", required=True)
    p.add_argument("--naive", action="store_true")
    p.add_argument("--checkpoint")
    p.add_argument("--saved")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--tool", choices=sorted(ARGS), default="email")
    p.add_argument("--reask", action="store_true")
    p.add_argument("--pending-wait", type=float, default=30.0)
    p.add_argument("--wait-bound", type=float, default=5.0)
    p.add_argument("--decide", choices=("approve", "reject"))
    p.add_argument("--lookup-back", action="store_true")
    a = p.parse_args(argv)
    kernel = Kernel(a.db, notifiers=[], wait_bound=a.wait_bound)
    register_test_tools(kernel, a.provider)
    _gated(kernel, a.provider)
    try:
        kernel.launch()  # the restart scan: settles what a killed run left unfinished
        seen: list[str] = []
        output = RUN[a.framework](kernel, a, seen)
    finally:
        kernel.close()
    Path(a.report).write_text(json.dumps({"seen": seen, "output": output}), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
