"""A DBOS application on SQLite whose workflow sends one email in a step, for the DBOS tests.

    python -m tests.integrations.dbos_runner start|recover|resume --system-db PATH --db URL
        --provider URL --workflow ID [--mode poimen|plain] [--tool email|flaky] [--call-id ID]

`start` runs a new workflow (`--tool ship`: one that asks for a Queryable shipment again
when its outcome is unknown, printing each answer as a JSON line, then waits for it);
`--tool gated|four`: one whose call needs one (two) operators' approval, printing what it asks
and waiting for the decisions sent to it; `recover` only launches DBOS, which recovers the workflows a killed run left pending, and
waits for the one named; `resume` runs a workflow that waits for an operator's decision on
`--call-id`. Prints the result or the error as its last JSON line.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx
from dbos import DBOS, DBOSConfig, SetWorkflowID

from poimen import Caps, Kernel, ToolContext, Unsafe
from poimen._engine import crashpoints as _crashpoints
from poimen.errors import OutcomeUnknownError, PoimenError
from poimen.integrations.dbos import dbos_step
from poimen.testing import EMAIL, SHIP, register_test_tools


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=("start", "recover", "resume"))
    p.add_argument("--system-db", required=True)
    p.add_argument("--db", required=True)
    p.add_argument("--provider", required=True)
    p.add_argument("--workflow", required=True)
    p.add_argument("--mode", choices=("poimen", "plain"), default="poimen")
    p.add_argument("--tool", choices=("email", "flaky", "ship", "gated", "four"),
                   default="email")
    p.add_argument("--call-id")
    ns = p.parse_args()
    config: DBOSConfig = {"name": "poimen-dbos-test", "log_level": "WARNING",
                          "system_database_url": f"sqlite:///{ns.system_db}"}
    DBOS(config=config)
    kernel = Kernel(ns.db, notifiers=[])
    register_test_tools(kernel, ns.provider)

    @kernel.tool(id="flaky", effects=Unsafe(), caps=Caps(), timeout=5)
    def flaky(ctx: ToolContext, to: str, subject: str) -> None:
        httpx.post(f"{ns.provider}/plain", json={"to": to, "subject": subject})
        raise ConnectionResetError("the link dropped before the answer")

    for tool, approvers in (("gated", 1), ("four", 2)):
        @kernel.tool(id=tool, effects=Unsafe(), caps=Caps(), timeout=5, requires_approval=True,
                     approvers=approvers)
        def gated(ctx: ToolContext, to: str, subject: str) -> Any:
            return httpx.post(f"{ns.provider}/plain", json={"to": to, "subject": subject}).json()

    steps = {t: dbos_step(kernel, t) for t in ("flaky", "gated", "four")}
    steps |= {"email": dbos_step(kernel, EMAIL), "ship": dbos_step(kernel, SHIP)}

    @DBOS.step()
    def send_plain(to: str, subject: str) -> Any:
        # What the same step does without poimen: DBOS alone.
        r = httpx.post(f"{ns.provider}/plain", json={"to": to, "subject": subject})
        _crashpoints.hit("after_effect")
        return r.json()

    @DBOS.workflow()
    def notify(to: str, mode: str, tool: str) -> Any:
        if mode == "plain":
            return send_plain(to=to, subject="invoice")
        return steps[tool](to=to, subject="invoice")

    @DBOS.workflow()
    def reask(order_id: str) -> Any:
        # A call whose outcome is unknown, asked for again by the workflow (another step,
        # another call id), then waited for. Each answer is printed as it comes.
        first = None
        for _ in range(2):
            try:
                return steps["ship"](order_id=order_id, address="x")
            except OutcomeUnknownError as exc:
                print(json.dumps({"answer": exc.data}), flush=True)
                first = first or exc.call_id
        assert first is not None
        return steps["ship"].resume(first, timeout=120)

    @DBOS.workflow()
    def approved(to: str, tool: str) -> Any:
        # A call that needs approval, asked of the approvers (printed), then their decisions.
        try:
            return steps[tool](to=to, subject="invoice")
        except OutcomeUnknownError as exc:
            if exc.reason != "awaiting_approval":
                raise
            print(json.dumps({"asked": exc.data}), flush=True)
            return steps[tool].approval(exc.call_id, timeout=120)

    @DBOS.workflow()
    def resume(call_id: str, tool: str) -> Any:
        return steps[tool].resume(call_id, timeout=60)

    DBOS.launch()
    try:
        if ns.command == "start" and ns.tool == "ship":
            with SetWorkflowID(ns.workflow):
                handle = DBOS.start_workflow(reask, f"order-{ns.workflow}")
        elif ns.command == "start" and ns.tool in ("gated", "four"):
            with SetWorkflowID(ns.workflow):
                handle = DBOS.start_workflow(approved, f"{ns.workflow}@example.com", ns.tool)
        elif ns.command == "start":
            with SetWorkflowID(ns.workflow):
                handle = DBOS.start_workflow(notify, f"{ns.workflow}@example.com", ns.mode, ns.tool)
        elif ns.command == "resume":
            with SetWorkflowID(ns.workflow):
                handle = DBOS.start_workflow(resume, ns.call_id, ns.tool)
        else:
            handle = DBOS.retrieve_workflow(ns.workflow)
        try:
            print(json.dumps({"result": handle.get_result()}))
        except PoimenError as exc:
            print(json.dumps({"error": type(exc).__name__, "message": str(exc), **exc.data}))
    finally:
        kernel.close()
        DBOS.destroy()


if __name__ == "__main__":
    main()
