"""Keyed capability: an Idempotent tool's writes carry the kernel's key, and a write that does
not is denied and recorded.

    python examples/capability.py

Offline: poimen.testing's provider process stands in for the payments API (it deduplicates on
the Idempotency-Key header only); the orders table is a SQLite table of the application's own
(docs/capability.md).
"""

from __future__ import annotations

import sqlite3
import tempfile
import threading
from pathlib import Path
from typing import Any

import httpx

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext
from poimen.testing import ProviderClient, ProviderProcess


class OrdersTable:
    """The application's own table. One row per key: a retried write changes nothing."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.lock = threading.Lock()
        db.execute("CREATE TABLE IF NOT EXISTS orders (key TEXT PRIMARY KEY, payload TEXT)")

    def apply(self, payload: Any, *, key: str | None) -> None:
        with self.lock, self.db:
            self.db.execute("INSERT INTO orders VALUES (?, ?) ON CONFLICT (key) DO NOTHING",
                            (key, repr(payload)))


def main(tmp: Path) -> None:
    db = sqlite3.connect(tmp / "orders.db", check_same_thread=False)
    with ProviderProcess(tmp / "ledger.db") as payments, \
            Kernel(f"sqlite:///{tmp / 'agent.db'}", notifiers=[]) as kernel:
        payments_api = payments.url
        kernel.register_sink("orders", OrdersTable(db))          # sink.apply(payload, *, key)

        @kernel.tool(id="charge",
                     effects=Idempotent(key=KeyDerivation.fields("order_id", "amount_cents")),
                     caps=Caps(hosts=("127.0.0.1",), sinks=("orders",)),  # hosts: e.g. api.payments.example
                     timeout=10)
        def charge(ctx: ToolContext, order_id: str, amount_cents: int) -> dict[str, Any]:
            r = ctx.http.post(f"{payments_api}/keyed",
                              json={"order": order_id, "amount": amount_cents})
            ctx.sink("orders").write({"order": order_id, "charged": True})
            return r.json()

        @kernel.tool(id="charge_raw",
                     effects=Idempotent(key=KeyDerivation.fields("order_id", "amount_cents")),
                     caps=Caps(hosts=("127.0.0.1",)), timeout=10)
        def charge_raw(ctx: ToolContext, order_id: str, amount_cents: int) -> Any:
            # A client of its own sends no key: a retry would charge again. Denied.
            return httpx.post(f"{payments_api}/plain", json={"order": order_id}).json()

        kernel.launch()
        out = kernel.call("charge", {"order_id": "o-17", "amount_cents": 4200}, call_id="r/1")
        print(f"charge through ctx.http: {type(out).__name__}, sent with key {out.result['key']}")
        raw = kernel.call("charge_raw", {"order_id": "o-18", "amount_cents": 900}, call_id="r/2")
        print(f"charge through its own client: {type(raw).__name__}")
        for d in kernel.denials():
            print(f"  denied: {d.tool_id} {d.action} {d.target}: {d.reason}")
        print(f"writes the provider took: {ProviderClient(payments_api).count()}; "
              f"rows in the orders table: {db.execute('SELECT count(*) FROM orders').fetchone()[0]}")
    db.close()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
