"""A refund over 100.00 waits for an operator's approval; a smaller one runs at once.

    python examples/approval.py

Offline: poimen.testing's provider process stands in for the payments API and counts the
refunds it takes (docs/approvals.md).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from poimen import Caps, Idempotent, Kernel, KeyDerivation, Pending, ToolContext
from poimen.testing import ProviderClient, ProviderProcess


def main(tmp: Path) -> None:
    with ProviderProcess(tmp / "ledger.db") as payments, \
            Kernel(f"sqlite:///{tmp / 'agent.db'}", notifiers=[]) as kernel:
        caps = Caps(hosts=("127.0.0.1",))

        @kernel.tool(id="refund", effects=Idempotent(key=KeyDerivation.fields("order_id")), caps=caps,
                     timeout=10, requires_approval=lambda args: args["amount_cents"] > 100_00,
                     approval_ttl=24 * 3600)
        def refund(ctx: ToolContext, order_id: str, amount_cents: int) -> dict[str, Any]:
            r = ctx.http.post(f"{payments.url}/keyed", json={"refund": order_id, "cents": amount_cents})
            return r.json()

        kernel.launch()
        small = kernel.call("refund", {"order_id": "o-17", "amount_cents": 25_00}, call_id="run-3/a")
        print(f"a refund of 25.00: {type(small).__name__}")
        big = kernel.call("refund", {"order_id": "o-18", "amount_cents": 250_00}, call_id="run-3/b")
        assert isinstance(big, Pending)
        print(f"a refund of 250.00: Pending ({big.reason}); the model is told: {big.for_model()}")
        print(f"refunds the provider took: {ProviderClient(payments.url).count()}")

        kernel.approve(big.intent_id, operator="ann", reason="the customer sent the goods back")
        done = kernel.wait_sync("run-3/b")  # the caller resumes: the approved call runs here
        print(f"approved by ann, then: {type(done).__name__}")
        print(f"refunds the provider took: {ProviderClient(payments.url).count()}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
