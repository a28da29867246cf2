"""An email provider's outage, answered: evidence for each call whose outcome is unknown,
an escalation for the ones left too long, and one audited batch to resolve them all.

    python examples/email_outage.py

Offline: poimen.testing's provider process stands in for the email provider; its ledger is
the provider's sent log (docs/email-outage.md).
"""

from __future__ import annotations

import csv
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from poimen import (
    CallbackNotifier,
    Caps,
    Evidence,
    Fact,
    Indeterminate,
    Kernel,
    Notification,
    RecordedCall,
    Suggestion,
    ToolContext,
    Unsafe,
)
from poimen.cli import main as poimen
from poimen.store import open_store
from poimen.testing import ProviderProcess


def make_kernel(url: str, api: str, ops: list[Notification], pager: list[Notification]) -> Kernel:
    client = httpx.Client(base_url=api, timeout=10)

    def sent_log(ctx: ToolContext, call: RecordedCall) -> list[Fact]:
        """The provider's sent messages to this call's recipient: facts, with links."""
        read_at = time.time()
        r = ctx.http.get(f"{api}/ledger", params={"kind": "plain"})  # reads only
        r.raise_for_status()
        to = call.args["to"]
        facts = [Fact(f"sent log read for {to}", data={"read_at": read_at})]
        for m in r.json()["entries"]:
            if m["body"]["to"] == to and m["at"] >= call.first_sent_at - 60:
                facts.append(Fact(f"message {m['id']} to {to}", link=f"{api}/ledger#{m['id']}",
                                  data={"id": m["id"], "call": m["body"]["meta"]["call"]}))
        return facts

    def one_message(call: RecordedCall, facts: Sequence[Fact]) -> Suggestion | None:
        """Conclusive when exactly one sent message carries this call's id."""
        mine = [f for f in facts if f.data and f.data.get("call") == call.call_id]
        if len(mine) == 1:
            return Suggestion(True, f"the sent log has it: {mine[0].text}")
        return None

    kernel = Kernel(
        url,
        notifiers=[CallbackNotifier(ops.append, name="ops-channel")],
        escalate_to=[CallbackNotifier(pager.append, name="pager")],  # the second line
    )

    @kernel.tool(id="mail.send", effects=Unsafe(), caps=Caps(hosts=(host_of(api),)), timeout=10,
                 evidence=Evidence(sent_log, suggest=one_message), escalate_after=3600)
    def send(ctx: ToolContext, to: str, subject: str) -> dict[str, int]:
        client.post("/plain", json={"to": to, "subject": subject, "meta": {"call": ctx.call_id}})
        # The outage: the provider sends, then the connection breaks before its answer.
        raise ConnectionResetError("the provider closed the connection")

    kernel.on_close(client.close)
    return kernel


def host_of(url: str) -> str:
    u = httpx.URL(url)
    return f"{u.host}:{u.port}"


def wait_for(check: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + 60
    while not check():
        assert time.monotonic() < end, f"no {what}"
        time.sleep(0.02)


def main(tmp: Path) -> None:
    url = f"sqlite:///{tmp / 'agent.db'}"
    ops: list[Notification] = []
    pager: list[Notification] = []
    with ProviderProcess(tmp / "provider.db") as provider:
        kernel = make_kernel(url, provider.url, ops, pager)
        with kernel:
            # The outage: 12 receipts, each call's connection reset after the send.
            outs = [kernel.call("mail.send", {"to": f"c{i}@example.com", "subject": "receipt"},
                                call_id=f"receipts/{i}") for i in range(12)]
            print(f"the calls: {sum(isinstance(o, Indeterminate) for o in outs)} Indeterminate")
            wait_for(lambda: len(ops) == 12, "notifications")
            note = json.loads(ops[0].payload)
            print(f"notified with evidence: {note['evidence']['facts'][1]['text']}")
            print(f"suggested: landed={note['evidence']['suggestion']['landed']}")

            # An hour later (the log's clock moved on here, instead of waiting).
            now = kernel.store.now
            kernel.store.now = lambda: now() + 3601  # type: ignore[method-assign]
            kernel.deliver_notifications()
            print(f"escalated to the pager: {len(pager)} overdue calls")
            kernel.store.now = now  # type: ignore[method-assign]

        # The operator exports the provider's sent log and resolves all at once.
        export = tmp / "sent-log.csv"
        with export.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["call_id", "outcome"])
            for m in httpx.get(f"{provider.url}/ledger?kind=plain").json()["entries"]:
                w.writerow([m["body"]["meta"]["call"], "landed"])
        poimen(["resolve", "--db", url, "--from-csv", str(export), "--dry-run"])
        code = poimen(["resolve", "--db", url, "--from-csv", str(export),
                       "--operator", "ana", "--reason", "matched with the provider's sent log"])
        print(f"exit code {code}")
    store = open_store(url, migrate=False, readonly=True)
    left = store.list_intents(state=None, limit=100)
    print(f"resolved landed: {sum(i.state == 'RESOLVED_LANDED' for i in left)}")
    store.close()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
