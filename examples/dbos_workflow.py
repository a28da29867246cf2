"""A DBOS workflow whose step sends an email through poimen, on DBOS's SQLite system database.

    python examples/dbos_workflow.py

Offline: poimen.testing's provider process stands in for the email service. The first
workflow sends its email; the second one's connection breaks after the request went out, so
its step raises OutcomeUnknownError, and the workflow waits in a step for an operator's
decision (here a hook resolves it; `poimen resolve` in real life)
(docs/integrations/dbos.md).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from dbos import DBOS, DBOSConfig

from poimen import Caps, Kernel, ToolContext, Unsafe
from poimen.errors import OutcomeUnknownError
from poimen.events import IndeterminateEvent
from poimen.integrations.dbos import dbos_step
from poimen.testing import ProviderClient, ProviderProcess


def main(tmp: Path) -> None:
    config: DBOSConfig = {"name": "poimen-example", "log_level": "WARNING",
                          "system_database_url": f"sqlite:///{tmp / 'dbos.db'}"}
    DBOS(config=config)
    with ProviderProcess(tmp / "ledger.db") as mail, \
            Kernel(f"sqlite:///{tmp / 'agent.db'}", notifiers=[]) as kernel:

        @kernel.tool(id="send_email", effects=Unsafe(), caps=Caps(hosts=("127.0.0.1",)), timeout=10)
        def send_email(ctx: ToolContext, to: str, subject: str) -> dict[str, Any]:
            """Send an email. Not idempotent: sending twice sends two emails."""
            ctx.http.post(f"{mail.url}/plain", json={"to": to, "subject": subject})
            if to.startswith("lost"):
                raise ConnectionResetError("the connection broke before the answer")
            return {"sent": True, "to": to}

        send = dbos_step(kernel, "send_email")          # a DBOS step; make it before DBOS.launch()

        @DBOS.workflow()
        def notify(to: str) -> dict:
            return send(to=to, subject="Your invoice")  # the tool's arguments, by name

        @DBOS.workflow()
        def notify_and_wait(to: str) -> dict:
            try:
                return send(to=to, subject="Your invoice")
            except OutcomeUnknownError as e:
                return send.resume(e.call_id)   # a DBOS step: kernel.wait_sync(call_id), mapped as above

        @kernel.on(IndeterminateEvent)
        def operator(event: IndeterminateEvent) -> None:  # stands in for `poimen resolve`
            kernel.resolve(event.intent_id, landed=True, result={"sent": True}, operator="ann",
                           reason="the email is in the provider's log")

        DBOS.launch()
        try:
            kernel.launch()
            print(f"notify: {notify('bob@example.com')}")
            print(f"notify_and_wait, its outcome unknown, then resolved: "
                  f"{notify_and_wait('lost@example.com')}")
            print(f"emails sent: {ProviderClient(mail.url).count()}")
        finally:
            DBOS.destroy()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
