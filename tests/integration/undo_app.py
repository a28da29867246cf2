"""An application with undos, for the undo tests: run in-process, as a crash-test child
(``python -m tests.integration.undo_app undo --scope S``, SIGKILLed at a crash point), and
loaded by ``poimen undo --app tests.integration.undo_app:app_kernel``.

Every effect and every reversal goes to the witness provider:

- `u.charge` (Idempotent, keyed write) is undone by `u.refund` (Idempotent, its own key),
  whose ledger body names the charge's call id: ``{"refund_of": <call id>}``.
- `u.email` (Unsafe, plain write) is undone by `u.retract` (Unsafe, plain write)
  ``{"retract_of": <call id>}``.
- `u.book` (Unsafe) is undone by `u.cancel` (Idempotent): a cancel of a booking that may not
  exist is safe, so an Indeterminate booking is cancelled without waiting.
- `u.note` (Unsafe) has no undo.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext, Unsafe
from poimen._engine import crashpoints as _crashpoints
from poimen.errors import DefiniteFailure

CHARGE, REFUND, EMAIL, RETRACT = "u.charge", "u.refund", "u.email", "u.retract"
BOOK, CANCEL, NOTE = "u.book", "u.cancel", "u.note"
ROOT = Path(__file__).resolve().parents[2]


def make_kernel(db: str, provider: str, **kw: Any) -> Kernel:
    k = Kernel(db, notifiers=[], deadline_margin=0.1, **kw)
    client = httpx.Client(base_url=provider, timeout=10)
    k.on_close(client.close)
    u = httpx.URL(provider)
    caps = Caps(hosts=(f"{u.host}:{u.port}",))

    def plain(body: dict[str, Any]) -> Any:
        r = client.post("/plain", json=body)
        r.raise_for_status()
        return r.json()

    def refuse_if(ctx: ToolContext, what: str) -> None:
        # The test asks a tool to be refused by the provider through this variable.
        if os.environ.get("UNDO_APP_REFUSE") == what:
            raise DefiniteFailure(f"provider refused {what} of {ctx.call_id}")

    @k.tool(id=CHARGE, effects=Idempotent(key=KeyDerivation.fields("order")), caps=caps,
            timeout=10, undo=REFUND,
            undo_args=lambda args, result: {"order": args["order"], "entry": result["entry_id"]})
    def charge(ctx: ToolContext, order: str, cents: int) -> Any:
        return ctx.http.post(f"{provider}/keyed", json={"order": order, "cents": cents}).json()

    @k.tool(id=REFUND, effects=Idempotent(key=KeyDerivation.fields("order")), caps=caps,
            timeout=10)
    def refund(ctx: ToolContext, order: str, entry: int) -> Any:
        _crashpoints.hit("mid_call")
        refuse_if(ctx, "refund")
        body = {"refund_of": f"charge:{order}", "entry": entry}
        return ctx.http.post(f"{provider}/keyed", json=body).json()

    @k.tool(id=EMAIL, effects=Unsafe(), caps=caps, timeout=10)
    def email(ctx: ToolContext, to: str) -> Any:
        return plain({"to": to, "call_id": ctx.call_id})

    # The decorator form: `email` is the handle `@k.tool` returned.
    @email.undo(id=RETRACT, effects=Unsafe(), caps=caps, timeout=10,
                args=lambda args, result: {"to": args["to"]})
    def retract(ctx: ToolContext, to: str) -> Any:
        _crashpoints.hit("mid_call")
        refuse_if(ctx, "retract")
        return plain({"retract_of": to, "call_id": ctx.call_id})

    @k.tool(id=BOOK, effects=Unsafe(), caps=caps, timeout=10, undo=CANCEL)
    def book(ctx: ToolContext, room: str) -> Any:
        return plain({"book": room})

    @k.tool(id=CANCEL, effects=Idempotent(key=KeyDerivation.fields("room")), caps=caps,
            timeout=10)
    def cancel(ctx: ToolContext, room: str) -> Any:
        _crashpoints.hit("mid_call")
        return ctx.http.post(f"{provider}/keyed", json={"cancel": room}).json()

    @k.tool(id=NOTE, effects=Unsafe(), caps=caps, timeout=10)
    def note(ctx: ToolContext, text: str) -> Any:
        return plain({"note": text})

    return k


def app_kernel() -> Kernel:
    """For ``poimen undo --app``: POIMEN_DB and UNDO_APP_PROVIDER say where."""
    return make_kernel(os.environ["POIMEN_DB"], os.environ["UNDO_APP_PROVIDER"])


# Effects and reversals as the provider's ledger counts them.


def charges(ledger: Any, order: str) -> int:
    return sum(1 for e in ledger.entries(kind="keyed") if e["body"].get("order") == order)


def refunds(ledger: Any, order: str) -> int:
    return sum(
        1 for e in ledger.entries(kind="keyed") if e["body"].get("refund_of") == f"charge:{order}"
    )


def emails(ledger: Any, to: str) -> int:
    return sum(1 for e in ledger.entries(kind="plain") if e["body"].get("to") == to)


def retractions(ledger: Any, to: str) -> int:
    return sum(1 for e in ledger.entries(kind="plain") if e["body"].get("retract_of") == to)


def cancels(ledger: Any, room: str) -> int:
    return sum(1 for e in ledger.entries(kind="keyed") if e["body"].get("cancel") == room)


# The child.


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POIMEN_", "UNDO_APP_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src")])
    env.update(extra)
    return env


def spawn(db: str, provider: str, cmd: Sequence[str], **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.undo_app", *cmd, "--db", db,
         "--provider", provider],
        cwd=ROOT, env=child_env(**extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )


def finished(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    got: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return got


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="undo_app")
    p.add_argument("cmd", choices=("call", "undo"))
    p.add_argument("--db", required=True)
    p.add_argument("--provider", required=True)
    p.add_argument("--tool")
    p.add_argument("--args", default="{}")
    p.add_argument("--call-id")
    p.add_argument("--scope")
    p.add_argument("--operator")
    ns = p.parse_args(argv)
    k = make_kernel(ns.db, ns.provider)
    try:
        if ns.cmd == "call":
            out: Mapping[str, Any] = {
                "type": type(o := k.call(ns.tool, json.loads(ns.args), call_id=ns.call_id)).__name__,
                "intent_id": o.intent_id,
            }
        else:
            out = k.undo(ns.scope, operator=ns.operator).to_json()
        print(json.dumps(out))
    finally:
        k.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
