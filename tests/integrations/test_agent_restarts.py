"""What models and applications do between runs, with real agent processes SIGKILLed and a
provider process counting effects in its own ledger (issue 22): a restart that asks the model
again, which mints new tool-call ids; a model asking again after a Pending answer; a Pending
call that ends inside the run. One effect each, never a second."""

from __future__ import annotations

import time
from typing import Any

import pytest

from poimen import Completed, Indeterminate, Kernel, call_ids
from poimen.testing import SHIP, ProviderClient
from tests.integrations.conftest import KILL_TIMEOUT, RunAgent

SHIP_ARGS = {"order_id": "o-1", "address": "x"}
NO_RESULT = ("This action is still in progress", "The outcome of this action is unknown")


@KILL_TIMEOUT
def test_a_langgraph_restart_with_inputs_asks_the_model_again_and_sends_one_email(
    run_agent: RunAgent, ledger: ProviderClient
) -> None:
    assert run_agent("langgraph", "call_first", kill_after_effect=True) is None
    assert ledger.count() == 1
    # invoke(inputs, config) instead of invoke(None, config): the model is asked again and
    # mints call_second for the same email, while the first is unsettled in the thread.
    report = run_agent("langgraph", "call_second")
    assert report is not None and report["output"] == "done"
    assert ledger.count() == 1
    [seen] = report["seen"]
    assert seen.startswith("The outcome of this action is unknown")


# (The Agents SDK's run ends with an interruption instead: the test after the LangGraph one.)
@KILL_TIMEOUT
@pytest.mark.parametrize("framework", ["pydantic-ai"])
def test_a_model_asking_again_after_pending_is_the_same_call(
    framework: str, run_agent: RunAgent, ledger: ProviderClient, sqlite_url: str,
    provider: Any,
) -> None:
    # Killed before the request left: the restarted run finds the call Pending (its deadline
    # not passed, or the provider's lookup unavailable), is told so (no wait here), and the
    # model asks again. The Pending answer is no result: the re-ask is the same call, and the
    # request lands once when it settles.
    assert run_agent(framework, "call_first", kill_at="mid_call", tool="ship") is None
    assert ledger.count() == 0
    ledger.set_lookup_mode("error")  # Pending however long the restart takes to start
    report = run_agent(framework, "call_second", tool="ship", reask=True, pending_wait=0,
                       wait_bound=0.1)
    ledger.set_lookup_mode("truthful")
    assert report is not None
    first, again = report["seen"]
    assert first.startswith(NO_RESULT) and again.startswith(NO_RESULT)
    call_id = call_ids.derived("conv-1", SHIP, SHIP_ARGS, 1)
    from poimen.testing import register_test_tools

    with Kernel(sqlite_url, notifiers=[], worker_id="later") as k:
        register_test_tools(k, provider.url)
        assert isinstance(k.wait_sync(call_id, timeout=120), Completed)
        assert [i.call_id for i in k.store.list_intents()] == [call_id]
    assert ledger.count() == 1


@KILL_TIMEOUT
def test_a_langgraph_restart_while_the_call_is_pending_interrupts_and_resumes_once(
    run_agent: RunAgent, ledger: ProviderClient
) -> None:
    assert run_agent("langgraph", "call_first", kill_at="mid_call", tool="ship") is None
    # Asked again (a new id), the call is the unsettled one: Pending, so the thread stops on
    # LangGraph's interrupt and is resumed once the call has settled.
    ledger.set_lookup_mode("error")  # Pending however long the restart takes to start
    report = run_agent("langgraph", "call_second", tool="ship", pending_wait=0, wait_bound=0.1,
                       lookup_back=True)  # once interrupted, the provider's lookup is back
    assert report is not None and report["output"] == "done"
    assert report["seen"][0].startswith("interrupt:")
    assert '"status"' in report["seen"][-1] or "request_id" in report["seen"][-1]
    assert ledger.count() == 1


@KILL_TIMEOUT
def test_an_agents_sdk_restart_while_the_call_is_pending_interrupts_and_resumes_once(
    run_agent: RunAgent, ledger: ProviderClient
) -> None:
    # Killed before the request left; restarted, the model asks again (a new id) for the
    # call still Pending past `pending_wait`: `needs_approval` ends the run with an
    # interruption, and the state resumed once the call has settled gets its one effect.
    assert run_agent("openai-agents", "call_first", kill_at="mid_call", tool="ship") is None
    assert ledger.count() == 0
    ledger.set_lookup_mode("error")  # Pending however long the restart takes to start
    report = run_agent("openai-agents", "call_second", tool="ship", pending_wait=0,
                       wait_bound=0.1, lookup_back=True)
    assert report is not None and report["output"] == "done"
    assert report["seen"][0] == "interrupt: Pending"
    [result] = report["seen"][1:]
    assert '"status"' in result or "request_id" in result
    assert ledger.count() == 1


@KILL_TIMEOUT
@pytest.mark.parametrize("framework", ["pydantic-ai", "openai-agents", "langgraph"])
def test_a_pending_call_ends_inside_the_run(
    framework: str, run_agent: RunAgent, ledger: ProviderClient
) -> None:
    # The integration waits for the Pending call (its deadline, the lookup, the retry): the
    # model gets its result in the same run. (A LangGraph thread is resumed from its
    # checkpoint: restarted with inputs, see the test below.)
    assert run_agent(framework, "call_first", kill_at="mid_call", tool="ship") is None
    report = run_agent(framework, "call_second", tool="ship", pending_wait=60,
                       resume=framework == "langgraph")
    assert report is not None and report["output"] == "done"
    assert not any(s.startswith(NO_RESULT) or s.startswith("interrupt") for s in report["seen"])
    assert ledger.count() == 1


@KILL_TIMEOUT
def test_a_langgraph_restart_with_inputs_after_recovery_settled_the_call_ships_once(
    run_agent: RunAgent, ledger: ProviderClient, sqlite_url: str, provider: Any
) -> None:
    # Killed before the request left; another process's recovery lands the Queryable call
    # (its caller, dead, never got the answer); the thread restarted with inputs asks the
    # model again, which mints a new tool-call id for the same shipment: it takes the
    # answer recovery recorded, and the shipment is not sent again.
    assert run_agent("langgraph", "call_first", kill_at="mid_call", tool="ship") is None
    first = call_ids.framework_id("conv-1", "call_first")
    recovered(sqlite_url, provider.url, first)
    assert ledger.count() == 1
    report = run_agent("langgraph", "call_second", tool="ship")
    assert report is not None and report["output"] == "done"
    assert ledger.count() == 1
    assert '"status"' in report["seen"][-1] or "request_id" in report["seen"][-1]


def recovered(db: str, provider: str, call_id: str) -> None:
    """Recovery passes of another process until the call is settled. Nobody asks for it
    by call id (`outcome` and `wait` give its answer to a caller): its answer is owed."""
    from poimen.testing import register_test_tools

    with Kernel(db, notifiers=[], worker_id="recovery") as k:
        register_test_tools(k, provider)
        end = time.monotonic() + 120
        while (it := k.store.get_by_call_id(call_id)) is None or it.state != "COMPLETED":
            assert time.monotonic() < end, it
            k.recover()
            time.sleep(0.05)


# A LangGraph thread asking for an approval through interrupt (its tool's own, or LangChain's
# HITL middleware), its process killed after the decision was applied (before the call ran) or
# after the email went out, then resumed from its checkpoint taken before the approval,
# decision and all.

@KILL_TIMEOUT
@pytest.mark.parametrize("kill_at", ["after_approval", "after_effect"])
@pytest.mark.parametrize("framework", ["langgraph", "langchain"])
def test_a_thread_killed_after_its_approval_and_resumed_from_the_stale_state_sends_once(
    framework: str, kill_at: str, run_agent: RunAgent, ledger: ProviderClient, sqlite_url: str
) -> None:
    asked = run_agent(framework, "call_1", tool="gated")
    assert asked is not None and asked["seen"] == ["interrupt: awaiting_approval"]
    assert ledger.count() == 0
    assert run_agent(framework, "call_1", tool="gated", resume=True, decide="approve",
                     kill_at=kill_at) is None
    assert ledger.count() == (1 if kill_at == "after_effect" else 0)
    report = run_agent(framework, "call_1", tool="gated", resume=True, decide="approve")
    assert report is not None and report["output"] == "done"
    assert ledger.count() == 1
    with Kernel(sqlite_url, notifiers=[], worker_id="later") as k:
        out = k.outcome(call_ids.framework_id("conv-1", "call_1"))
    if kill_at == "after_effect":  # Unsafe, its process died after sending: an operator decides
        assert report["seen"][-1].startswith("The outcome of this action is unknown")
    else:
        assert isinstance(out, Completed)


# The same through PydanticAI's deferred tools and the Agents SDK's RunState: the run that
# asked for the approval saved its state; a later process resumed it with the decision and
# was killed; the saved pre-approval state resumed again, decision and all.

@KILL_TIMEOUT
@pytest.mark.parametrize("kill_at", ["after_approval", "after_effect"])
@pytest.mark.parametrize("framework", ["pydantic-ai", "openai-agents"])
def test_a_run_killed_after_its_approval_and_resumed_from_the_stale_state_sends_once(
    framework: str, kill_at: str, run_agent: RunAgent, ledger: ProviderClient, sqlite_url: str
) -> None:
    asked = run_agent(framework, "call_1", tool="gated")
    assert asked is not None and asked["output"].startswith("approval: ")
    assert ledger.count() == 0
    assert run_agent(framework, "call_1", tool="gated", decide="approve", kill_at=kill_at) is None
    assert ledger.count() == (1 if kill_at == "after_effect" else 0)
    report = run_agent(framework, "call_1", tool="gated", decide="approve")
    assert report is not None and report["output"] == "done"
    assert ledger.count() == 1
    call_id = call_ids.derived("conv-1", "mail.gated", {"to": "bob@example.com",
                                                        "subject": "hello"}, 1)
    with Kernel(sqlite_url, notifiers=[], worker_id="later") as k:
        out = k.outcome(call_id)
    if kill_at == "after_effect":  # Unsafe, its process died after sending: an operator decides
        assert isinstance(out, Indeterminate) and report["seen"][-1] == out.for_model()
    else:
        assert isinstance(out, Completed)
