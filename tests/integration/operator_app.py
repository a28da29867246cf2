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
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from poimen import (
    Caps,
    Idempotent,
    Kernel,
    KeyDerivation,
    Notifier,
    ToolContext,
    Unsafe,
    WebhookNotifier,
)
from poimen.errors import SandboxDeniedError
from poimen.testing import register_test_tools

HOOK = "ops.post_hook"
HOOK_CHECK = "Look for the message in the channel's history (Slack: the channel, or the audit log)."
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 0.5


def register_ops(kernel: Kernel, provider_url: str, *, timeout: float = 10.0) -> None:
    # Unsafe has no deadline to wait for: a generous timeout keeps loaded CI machines honest.
    u = httpx.URL(provider_url)
    client = httpx.Client(base_url=provider_url, timeout=timeout)

    @kernel.tool(
        id=HOOK, effects=Unsafe(), caps=Caps(hosts=(f"{u.host}:{u.port}",)), timeout=timeout
    )
    def post_hook(
        ctx: ToolContext, channel: str, api_token: str, payload: dict[str, Any]
    ) -> dict[str, Any]:
        # The secret goes to the provider as a header, never into its ledger body.
        r = client.post(
            "/plain",
            json={"channel": channel, "payload": payload},
            headers={"Authorization": f"Bearer {api_token}"},
        )
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body


ROGUE = "ops.rogue_refund"


def register_rogue(kernel: Kernel, provider_url: str) -> None:
    """An Idempotent tool that sets its own idempotency key: the keyed capability denies the
    write and records the denial before the tool sees the refusal."""
    u = httpx.URL(provider_url)

    @kernel.tool(
        id=ROGUE,
        effects=Idempotent(key=KeyDerivation.fields("order_id")),
        caps=Caps(hosts=(f"{u.host}:{u.port}",)),
        timeout=TIMEOUT,
    )
    def rogue_refund(ctx: ToolContext, order_id: str) -> dict[str, Any]:
        r = ctx.http.post(
            f"{provider_url}/keyed",
            json={"order_id": order_id},
            headers={"Idempotency-Key": f"my-own-{order_id}"},
        )
        body: dict[str, Any] = r.json()
        return body


def make_kernel() -> Kernel:
    notifiers: list[Notifier] | None = None
    hook = os.environ.get("POIMEN_TEST_WEBHOOK")
    if hook:
        notifiers = [
            WebhookNotifier(
                hook,
                secret=os.environ["POIMEN_TEST_WEBHOOK_SECRET"],
                console_url=os.environ.get("POIMEN_TEST_CONSOLE_URL"),
                timeout=30.0,
            )
        ]
    renotify = os.environ.get("POIMEN_TEST_RENOTIFY")
    mode: Any = os.environ.get("POIMEN_TEST_MODE", "live")
    kernel = Kernel(
        os.environ["POIMEN_DB"],
        mode=mode,
        notifiers=notifiers,
        deadline_margin=0.1,
        renotify_after=float(renotify) if renotify else None,
    )
    provider = os.environ["POIMEN_TEST_PROVIDER"]
    register_test_tools(kernel, provider, timeout=TIMEOUT)
    register_ops(kernel, provider)
    register_rogue(kernel, provider)
    kernel.describe(HOOK, check=HOOK_CHECK)
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
        cwd=ROOT,
        env=child_env(db_url, provider_url, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
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
                threading.Thread(
                    target=_call, args=(kernel, ns.tool, args, f"{ns.prefix}-{i}"), daemon=True
                )
                for i in range(ns.n)
            ]
            for t in threads:
                t.start()
            if os.environ.get("POIMEN_PAUSE_AT"):
                # Threads share one pause file and may trip over each other writing it; either
                # way none records an outcome. Wait here for the parent's SIGKILL.
                while True:
                    time.sleep(3600)
            for t in threads:
                t.join()
    finally:
        kernel.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# Helpers for the tests: real children, the installed `poimen` command.

POIMEN = Path(sys.executable).with_name("poimen")


def crash(
    tmp_path: Path,
    db_url: str,
    provider_url: str,
    tool: str,
    args: Mapping[str, Any],
    call_id: str,
    point: str = "after_effect",
    **extra: str,
) -> int:
    """Run one call in a child and SIGKILL it at `point`; returns the child's pid."""
    from poimen.testing import kill_at_pause

    pause = tmp_path / f"pause-{call_id.replace('/', '_')}"
    proc = spawn(
        db_url,
        provider_url,
        ["call", "--tool", tool, "--args", json.dumps(dict(args)), "--call-id", call_id],
        POIMEN_PAUSE_AT=point,
        POIMEN_PAUSE_FILE=str(pause),
        **extra,
    )
    kill_at_pause(proc, pause)
    return proc.pid


def run_call(
    db_url: str,
    provider_url: str,
    tool: str,
    args: Mapping[str, Any],
    call_id: str,
    **extra: str,
) -> dict[str, Any]:
    proc = spawn(
        db_url,
        provider_url,
        ["call", "--tool", tool, "--args", json.dumps(dict(args)), "--call-id", call_id],
        **extra,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


def poimen(
    *args: str, db: str | None = None, provider: str | None = None, **extra: str
) -> subprocess.CompletedProcess[str]:
    """The installed `poimen` console script, as an operator would run it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    if db is not None:
        env["POIMEN_DB"] = db
    if provider is not None:
        env["POIMEN_TEST_PROVIDER"] = provider
    env.update(extra)
    return subprocess.run(
        [str(POIMEN), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def poimen_json(*args: str, db: str | None = None, **kw: str) -> Any:
    r = poimen(*args, "--json", db=db, **kw)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout)


def shadow_denial(db_url: str, provider_url: str, call_id: str) -> None:
    """An Unsafe call in shadow mode: denied before dispatch, with a denial row for the audit
    (the shadow run is answered "would have called")."""
    out = run_call(
        db_url,
        provider_url,
        "test.email",
        {"to": "z@example.com", "subject": "x"},
        call_id,
        POIMEN_TEST_MODE="shadow",
    )
    assert out.get("type") == "Pending", out
