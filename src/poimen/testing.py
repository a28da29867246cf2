"""Crash-test harness, public so users can crash-test their own tools.

- `ProviderProcess` / `ProviderClient`: a provider in its own process whose ledger
  deduplicates keyed writes on the supplied key only, never on content.
- `register_test_tools`: three tools, one per effect class, writing to that provider.
- `spawn_call` / `kill_at_pause`: run one call in a child process and SIGKILL it at a crash
  point (see `poimen._crashpoints` for the points and the environment variables).
- `crash_drill`: the end-to-end drill the README runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from poimen import _crashpoints
from poimen._capability import ToolContext
from poimen._effects import (
    Idempotent,
    KeyDerivation,
    Landed,
    LookupAnswer,
    NotLanded,
    Queryable,
    Unknown,
    Unsafe,
)
from poimen._intents import Outcome
from poimen._kernel import Kernel
from poimen._provider import ProviderClient, ProviderProcess
from poimen._tools import Caps
from poimen.errors import DefiniteFailure

__all__ = [
    "CHARGE",
    "EMAIL",
    "SHIP",
    "DrillReport",
    "ProviderClient",
    "ProviderProcess",
    "crash_drill",
    "held_call",
    "kill_at_pause",
    "provider_lookup",
    "register_test_tools",
    "spawn_call",
    "spawn_held_calls",
]

CHARGE = "test.charge"  # Idempotent: keyed write
SHIP = "test.ship"  # Queryable: write with a request id, lookup endpoint
EMAIL = "test.email"  # Unsafe: plain write, no dedup

_SRC = str(Path(__file__).resolve().parent.parent)


def _host_port(url: str) -> str:
    u = httpx.URL(url)
    return f"{u.host}:{u.port}"


def provider_lookup(url: str, client: httpx.Client | None = None) -> Any:
    """A `RequestIdLookup` over the provider's lookup endpoint."""
    client = client or httpx.Client(base_url=url, timeout=10)

    def lookup(request_id: str, /) -> LookupAnswer:
        r = client.get(f"/requests/{request_id}")
        if r.status_code == 200:
            return Landed(r.json())
        if r.status_code == 404:
            return NotLanded()
        return Unknown(f"provider answered {r.status_code}")

    return lookup


def register_test_tools(kernel: Kernel, provider_url: str, *, timeout: float = 2.0) -> None:
    """Register `test.charge`, `test.ship` and `test.email` against the provider."""
    client = httpx.Client(base_url=provider_url, timeout=timeout)
    kernel.on_close(client.close)
    caps = Caps(hosts=(_host_port(provider_url),))

    def _check(r: httpx.Response) -> dict[str, Any]:
        if 400 <= r.status_code < 500:
            raise DefiniteFailure(f"provider refused: {r.status_code} {r.text}")
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    @kernel.tool(
        id=CHARGE,
        effects=Idempotent(key=KeyDerivation.fields("order_id", "amount_cents")),
        caps=caps,
        timeout=timeout,
    )
    def charge(ctx: ToolContext, order_id: str, amount_cents: int, note: str = "") -> dict[str, Any]:
        _crashpoints.hit("mid_call")
        body = {"order_id": order_id, "amount_cents": amount_cents, "note": note}
        # Through the kernel's keyed handle: it sets the key header; a raw client is denied.
        return _check(ctx.http.post(f"{provider_url}/keyed", json=body))

    @kernel.tool(
        id=SHIP, effects=Queryable(lookup=provider_lookup(provider_url, client)), caps=caps,
        timeout=timeout,
    )
    def ship(ctx: ToolContext, order_id: str, address: str) -> dict[str, Any]:
        _crashpoints.hit("mid_call")
        assert ctx.request_id is not None
        body = {"order_id": order_id, "address": address}
        return _check(client.post("/requests", json=body,
                                  headers={"X-Request-Id": ctx.request_id}))

    @kernel.tool(id=EMAIL, effects=Unsafe(), caps=caps, timeout=timeout)
    def email(ctx: ToolContext, to: str, subject: str) -> dict[str, Any]:
        _crashpoints.hit("mid_call")
        return _check(client.post("/plain", json={"to": to, "subject": subject}))


def _child_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("POIMEN_CRASH_AT", None)
    env.pop("POIMEN_PAUSE_AT", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_SRC, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def spawn_call(
    db_url: str,
    provider_url: str,
    tool: str,
    args: Mapping[str, Any],
    call_id: str,
    *,
    crash_at: str | None = None,
    pause_at: str | None = None,
    pause_file: str | os.PathLike[str] | None = None,
    worker_id: str | None = None,
    host: str | None = None,
    timeout: float = 2.0,
) -> subprocess.Popen[str]:
    """Run one call in a child process (`python -m poimen.testing call ...`)."""
    extra: dict[str, str] = {}
    if crash_at:
        extra["POIMEN_CRASH_AT"] = crash_at
    if pause_at:
        if pause_file is None:
            raise ValueError("pause_at needs a pause_file")
        extra["POIMEN_PAUSE_AT"] = pause_at
        extra["POIMEN_PAUSE_FILE"] = str(pause_file)
    cmd = [sys.executable, "-m", "poimen.testing", "call", "--db", db_url, "--provider",
           provider_url, "--tool", tool, "--call-id", call_id, "--args", json.dumps(dict(args)),
           "--timeout", str(timeout)]
    if worker_id:
        cmd += ["--worker-id", worker_id]
    if host:
        cmd += ["--host", host]
    return subprocess.Popen(cmd, env=_child_env(extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def kill_at_pause(
    proc: subprocess.Popen[str], pause_file: str | os.PathLike[str], *, timeout: float = 30.0
) -> str:
    """Wait until the child reaches its pause point, SIGKILL it; returns the point it reached."""
    marker = Path(pause_file)
    end = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise RuntimeError(f"child exited {proc.returncode} before its pause point:\n{err}")
        if time.monotonic() > end:
            proc.kill()
            raise TimeoutError(f"child did not reach its pause point in {timeout}s")
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    if proc.stdout:
        proc.stdout.close()
    if proc.stderr:
        proc.stderr.close()
    return marker.read_text(encoding="ascii").split()[1]


def outcome_json(outcome: Outcome) -> dict[str, Any]:
    return {"type": type(outcome).__name__, **asdict(outcome)}


HOLD_POINTS = ("after_dispatch_commit", "mid_call", "after_effect")


def held_call(prefix: str, i: int) -> tuple[str, str, dict[str, Any], str]:
    """Call `i` of a held batch: (call id, tool, args, the point it is held at)."""
    tool = (CHARGE, SHIP, EMAIL)[i % 3]
    every: dict[str, dict[str, Any]] = {
        CHARGE: {"order_id": f"{prefix}-{i}", "amount_cents": 100 + i},
        SHIP: {"order_id": f"{prefix}-{i}", "address": f"{i} Main St"},
        EMAIL: {"to": f"{prefix}-{i}@example.com", "subject": "hi"},
    }
    args = every[tool]
    return f"{prefix}-{i}", tool, args, HOLD_POINTS[(i // 3) % 3]


def spawn_held_calls(
    db_url: str,
    provider_url: str,
    count: int,
    ready_file: str | os.PathLike[str],
    *,
    prefix: str = "held",
    worker_id: str | None = None,
    host: str | None = None,
    lease_ttl: float = 30.0,
    timeout: float = 1.0,
) -> subprocess.Popen[str]:
    """A child that makes `count` calls at once (mixed classes, see `held_call`), holds each at
    its crash point, writes `ready_file` once all are held, and waits for the parent's SIGKILL."""
    cmd = [sys.executable, "-m", "poimen.testing", "hold", "--db", db_url, "--provider",
           provider_url, "--count", str(count), "--ready", str(ready_file), "--prefix", prefix,
           "--lease-ttl", str(lease_ttl), "--timeout", str(timeout)]
    if worker_id:
        cmd += ["--worker-id", worker_id]
    if host:
        cmd += ["--host", host]
    return subprocess.Popen(cmd, env=_child_env({}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _hook_points(on_point: Any) -> None:
    # Child processes only: every crash point goes through `on_point` instead.
    setattr(_crashpoints, "hit", on_point)  # noqa: B010


def _hold(kernel: Kernel, count: int, prefix: str, ready: str) -> int:
    local = threading.local()
    cond = threading.Condition()
    held: list[str] = []
    errors: list[str] = []

    def on_point(point: str) -> None:
        if getattr(local, "point", None) != point:
            return
        with cond:
            held.append(local.call_id)
            cond.notify_all()
        threading.Event().wait()  # held until the parent's SIGKILL

    def run(i: int) -> None:
        call_id, tool, args, point = held_call(prefix, i)
        local.point, local.call_id = point, call_id
        try:
            kernel.call(tool, args, call_id=call_id)
        except Exception as exc:  # reported to the parent, which fails the test
            with cond:
                errors.append(f"{call_id}: {type(exc).__name__}: {exc}")
                cond.notify_all()

    _hook_points(on_point)
    for i in range(count):
        threading.Thread(target=run, args=(i,), daemon=True).start()
    with cond:
        if not cond.wait_for(lambda: len(held) + len(errors) >= count, timeout=120):
            print(f"only {len(held)} of {count} calls reached their points", file=sys.stderr)
            return 1
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    tmp = ready + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"pid": os.getpid(), "held": len(held)}, f)
    os.replace(tmp, ready)
    threading.Event().wait()
    return 0


def _stop_at(point: str, marker: str) -> None:
    """At `point`, write `marker` and SIGSTOP this process; the parent SIGCONTs it."""

    def on_point(p: str) -> None:
        if p == point:
            from poimen import _guard

            token = _guard.suspend()  # the marker is the harness's write, not the tool's
            try:
                Path(marker).write_text(f"{os.getpid()} {p}\n", encoding="ascii")
            finally:
                _guard.resume(token)
            os.kill(os.getpid(), signal.SIGSTOP)

    _hook_points(on_point)


@dataclass
class DrillReport:
    """What the crash drill saw: per scenario, the state and the provider's ledger count."""

    scenarios: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def ok(self) -> bool:
        return all(s["ok"] for s in self.scenarios)

    def table(self) -> str:
        lines = [f"{'scenario':44} {'state':15} {'ledger':>6}  ok"]
        for s in self.scenarios:
            lines.append(f"{s['name']:44} {s['state']:15} {s['ledger']:>6}  "
                         f"{'yes' if s['ok'] else 'NO'}")
        lines.append(f"drill took {self.seconds:.2f}s; "
                     f"{'all guarantees held' if self.ok() else 'A GUARANTEE FAILED'}")
        return "\n".join(lines)


def crash_drill(workdir: str | os.PathLike[str] | None = None) -> DrillReport:
    """Kill a real child mid-call for each effect class, recover, count effects in the ledger."""
    started = time.monotonic()
    base = Path(workdir or tempfile.mkdtemp(prefix="poimen-drill-"))
    base.mkdir(parents=True, exist_ok=True)
    db_url = f"sqlite:///{base / 'intents.db'}"
    report = DrillReport()
    # (name, tool, args, pause point, expected state, expected ledger count, ledger filter)
    plan: list[tuple[str, str, dict[str, Any], str, str, int]] = [
        ("idempotent, killed after the effect", CHARGE,
         {"order_id": "o-1", "amount_cents": 1200}, "after_effect", "COMPLETED", 1),
        ("idempotent, killed before the effect", CHARGE,
         {"order_id": "o-2", "amount_cents": 900}, "mid_call", "COMPLETED", 1),
        ("queryable, landed before the kill", SHIP,
         {"order_id": "o-1", "address": "1 Main St"}, "after_effect", "COMPLETED", 1),
        ("queryable, never arrived", SHIP,
         {"order_id": "o-2", "address": "2 Main St"}, "mid_call", "COMPLETED", 1),
        ("unsafe, killed after the effect", EMAIL,
         {"to": "a@example.com", "subject": "hi"}, "after_effect", "INDETERMINATE", 1),
        ("unsafe, killed before the effect", EMAIL,
         {"to": "b@example.com", "subject": "hi"}, "mid_call", "INDETERMINATE", 0),
    ]
    with ProviderProcess(base / "ledger.db") as provider, ProviderClient(provider.url) as ledger:
        call_ids = []
        for i, (_name, tool, args, point, _state, _n) in enumerate(plan):
            pause = base / f"pause-{i}"
            proc = spawn_call(db_url, provider.url, tool, args, f"drill-{i}", pause_at=point,
                              pause_file=pause, timeout=0.5)
            kill_at_pause(proc, pause)
            call_ids.append(f"drill-{i}")
        kernel = Kernel(db_url, deadline_margin=0.1)
        register_test_tools(kernel, provider.url, timeout=0.5)
        try:
            kernel.launch(background=False)
            time.sleep(0.7)  # past the Queryable deadline: "never arrived" is trusted only then
            kernel.recover()
            for (name, tool, args, _point, state, n), cid in zip(plan, call_ids, strict=True):
                intent = kernel.store.get_by_call_id(cid)
                assert intent is not None
                if tool == CHARGE:
                    count = ledger.count(kind="keyed", key=intent.key)
                elif tool == SHIP:
                    count = ledger.count(kind="request", request_id=intent.request_id)
                else:
                    count = sum(1 for e in ledger.entries(kind="plain")
                                if e["body"].get("to") == args["to"])
                report.scenarios.append({
                    "name": name, "tool": tool, "state": intent.state.value, "ledger": count,
                    "ok": intent.state.value == state and count == n,
                    "notified": bool(kernel.store.notifications(intent.id)),
                })
        finally:
            kernel.close()
    report.seconds = time.monotonic() - started
    return report


def _main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m poimen.testing")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("call", help="run one call against the provider (a crash-test child)")
    c.add_argument("--db", required=True)
    c.add_argument("--provider", required=True)
    c.add_argument("--tool", required=True)
    c.add_argument("--call-id", required=True)
    c.add_argument("--args", required=True)
    c.add_argument("--timeout", type=float, default=2.0)
    c.add_argument("--worker-id")
    c.add_argument("--host")
    c.add_argument("--lease-ttl", type=float, default=30.0)
    c.add_argument("--stop-at", help="SIGSTOP this process at a crash point")
    c.add_argument("--stop-file", help="written when --stop-at is reached")
    r = sub.add_parser("recover", help="one recovery pass with the test tools registered")
    r.add_argument("--db", required=True)
    r.add_argument("--provider", required=True)
    r.add_argument("--timeout", type=float, default=2.0)
    r.add_argument("--worker-id")
    r.add_argument("--host")
    r.add_argument("--lease-ttl", type=float, default=30.0)
    h = sub.add_parser("hold", help="many calls at once, each held at a crash point")
    h.add_argument("--db", required=True)
    h.add_argument("--provider", required=True)
    h.add_argument("--count", type=int, required=True)
    h.add_argument("--ready", required=True)
    h.add_argument("--prefix", default="held")
    h.add_argument("--timeout", type=float, default=1.0)
    h.add_argument("--worker-id")
    h.add_argument("--host")
    h.add_argument("--lease-ttl", type=float, default=30.0)
    d = sub.add_parser("drill", help="the end-to-end crash drill")
    d.add_argument("--dir")
    d.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    if ns.cmd == "drill":
        report = crash_drill(ns.dir)
        print(json.dumps(asdict(report), indent=2) if ns.json else report.table())
        return 0 if report.ok() else 1
    kernel = Kernel(ns.db, worker_id=ns.worker_id, host=ns.host, deadline_margin=0.1,
                    lease_ttl=ns.lease_ttl)
    register_test_tools(kernel, ns.provider, timeout=ns.timeout)
    try:
        if ns.cmd == "hold":
            return _hold(kernel, ns.count, ns.prefix, ns.ready)
        if ns.cmd == "call" and ns.stop_at:
            _stop_at(ns.stop_at, ns.stop_file or os.devnull)
        if ns.cmd == "call":
            out = kernel.call(ns.tool, json.loads(ns.args), call_id=ns.call_id)
            print(json.dumps(outcome_json(out)))
        else:
            print(json.dumps(asdict(kernel.recover())))
    finally:
        kernel.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
