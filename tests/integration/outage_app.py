"""An application for the evidence, ageing and bulk-resolution tests: an Unsafe email tool
(`mail.send`) against poimen.testing's provider, whose ledger is the provider's sent log, with
an evidence function that reads that log and a rule that suggests a resolution. Loaded by
``poimen evidence --app``, ``poimen console --app``, and run as a crash-test child
(``python -m tests.integration.outage_app call ...``).

Configuration from the environment: POIMEN_DB, POIMEN_TEST_PROVIDER, and optionally
POIMEN_TEST_WEBHOOK (+ _SECRET), POIMEN_TEST_ESCALATE_AFTER (seconds).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from poimen import (
    Caps,
    Evidence,
    Fact,
    Kernel,
    Notifier,
    RecordedCall,
    Suggestion,
    ToolContext,
    Unsafe,
    WebhookNotifier,
)
from poimen.testing import crash_point, kill_at_pause
from tests.integration.operator_app import child_env

MAIL = "mail.send"
TIMEOUT = 5.0
ROOT = Path(__file__).resolve().parents[2]


def sent_log(provider_url: str) -> Any:
    """The evidence function: the provider's sent messages to the call's recipient, read
    through the read-only handle."""

    def gather(ctx: ToolContext, call: RecordedCall) -> list[Fact]:
        read_at = time.time()
        r = ctx.http.get(f"{provider_url}/ledger", params={"kind": "plain"})
        r.raise_for_status()
        to = call.args.get("to")
        facts = [
            Fact(
                f"sent log, read {dt.datetime.fromtimestamp(read_at, dt.UTC):%H:%M:%SZ}: "
                f"messages to {to} listed from the call's first attempt on",
                link=f"{provider_url}/ledger?kind=plain",
                data={"read_at": read_at, "to": to},
            )
        ]
        for e in r.json()["entries"]:
            body = e["body"]
            if body.get("to") != to or e["at"] < call.first_sent_at - 60:
                continue
            facts.append(
                Fact(
                    f"message {e['id']} to {to}: {body.get('subject')!r}",
                    link=f"{provider_url}/ledger?kind=plain#entry-{e['id']}",
                    data={"entry_id": e["id"], "at": e["at"],
                          "poimen_call": body.get("meta", {}).get("poimen_call")},
                )
            )
        return facts

    return gather


def one_message(call: RecordedCall, facts: Sequence[Fact]) -> Suggestion | None:
    """The rule: exactly one sent message carrying this call's id: landed; none, in a log
    read after anything sent could have landed: not landed; anything else: no suggestion."""
    mine = [f for f in facts if f.data and f.data.get("poimen_call") == call.call_id]
    if len(mine) == 1:
        return Suggestion(True, f"exactly one sent message carries this call's id ({mine[0].text})")
    read = [f.data["read_at"] for f in facts if f.data and "read_at" in f.data]
    if not mine and read and max(read) > call.last_attempt_at + call.timeout:
        return Suggestion(False, "the sent log, read after the attempt's timeout, has no message "
                                 "carrying this call's id")
    return None


def register_mail(
    kernel: Kernel, provider_url: str, *, escalate_after: float | None = None,
    evidence: Any = None, timeout: float = TIMEOUT,
) -> None:
    u = httpx.URL(provider_url)
    client = httpx.Client(base_url=provider_url, timeout=TIMEOUT)
    kernel.on_close(client.close)

    @kernel.tool(
        id=MAIL, effects=Unsafe(), caps=Caps(hosts=(f"{u.host}:{u.port}",)), timeout=timeout,
        evidence=evidence or Evidence(sent_log(provider_url), suggest=one_message),
        escalate_after=escalate_after,
    )
    def send(ctx: ToolContext, to: str, subject: str, land: bool = True) -> dict[str, Any]:
        crash_point("mid_call")
        if not land:  # an outage: the connection breaks before anything is sent
            raise ConnectionResetError("connection reset before the message was sent")
        r = client.post("/plain", json={"to": to, "subject": subject,
                                        "meta": {"poimen_call": ctx.call_id}})
        r.raise_for_status()
        if os.environ.get("POIMEN_TEST_OUTAGE"):  # sent, but the answer is lost
            raise ConnectionResetError("connection reset after the message was sent")
        body: dict[str, Any] = r.json()
        return body


def make_kernel() -> Kernel:
    notifiers: list[Notifier] | None = None
    hook = os.environ.get("POIMEN_TEST_WEBHOOK")
    if hook:
        notifiers = [WebhookNotifier(hook, secret=os.environ["POIMEN_TEST_WEBHOOK_SECRET"],
                                     timeout=30.0)]
    escalate = os.environ.get("POIMEN_TEST_ESCALATE_AFTER")
    kernel = Kernel(os.environ["POIMEN_DB"], notifiers=notifiers, deadline_margin=0.1)
    register_mail(kernel, os.environ["POIMEN_TEST_PROVIDER"],
                  escalate_after=float(escalate) if escalate else None,
                  timeout=float(os.environ.get("POIMEN_TEST_MAIL_TIMEOUT", TIMEOUT)))
    kernel.describe(MAIL, check="Find the message in the provider's sent log.")
    return kernel


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="outage_app")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("call")
    c.add_argument("--args", required=True)
    c.add_argument("--call-id", required=True)
    ns = p.parse_args(argv)
    kernel = make_kernel()
    try:
        out = kernel.call(MAIL, json.loads(ns.args), call_id=ns.call_id)
        print(json.dumps({"type": type(out).__name__, "intent_id": out.intent_id}))
    finally:
        kernel.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def crash_mail(
    tmp_path: Path, db_url: str, provider_url: str, args: Mapping[str, Any], call_id: str,
    point: str = "after_effect", **extra: str,
) -> None:
    """One `mail.send` call in a child, SIGKILLed at `point`."""
    pause = tmp_path / f"pause-{call_id.replace('/', '_')}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.outage_app", "call", "--args",
         json.dumps(dict(args)), "--call-id", call_id],
        cwd=ROOT,
        env=child_env(db_url, provider_url, POIMEN_PAUSE_AT=point, POIMEN_PAUSE_FILE=str(pause),
                      **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    kill_at_pause(proc, pause)
