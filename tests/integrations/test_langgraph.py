"""LangGraph's `ToolNode` over `poimen_tools`, with a scripted chat model and the SQLite
checkpointer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from langchain_core.messages import BaseMessage, ToolMessage
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.sqlite import SqliteSaver

from poimen import Completed, Failed, Indeterminate, Kernel, call_ids
from poimen.errors import PoimenError
from poimen.integrations.langgraph import poimen_tools
from poimen.testing import EMAIL, ProviderClient
from tests.integrations.conftest import KILL_TIMEOUT, RunAgent
from tests.integrations.fake_chat import build_graph

BOB = {"to": "bob@example.com", "subject": "hello"}


class Script:
    """Asks for the given calls after the user's message, says "done" after tool results,
    and keeps every tool message it was given."""

    def __init__(self, *calls: tuple[str, dict[str, Any], str]) -> None:
        self.calls = list(calls)
        self.seen: list[ToolMessage] = []

    def __call__(self, messages: list[BaseMessage]) -> dict[str, Any]:
        if messages[-1].type != "tool":
            return {"content": "", "tool_calls": [
                {"name": n, "args": a, "id": i} for n, a, i in self.calls]}
        for m in reversed(messages):
            if not isinstance(m, ToolMessage):
                break
            self.seen.insert(0, m)
        return {"content": "done"}


THREAD = {"configurable": {"thread_id": "th-1"}}


def run(kernel: Kernel, script: Script, saver: Any, config: Any = THREAD, **kw: Any) -> Any:
    graph = build_graph(script, poimen_tools(kernel, **kw), saver)
    return graph.invoke({"messages": [("user", "email bob")]}, config)


def test_the_model_sees_the_kernels_tools(kernel: Kernel) -> None:
    tools = poimen_tools(kernel)
    assert [(t.name, t.description, t.args_schema) for t in tools] == [
        (s.name, s.description, s.parameters) for s in kernel.specs()]
    # What bind_tools sends: LangChain drops the titles, nothing else.
    [sent] = [convert_to_openai_tool(t)["function"] for t in tools if t.name == "test_email"]
    assert sent["parameters"]["required"] == ["to", "subject"]


def test_a_completed_call_is_a_tool_message_with_its_result(
    kernel: Kernel, saver: SqliteSaver, ledger: ProviderClient
) -> None:
    script = Script(("test_email", BOB, "c1"))
    state = run(kernel, script, saver)
    assert state["messages"][-1].content == "done"
    call_id = call_ids.framework_id("th-1", "c1")
    outcome = kernel.outcome(call_id)
    assert isinstance(outcome, Completed)
    [message] = script.seen
    assert json.loads(message.content) == outcome.result and message.status == "success"
    assert message.artifact == {"call_id": call_id, "intent_id": outcome.intent_id,
                                "outcome": "Completed"}
    assert ledger.count(kind="plain") == 1


def test_an_indeterminate_call_is_told_to_the_model_in_the_standard_words(
    kernel: Kernel, saver: SqliteSaver
) -> None:
    script = Script(("mail_lost", BOB, "c1"))
    run(kernel, script, saver)
    outcome = kernel.outcome(call_ids.framework_id("th-1", "c1"))
    assert isinstance(outcome, Indeterminate)
    [message] = script.seen
    assert message.content == outcome.for_model() and "Do NOT call it again" in message.content


def test_a_failed_call_is_an_error_tool_message(kernel: Kernel, saver: SqliteSaver) -> None:
    script = Script(("mail_refused", BOB, "c1"))
    run(kernel, script, saver)
    outcome = kernel.outcome(call_ids.framework_id("th-1", "c1"))
    assert isinstance(outcome, Failed)
    [message] = script.seen
    assert message.content == outcome.for_model() and message.status == "error"


def test_refused_arguments_are_an_error_message_and_record_nothing(
    kernel: Kernel, saver: SqliteSaver
) -> None:
    script = Script(("test_email", {"to": "bob@example.com"}, "c1"))
    run(kernel, script, saver)
    [message] = script.seen
    assert message.status == "error" and "subject" in message.content
    assert kernel.outcome(call_ids.framework_id("th-1", "c1")) is None


def test_async_graphs_call_through_acall(kernel: Kernel, saver: SqliteSaver) -> None:
    script = Script(("test_email", BOB, "c1"), ("mail_lost", BOB, "c2"))
    graph = build_graph(script, poimen_tools(kernel), None)
    asyncio.run(graph.ainvoke({"messages": [("user", "email bob")]}, THREAD))
    assert [m.artifact["outcome"] for m in script.seen] == ["Completed", "Indeterminate"]
    assert isinstance(kernel.outcome(call_ids.framework_id("th-1", "c2")), Indeterminate)


def test_without_a_thread_id_the_call_id_is_rule_2_in_the_scope(kernel: Kernel) -> None:
    script = Script(("test_email", BOB, "c1"))
    run(kernel, script, None, config=None, scope="conv-9")
    assert isinstance(kernel.outcome(call_ids.derived("conv-9", EMAIL, BOB, 1)), Completed)


def test_without_a_thread_id_or_a_scope_the_call_is_refused(kernel: Kernel) -> None:
    script = Script(("test_email", BOB, "c1"))
    with pytest.raises(PoimenError, match="thread_id"):
        run(kernel, script, None, config=None)
    assert kernel.outcome(call_ids.framework_id("th-1", "c1")) is None


# A real agent process, SIGKILLed after its email went out, resumed from its checkpoint.

@KILL_TIMEOUT
def test_a_thread_killed_after_the_effect_and_resumed_sends_one_email(
    run_agent: RunAgent, ledger: ProviderClient, sqlite_url: str
) -> None:
    assert run_agent("langgraph", "call_first", kill_after_effect=True) is None
    assert ledger.count(kind="plain") == 1
    # The checkpoint holds the model's message: the resumed thread runs the same call again
    # with its id, without asking the model (whose next id would be call_second).
    report = run_agent("langgraph", "call_second", resume=True)
    assert report is not None and report["output"] == "done"
    assert ledger.count(kind="plain") == 1
    [seen] = report["seen"]
    k = Kernel(sqlite_url, notifiers=[])
    try:
        outcome = k.outcome(call_ids.framework_id("conv-1", "call_first"))
        assert isinstance(outcome, Indeterminate) and seen == outcome.for_model()
    finally:
        k.close()


# Approvals through LangGraph's interrupt, bound to the intent asked about.

def approval_graph(kernel: Kernel, saver: Any) -> Any:
    return build_graph(Script(("mail_gated", BOB, "c1")), poimen_tools(kernel), saver)


def asked(state: Any) -> dict[str, Any]:
    [pending] = state["__interrupt__"]
    details: dict[str, Any] = pending.value["poimen"]
    return details


def test_an_approval_is_asked_through_interrupt_and_the_decision_resumes_the_thread(
    kernel: Kernel, saver: SqliteSaver, ledger: ProviderClient
) -> None:
    from langgraph.types import Command

    graph = approval_graph(kernel, saver)
    state = graph.invoke({"messages": [("user", "email bob")]}, THREAD)
    details = asked(state)
    assert details["reason"] == "awaiting_approval" and details["args"] == BOB
    assert details["call_id"] == call_ids.framework_id("th-1", "c1") and ledger.count() == 0
    decision = {"decision": "approve", "operator": "ann", "reason": "checked"}
    state = graph.invoke(Command(resume=decision), THREAD)
    assert state["messages"][-1].content == "done" and ledger.count() == 1
    done = kernel.outcome(details["call_id"])
    assert isinstance(done, Completed)
    [approved] = [e for e in kernel.store.events(details["intent_id"]) if e.kind == "approved"]
    assert approved.actor == "ann"
    # Resumed again from the stale checkpoint taken before the approval: no second email.
    before = next(s for s in graph.get_state_history(THREAD) if s.interrupts)
    graph.invoke(Command(resume=decision), before.config)
    assert ledger.count() == 1


def test_an_edit_through_interrupt_sends_the_edited_call_and_a_reject_sends_nothing(
    kernel: Kernel, saver: SqliteSaver, ledger: ProviderClient
) -> None:
    from langgraph.types import Command

    graph = approval_graph(kernel, saver)
    details = asked(graph.invoke({"messages": [("user", "email bob")]}, THREAD))
    eve = {"to": "eve@example.com", "subject": "hello"}
    edit = {"decision": "edit", "operator": "ann", "reason": "eve, not bob", "args": eve}
    state = graph.invoke(Command(resume=edit), THREAD)
    out = kernel.outcome(details["call_id"])
    assert isinstance(out, Completed) and out.intent_id != details["intent_id"]
    assert [e["body"]["to"] for e in ledger.entries(kind="plain")] == ["eve@example.com"]
    assert state["messages"][-2].artifact["intent_id"] == out.intent_id

    other = {"configurable": {"thread_id": "th-2"}}
    details = asked(graph.invoke({"messages": [("user", "email bob")]}, other))
    no = {"decision": "reject", "operator": "ann", "reason": "not now"}
    state = graph.invoke(Command(resume=no), other)
    assert state["messages"][-2].status == "error" and "rejected by ann" in state["messages"][-2].content
    assert ledger.count() == 1


def test_four_eyes_through_interrupt_asks_until_two_distinct_operators_approved(
    kernel: Kernel, saver: SqliteSaver, ledger: ProviderClient
) -> None:
    from langgraph.types import Command

    graph = build_graph(Script(("mail_four_eyes", BOB, "c1")), poimen_tools(kernel), saver)
    first = asked(graph.invoke({"messages": [("user", "email bob")]}, THREAD))
    assert first["approvals"] == {"needed": 2, "given": []}
    ann = {"decision": "approve", "operator": "ann", "reason": "checked"}
    again = asked(graph.invoke(Command(resume=ann), THREAD))  # one more operator
    assert again["intent_id"] == first["intent_id"] and again["approvals"]["given"] == ["ann"]
    # ann a second time does not count: the thread asks again, nothing is sent.
    still = asked(graph.invoke(Command(resume=ann), THREAD))
    assert still["approvals"]["given"] == ["ann"] and ledger.count() == 0
    bob = {"decision": "approve", "operator": "bob", "reason": "checked too"}
    state = graph.invoke(Command(resume=bob), THREAD)
    assert state["messages"][-1].content == "done" and ledger.count() == 1
    [approved] = [e for e in kernel.store.events(first["intent_id"]) if e.kind == "approved"]
    assert json.loads(approved.detail or "{}")["approved_by"] == ["ann", "bob"]


def test_four_eyes_with_an_edit_asks_the_second_operator_about_the_edited_call(
    kernel: Kernel, saver: SqliteSaver, ledger: ProviderClient
) -> None:
    from langgraph.types import Command

    graph = build_graph(Script(("mail_four_eyes", BOB, "c1")), poimen_tools(kernel), saver)
    first = asked(graph.invoke({"messages": [("user", "email bob")]}, THREAD))
    eve = {"to": "eve@example.com", "subject": "hello"}
    edit = {"decision": "edit", "operator": "ann", "reason": "eve, not bob", "args": eve}
    second = asked(graph.invoke(Command(resume=edit), THREAD))
    assert second["args"] == eve and second["intent_id"] != first["intent_id"]
    assert second["approvals"]["given"] == ["ann"] and ledger.count() == 0
    bob = {"decision": "approve", "operator": "bob", "reason": "checked"}
    state = graph.invoke(Command(resume=bob), THREAD)
    assert state["messages"][-2].artifact["intent_id"] == second["intent_id"]
    assert state["messages"][-2].artifact["outcome"] == "Completed"
    assert [e["body"]["to"] for e in ledger.entries(kind="plain")] == ["eve@example.com"]


def test_a_stale_checkpoint_resumed_after_an_edit_answers_the_edited_call(
    kernel: Kernel, saver: SqliteSaver, ledger: ProviderClient
) -> None:
    from langgraph.types import Command

    graph = approval_graph(kernel, saver)
    graph.invoke({"messages": [("user", "email bob")]}, THREAD)
    eve = {"to": "eve@example.com", "subject": "hello"}
    edit = {"decision": "edit", "operator": "ann", "reason": "eve, not bob", "args": eve}
    graph.invoke(Command(resume=edit), THREAD)
    before = next(s for s in graph.get_state_history(THREAD) if s.interrupts)
    state = graph.invoke(Command(resume=edit), before.config)
    message = state["messages"][-2]
    assert message.artifact["outcome"] == "Completed" and message.status == "success"
    assert ledger.count() == 1


def test_a_decision_that_does_not_count_is_asked_again_saying_why(
    kernel: Kernel, saver: SqliteSaver, ledger: ProviderClient
) -> None:
    # LangGraph gives an interrupt's answer again each time the node runs again: a refused
    # decision raised would come back on every resume, and the thread could never go on.
    from langgraph.types import Command

    graph = approval_graph(kernel, saver)
    graph.invoke({"messages": [("user", "email bob")]}, THREAD)
    again = asked(graph.invoke(Command(resume={"decision": "approve", "reason": "ok"}), THREAD))
    assert "needs the operator's name" in again["refused"]
    again = asked(graph.invoke(Command(resume={"decision": "maybe", "operator": "ann"}), THREAD))
    assert "'maybe'" in again["refused"] and ledger.count() == 0
    decision = {"decision": "approve", "operator": "ann", "reason": "checked"}
    state = graph.invoke(Command(resume=decision), THREAD)
    assert state["messages"][-1].content == "done" and ledger.count() == 1
