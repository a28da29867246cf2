"""Agents re-run in replay get the recorded answers and run no tool body; the intent diff of
two real runs of an agent shows exactly the step that changed."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from langgraph.checkpoint.sqlite import SqliteSaver
from pydantic_ai.messages import ToolReturnPart

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext, Unsafe, call_ids
from poimen.errors import DivergenceError
from poimen.integrations.langgraph import poimen_tools
from poimen.testing import ProviderClient, ProviderProcess
from tests.integrations.conftest import ROOT
from tests.integrations.fake_chat import build_graph
from tests.integrations.test_langgraph import Script as GraphScript
from tests.integrations.test_pydantic_ai import Script, agent, run

BOB = {"to": "bob@example.com", "subject": "Your order"}
EVE = {"to": "eve@example.com", "subject": "Your order"}
ORDER = {"order_id": "o-17", "amount_cents": 4200}


def make_kernel(url: str, provider_url: str, bodies: list[str], **mode: Any) -> Kernel:
    """An agent's kernel: an Unsafe email and an Idempotent charge against the provider;
    `bodies` gets the id of each tool whose body runs."""
    k = Kernel(url, notifiers=[], **mode)
    u = httpx.URL(provider_url)
    caps = Caps(hosts=(f"{u.host}:{u.port}",))

    @k.tool(id="send_email", effects=Unsafe(), caps=caps, timeout=10)
    def send_email(ctx: ToolContext, to: str, subject: str) -> dict[str, Any]:
        """Send an email."""
        bodies.append("send_email")
        return dict(httpx.post(f"{provider_url}/plain", json={"to": to, "subject": subject}).json())

    @k.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("order_id")), caps=caps,
            timeout=10)
    def charge(ctx: ToolContext, order_id: str, amount_cents: int) -> dict[str, Any]:
        """Charge an order."""
        bodies.append("charge")
        r = ctx.http.post(f"{provider_url}/keyed", json={"order": order_id, "cents": amount_cents})
        return dict(r.json())

    return k


def turns(email: dict[str, Any]) -> list[list[tuple[str, dict[str, Any], str]]]:
    """The agent: charge the order, then email the customer, one step per model turn."""
    return [[("charge", ORDER, "t1")], [("send_email", email, "t2")]]


class Steps(Script):
    """`Script` that asks for the next step after each tool result as well."""

    def __call__(self, messages: Any, info: Any) -> Any:
        from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart

        last = messages[-1]
        self.seen += [p for p in last.parts if isinstance(p, ToolReturnPart)]
        if self.turns:
            return ModelResponse(parts=[ToolCallPart(n, a, tool_call_id=i)
                                        for n, a, i in self.turns.pop(0)])
        return ModelResponse(parts=[TextPart("done")])


def live_run(url: str, provider_url: str, email: dict[str, Any]) -> list[Any]:
    bodies: list[str] = []
    with make_kernel(url, provider_url, bodies) as k:
        script = Steps(*turns(email))
        assert run(agent(k, script), "charge and email").output == "done"
    assert bodies == ["charge", "send_email"]
    return [p.content for p in script.seen]


@pytest.fixture
def logs(tmp_path: Path) -> tuple[str, str]:
    return f"sqlite:///{tmp_path / 'yesterday.db'}", f"sqlite:///{tmp_path / 'today.db'}"


def test_a_pydantic_ai_agent_replayed_gets_the_recorded_answers_and_runs_no_tool(
    store_url: str, logs: tuple[str, str], provider: ProviderProcess, ledger: ProviderClient
) -> None:
    yesterday, today = store_url, logs[1]  # the recording on either backend
    answers = live_run(yesterday, provider.url, BOB)
    witness = ledger.entries()
    assert len(witness) == 2

    bodies: list[str] = []
    with make_kernel(today, provider.url, bodies, mode="replay", recording=yesterday,
                     scope="conv-1/") as k:
        script = Steps(*turns(BOB))
        assert run(agent(k, script), "charge and email").output == "done"
        assert [p.content for p in script.seen] == answers
    assert bodies == [] and ledger.entries() == witness

    # A changed agent (another recipient) diverges at that step: refused by default...
    with make_kernel(f"{today}.2", provider.url, bodies, mode="replay", recording=yesterday,
                     scope="conv-1/") as k:
        with pytest.raises(DivergenceError) as err:
            run(agent(k, Steps(*turns(EVE))), "charge and email")
        assert err.value.data["kind"] == "not_in_recording"
        assert err.value.data["recorded_call_id"] == call_ids.derived("conv-1", "send_email", BOB)
    # ... or answered "not in the recording", so the run goes on and is reported.
    with make_kernel(f"{today}.3", provider.url, bodies, mode="replay", recording=yesterday,
                     scope="conv-1/", on_divergence="record") as k:
        script = Steps(*turns(EVE))
        assert run(agent(k, script), "charge and email").output == "done"
        charged, emailed = [p.content for p in script.seen]
        assert charged == answers[0] and "not carried out" in emailed
    assert bodies == [] and ledger.entries() == witness


def test_a_langgraph_agent_replayed_on_its_thread_gets_the_recorded_answers(
    tmp_path: Path, logs: tuple[str, str], provider: ProviderProcess, ledger: ProviderClient
) -> None:
    yesterday, today = logs
    config = {"configurable": {"thread_id": "th-1"}}
    calls = (("send_email", BOB, "c1"), ("charge", ORDER, "c2"))
    seen = []
    for n, (url, mode) in enumerate(((yesterday, {}), (today, {
            "mode": "replay", "recording": yesterday, "scope": "th-1/"}))):
        bodies: list[str] = []
        conn = sqlite3.connect(tmp_path / f"checkpoints-{n}.db", check_same_thread=False)
        try:
            with make_kernel(url, provider.url, bodies, **mode) as k:
                script = GraphScript(*calls)
                build_graph(script, poimen_tools(k), SqliteSaver(conn)).invoke(
                    {"messages": [("user", "email bob, charge")]}, config)
                seen.append([(m.content, m.artifact["call_id"]) for m in script.seen])
        finally:
            conn.close()
        assert sorted(bodies) == ([] if mode else ["charge", "send_email"])
        if not mode:
            witness = ledger.entries()
    assert seen[0] == seen[1] and [c for _, c in seen[1]] == ["th-1/c1", "th-1/c2"]
    assert ledger.entries() == witness


def poimen_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    return subprocess.run([sys.executable, "-m", "poimen.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_diff_of_two_real_runs_with_one_changed_step_shows_that_step(
    logs: tuple[str, str], provider: ProviderProcess, ledger: ProviderClient
) -> None:
    yesterday, today = logs
    live_run(yesterday, provider.url, BOB)
    live_run(today, provider.url, EVE)
    assert ledger.count(kind="plain") == 2  # both runs were real

    out = poimen_cli("diff", "--recording", yesterday, "--run", today, "--scope", "conv-1/",
                     "--json")
    assert out.returncode == 1, out.stderr  # they differ
    d = json.loads(out.stdout)
    assert d["counts"] == {"same": 1, "arguments_changed": 1, "tool_changed": 0,
                           "only_in_recording": 0, "only_in_run": 0}
    [step] = [e for e in d["entries"] if e["kind"] != "same"]
    assert (step["tool_id"], step["effect"]) == ("send_email", "unsafe")
    assert step["changes"] == [
        {"path": "/to", "recording": "bob@example.com", "run": "eve@example.com"}]
    assert step["recording"]["call_id"] == call_ids.derived("conv-1", "send_email", BOB)
    assert step["run"]["call_id"] == call_ids.derived("conv-1", "send_email", EVE)

    text = poimen_cli("diff", "--recording", yesterday, "--run", today)
    assert text.returncode == 1
    assert "1 arguments changed" in text.stdout
    assert '/to: "bob@example.com" -> "eve@example.com"' in text.stdout
    same = poimen_cli("diff", "--recording", yesterday, "--run", yesterday)
    assert same.returncode == 0 and "the run made the same calls" in same.stdout
    missing = poimen_cli("diff", "--recording", yesterday + ".nope", "--run", today)
    assert missing.returncode == 3 and "no intent log" in missing.stderr
