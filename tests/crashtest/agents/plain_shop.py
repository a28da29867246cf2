"""A plain-Python shop agent for `poimen crashtest`: a scripted plan charges an order, then
emails the receipt.

    python -m tests.crashtest.agents.plain_shop naive|poimen

naive: an at-least-once runner, as agents are written without poimen: it journals each step
(in $POIMEN_CRASHTEST_DIR) and on restart runs every step not journalled done again. Its tools
are plain HTTP clients to the real providers' addresses (reached through HTTP_PROXY); the
charge sends a new Idempotency-Key on every attempt, the usual mistake.
poimen: the same plan through a Kernel on POIMEN_DB, the charge Idempotent, the email Unsafe.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext, Unsafe

PLAN: list[tuple[str, dict[str, Any]]] = [
    ("charge", {"order_id": "o-42", "amount_cents": 1200}),
    ("send_receipt", {"to": "ann@example.com", "order_id": "o-42"}),
]
PAYMENTS = "http://payments.example.test"
MAIL = "http://mail.example.test"


def naive() -> None:
    journal = Path(os.environ["POIMEN_CRASHTEST_DIR"]) / "journal.jsonl"
    done = set()
    if journal.exists():
        for line in journal.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if record["event"] == "done":
                done.add(record["step"])
    with httpx.Client(timeout=30) as http:  # HTTP_PROXY: the witness sees every request
        tools = {
            "charge": lambda a: http.post(f"{PAYMENTS}/v1/charges", json=a,
                                          headers={"Idempotency-Key": uuid.uuid4().hex}),
            "send_receipt": lambda a: http.post(f"{MAIL}/v1/messages", json=a),
        }
        for step, (tool, args) in enumerate(PLAN):
            if step in done:
                continue
            tools[tool](args).raise_for_status()
            with journal.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "event": "done"}) + "\n")


def with_poimen() -> None:
    url = os.environ["POIMEN_CRASHTEST_URL"]
    caps = Caps(hosts=(url.removeprefix("http://"),))
    kernel = Kernel(os.environ["POIMEN_DB"], notifiers=[])

    @kernel.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("order_id", "amount_cents")),
                 caps=caps, timeout=10)
    def charge(ctx: ToolContext, order_id: str, amount_cents: int) -> Any:
        r = ctx.http.post(f"{url}/v1/charges", json={"order_id": order_id,
                                                      "amount_cents": amount_cents})
        r.raise_for_status()
        return r.json()

    @kernel.tool(id="send_receipt", effects=Unsafe(), caps=caps, timeout=10)
    def send_receipt(ctx: ToolContext, to: str, order_id: str) -> Any:
        r = ctx.http.post(f"{url}/v1/messages", json={"to": to, "order_id": order_id})
        r.raise_for_status()
        return r.json()

    with kernel:
        kernel.launch()  # the restart's recovery: settles what a killed run left unfinished
        for step, (tool, args) in enumerate(PLAN):
            print(tool, kernel.call(tool, args, call_id=f"order-42/{step}"))


if __name__ == "__main__":
    naive() if sys.argv[1] == "naive" else with_poimen()
