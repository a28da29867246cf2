"""An application for the operator-path tests, loaded by ``poimen recover --app`` and run as
a crash-test child (``python -m tests.integration.operator_app call ...``).

It registers the poimen.testing tools plus `ops.post_hook`, an Unsafe tool with a secret
argument, so that `poimen show` has something to redact. Configuration comes from the
environment: POIMEN_DB, POIMEN_TEST_PROVIDER, and optionally POIMEN_TEST_WEBHOOK (+ _SECRET),
POIMEN_TEST_CONSOLE_URL, POIMEN_TEST_MODE (live/shadow/replay), POIMEN_TEST_RENOTIFY (seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from poimen import Caps, Kernel, ToolContext, Unsafe
from poimen._notify import Notifier, WebhookNotifier
from poimen.errors import SandboxDeniedError
from poimen.testing import register_test_tools

HOOK = "ops.post_hook"
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 0.5


def register_ops(kernel: Kernel, provider_url: str, *, timeout: float = TIMEOUT) -> None:
    u = httpx.URL(provider_url)
    client = httpx.Client(base_url=provider_url, timeout=timeout)

    @kernel.tool(id=HOOK, effects=Unsafe(), caps=Caps(hosts=(f"{u.host}:{u.port}",)),
                 timeout=timeout)
    def post_hook(
        ctx: ToolContext, channel: str, api_token: str, payload: dict[str, Any]
    ) -> dict[str, Any]:
        # The secret goes to the provider as a header, never into its ledger body.
        r = client.post("/plain", json={"channel": channel, "payload": payload},
                        headers={"Authorization": f"Bearer {api_token}"})
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body


def make_kernel() -> Kernel:
    notifiers: list[Notifier] | None = None
    hook = os.environ.get("POIMEN_TEST_WEBHOOK")
    if hook:
        notifiers = [WebhookNotifier(hook, secret=os.environ["POIMEN_TEST_WEBHOOK_SECRET"],
                                     console_url=os.environ.get("POIMEN_TEST_CONSOLE_URL"),
                                     timeout=30.0)]
    renotify = os.environ.get("POIMEN_TEST_RENOTIFY")
    mode: Any = os.environ.get("POIMEN_TEST_MODE", "live")
    kernel = Kernel(os.environ["POIMEN_DB"], mode=mode, notifiers=notifiers,
                    deadline_margin=0.1, renotify_after=float(renotify) if renotify else None)
    provider = os.environ["POIMEN_TEST_PROVIDER"]
    register_test_tools(kernel, provider, timeout=TIMEOUT)
    register_ops(kernel, provider)
    return kernel


def child_env(db_url: str, provider_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src")])
    env.update(POIMEN_DB=db_url, POIMEN_TEST_PROVIDER=provider_url, **extra)
    return env


def spawn(
    db_url: str, provider_url: str, cmd: Sequence[str], **extra: str
) -> subprocess.Popen[str]:
    """This module as a child process (a crash-test child when POIMEN_PAUSE_AT is set)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.operator_app", *cmd],
        cwd=ROOT, env=child_env(db_url, provider_url, **extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _call(kernel: Kernel, tool: str, args: Mapping[str, Any], call_id: str) -> dict[str, Any]:
    try:
        out = kernel.call(tool, args, call_id=call_id)
    except SandboxDeniedError as exc:
        return {"denied": str(exc)}
    return {"type": type(out).__name__, "intent_id": out.intent_id}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="operator_app")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("call")
    c.add_argument("--tool", required=True)
    c.add_argument("--args", required=True)
    c.add_argument("--call-id", required=True)
    m = sub.add_parser("call-many", help="N concurrent calls in threads (each pauses if told)")
    m.add_argument("--tool", required=True)
    m.add_argument("--args", required=True)
    m.add_argument("--n", type=int, required=True)
    m.add_argument("--prefix", required=True)
    ns = p.parse_args(argv)
    kernel = make_kernel()
    try:
        if ns.cmd == "call":
            print(json.dumps(_call(kernel, ns.tool, json.loads(ns.args), ns.call_id)))
        else:
            args = json.loads(ns.args)
            threads = [
                threading.Thread(target=_call, args=(kernel, ns.tool, args, f"{ns.prefix}-{i}"))
                for i in range(ns.n)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        kernel.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
