"""A Temporal workflow sending one email through the poimen activity, and a worker process
for it, for the tests against a real Temporal dev server.

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
    from poimen.testing import EMAIL


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


async def serve(address: str, db: str, provider: str, task_queue: str) -> None:
    from temporalio.client import Client
    from temporalio.worker import Worker

    from poimen import Kernel
    from poimen.integrations.temporal import temporal_activity
    from poimen.testing import register_test_tools

    client = await Client.connect(address)
    with Kernel(db, notifiers=[]) as kernel:
        register_test_tools(kernel, provider)
        async with Worker(client, task_queue=task_queue, workflows=[Notify],
                          activities=[temporal_activity(kernel, EMAIL)]):
            await asyncio.sleep(600)


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--address", "--db", "--provider", "--task-queue"):
        p.add_argument(name, required=True)
    ns = p.parse_args()
    asyncio.run(serve(ns.address, ns.db, ns.provider, ns.task_queue))


if __name__ == "__main__":
    main()
