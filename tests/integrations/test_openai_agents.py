"""The OpenAI Agents SDK with `poimen_tools`, driven by the SDK's own `ScriptedModel`."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from agents import Agent, Runner, set_tracing_disabled
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call

from poimen import Completed, Indeterminate, Kernel, call_ids
from poimen.errors import NotAwaitingApprovalError, PoimenError
from poimen.integrations.openai_agents import poimen_tools
from poimen.testing import EMAIL, ProviderClient, ProviderProcess, register_test_tools
from tests.integrations.conftest import (
    KILL_TIMEOUT,
    LOST,
    REFUSED,
    SLOW,
    RunAgent,
    in_flight,
    slow_kernel,
)

set_tracing_disabled(True)  # nothing to export traces to
BOB = {"to": "bob@example.com", "subject": "hello"}


class Script:
    """After each user message, the next turn's function calls; after their outputs, "done".
    Keeps every output the model was given, and the tools it was offered."""

    def __init__(self, *turns: list[tuple[str, dict[str, Any], str]]) -> None:
        self.turns = list(turns)
        self.seen: list[str] = []
        self.tools: list[Any] = []
        self._known: set[str] = set()

    def __call__(self, call: ModelCall) -> Any:
        self.tools = call.tools
        items = call.input if isinstance(call.input, list) else [
            {"role": "user", "content": call.input}]
        for i in items:
            if i.get("type") == "function_call_output" and i["call_id"] not in self._known:
                self._known.add(i["call_id"])
                self.seen.append(i["output"])
        if items[-1].get("role") == "user" and self.turns:
            return [function_call(n, a, call_id=c) for n, a, c in self.turns.pop(0)]
        return [assistant_message("done")]

    def model(self) -> ScriptedModel:
        return ScriptedModel([ModelStep.respond(self) for _ in range(20)])


def run(kernel: Kernel, script: Script, prompt: Any = "email bob") -> Any:
    agent = Agent(name="mailer", model=script.model(), tools=list(poimen_tools(kernel, scope="s-1")))
    return asyncio.run(Runner.run(agent, prompt))


def test_the_model_sees_the_kernels_tools(kernel: Kernel) -> None:
    script = Script()
    run(kernel, script)
    assert [(t.name, t.description, t.params_json_schema) for t in script.tools] == [
        (s.name, s.description, s.parameters) for s in kernel.specs()]
    # Strict where every parameter is required (test.charge's `note` has a default).
    assert {t.name: t.strict_json_schema for t in script.tools} == {
        "test_charge": False, "test_ship": True, "test_email": True, "mail_lost": True,
        "mail_refused": True, "mail_twice": True, "mail_gated": True, "mail_four_eyes": True}


def test_a_completed_call_gives_the_model_its_result(kernel: Kernel, ledger: ProviderClient) -> None:
    script = Script([("test_email", BOB, "c1")])
    assert run(kernel, script).final_output == "done"
    outcome = kernel.outcome(call_ids.derived("s-1", EMAIL, BOB, 1))
    assert isinstance(outcome, Completed)
    assert [json.loads(s) for s in script.seen] == [outcome.result]
    assert ledger.count(kind="plain") == 1


def test_an_indeterminate_call_is_told_to_the_model_in_the_standard_words(kernel: Kernel) -> None:
    script = Script([("mail_lost", BOB, "c1")])
    run(kernel, script)
    outcome = kernel.outcome(call_ids.derived("s-1", LOST, BOB, 1))
    assert isinstance(outcome, Indeterminate)
    assert script.seen == [outcome.for_model()]
    assert "Do NOT call it again" in script.seen[0]


def test_a_failed_call_is_told_in_the_standard_words(kernel: Kernel) -> None:
    script = Script([("mail_refused", BOB, "c1")])
    run(kernel, script)
    outcome = kernel.outcome(call_ids.derived("s-1", REFUSED, BOB, 1))
    assert outcome is not None and script.seen == [outcome.for_model()]


def test_refused_arguments_are_told_and_record_nothing(kernel: Kernel) -> None:
    script = Script([("test_email", {"to": "bob@example.com"}, "c1")])
    run(kernel, script)
    [seen] = script.seen
    assert seen.startswith("The call was refused and had no effect") and "subject" in seen
    assert kernel.outcome(call_ids.derived("s-1", EMAIL, {"to": "bob@example.com"}, 1)) is None


@pytest.mark.parametrize("raw", ['{"to": "bob@', '["bob@example.com"]', ""])
def test_arguments_that_are_no_json_object_are_let_through_and_refused(
    kernel: Kernel, raw: str
) -> None:
    # The SDK stops the run on them before it asks the tools; poimen holds nothing, so
    # `resume_pending` lets them through and the model is told they were refused.
    from poimen.integrations.openai_agents import resume_pending

    script = Script([("test_email", raw, "c1")])  # type: ignore[list-item]
    agent = Agent(name="mailer", model=script.model(), tools=list(poimen_tools(kernel, scope="s-1")))

    async def go() -> Any:
        first = await Runner.run(agent, "email bob")
        state = first.to_state()
        assert len(first.interruptions) == 1
        assert await resume_pending(kernel, state, scope="s-1", timeout=0) == []
        return await Runner.run(agent, state)

    assert asyncio.run(go()).final_output == "done"
    [seen] = script.seen
    assert seen.startswith("The call was refused and had no effect")
    assert kernel.store.list_intents() == []


def test_the_same_call_twice_in_one_run_is_one_call_while_the_first_is_unsettled(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    script = Script([("test_email", BOB, "c1"), ("test_email", BOB, "c2")])
    run(kernel, script)
    assert ledger.count(kind="plain") == 1 and len(script.seen) == 2
    assert script.seen[0] == script.seen[1]


def test_a_tool_that_means_repeats_sends_the_same_call_twice_in_one_run(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    script = Script([("mail_twice", BOB, "c1"), ("mail_twice", BOB, "c2")])
    run(kernel, script)
    assert ledger.count(kind="plain") == 2


def test_a_call_made_again_in_a_later_turn_after_a_restart_is_a_new_call(
    sqlite_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    def turn(history: list[Any], call_id: str) -> list[Any]:
        k = Kernel(sqlite_url, notifiers=[])  # a new process's kernel and tools
        register_test_tools(k, provider.url)
        try:
            prompt = [*history, {"role": "user", "content": "email bob"}]
            return list(run(k, Script([("test_email", BOB, call_id)]), prompt).to_input_list())
        finally:
            k.close()

    history = turn([], "c1")
    turn(history, "c2")
    assert ledger.count(kind="plain") == 2


def test_a_bad_scope_is_refused_when_the_tools_are_made(kernel: Kernel) -> None:
    with pytest.raises(PoimenError, match="scope"):
        poimen_tools(kernel, scope="")


# A real agent process, SIGKILLed after its email went out, then run again.

@KILL_TIMEOUT
def test_an_agent_killed_after_the_effect_and_run_again_sends_one_email(
    run_agent: RunAgent, ledger: ProviderClient
) -> None:
    assert run_agent("openai-agents", "call_first", kill_after_effect=True) is None
    assert ledger.count(kind="plain") == 1
    # The restarted run asks the model again, which mints a new call id.
    report = run_agent("openai-agents", "call_second")
    assert report is not None and ledger.count(kind="plain") == 1
    [seen] = report["seen"]
    assert seen.startswith("The outcome of this action is unknown") and "Do NOT call it again" in seen


@KILL_TIMEOUT
def test_without_the_rule_the_same_kill_sends_two_emails(
    run_agent: RunAgent, ledger: ProviderClient
) -> None:
    # The baseline: the model's call id as the call id.
    run_agent("openai-agents", "call_first", kill_after_effect=True, naive=True)
    run_agent("openai-agents", "call_second", naive=True)
    assert ledger.count(kind="plain") == 2


# Approvals through the SDK's needs_approval and RunState interruptions.

def test_an_approval_interrupts_the_run_and_the_decision_resumes_it_once(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    from agents import RunState

    from poimen.integrations.openai_agents import decide

    script = Script([("mail_gated", BOB, "c1")])
    agent = Agent(name="mailer", model=script.model(),
                  tools=list(poimen_tools(kernel, scope="s-1")))
    first = asyncio.run(Runner.run(agent, "email bob"))
    [item] = first.interruptions
    assert ledger.count() == 0
    saved = first.to_state().to_string()  # the application keeps the pre-approval state

    async def resume(decision: str, **kw: Any) -> Any:
        state = await RunState.from_string(agent, saved)
        [pending] = state.get_interruptions()
        await decide(kernel, state, pending, scope="s-1", decision=decision, operator="ann",
                     reason="checked", **kw)
        return await Runner.run(agent, state)

    done = asyncio.run(resume("approve"))
    assert done.final_output == "done" and ledger.count() == 1
    call_id = call_ids.derived("s-1", "mail.gated", BOB, 1)
    assert isinstance(kernel.outcome(call_id), Completed)
    # The stale pre-approval state resumed again: no second email.
    asyncio.run(resume("approve"))
    assert ledger.count() == 1
    assert item.tool_name == "mail_gated"


def test_an_edit_sends_the_edited_call_and_a_rejection_sends_nothing(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    from poimen.integrations.openai_agents import decide

    eve = {"to": "eve@example.com", "subject": "hello"}
    for n, (decision, extra) in enumerate((("edit", {"args": eve}), ("reject", {}))):
        script = Script([("mail_gated", BOB, f"c{n}")])
        scope = f"s-{n}"
        agent = Agent(name="mailer", model=script.model(),
                      tools=list(poimen_tools(kernel, scope=scope)))
        first = asyncio.run(Runner.run(agent, "email bob"))
        state = first.to_state()
        [item] = state.get_interruptions()
        asyncio.run(decide(kernel, state, item, scope=scope, decision=decision, operator="ann",
                           reason="eve, not bob", **extra))
        asyncio.run(Runner.run(agent, state))
    assert [e["body"]["to"] for e in ledger.entries(kind="plain")] == ["eve@example.com"]
    assert any("rejected by ann" in s for s in script.seen)


def approval_run(kernel: Kernel, script: Script, scope: str = "s-1") -> tuple[Agent[Any], Any]:
    agent = Agent(name="mailer", model=script.model(),
                  tools=list(poimen_tools(kernel, scope=scope)))
    return agent, asyncio.run(Runner.run(agent, "email bob"))


def decided(kernel: Kernel, agent: Agent[Any], result: Any, operator: str, decision: str = "approve",
            **kw: Any) -> Any:
    """`operator` decides the run's one interruption; the run resumes."""
    from poimen.integrations.openai_agents import decide

    state = result.to_state()
    [item] = state.get_interruptions()
    asyncio.run(decide(kernel, state, item, scope="s-1", decision=decision, operator=operator,
                       reason="checked", **kw))
    return asyncio.run(Runner.run(agent, state))


def test_four_eyes_interrupts_again_until_two_distinct_operators_approved(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    from poimen.errors import SameApproverError

    script = Script([("mail_four_eyes", BOB, "c1")])
    agent, first = approval_run(kernel, script)
    second = decided(kernel, agent, first, "ann")
    # One more operator: the run stops again on the same call, nothing sent, nothing told.
    [item] = second.interruptions
    assert item.raw_item.call_id == "c1" and ledger.count() == 0 and script.seen == []
    with pytest.raises(SameApproverError):
        decided(kernel, agent, second, "ann")
    done = decided(kernel, agent, second, "bob")
    assert done.final_output == "done" and ledger.count() == 1
    call_id = call_ids.derived("s-1", "mail.four_eyes", BOB, 1)
    assert isinstance(kernel.outcome(call_id), Completed)


def test_four_eyes_with_an_edit_has_the_second_operator_approve_the_edited_call(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    eve = {"to": "eve@example.com", "subject": "hello"}
    script = Script([("mail_four_eyes", BOB, "c1")])
    agent, first = approval_run(kernel, script)
    second = decided(kernel, agent, first, "ann", "edit", args=eve)
    assert len(second.interruptions) == 1 and ledger.count() == 0
    done = decided(kernel, agent, second, "bob")
    assert done.final_output == "done"
    assert [e["body"]["to"] for e in ledger.entries(kind="plain")] == ["eve@example.com"]
    call_id = call_ids.derived("s-1", "mail.four_eyes", BOB, 1)
    [approved] = [e for e in kernel.store.events(kernel.outcome(call_id).intent_id)  # type: ignore[union-attr]
                  if e.kind == "approved"]
    assert approved.actor == "bob"


def test_a_stale_state_resumed_with_another_decision_is_told_what_the_log_holds(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    script = Script([("mail_gated", BOB, "c1")])
    agent, first = approval_run(kernel, script)
    saved = first.to_state().to_string()
    decided(kernel, agent, first, "ann")
    from agents import RunState

    from poimen.integrations.openai_agents import decide

    async def late() -> Any:
        state = await RunState.from_string(agent, saved)
        [item] = state.get_interruptions()
        await decide(kernel, state, item, scope="s-1", decision="reject", operator="bob",
                     reason="too late")
        return await Runner.run(agent, state)

    result = asyncio.run(late())
    assert ledger.count() == 1
    [sent] = script.seen
    [told] = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert told.output == sent and "entry_id" in sent
    assert told.raw_item["output"] == sent


@pytest.mark.parametrize("gated", [False, True])
def test_a_call_still_pending_ends_the_run_with_an_interruption_and_resumes_once(
    sqlite_url: str, provider: ProviderProcess, ledger: ProviderClient, gated: bool
) -> None:
    # The identical call is in flight in another thread (its owner alive; `gated`: approved
    # first): the model's call is still Pending after `pending_wait`, so the run ends with an
    # interruption that is no approval (`decide` refuses it); resumed once the first
    # settled, it gets its result. One email.
    from agents import RunState

    from poimen.integrations.openai_agents import decide, resume_pending

    release = threading.Event()
    with slow_kernel(sqlite_url, provider.url, release, gated=gated) as k:
        first_id = call_ids.derived("s-1", SLOW, BOB, 1) + "-first"
        if gated:
            asked = k.call(SLOW, BOB, call_id=first_id, scope="s-1")
            k.approve(asked.intent_id, operator="ann", reason="checked")
        first = in_flight(k, BOB, first_id, "s-1")
        script = Script([("mail_slow", BOB, "c1")])
        agent = Agent(name="mailer", model=script.model(),
                      tools=list(poimen_tools(k, scope="s-1", pending_wait=0.2)))
        try:
            ended = asyncio.run(Runner.run(agent, "email bob"))
            [item] = ended.interruptions
            assert item.tool_name == "mail_slow" and script.seen == []
            assert ledger.count(kind="plain") == 0
            saved = ended.to_state().to_string()

            async def approve() -> None:
                state = await RunState.from_string(agent, saved)
                await decide(k, state, item, scope="s-1", decision="approve",
                             operator="ann", reason="checked")

            with pytest.raises(NotAwaitingApprovalError, match="Pending call"):
                asyncio.run(approve())
        finally:
            release.set()
            first.join(60)

        async def resumed() -> Any:
            state = await RunState.from_string(agent, saved)
            assert await resume_pending(k, state, scope="s-1", timeout=30) == []
            return await Runner.run(agent, state)

        assert asyncio.run(resumed()).final_output == "done"
        [seen] = script.seen
        done = k.outcome(first_id)
        assert isinstance(done, Completed) and json.loads(seen) == done.result
    assert ledger.count(kind="plain") == 1
