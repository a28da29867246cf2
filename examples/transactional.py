"""A tool whose effect is a write to the application's own database, exactly once.

    python examples/transactional.py

`open_ticket` writes through `ctx.tx`, a connection inside a transaction poimen opened on the
application's database; poimen commits it together with a marker of the call. The second call
runs in a child process that is killed (SIGKILL) after that commit, before poimen recorded the
outcome in its log: recovery finds the marker, completes the call with the recorded result,
and never runs the tool again. The tickets table is the witness (docs/transactional.md).
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from poimen import Caps, Kernel, ToolContext, Transactional


def make_kernel(tmp: Path) -> Kernel:
    kernel = Kernel(f"sqlite:///{tmp / 'agent.db'}", notifiers=[])

    @kernel.tool(id="open_ticket", effects=Transactional(database=f"sqlite:///{tmp / 'shop.db'}"),
                 caps=Caps(), timeout=10)
    def open_ticket(ctx: ToolContext, customer: str, subject: str) -> dict[str, Any]:
        cur = ctx.tx.execute("INSERT INTO tickets (customer, subject) VALUES (?, ?)",
                             (customer, subject))
        return {"ticket": cur.lastrowid}  # committed by poimen, with the call's marker

    return kernel


def main(tmp: Path) -> None:
    with sqlite3.connect(tmp / "shop.db") as shop:
        shop.execute("CREATE TABLE tickets (id INTEGER PRIMARY KEY, customer TEXT, subject TEXT)")
    with make_kernel(tmp) as kernel:
        out = kernel.call("open_ticket", {"customer": "bob", "subject": "late parcel"},
                          call_id="conv-1/1")
        print("first call:", type(out).__name__, out.result)  # type: ignore[union-attr]

    # The agent's process dies right after the transaction committed (a crash point).
    child = subprocess.run(
        [sys.executable, __file__, str(tmp), "conv-1/2"],
        env={**os.environ, "POIMEN_CRASH_AT": "after_effect", "POIMEN_CRASH_CALL": "conv-1/2"},
        check=False,
    )
    print(f"the agent died after the commit (exit {child.returncode})")

    with make_kernel(tmp) as kernel:
        kernel.recover()  # asks the marker: the write landed
        out = kernel.call("open_ticket", {"customer": "bob", "subject": "wrong size"},
                          call_id="conv-1/2")
        print("after recovery:", type(out).__name__, out.result)  # type: ignore[union-attr]
    with sqlite3.connect(tmp / "shop.db") as shop:
        tickets = shop.execute("SELECT id, subject FROM tickets ORDER BY id").fetchall()
    print("tickets in the shop's table:", tickets)


def child(tmp: Path, call_id: str) -> None:
    with make_kernel(tmp) as kernel:
        kernel.call("open_ticket", {"customer": "bob", "subject": "wrong size"}, call_id=call_id)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        child(Path(sys.argv[1]), sys.argv[2])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(Path(d))
