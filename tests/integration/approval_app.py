"""A crash-test child for calls that need an operator's approval: `call` records one (it
awaits approval), `resume` waits for its outcome (driving it once approved), `recover` runs a
pass. Tools write to the witness provider: `ap.charge` (Idempotent, keyed), `ap.email`
(Unsafe, plain)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import httpx

from poimen import Caps, Idempotent, Kernel, KeyDerivation, ToolContext, Unsafe
from poimen._engine import crashpoints as _crashpoints
from poimen.testing import outcome_json

CHARGE, EMAIL = "ap.charge", "ap.email"


def make_kernel(db: str, provider: str, **kw: Any) -> Kernel:
    k = Kernel(db, notifiers=[], deadline_margin=0.1, **kw)
    client = httpx.Client(base_url=provider, timeout=5)
    k.on_close(client.close)
    host = httpx.URL(provider)
    caps = Caps(hosts=(f"{host.host}:{host.port}",))

    @k.tool(id=CHARGE, effects=Idempotent(key=KeyDerivation.fields("order")), caps=caps,
            timeout=2, requires_approval=lambda a: a["cents"] > 1000)
    def charge(ctx: ToolContext, order: str, cents: int) -> Any:
        _crashpoints.hit("mid_call")
        return ctx.http.post(f"{provider}/keyed", json={"order": order, "cents": cents}).json()

    @k.tool(id=EMAIL, effects=Unsafe(), caps=caps, timeout=2, requires_approval=True)
    def email(ctx: ToolContext, to: str) -> Any:
        _crashpoints.hit("mid_call")
        return client.post("/plain", json={"to": to, "call_id": ctx.call_id}).json()

    return k


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=("call", "resume", "recover"))
    p.add_argument("--db", required=True)
    p.add_argument("--provider", required=True)
    p.add_argument("--tool", default=EMAIL)
    p.add_argument("--args", default='{"to": "bob"}')
    p.add_argument("--call-id", default="c1")
    ns = p.parse_args(argv)
    k = make_kernel(ns.db, ns.provider)
    try:
        if ns.cmd == "call":
            out = k.call(ns.tool, json.loads(ns.args), call_id=ns.call_id)
        elif ns.cmd == "resume":
            out = k.wait_sync(ns.call_id, timeout=30)
        else:
            print(json.dumps({"completed": k.recover().completed}))
            return 0
        print(json.dumps(outcome_json(out)))
    finally:
        k.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
