"""Undo what a run did: its calls reversed newest first, each by its tool's undo.

    python examples/undo.py

Offline: poimen.testing's provider process stands in for the payments and booking APIs, and
its ledger shows each effect and each reversal (docs/undo.md).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext, Unsafe
from poimen.testing import ProviderClient, ProviderProcess


def main(tmp: Path) -> None:
    with ProviderProcess(tmp / "ledger.db") as provider, \
            Kernel(f"sqlite:///{tmp / 'agent.db'}", notifiers=[]) as kernel:
        caps = Caps(hosts=("127.0.0.1",))

        def post(ctx: ToolContext, body: dict[str, Any]) -> dict[str, Any]:
            r = ctx.http.post(f"{provider.url}/keyed", json=body)
            r.raise_for_status()
            return {"id": f"e-{r.json()['entry_id']}"}

        @kernel.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("order_id")), caps=caps,
                     timeout=10, undo="refund",
                     undo_args=lambda args, result: {"order_id": args["order_id"],
                                                     "charge_id": result["id"]})
        def charge(ctx: ToolContext, order_id: str, amount_cents: int) -> dict[str, Any]:
            return post(ctx, {"charge": order_id, "cents": amount_cents})

        @kernel.tool(id="refund", effects=Idempotent(key=KeyDerivation.fields("charge_id")), caps=caps,
                     timeout=10)
        def refund(ctx: ToolContext, order_id: str, charge_id: str) -> dict[str, Any]:
            return post(ctx, {"refund_of": charge_id})

        @kernel.tool(id="book", effects=Idempotent(key=KeyDerivation.fields("room", "night")),
                     caps=caps, timeout=10)
        def book(ctx: ToolContext, room: str, night: str) -> dict[str, Any]:
            return post(ctx, {"book": room, "night": night})

        @book.undo(id="cancel", effects=Idempotent(key=KeyDerivation.fields("booking_id")), caps=caps,
                   timeout=10, args=lambda args, result: {"booking_id": result["id"]})
        def cancel(ctx: ToolContext, booking_id: str) -> dict[str, Any]:
            return post(ctx, {"cancel": booking_id})

        @kernel.tool(id="note", effects=Unsafe(), caps=Caps(), timeout=10)
        def note(ctx: ToolContext, text: str) -> str:
            return text  # an effect that stays: no undo

        kernel.launch()
        charge.call("run-9/step-1", order_id="o-17", amount_cents=4200)
        book.call("run-9/step-2", room="12", night="2026-06-01")
        note.call("run-9/step-3", text="booked and paid")
        report = kernel.undo("run-9/", operator="ann", reason="customer cancelled the order")
        print(report.summary())
        for step in report.steps:
            print(f"  {step.call_id}  {step.tool_id:6}  {step.status:8}  {step.undo_tool or '-'}")
        print("the provider's ledger:")
        for entry in ProviderClient(provider.url).entries():
            print(f"  {entry['body']}")
        again = kernel.undo("run-9/", operator="ann", reason="once more, after a crash")
        print(f"undo again: {again.summary()}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
