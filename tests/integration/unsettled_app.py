"""A child process for the identical-call race: `call` makes one call of `hold.email`
(Unsafe: posts to the witness provider, then holds until a release file exists) in a scope,
and prints its outcome as JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from poimen import Caps, Kernel, ToolContext, Unsafe
from poimen.testing import outcome_json

HOLD = "hold.email"


def make_kernel(db: str, provider: str, release: Path, **kw: Any) -> Kernel:
    k = Kernel(db, notifiers=[], **kw)
    client = httpx.Client(base_url=provider, timeout=5)
    k.on_close(client.close)

    @k.tool(id=HOLD, effects=Unsafe(), caps=Caps(), timeout=300)
    def hold(ctx: ToolContext, to: str) -> Any:
        sent = client.post("/plain", json={"to": to, "call_id": ctx.call_id}).json()
        end = time.monotonic() + 240
        while not release.exists() and time.monotonic() < end:
            time.sleep(0.02)
        return sent

    return k


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    p.add_argument("--provider", required=True)
    p.add_argument("--release", required=True)
    p.add_argument("--call-id", required=True)
    p.add_argument("--scope", required=True)
    ns = p.parse_args(argv)
    k = make_kernel(ns.db, ns.provider, Path(ns.release), wait_bound=0.2)
    try:
        out = k.call(HOLD, {"to": "bob"}, call_id=ns.call_id, scope=ns.scope)
        print(json.dumps(outcome_json(out)))
    finally:
        k.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
