"""A DBOS workflow whose refund step waits for approvers' decisions, sent to it as DBOS
messages: approve, edit or reject, and four eyes for a large refund; each decision recorded
on the call's intent in poimen's log.

    python examples/dbos_approval.py

Offline, on DBOS's SQLite system database: poimen.testing's provider process stands in for the
payments API, counting the refunds it takes. The step raises `OutcomeUnknownError` with
``reason == "awaiting_approval"``; the workflow hands the call to `refund.approval`, which
receives each decision (`send_decision`, from an approver's request handler in real life; here
this process) and runs the call once decided (docs/integrations/dbos.md, "Approvals").
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from dbos import DBOS, DBOSConfig

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext
from poimen.errors import OutcomeUnknownError, ToolCallFailedError
from poimen.integrations.dbos import dbos_step, send_decision
from poimen.testing import ProviderClient, ProviderProcess


def pay(ctx: ToolContext, url: str, order_id: str, amount_cents: int) -> dict[str, Any]:
    """The refund, through the kernel's keyed handle."""
    ctx.http.post(f"{url}/keyed", json={"refund": order_id, "cents": amount_cents}).raise_for_status()
    return {"refunded": order_id, "cents": amount_cents}


def main(tmp: Path) -> None:
    config: DBOSConfig = {"name": "poimen-approvals", "log_level": "WARNING",
                          "system_database_url": f"sqlite:///{tmp / 'dbos.db'}"}
    DBOS(config=config)
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

        steps = {"refund": dbos_step(kernel, "refund"),
                 "refund_large": dbos_step(kernel, "refund_large")}

        @DBOS.workflow()
        def refund_order(tool: str, order_id: str, amount_cents: int) -> dict:
            step = steps[tool]
            try:
                return step(order_id=order_id, amount_cents=amount_cents)
            except OutcomeUnknownError as e:
                if e.reason != "awaiting_approval":
                    raise
                DBOS.set_event("asked", e.call_id)  # where approvers find the call
                try:
                    return step.approval(e.call_id)  # each decision applied, then the call runs
                except ToolCallFailedError as rejected:  # nothing was sent
                    return {"failed": rejected.error}

        DBOS.launch()
        try:
            kernel.launch()
            approve = {"decision": "approve", "operator": "ann", "reason": "checked"}
            edit = {"decision": "edit", "operator": "ann", "reason": "half of it",
                    "args": {"order_id": "o-2", "amount_cents": 125_00}}  # the edited call runs
            reject = {"decision": "reject", "operator": "ann", "reason": "duplicate"}
            bob = {"decision": "approve", "operator": "bob", "reason": "checked too"}
            for tool, order_id, cents, decisions in (
                ("refund", "o-1", 250_00, [approve]),
                ("refund", "o-2", 250_00, [edit]),
                ("refund", "o-3", 250_00, [reject]),  # nothing is sent
                ("refund_large", "o-4", 2500_00, [approve, bob]),  # four eyes
            ):
                handle = DBOS.start_workflow(refund_order, tool, order_id, cents)
                call_id = DBOS.get_event(handle.workflow_id, "asked", timeout_seconds=60)
                print(f"{tool} {order_id}: awaiting approval, call {call_id}")
                for decision in decisions:  # an approver's request handler, in real life
                    send_decision(call_id, decision)
                by = " and ".join(d["operator"] for d in decisions)
                print(f"  {decisions[0]['decision']} by {by}: {handle.get_result()}")
                print(f"  refunds the provider took: {ProviderClient(payments.url).count()}")
            taken = [e["body"] for e in ProviderClient(payments.url).entries()]
            print(f"the provider's ledger: {taken}")
        finally:
            DBOS.destroy()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
