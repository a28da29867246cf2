"""PydanticAI with `PoimenToolset`, driven by PydanticAI's own `FunctionModel`."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from pydantic_ai import Agent, DeferredToolRequests
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from poimen import (
    Completed,
    Indeterminate,
    Kernel,
    Resolved,
    call_ids,
)
from poimen.errors import PoimenError
from poimen.integrations.pydantic_ai import PoimenToolset, deferred_results
from poimen.testing import EMAIL, ProviderClient
from tests.integrations.conftest import (
    KILL_TIMEOUT,
    LOST,
    REFUSED,
    SLOW,
    RunAgent,
    in_flight,
    slow_kernel,
)

BOB = {"to": "bob@example.com", "subject": "hello"}


class Script:
    """A model that asks for the next turn's tool calls after each user prompt or retry
    prompt, says "done" after tool results, and keeps every result it was given."""

    def __init__(self, *turns: list[tuple[str, dict[str, Any], str]]) -> None:
        self.turns = list(turns)
        self.seen: list[ToolReturnPart | RetryPromptPart] = []
        self.tools: list[Any] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.tools = info.function_tools
        last = messages[-1]
        assert isinstance(last, ModelRequest)
        self.seen += [p for p in last.parts if isinstance(p, ToolReturnPart | RetryPromptPart)]
        asks = any(isinstance(p, UserPromptPart | RetryPromptPart)
                   or (isinstance(p, ToolReturnPart) and p.outcome == "retried")
                   for p in last.parts)
        if asks and self.turns:
            return ModelResponse(parts=[ToolCallPart(n, a, tool_call_id=i)
                                        for n, a, i in self.turns.pop(0)])
        return ModelResponse(parts=[TextPart("done")])


def agent(kernel: Kernel, script: Script, **kw: Any) -> Agent[None, Any]:
    output = [str, DeferredToolRequests] if kw.get("defer") else str
    return Agent(FunctionModel(script), toolsets=[PoimenToolset(kernel, scope="conv-1", **kw)],
                 output_type=output)


def run(a: Agent[None, Any], prompt: str | None = None, **kw: Any) -> Any:
    # asyncio.run closes its loop; PydanticAI's run_sync leaves one open.
    return asyncio.run(a.run(prompt, **kw))


def test_the_model_sees_the_kernels_tools(kernel: Kernel) -> None:
    script = Script()
    run(agent(kernel, script), "hi")
    assert [(t.name, t.description, t.parameters_json_schema) for t in script.tools] == [
        (s.name, s.description, s.parameters) for s in kernel.specs()]
    assert "test_email" in [t.name for t in script.tools]  # "test.email" under a safe name


def test_a_completed_call_gives_the_model_its_result(kernel: Kernel, ledger: ProviderClient) -> None:
    script = Script([("test_email", BOB, "t1")])
    assert run(agent(kernel, script), "email bob").output == "done"
    outcome = kernel.outcome(call_ids.derived("conv-1", EMAIL, BOB, 1))
    assert isinstance(outcome, Completed)
    [seen] = script.seen
    assert isinstance(seen, ToolReturnPart) and seen.content == outcome.result
    assert ledger.count(kind="plain") == 1


def test_an_indeterminate_call_is_told_to_the_model_in_the_standard_words(kernel: Kernel) -> None:
    script = Script([("mail_lost", BOB, "t1")])
    run(agent(kernel, script), "email bob")
    outcome = kernel.outcome(call_ids.derived("conv-1", LOST, BOB, 1))
    assert isinstance(outcome, Indeterminate)
    [seen] = script.seen
    assert seen.model_response_str() == outcome.for_model()
    assert "Do NOT call it again" in seen.model_response_str()


def test_a_failed_call_is_a_failed_tool_result(kernel: Kernel) -> None:
    script = Script([("mail_refused", BOB, "t1")])
    run(agent(kernel, script), "email bob")
    [seen] = script.seen
    assert isinstance(seen, ToolReturnPart) and seen.outcome == "failed"
    outcome = kernel.outcome(call_ids.derived("conv-1", REFUSED, BOB, 1))
    assert outcome is not None and seen.content == outcome.for_model()


def test_refused_arguments_let_the_model_correct_them_and_record_nothing(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    script = Script([("test_email", {"to": "bob@example.com"}, "t1")], [("test_email", BOB, "t2")])
    run(agent(kernel, script), "email bob")
    retry, done = script.seen
    assert "subject" in retry.model_response_str() and "refused" in retry.model_response_str()
    assert isinstance(done, ToolReturnPart) and ledger.count(kind="plain") == 1
    assert kernel.outcome(call_ids.derived("conv-1", EMAIL, BOB, 1)) is not None


def test_the_same_call_twice_in_one_response_is_one_call_while_the_first_is_unsettled(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    script = Script([("test_email", BOB, "t1"), ("test_email", BOB, "t2")])
    run(agent(kernel, script), "email bob twice")
    assert ledger.count(kind="plain") == 1
    first, second = script.seen
    assert first.model_response_str() == second.model_response_str()


def test_a_tool_that_means_repeats_sends_the_same_call_twice_in_one_response(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    script = Script([("mail_twice", BOB, "t1"), ("mail_twice", BOB, "t2")])
    run(agent(kernel, script), "email bob twice")
    assert ledger.count(kind="plain") == 2


def test_a_call_made_again_in_a_later_turn_after_a_restart_is_a_new_call(
    sqlite_url: str, provider: Any, ledger: ProviderClient
) -> None:
    # The occurrence comes from the history, not from the process: a restart between two
    # turns that each mean to send the email sends it twice.
    from poimen.testing import register_test_tools

    def turn(history: list[ModelMessage], tool_call_id: str) -> list[ModelMessage]:
        k = Kernel(sqlite_url, notifiers=[])  # a new process's kernel and toolset
        register_test_tools(k, provider.url)
        try:
            script = Script([("test_email", BOB, tool_call_id)])
            result = run(agent(k, script), "email bob", message_history=history)
            return result.all_messages()
        finally:
            k.close()

    history = turn([], "t1")
    turn(history, "t2")
    assert ledger.count(kind="plain") == 2


def test_deferred_calls_resume_with_the_operators_decision(kernel: Kernel) -> None:
    script = Script([("mail_lost", BOB, "t1")])
    a = agent(kernel, script, defer=True)
    first = run(a, "email bob")
    requests = first.output
    assert isinstance(requests, DeferredToolRequests) and script.seen == []
    assert [c.tool_call_id for c in requests.calls] == ["t1"]
    details = requests.metadata["t1"]["poimen"]
    assert details["outcome"] == "Indeterminate"
    undecided = deferred_results_now(kernel, requests)
    assert undecided.calls == {} and requests.remaining(undecided) is not None

    kernel.resolve(details["intent_id"], landed=True, result={"id": "m-7"}, operator="ann",
                   reason="the message is in the sent folder")
    results = deferred_results_now(kernel, requests)
    second = run(a, message_history=first.all_messages(), deferred_tool_results=results)
    assert second.output == "done"
    [seen] = script.seen
    outcome = kernel.outcome(details["call_id"])
    assert isinstance(outcome, Resolved) and seen.model_response_str() == outcome.for_model()


def test_a_call_still_pending_ends_the_run_deferred_and_resumes_with_its_one_effect(
    sqlite_url: str, provider: Any, ledger: ProviderClient
) -> None:
    # The identical call is in flight in another thread (its owner alive): the model's call
    # waits `pending_wait`, is still Pending, and ends the run through PydanticAI's deferral;
    # once the first settles, the resumed run gets its result. One email.
    release = threading.Event()
    with slow_kernel(sqlite_url, provider.url, release) as k:
        call_id = call_ids.derived("conv-1", SLOW, BOB, 1)
        first = in_flight(k, BOB, call_id, "conv-1")
        try:
            script = Script([("mail_slow", BOB, "t1")])
            a = agent(k, script, defer=True, pending_wait=0.2)
            ended = run(a, "email bob")
            requests = ended.output
            assert isinstance(requests, DeferredToolRequests) and script.seen == []
            details = requests.metadata["t1"]["poimen"]
            assert details["outcome"] == "Pending" and details["call_id"] == call_id
            assert ledger.count(kind="plain") == 0
        finally:
            release.set()
            first.join(60)
        results = asyncio.run(deferred_results(k, requests, timeout=30))
        resumed = run(a, message_history=ended.all_messages(), deferred_tool_results=results)
        assert resumed.output == "done"
        [seen] = script.seen
        done = k.outcome(call_id)
        assert isinstance(done, Completed) and seen.content == done.result
    assert ledger.count(kind="plain") == 1


def test_a_handler_resolves_deferred_calls_inline(kernel: Kernel) -> None:
    # The operator decides while the run waits in its handler: the run goes on in one call.
    from pydantic_ai.capabilities import HandleDeferredToolCalls

    async def operator_then_results(ctx: Any, requests: DeferredToolRequests) -> Any:
        details = requests.metadata["t1"]["poimen"]
        await kernel.aresolve(details["intent_id"], landed=False, operator="ann",
                              reason="not in the sent folder")
        return await deferred_results(kernel, requests, timeout=30)

    script = Script([("mail_lost", BOB, "t1")])
    a = Agent(FunctionModel(script), toolsets=[PoimenToolset(kernel, scope="conv-1", defer=True)],
              capabilities=[HandleDeferredToolCalls(handler=operator_then_results)])
    assert run(a, "email bob").output == "done"
    [seen] = script.seen
    outcome = kernel.outcome(call_ids.derived("conv-1", LOST, BOB, 1))
    assert isinstance(outcome, Resolved) and not outcome.landed
    assert seen.model_response_str() == outcome.for_model()


def deferred_results_now(kernel: Kernel, requests: DeferredToolRequests) -> Any:
    return asyncio.run(deferred_results(kernel, requests, timeout=0))


def test_a_bad_scope_is_refused_when_the_toolset_is_made(kernel: Kernel) -> None:
    with pytest.raises(PoimenError, match="scope"):
        PoimenToolset(kernel, scope="")


# A real agent process, SIGKILLed after its email went out, then run again.

@KILL_TIMEOUT
def test_an_agent_killed_after_the_effect_and_run_again_sends_one_email(
    run_agent: RunAgent, ledger: ProviderClient
) -> None:
    assert run_agent("pydantic-ai", "call_first", kill_after_effect=True) is None
    assert ledger.count(kind="plain") == 1
    # The restarted run asks the model again, which mints a new tool-call id.
    report = run_agent("pydantic-ai", "call_second")
    assert report is not None and ledger.count(kind="plain") == 1
    [seen] = report["seen"]
    assert seen.startswith("The outcome of this action is unknown") and "Do NOT call it again" in seen


@KILL_TIMEOUT
def test_without_the_rule_the_same_kill_sends_two_emails(
    run_agent: RunAgent, ledger: ProviderClient
) -> None:
    # The baseline: the model's tool-call id as the call id.
    run_agent("pydantic-ai", "call_first", kill_after_effect=True, naive=True)
    run_agent("pydantic-ai", "call_second", naive=True)
    assert ledger.count(kind="plain") == 2


# Approvals as PydanticAI's deferred tools, bound to the intent asked about.

def test_an_approval_ends_the_run_and_the_decision_resumes_it_once(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    from pydantic_ai import DeferredToolResults

    from poimen.integrations.pydantic_ai import decide

    script = Script([("mail_gated", BOB, "t1")])
    a = agent(kernel, script, defer=True)
    first = run(a, "email bob")
    requests = first.output
    assert isinstance(requests, DeferredToolRequests) and ledger.count() == 0
    assert [c.tool_call_id for c in requests.approvals] == ["t1"]
    details = requests.metadata["t1"]["poimen"]
    assert details["reason"] == "awaiting_approval" and details["args"] == BOB
    results = DeferredToolResults()
    asyncio.run(decide(kernel, results, requests, "t1", decision="approve", operator="ann",
                       reason="checked"))
    second = run(a, message_history=first.all_messages(), deferred_tool_results=results)
    assert second.output == "done" and ledger.count() == 1
    assert isinstance(kernel.outcome(details["call_id"]), Completed)
    # The stale pre-approval state resumed again, decision and all: no second email.
    again = DeferredToolResults()
    asyncio.run(decide(kernel, again, requests, "t1", decision="approve", operator="ann",
                       reason="checked"))
    run(a, message_history=first.all_messages(), deferred_tool_results=again)
    assert ledger.count() == 1


def test_an_edit_sends_the_edited_call_and_a_rejection_sends_nothing(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    from pydantic_ai import DeferredToolResults

    from poimen.integrations.pydantic_ai import decide

    eve = {"to": "eve@example.com", "subject": "hello"}
    script = Script([("mail_gated", BOB, "t1")], [("mail_gated", eve, "t2")])
    a = agent(kernel, script, defer=True)
    first = run(a, "email bob")
    results = DeferredToolResults()
    asyncio.run(decide(kernel, results, first.output, "t1", decision="edit", operator="ann",
                       reason="eve, not bob", args=eve))
    run(a, message_history=first.all_messages(), deferred_tool_results=results)
    assert [e["body"]["to"] for e in ledger.entries(kind="plain")] == ["eve@example.com"]

    third = run(a, "email eve")
    results = DeferredToolResults()
    asyncio.run(decide(kernel, results, third.output, "t2", decision="reject", operator="ann",
                       reason="sent already"))
    run(a, message_history=third.all_messages(), deferred_tool_results=results)
    assert ledger.count() == 1
    assert any("rejected by ann" in p.model_response_str() for p in script.seen)


def test_four_eyes_ends_the_run_again_until_two_distinct_operators_approved(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    from pydantic_ai import DeferredToolResults

    from poimen.errors import SameApproverError
    from poimen.integrations.pydantic_ai import decide

    script = Script([("mail_four_eyes", BOB, "t1")])
    a = agent(kernel, script, defer=True)
    first = run(a, "email bob")
    assert first.output.metadata["t1"]["poimen"]["approvals"] == {"needed": 2, "given": []}
    results = DeferredToolResults()
    asyncio.run(decide(kernel, results, first.output, "t1", decision="approve", operator="ann",
                       reason="checked"))
    second = run(a, message_history=first.all_messages(), deferred_tool_results=results)
    # One more operator: the run ends again asking about the same call.
    assert isinstance(second.output, DeferredToolRequests) and ledger.count() == 0
    [call] = second.output.approvals
    details = second.output.metadata[call.tool_call_id]["poimen"]
    assert details["approvals"]["given"] == ["ann"]
    with pytest.raises(SameApproverError):
        asyncio.run(decide(kernel, DeferredToolResults(), second.output, call.tool_call_id,
                           decision="approve", operator="ann", reason="again"))
    results = DeferredToolResults()
    asyncio.run(decide(kernel, results, second.output, call.tool_call_id, decision="approve",
                       operator="bob", reason="checked too"))
    third = run(a, message_history=second.all_messages(), deferred_tool_results=results)
    assert third.output == "done" and ledger.count() == 1
    assert isinstance(kernel.outcome(details["call_id"]), Completed)


def test_four_eyes_with_an_edit_asks_the_second_operator_about_the_edited_call(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    from pydantic_ai import DeferredToolResults

    from poimen.integrations.pydantic_ai import decide

    eve = {"to": "eve@example.com", "subject": "hello"}
    a = agent(kernel, Script([("mail_four_eyes", BOB, "t1")]), defer=True)
    first = run(a, "email bob")
    results = DeferredToolResults()
    asyncio.run(decide(kernel, results, first.output, "t1", decision="edit", operator="ann",
                       reason="eve, not bob", args=eve))
    second = run(a, message_history=first.all_messages(), deferred_tool_results=results)
    [call] = second.output.approvals
    details = second.output.metadata[call.tool_call_id]["poimen"]
    assert details["args"] == eve and details["approvals"]["given"] == ["ann"]
    results = DeferredToolResults()
    asyncio.run(decide(kernel, results, second.output, call.tool_call_id, decision="approve",
                       operator="bob", reason="checked"))
    assert run(a, message_history=second.all_messages(),
               deferred_tool_results=results).output == "done"
    assert [e["body"]["to"] for e in ledger.entries(kind="plain")] == ["eve@example.com"]


def test_a_stale_state_resumed_with_another_decision_is_told_what_the_log_holds(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    from pydantic_ai import DeferredToolResults

    from poimen.integrations.pydantic_ai import decide

    script = Script([("mail_gated", BOB, "t1")])
    a = agent(kernel, script, defer=True)
    first = run(a, "email bob")
    results = DeferredToolResults()
    asyncio.run(decide(kernel, results, first.output, "t1", decision="approve", operator="ann",
                       reason="checked"))
    run(a, message_history=first.all_messages(), deferred_tool_results=results)
    # The saved pre-approval state, resumed by another approver who rejects: the email went
    # out already, and the model is told so, not that it was rejected.
    late = DeferredToolResults()
    asyncio.run(decide(kernel, late, first.output, "t1", decision="reject", operator="bob",
                       reason="too late"))
    run(a, message_history=first.all_messages(), deferred_tool_results=late)
    assert ledger.count() == 1
    sent, told = script.seen
    assert isinstance(told, ToolReturnPart) and told.content == sent.content
