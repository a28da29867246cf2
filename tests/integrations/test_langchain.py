"""LangChain's `create_agent` with `PoimenHumanInTheLoop`: approvals of the kernel's tools in
LangChain's human-in-the-loop protocol, recorded on poimen's intents, with a scripted chat
model, the SQLite checkpointer and the provider's ledger as the witness."""

from __future__ import annotations

import json
from typing import Any

from langchain.agents import create_agent
from langchain_core.messages import BaseMessage, ToolMessage
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.types import Command

from poimen import Completed, Failed, Kernel, call_ids
from poimen.integrations.langchain import PoimenHumanInTheLoop
from poimen.integrations.langgraph import poimen_tools
from poimen.testing import ProviderClient
from tests.integrations.fake_chat import ScriptedChat

BOB = {"to": "bob@example.com", "subject": "hello"}
EVE = {"to": "eve@example.com", "subject": "hello"}
THREAD = {"configurable": {"thread_id": "th-1"}}


def script(name: str, args: dict[str, Any]) -> Any:
    def answer(messages: list[BaseMessage]) -> dict[str, Any]:
        if messages[-1].type != "tool":
            return {"content": "", "tool_calls": [{"name": name, "args": args, "id": "c1"}]}
        return {"content": "done"}

    return answer


def agent(kernel: Kernel, saver: Any, tool: str = "mail_gated", **kw: Any) -> Any:
    return create_agent(ScriptedChat(script=script(tool, BOB)), tools=poimen_tools(kernel),
                        middleware=[PoimenHumanInTheLoop(kernel, **kw)], checkpointer=saver)


def asked(state: Any) -> dict[str, Any]:
    [pending] = state["__interrupt__"]
    value: dict[str, Any] = pending.value
    return value


def start(graph: Any, config: Any = THREAD) -> dict[str, Any]:
    return asked(graph.invoke({"messages": [("user", "email bob")]}, config))


def decide(kind: str, operator: str = "ann", **kw: Any) -> Command[Any]:
    return Command(resume={"decisions": [{"type": kind, "operator": operator,
                                          "reason": "checked", **kw}]})


def tool_message(state: Any) -> ToolMessage:
    [message] = [m for m in state["messages"] if isinstance(m, ToolMessage)]
    return message


def test_an_approval_is_asked_in_langchains_protocol_and_recorded_on_the_intent(
    kernel: Kernel, saver: SqliteSaver, ledger: ProviderClient
) -> None:
    graph = agent(kernel, saver)
    request = start(graph)
    [action] = request["action_requests"]
    assert action["name"] == "mail_gated" and action["args"] == BOB
    assert request["review_configs"] == [{"action_name": "mail_gated",
                                          "allowed_decisions": ["approve", "edit", "reject"]}]
    details = request["poimen"]
    assert details["call_id"] == call_ids.framework_id("th-1", "c1") and ledger.count() == 0
    assert details["intent_id"] in action["description"]
    state = graph.invoke(decide("approve"), THREAD)
    assert state["messages"][-1].content == "done" and ledger.count() == 1
    assert isinstance(kernel.outcome(details["call_id"]), Completed)
    [approved] = [e for e in kernel.store.events(details["intent_id"]) if e.kind == "approved"]
    assert approved.actor == "ann"
    # The stale checkpoint taken before the approval, resumed again: no second email.
    before = next(s for s in graph.get_state_history(THREAD) if s.interrupts)
    graph.invoke(decide("approve"), before.config)
    assert ledger.count() == 1


def test_an_edit_runs_the_edited_call_and_tells_the_model(
    kernel: Kernel, saver: SqliteSaver, ledger: ProviderClient
) -> None:
    graph = agent(kernel, saver)
    details = start(graph)["poimen"]
    state = graph.invoke(decide("edit", edited_action={"name": "mail_gated", "args": EVE}),
                         THREAD)
    assert [e["body"]["to"] for e in ledger.entries(kind="plain")] == ["eve@example.com"]
    message = tool_message(state)
    assert message.artifact["outcome"] == "Completed"
    assert message.artifact["intent_id"] != details["intent_id"]
    assert "eve@example.com" in message.content and "Do not make your call again" in message.content
    original = kernel.store.get_intent(details["intent_id"])
    assert original is not None and original.reason == "edited"


def test_a_rejection_sends_nothing_and_tells_the_model_who_rejected(
    kernel: Kernel, saver: SqliteSaver, ledger: ProviderClient
) -> None:
    graph = agent(kernel, saver)
    details = start(graph)["poimen"]
    state = graph.invoke(decide("reject", message="not now"), THREAD)
    message = tool_message(state)
    assert message.status == "error" and "rejected by ann: not now" in message.content
    assert isinstance(kernel.outcome(details["call_id"]), Failed) and ledger.count() == 0


def test_four_eyes_stops_the_thread_until_two_distinct_operators_approved(
    kernel: Kernel, saver: SqliteSaver, ledger: ProviderClient
) -> None:
    graph = agent(kernel, saver, tool="mail_four_eyes")
    first = start(graph)
    assert first["poimen"]["approvals"] == {"needed": 2, "given": []}
    again = asked(graph.invoke(decide("approve"), THREAD))
    assert again["poimen"]["approvals"]["given"] == ["ann"] and ledger.count() == 0
    assert "approved so far by ann" in again["action_requests"][0]["description"]
    still = asked(graph.invoke(decide("approve"), THREAD))  # ann again does not count
    assert still["poimen"]["approvals"]["given"] == ["ann"] and ledger.count() == 0
    state = graph.invoke(decide("approve", "bob"), THREAD)
    assert state["messages"][-1].content == "done" and ledger.count() == 1
    [approved] = [e for e in kernel.store.events(first["poimen"]["intent_id"])
                  if e.kind == "approved"]
    assert json.loads(approved.detail or "{}")["approved_by"] == ["ann", "bob"]


def test_per_call_mode_asks_with_a_tool_approval_request(
    kernel: Kernel, saver: SqliteSaver, ledger: ProviderClient
) -> None:
    graph = agent(kernel, saver, interrupt_mode="per_call")
    request = start(graph)
    assert request["type"] == "tool_approval" and request["tool_call_id"] == "c1"
    assert request["args"] == BOB
    state = graph.invoke(Command(resume={"type": "approve", "operator": "ann",
                                         "reason": "checked"}), THREAD)
    assert state["messages"][-1].content == "done" and ledger.count() == 1


def test_a_decision_that_does_not_count_is_asked_again_saying_why(
    kernel: Kernel, saver: SqliteSaver, ledger: ProviderClient
) -> None:
    graph = agent(kernel, saver)
    details = start(graph)["poimen"]
    again = asked(graph.invoke(Command(resume={"decisions": [{"type": "approve"}]}), THREAD))
    assert "needs the operator's name" in again["poimen"]["refused"]
    assert "did not count" in again["action_requests"][0]["description"]
    again = asked(graph.invoke(decide("respond", message="sent it myself"), THREAD))
    assert "'respond'" in again["poimen"]["refused"]
    assert kernel.store.events(details["intent_id"])[-1].kind == "awaiting_approval"
    state = graph.invoke(decide("approve"), THREAD)  # a proper decision
    assert state["messages"][-1].content == "done" and ledger.count() == 1


def test_a_tool_without_approval_runs_as_it_would_without_the_middleware(
    kernel: Kernel, saver: SqliteSaver, ledger: ProviderClient
) -> None:
    state = agent(kernel, saver, tool="test_email").invoke(
        {"messages": [("user", "email bob")]}, THREAD)
    assert "__interrupt__" not in state and state["messages"][-1].content == "done"
    assert ledger.count(kind="plain") == 1
