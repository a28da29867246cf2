"""A poimen tool as a Temporal activity, and a workflow that waits for an operator's decision.

    python examples/temporal_activity.py                       # offline: no server
    python examples/temporal_activity.py --server localhost:7233  # with a Temporal server

Offline, the activities run in `temporalio.testing.ActivityEnvironment` with the ids a server
gives each attempt: attempt 1's connection breaks after the email went out (Indeterminate: a
non-retryable error), attempt 2 (what a server runs when a worker died mid-attempt) finds the
call in poimen's log and sends nothing, and `poimen.outcome` answers once an operator decided. With `--server`, a worker runs the `Notify` workflow below for real
(docs/integrations/temporal.md). poimen.testing's provider process stands in for the email
service.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.testing import ActivityEnvironment
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():  # a worker's sandbox re-imports this module
    from poimen import Caps, Kernel, ToolContext, Unsafe
    from poimen.integrations.temporal import outcome_activity, temporal_activity
    from poimen.testing import ProviderClient, ProviderProcess


async def with_server(address: str, kernel: Kernel) -> None:
    client = await Client.connect(address)
    send_email = temporal_activity(kernel, "send_email")     # an async activity named "send_email"
    worker = Worker(client, task_queue="mail", workflows=[Notify],
                    activities=[send_email, outcome_activity(kernel)])
    async with worker:
        result = await client.execute_workflow(Notify.run, "bob@example.com",
                                               id=f"notify-{uuid.uuid4()}", task_queue="mail")
        print(f"Notify: {result}")


@workflow.defn
class Notify:
    @workflow.run
    async def run(self, to: str) -> Any:
        try:
            # in the workflow: the tool's arguments as one dict
            return await workflow.execute_activity("send_email", {"to": to, "subject": "Your invoice"},
                                                   start_to_close_timeout=timedelta(seconds=30))
        except ActivityError as e:
            if isinstance(e.cause, ApplicationError) and e.cause.type == "PoimenOutcomeUnknown":
                result = await workflow.execute_activity(
                    "poimen.outcome", e.cause.details[0]["call_id"],
                    start_to_close_timeout=timedelta(seconds=10),
                    retry_policy=RetryPolicy(maximum_interval=timedelta(minutes=5)))
                return result
            raise


def make_kernel(tmp: Path, mail_url: str) -> Kernel:
    kernel = Kernel(f"sqlite:///{tmp / 'worker.db'}", notifiers=[])

    @kernel.tool(id="send_email", effects=Unsafe(), caps=Caps(hosts=("127.0.0.1",)), timeout=10)
    def send_email(ctx: ToolContext, to: str, subject: str) -> dict[str, Any]:
        """Send an email. Not idempotent: sending twice sends two emails."""
        ctx.http.post(f"{mail_url}/plain", json={"to": to, "subject": subject})
        if to.startswith("lost"):
            raise ConnectionResetError("the connection broke before the answer")
        return {"sent": True, "to": to}

    return kernel


async def offline(kernel: Kernel, mail_url: str) -> None:
    """The activities' attempts as a server would run them: the same ids, attempt 1 then 2."""
    env = ActivityEnvironment()
    args = {"to": "lost@example.com", "subject": "Your invoice"}
    for attempt in (1, 2):
        env.info = dataclasses.replace(env.info, workflow_id="notify-1", workflow_run_id="run-1",
                                       activity_id="1", attempt=attempt, activity_type="send_email")
        try:
            await env.run(temporal_activity(kernel, "send_email"), args)
        except ApplicationError as e:
            call_id = e.details[0]["call_id"]
            print(f"attempt {attempt}: {e.type}, non-retryable, call id {call_id}; "
                  f"emails sent: {ProviderClient(mail_url).count()}")
    try:
        await env.run(outcome_activity(kernel), call_id)
    except ApplicationError as e:
        print(f"poimen.outcome before a decision: {e.type} (retryable: the workflow polls)")
    outcome = kernel.outcome(call_id)
    assert outcome is not None
    await kernel.aresolve(outcome.intent_id, landed=True, result={"sent": True}, operator="ann",
                          reason="the email is in the provider's log")
    print(f"poimen.outcome after the operator's decision: {await env.run(outcome_activity(kernel), call_id)}")


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", help="a Temporal server's address, e.g. localhost:7233")
    ns = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ProviderProcess(Path(tmp) / "ledger.db") as mail, \
            make_kernel(Path(tmp), mail.url) as kernel:
        kernel.launch()
        await (with_server(ns.server, kernel) if ns.server else offline(kernel, mail.url))


if __name__ == "__main__":
    asyncio.run(main())
