"""Temporal workflows sending one email (`Notify`), asking again for a shipment whose
outcome is unknown (`ReAsk`), or sending an email once approvers decided (`Approved`) through
poimen activities, and a worker process for them, for the tests against a real Temporal dev
server.

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
    from poimen import ToolContext
    from poimen.integrations.temporal import APPROVAL
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


@workflow.defn
class Approved:
    """Sends an email through a tool that needs approval: asks the approvers (a query lists
    what was asked), applies each decision signalled with `poimen.decide` until the call is
    decided, then gets its outcome from `poimen.outcome`."""

    def __init__(self) -> None:
        self.decisions: list[dict[str, Any]] = []
        self.asked: list[dict[str, Any]] = []

    @workflow.signal
    def decide(self, decision: dict[str, Any]) -> None:
        self.decisions.append(decision)

    @workflow.query
    def asking(self) -> list[dict[str, Any]]:
        return self.asked

    @workflow.run
    async def run(self, tool: str, to: str) -> dict[str, Any]:
        quick = {"start_to_close_timeout": timedelta(seconds=5),
                 "retry_policy": RetryPolicy(initial_interval=timedelta(seconds=1),
                                             maximum_interval=timedelta(seconds=2))}
        try:
            result = await workflow.execute_activity(tool, {"to": to, "subject": "invoice"},
                                                     **quick)
            return {"result": result}
        except ActivityError as e:
            if getattr(e.cause, "type", None) != APPROVAL:
                raise
            asked: dict[str, Any] = e.cause.details[0]
        call_id = asked["call_id"]
        while asked:
            self.asked.append(asked)
            await workflow.wait_condition(lambda: bool(self.decisions))
            asked = await workflow.execute_activity(
                "poimen.decide", {"call_id": call_id, "decision": self.decisions.pop(0)},
                **quick)
        try:
            return {"result": await workflow.execute_activity("poimen.outcome", call_id,
                                                              **quick)}
        except ActivityError as e:
            return {"error": getattr(e.cause, "type", None), "message": str(e.cause)}


def register_gated(kernel: Any, provider: str) -> None:
    """`mail.gated` (one operator approves) and `mail.four_eyes` (two)."""
    import httpx

    from poimen import Caps, Unsafe

    for tool, approvers in (("mail.gated", 1), ("mail.four_eyes", 2)):
        @kernel.tool(id=tool, effects=Unsafe(), caps=Caps(), timeout=5, requires_approval=True,
                     approvers=approvers)
        def gated(ctx: ToolContext, to: str, subject: str) -> Any:
            return httpx.post(f"{provider}/plain", json={"to": to, "subject": subject}).json()


def approval_activities(kernel: Any) -> list[Any]:
    from poimen.integrations.temporal import decide_activity, outcome_activity, temporal_activity

    return [*(temporal_activity(kernel, t) for t in (EMAIL, SHIP, "mail.gated",
                                                     "mail.four_eyes")),
            decide_activity(kernel), outcome_activity(kernel)]


async def serve(address: str, db: str, provider: str, task_queue: str) -> None:
    from temporalio.client import Client
    from temporalio.worker import Worker

    from poimen import Kernel
    from poimen.testing import register_test_tools

    client = await Client.connect(address)
    with Kernel(db, notifiers=[]) as kernel:
        register_test_tools(kernel, provider)
        register_gated(kernel, provider)
        async with Worker(client, task_queue=task_queue, workflows=[Notify, ReAsk, Approved],
                          activities=approval_activities(kernel)):
            await asyncio.sleep(600)


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--address", "--db", "--provider", "--task-queue"):
        p.add_argument(name, required=True)
    ns = p.parse_args()
    asyncio.run(serve(ns.address, ns.db, ns.provider, ns.task_queue))


if __name__ == "__main__":
    main()
