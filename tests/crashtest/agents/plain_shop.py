"""A plain-Python shop agent for `poimen crashtest`: a scripted plan charges an order, then
emails the receipt.

    python -m tests.crashtest.agents.plain_shop naive|poimen

naive: an at-least-once runner, as agents are written without poimen: it journals each step
(in $POIMEN_CRASHTEST_DIR) and on restart runs every step not journalled done again. Its tools
are plain HTTP clients to the real providers' addresses (reached through HTTP_PROXY); the
charge sends a new Idempotency-Key on every attempt, the usual mistake.
poimen: the same plan through the Kernel of examples/shop_agent_poimen.py (on POIMEN_DB; the charge
Idempotent, the receipt Unsafe).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx

from poimen import Kernel

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


def example_kernel() -> Kernel:
    """The tools of examples/shop_agent_poimen.py: the same calls, the same classes."""
    path = Path(__file__).resolve().parents[3] / "examples" / "shop_agent_poimen.py"
    spec = importlib.util.spec_from_file_location("shop_agent_poimen", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel: Kernel = module.make_kernel()
    return kernel


def with_poimen() -> None:
    kernel = example_kernel()
    with kernel:
        kernel.launch()  # the restart's recovery: settles what a killed run left unfinished
        for step, (tool, args) in enumerate(PLAN):
            print(tool, kernel.call(tool, args, call_id=f"order-42/{step}"))


if __name__ == "__main__":
    naive() if sys.argv[1] == "naive" else with_poimen()
