"""Temporal workflows sending one email (`Notify`) or asking again for a shipment whose
outcome is unknown (`ReAsk`) through poimen activities, and a worker process for them, for
the tests against a real Temporal dev server.

    python -m tests.integrations.temporal_app --address HOST:PORT --db URL --provider URL
        --task-queue Q

The worker runs until it is killed (or for ten minutes at most)."""

from __future__ import annotations

import argparse
import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from poimen.testing import EMAIL, SHIP


@workflow.defn
class Notify:
    @workflow.run
    async def run(self, to: str) -> dict[str, Any]:
        try:
            result = await workflow.execute_activity(
                EMAIL, {"to": to, "subject": "invoice"},
                start_to_close_timeout=timedelta(seconds=5),
                retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1),
                                         maximum_attempts=5),
            )
            return {"result": result}
        except ActivityError as e:
            return {"error": getattr(e.cause, "type", None),
                    "details": list(getattr(e.cause, "details", ()) or ())}


@workflow.defn
class ReAsk:
    """Ships an order; when its outcome is unknown, asks again (another activity, another
    call id), then waits for the first call with the `poimen.outcome` activity."""

    def __init__(self) -> None:
        self.answers: list[dict[str, Any]] = []

    @workflow.query
    def answered(self) -> list[dict[str, Any]]:
        return self.answers

    @workflow.run
    async def run(self, order_id: str) -> Any:
        for _ in range(2):
            try:
                return await workflow.execute_activity(
                    SHIP, {"order_id": order_id, "address": "x"},
                    start_to_close_timeout=timedelta(seconds=5),
                    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1),
                                             maximum_attempts=5),
                )
            except ActivityError as e:
                self.answers.append(dict(getattr(e.cause, "details", ({},))[0]))
        return await workflow.execute_activity(
            "poimen.outcome", self.answers[0]["call_id"],
            start_to_close_timeout=timedelta(seconds=10),
            retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1),
                                     maximum_interval=timedelta(seconds=2)),
        )


async def serve(address: str, db: str, provider: str, task_queue: str) -> None:
    from temporalio.client import Client
    from temporalio.worker import Worker

    from poimen import Kernel
    from poimen.integrations.temporal import outcome_activity, temporal_activity
    from poimen.testing import register_test_tools

    client = await Client.connect(address)
    with Kernel(db, notifiers=[]) as kernel:
        register_test_tools(kernel, provider)
        activities = [temporal_activity(kernel, t) for t in (EMAIL, SHIP)]
        async with Worker(client, task_queue=task_queue, workflows=[Notify, ReAsk],
                          activities=[*activities, outcome_activity(kernel)]):
            await asyncio.sleep(600)


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--address", "--db", "--provider", "--task-queue"):
        p.add_argument(name, required=True)
    ns = p.parse_args()
    asyncio.run(serve(ns.address, ns.db, ns.provider, ns.task_queue))


if __name__ == "__main__":
    main()
