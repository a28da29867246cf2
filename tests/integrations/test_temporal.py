"""poimen under Temporal: activities run in `temporalio.testing.ActivityEnvironment` with the
ids a Temporal server gives each attempt, and an attempt's process SIGKILLed after the email
went out, then the next attempt run as the server would run it (no server runs here)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from poimen import Caps, Completed, Indeterminate, Kernel, ToolContext, Unsafe
from poimen.errors import DefiniteFailure
from poimen.integrations.temporal import (
    FAILED,
    NOT_DECIDED,
    UNKNOWN,
    outcome_activity,
    temporal_activity,
)
from poimen.testing import (
    EMAIL,
    ProviderClient,
    ProviderProcess,
    kill_at_pause,
    register_test_tools,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def kernel(tmp_path: Path, provider: ProviderProcess) -> Iterator[Kernel]:
    k = Kernel(f"sqlite:///{tmp_path / 'intents.db'}", notifiers=[])
    register_test_tools(k, provider.url)

    @k.tool(id="flaky", effects=Unsafe(), caps=Caps(), timeout=5)
    def flaky(ctx: ToolContext, to: str, subject: str) -> None:
        raise ConnectionResetError("the link dropped before the answer")

    @k.tool(id="refused", effects=Unsafe(), caps=Caps(), timeout=5)
    def refused(ctx: ToolContext, to: str, subject: str) -> None:
        raise DefiniteFailure("no such mailbox")

    try:
        yield k
    finally:
        k.close()


def attempt(kernel: Kernel, tool: str, args: dict[str, Any], *, workflow: str = "wf-1",
            run: str = "run-1", activity_id: str = "1", number: int = 1) -> Any:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id=workflow, workflow_run_id=run,
                                   activity_id=activity_id, attempt=number, activity_type=tool)
    return asyncio.run(env.run(temporal_activity(kernel, tool), args))


def sent_to(ledger: ProviderClient, to: str) -> int:
    return sum(1 for e in ledger.entries(kind="plain") if e["body"].get("to") == to)


ARGS = {"to": "t@example.com", "subject": "invoice"}


def test_an_activity_returns_the_result_and_a_retry_answers_from_the_log(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    first = attempt(kernel, EMAIL, ARGS)
    assert "entry_id" in first
    assert kernel.outcome("temporal/wf-1/run-1/1") == Completed(
        kernel.outcome("temporal/wf-1/run-1/1").intent_id, first)  # type: ignore[union-attr]
    # Temporal retries an attempt whose answer it lost: the same ids, attempt 2.
    assert attempt(kernel, EMAIL, ARGS, number=2) == first
    assert sent_to(ledger, "t@example.com") == 1
    # A workflow continued as new is another run: its activity 1 is another call.
    attempt(kernel, EMAIL, ARGS, run="run-2")
    assert sent_to(ledger, "t@example.com") == 2


def test_an_unknown_outcome_is_a_non_retryable_error_with_the_intent(kernel: Kernel) -> None:
    with pytest.raises(ApplicationError) as err:
        attempt(kernel, "flaky", ARGS)
    out = kernel.outcome("temporal/wf-1/run-1/1")
    assert isinstance(out, Indeterminate)
    assert err.value.type == UNKNOWN and err.value.non_retryable
    details = err.value.details[0]
    assert details["intent_id"] == out.intent_id
    assert details["call_id"] == "temporal/wf-1/run-1/1"
    assert "Do not retry it" in err.value.message and out.intent_id in err.value.message


def test_a_failed_call_is_a_non_retryable_error(kernel: Kernel) -> None:
    with pytest.raises(ApplicationError) as err:
        attempt(kernel, "refused", ARGS)
    assert err.value.type == FAILED and err.value.non_retryable
    assert "no such mailbox" in err.value.message


def run_attempt(db: str, provider: str, number: int, env: dict[str, str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tests.integrations.temporal_runner", "--db", db,
           "--provider", provider, "--workflow-id", "wf-kill", "--run-id", "run-1",
           "--activity-id", "3", "--attempt", str(number), "--args",
           json.dumps({"to": "kill@example.com", "subject": "invoice"})]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", **env})


def test_an_attempt_killed_after_the_effect_is_not_sent_again_by_the_next_attempt(
    tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    db = f"sqlite:///{tmp_path / 'worker.db'}"
    marker = tmp_path / "paused"
    first = run_attempt(db, provider.url, 1, {"POIMEN_PAUSE_AT": "after_effect",
                                              "POIMEN_PAUSE_FILE": str(marker)})
    assert kill_at_pause(first, marker, timeout=120) == "after_effect"
    assert sent_to(ledger, "kill@example.com") == 1
    second = run_attempt(db, provider.url, 2, {})  # the server's retry, on a new worker
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    answer = json.loads(out.strip().splitlines()[-1])
    assert sent_to(ledger, "kill@example.com") == 1
    assert answer["error"] == UNKNOWN and answer["non_retryable"] is True
    details = answer["details"][0]
    assert details["call_id"] == "temporal/wf-kill/run-1/3"
    # After the operator decides, poimen.outcome answers the decision.
    with Kernel(db, notifiers=[], worker_id="operator") as k:
        env = ActivityEnvironment()
        with pytest.raises(ApplicationError) as pending:
            asyncio.run(env.run(outcome_activity(k), details["call_id"]))
        assert pending.value.type == NOT_DECIDED and not pending.value.non_retryable
        k.resolve(details["intent_id"], landed=True, result={"checked": "sent"},
                  operator="ops@example.com", reason="the provider shows one email")
        decided = asyncio.run(env.run(outcome_activity(k), details["call_id"]))
    assert decided == {"checked": "sent"}


def test_a_standalone_activity_is_named_by_its_run_and_one_without_ids_is_refused(
    kernel: Kernel, ledger: ProviderClient
) -> None:
    from poimen.errors import PoimenError
    from poimen.integrations.temporal import activity_call_id

    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id=None, workflow_run_id=None,
                                   activity_id="send-1", activity_run_id="ar-9")
    assert env.run(activity_call_id) == "temporal/activity/ar-9/send-1"
    env.info = dataclasses.replace(env.info, activity_run_id=None)
    with pytest.raises(PoimenError, match="nothing was recorded"):
        asyncio.run(env.run(temporal_activity(kernel, EMAIL), ARGS))
    assert sent_to(ledger, "t@example.com") == 0
