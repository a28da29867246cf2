"""One attempt of a Temporal activity in its own process, for the Temporal kill test.

    python -m tests.integrations.temporal_runner --db URL --provider URL --workflow-id W
        --run-id R --activity-id A --attempt N --args JSON

Runs the `test.email` activity in a `temporalio.testing.ActivityEnvironment` whose info
carries the ids a Temporal server gives every attempt of that activity. Prints one JSON line:
the result, or the ApplicationError (type, non_retryable, details).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json

from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from poimen import Kernel
from poimen.integrations.temporal import temporal_activity
from poimen.testing import EMAIL, register_test_tools


async def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--db", "--provider", "--workflow-id", "--run-id", "--activity-id", "--args"):
        p.add_argument(name, required=True)
    p.add_argument("--attempt", type=int, required=True)
    ns = p.parse_args()
    with Kernel(ns.db, notifiers=[]) as kernel:
        register_test_tools(kernel, ns.provider)
        env = ActivityEnvironment()
        env.info = dataclasses.replace(
            env.info, workflow_id=ns.workflow_id, workflow_run_id=ns.run_id,
            activity_id=ns.activity_id, attempt=ns.attempt, activity_type=EMAIL)
        try:
            result = await env.run(temporal_activity(kernel, EMAIL), json.loads(ns.args))
            print(json.dumps({"result": result}))
        except ApplicationError as exc:
            print(json.dumps({"error": exc.type, "non_retryable": exc.non_retryable,
                              "details": list(exc.details), "message": exc.message}))


if __name__ == "__main__":
    asyncio.run(main())
