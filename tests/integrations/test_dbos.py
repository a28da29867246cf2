"""poimen under DBOS on SQLite: real DBOS processes (tests/integrations/dbos_runner.py), one
of them SIGKILLed inside the email step after the email went out, then relaunched so DBOS
recovers the workflow and runs the step again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from poimen import Indeterminate, Kernel
from poimen.testing import ProviderClient, ProviderProcess, kill_at_pause

ROOT = Path(__file__).resolve().parents[2]


class App:
    """The DBOS application's files, and how to start it."""

    def __init__(self, tmp_path: Path, provider_url: str) -> None:
        self.tmp_path = tmp_path
        self.db = f"sqlite:///{tmp_path / 'intents.db'}"
        self.base = [sys.executable, "-m", "tests.integrations.dbos_runner"]
        self.opts = ["--system-db", str(tmp_path / "dbos.sqlite"), "--db", self.db,
                     "--provider", provider_url]

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", **extra}

    def run(self, command: str, workflow: str, *args: str) -> dict[str, Any]:
        done = subprocess.run([*self.base, command, *self.opts, "--workflow", workflow, *args],
                              env=self.env({}), cwd=ROOT, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, done.stderr
        out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return out

    def killed_after_effect(self, workflow: str, *args: str, point: str = "after_effect"
                            ) -> None:
        marker = self.tmp_path / f"paused-{workflow}"
        proc = subprocess.Popen(
            [*self.base, "start", *self.opts, "--workflow", workflow, *args],
            env=self.env({"POIMEN_PAUSE_AT": point, "POIMEN_PAUSE_FILE": str(marker)}),
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert kill_at_pause(proc, marker, timeout=120) == point

    def running(self, command: str, workflow: str, *args: str,
                env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*self.base, command, *self.opts, "--workflow", workflow, *args],
            env=self.env(env or {}), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)

    def send(self, call_id: str, decision: str, operator: str = "ann", **extra: Any) -> None:
        """An approver's decision, sent from this process through a `DBOSClient`."""
        from dbos import DBOSClient

        from poimen.integrations.dbos import send_decision

        client = DBOSClient(system_database_url=f"sqlite:///{self.tmp_path / 'dbos.sqlite'}")
        try:
            send_decision(call_id, {"decision": decision, "operator": operator,
                                    "reason": "checked", **extra}, client=client)
        finally:
            client.destroy()


def asked(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """What the workflow asked of the approvers (its first line)."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, proc.communicate(timeout=60)[1]
    out: dict[str, Any] = json.loads(line)["asked"]
    return out


def finished(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    last: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return last


@pytest.fixture
def app(tmp_path: Path, provider: ProviderProcess) -> App:
    return App(tmp_path, provider.url)


def sent_to(ledger: ProviderClient, to: str) -> int:
    return sum(1 for e in ledger.entries(kind="plain") if e["body"].get("to") == to)


def test_a_step_returns_the_tools_result_under_the_workflow_and_step_id(
    app: App, ledger: ProviderClient
) -> None:
    out = app.run("start", "wf-ok")
    assert "entry_id" in out["result"]
    assert sent_to(ledger, "wf-ok@example.com") == 1
    with Kernel(app.db, notifiers=[], worker_id="test") as k:
        recorded = k.outcome("dbos/wf-ok/1")
        assert recorded is not None and recorded.result == out["result"]  # type: ignore[union-attr]


def test_an_unknown_outcome_raises_with_the_intent_and_dbos_does_not_retry_it(
    app: App, ledger: ProviderClient
) -> None:
    out = app.run("start", "wf-flaky", "--tool", "flaky")
    assert out["error"] == "OutcomeUnknownError"
    assert out["outcome"] == "indeterminate" and out["call_id"] == "dbos/wf-flaky/1"
    assert out["intent_id"] in out["message"] and "Do not retry it" in out["message"]
    # DBOS recorded the step's error: relaunching runs nothing again.
    again = app.run("recover", "wf-flaky")
    assert again["error"] == "OutcomeUnknownError" and again["intent_id"] == out["intent_id"]
    assert sent_to(ledger, "wf-flaky@example.com") == 1


def test_dbos_alone_sends_a_second_email_after_a_kill_in_the_step(
    app: App, ledger: ProviderClient
) -> None:
    app.killed_after_effect("wf-plain", "--mode", "plain")
    assert sent_to(ledger, "wf-plain@example.com") == 1
    out = app.run("recover", "wf-plain", "--mode", "plain")
    assert "entry_id" in out["result"]
    assert sent_to(ledger, "wf-plain@example.com") == 2  # the baseline: DBOS re-ran the step


def test_with_poimen_the_recovered_step_sends_nothing_and_tells_the_workflow_not_to_retry(
    app: App, ledger: ProviderClient
) -> None:
    app.killed_after_effect("wf-kill")
    assert sent_to(ledger, "wf-kill@example.com") == 1
    out = app.run("recover", "wf-kill")
    assert sent_to(ledger, "wf-kill@example.com") == 1
    assert out["error"] == "OutcomeUnknownError" and out["call_id"] == "dbos/wf-kill/1"
    with Kernel(app.db, notifiers=[], worker_id="operator") as k:
        assert k.outcome(out["call_id"]) == Indeterminate(out["intent_id"], out["reason"])
        # The operator checks the mailbox, finds the email, and says so.
        k.resolve(out["intent_id"], landed=True, result={"checked": "in the outbox"},
                  operator="ops@example.com", reason="found in the provider's outbox")
    resumed = app.run("resume", "wf-kill-resume", "--call-id", out["call_id"])
    assert resumed == {"result": {"checked": "in the outbox"}}
    assert sent_to(ledger, "wf-kill@example.com") == 1


def test_a_step_outside_a_workflow_has_no_call_id_and_records_nothing() -> None:
    from poimen.errors import PoimenError
    from poimen.integrations.dbos import step_call_id

    with pytest.raises(PoimenError, match="only inside a DBOS workflow"):
        step_call_id()


@pytest.mark.timeout(600)
def test_a_workflow_asking_again_after_pending_makes_one_shipment(
    app: App, ledger: ProviderClient
) -> None:
    # Killed inside the step before the request left; recovered while the provider's lookup
    # is down, the step's outcome is unknown (Pending) and the workflow asks again: another
    # step, another call id, the same call. Then it waits, and the shipment is made once.
    app.killed_after_effect("wf-reask", "--tool", "ship", point="mid_call")
    assert ledger.count() == 0
    ledger.set_lookup_mode("error")
    proc = app.running("recover", "wf-reask")
    assert proc.stdout is not None
    answers = [json.loads(proc.stdout.readline())["answer"] for _ in range(2)]
    ledger.set_lookup_mode("truthful")  # the provider is back: the wait ends
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert [a["outcome"] for a in answers] == ["pending", "pending"]
    assert [a["call_id"] for a in answers] == ["dbos/wf-reask/1", "dbos/wf-reask/2"]
    assert answers[0]["intent_id"] == answers[1]["intent_id"]
    result = json.loads(out.strip().splitlines()[-1])["result"]
    assert "request_id" in result and ledger.count() == 1


# Approvals through DBOS messages: the workflow receives the approvers' decisions.

@pytest.mark.timeout(600)
@pytest.mark.parametrize(("decision", "extra", "sent"), [
    ("approve", {}, ["wf-a@example.com"]),
    ("edit", {"args": {"to": "eve@example.com", "subject": "invoice"}}, ["eve@example.com"]),
    ("reject", {}, []),
])
def test_a_workflow_waits_for_the_approvers_decision_sent_as_a_dbos_message(
    decision: str, extra: dict[str, Any], sent: list[str], app: App, ledger: ProviderClient
) -> None:
    proc = app.running("start", "wf-a", "--tool", "gated")
    call = asked(proc)
    assert call["reason"] == "awaiting_approval" and call["call_id"] == "dbos/wf-a/1"
    assert ledger.count() == 0
    app.send(call["call_id"], decision, **extra)
    out = finished(proc)
    assert [e["body"]["to"] for e in ledger.entries(kind="plain")] == sent
    if decision == "reject":
        assert "result" not in out and "rejected by ann" in out["message"]
    else:
        assert "entry_id" in out["result"]
    with Kernel(app.db, notifiers=[], worker_id="test") as k:
        [event] = [e for e in k.store.events(call["intent_id"])
                   if e.kind in ("approved", "edited", "rejected")]
        assert event.actor == "ann"


@pytest.mark.timeout(600)
def test_four_eyes_through_dbos_messages_needs_two_distinct_operators(
    app: App, ledger: ProviderClient
) -> None:
    proc = app.running("start", "wf-4", "--tool", "four")
    call = asked(proc)
    app.send(call["call_id"], "approve", "ann")
    app.send(call["call_id"], "approve", "ann")  # does not count: the workflow waits on
    app.send(call["call_id"], "approve", "bob")
    assert "entry_id" in finished(proc)["result"] and ledger.count() == 1
    with Kernel(app.db, notifiers=[], worker_id="test") as k:
        [approved] = [e for e in k.store.events(call["intent_id"]) if e.kind == "approved"]
        assert json.loads(approved.detail or "{}")["approved_by"] == ["ann", "bob"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kill_at", ["after_approval", "after_effect"])
def test_a_workflow_killed_after_the_approval_is_recovered_without_a_second_email(
    kill_at: str, app: App, ledger: ProviderClient
) -> None:
    marker = app.tmp_path / "paused"
    proc = app.running("start", "wf-k", "--tool", "gated",
                       env={"POIMEN_PAUSE_AT": kill_at, "POIMEN_PAUSE_FILE": str(marker)})
    call = asked(proc)
    app.send(call["call_id"], "approve")
    assert kill_at_pause(proc, marker, timeout=120) == kill_at
    assert ledger.count() == (1 if kill_at == "after_effect" else 0)
    # DBOS recovers the workflow: the decision it received is recorded, and is applied once.
    out = app.run("recover", "wf-k")
    assert ledger.count() == 1
    if kill_at == "after_effect":  # Unsafe, its process died after sending: an operator decides
        assert out["error"] == "OutcomeUnknownError" and out["outcome"] == "indeterminate"
    else:
        assert "entry_id" in out["result"]
