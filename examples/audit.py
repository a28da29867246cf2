"""A tamper-evident log: the chain holds, an auditor gets a signed export to check offline,
and a row changed behind poimen's back is named (docs/audit.md).

    python examples/audit.py

Signing needs the extra: pip install 'poimen[audit]'.
"""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

from poimen import (
    CallbackNotifier,
    Caps,
    Idempotent,
    Kernel,
    KeyDerivation,
    Notification,
    ToolContext,
)
from poimen.audit import export, keygen, load_private, load_public, verify, verify_export


def main(tmp: Path) -> None:
    log = tmp / "agent.db"
    heads: list[Notification] = []  # where the heads go: a webhook, a bucket, another team
    with Kernel(f"sqlite:///{log}", notifiers=[CallbackNotifier(heads.append, name="heads")],
                audit_head_every=3600) as kernel:

        @kernel.tool(id="refund", effects=Idempotent(key=KeyDerivation.fields("order_id")),
                     caps=Caps(), timeout=10)
        def refund(ctx: ToolContext, order_id: str, cents: int) -> dict[str, int]:
            return {"refunded": cents}

        for n, cents in enumerate((1200, 450, 9900), 1):
            refund.call(f"run-3/refund-{n}", order_id=f"o-{n}", cents=cents)

        print("verify:", verify(kernel.store).line())
        head = kernel.publish_audit_head()  # as the kernel does every hour after launch()
        assert head is not None
        print("published:", heads[-1].payload)

        # The auditor's copy: signed with a key only the operators hold.
        private, public = keygen(tmp / "audit.key")
        with open(tmp / "audit.jsonl", "wb") as out:
            export(kernel.store, out, load_private(private), now=kernel.store.now())
        print("export:", verify_export(tmp / "audit.jsonl", load_public(public)).line())

        # Someone with the database file edits a refund after the fact.
        db = sqlite3.connect(log)
        with db:
            db.execute("UPDATE intents SET result = '{\"refunded\":99000}' "
                       "WHERE call_id = 'run-3/refund-3'")
        db.close()
        print("verify again:", verify(kernel.store).line())
        print("against the published head:", verify(kernel.store, published=head.token()).ok)
        # The export made before still holds, with the refund as it was.
        print("the export still:", verify_export(tmp / "audit.jsonl", load_public(public)).ok)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        main(Path(d))
