"""Crash-test harness, public so users can crash-test their own tools.

- `ProviderProcess` / `ProviderClient`: a provider in its own process whose ledger
  deduplicates keyed writes on the supplied key only, never on content.
- `register_test_tools`: three tools, one per effect class, writing to that provider.
- `spawn_call` / `kill_at_pause`: run one call in a child process and SIGKILL it at a crash
  point (see `crash_point` for the points and the environment variables).
- `spawn_held_calls` / `spawn_held_plan` / `kill_when_held`: many calls in one child, each
  held at its crash point, and one SIGKILL for all of them.
- `crash_drill`: the end-to-end drill the README runs: the same kills without poimen (a naive
  at-least-once runner) and with it.

Every public helper is in this one module, so that a user finds them here; beside it are the
witness provider's server (`_provider`), its process and client (`_provider_client`), its
injected faults (`_faults`) and the naive runner (`_naive`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from poimen._capability.context import ToolContext
from poimen._core.effects import (
    Idempotent,
    KeyDerivation,
    Landed,
    LookupAnswer,
    NotLanded,
    Queryable,
    Unknown,
    Unsafe,
)
from poimen._core.intents import Outcome
from poimen._core.tools import Caps
from poimen._engine import crashpoints as _crashpoints
from poimen._kernel import Kernel
from poimen.errors import DefiniteFailure

# From the client module: `python -m poimen.testing._provider` must find its module not yet
# imported (runpy would run it twice and warn, an error where warnings are errors).
from poimen.testing._provider_client import LOOKUP_MODES, ProviderClient, ProviderProcess

__all__ = [
    "CHARGE",
    "CRASH_POINTS",
    "EMAIL",
    "SHIP",
    "DrillReport",
    "ProviderClient",
    "ProviderProcess",
    "crash_drill",
    "crash_point",
    "held_call",
    "kill_at_pause",
    "kill_when_held",
    "provider_lookup",
    "provider_result",
    "register_test_tools",
    "spawn_call",
    "spawn_held_calls",
    "spawn_held_plan",
]

#: Where a crash test can stop a process: see `crash_point`.
CRASH_POINTS = _crashpoints.POINTS


def crash_point(point: str) -> None:
    """Mark a crash point in your own tool (e.g. ``crash_point("mid_call")`` before its
    effect). A no-op unless the process was started with ``POIMEN_CRASH_AT=point`` (it is
    SIGKILLed there) or ``POIMEN_PAUSE_AT=point`` with ``POIMEN_PAUSE_FILE`` (it writes the
    file and waits there for its SIGKILL): see docs/crash-testing.md."""
    _crashpoints.hit(point)


CHARGE = "test.charge"  # Idempotent: keyed write
SHIP = "test.ship"  # Queryable: write with a request id, lookup endpoint
EMAIL = "test.email"  # Unsafe: plain write, no dedup

_SRC = str(Path(__file__).resolve().parents[2])


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


def provider_result(r: httpx.Response) -> dict[str, Any]:
    """A write's answer from the provider: a refusal (4xx) is a `DefiniteFailure`; any other
    error raises (an unknown outcome)."""
    if 400 <= r.status_code < 500:
        raise DefiniteFailure(f"provider refused: {r.status_code} {r.text}")
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    return body


def register_test_tools(kernel: Kernel, provider_url: str, *, timeout: float = 2.0) -> None:
    """Register `test.charge`, `test.ship` and `test.email` against the provider."""
    client = httpx.Client(base_url=provider_url, timeout=timeout)
    kernel.on_close(client.close)
    caps = Caps(hosts=(_host_port(provider_url),))
    _check = provider_result

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
#: A call held at a crash point: (call id, tool, args, point).
HeldCall = tuple[str, str, dict[str, Any], str]


def held_call(prefix: str, i: int) -> HeldCall:
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
    cmd = ["--db", db_url, "--count", str(count), "--prefix", prefix,
           "--lease-ttl", str(lease_ttl), "--timeout", str(timeout)]
    if worker_id:
        cmd += ["--worker-id", worker_id]
    if host:
        cmd += ["--host", host]
    return _spawn_hold(provider_url, ready_file, cmd)


def spawn_held_plan(
    provider_url: str,
    plan: Sequence[HeldCall],
    ready_file: str | os.PathLike[str],
    *,
    db_url: str | None = None,
    naive_journal: str | os.PathLike[str] | None = None,
    timeout: float = 1.0,
) -> subprocess.Popen[str]:
    """`spawn_held_calls` for given calls: through poimen (`db_url`), or through the naive
    at-least-once runner of `poimen.testing._naive` (`naive_journal`), never both."""
    if (db_url is None) == (naive_journal is None):
        raise ValueError("give db_url or naive_journal, not both")
    where = ["--db", db_url] if db_url is not None else ["--naive", str(naive_journal)]
    return _spawn_hold(provider_url, ready_file,
                       [*where, "--plan", json.dumps(list(plan)), "--timeout", str(timeout)])


def _spawn_hold(
    provider_url: str, ready_file: str | os.PathLike[str], options: list[str]
) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "poimen.testing", "hold", "--provider", provider_url,
           "--ready", str(ready_file), *options]
    return subprocess.Popen(cmd, env=_child_env({}), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def kill_when_held(
    proc: subprocess.Popen[str], ready_file: str | os.PathLike[str], *, timeout: float = 60.0
) -> int:
    """Wait until a holding child has every call at its point, SIGKILL it; returns how many
    calls it held."""
    ready = Path(ready_file)
    end = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise RuntimeError(f"holding child exited {proc.returncode}:\n{err[-3000:]}")
        if time.monotonic() > end:
            proc.kill()
            proc.communicate()
            raise TimeoutError(f"holding child did not get its calls in flight in {timeout}s")
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    held: int = json.loads(ready.read_text(encoding="utf-8"))["held"]
    return held


def _hook_points(on_point: Any) -> None:
    # Child processes only: every crash point goes through `on_point` instead; the call path
    # asks `ACTIVE` before it calls `hit`.
    setattr(_crashpoints, "hit", on_point)  # noqa: B010
    setattr(_crashpoints, "ACTIVE", True)  # noqa: B010


def _hold(run: Callable[[str, str, dict[str, Any]], object], calls: Sequence[HeldCall],
          ready: str) -> int:
    local = threading.local()
    cond = threading.Condition()
    held: list[str] = []
    errors: list[str] = []

    def on_point(point: str, call_id: str | None = None) -> None:
        if getattr(local, "point", None) != point:
            return
        with cond:
            held.append(local.call_id)
            cond.notify_all()
        threading.Event().wait()  # held until the parent's SIGKILL

    def one(call: HeldCall) -> None:
        call_id, tool, args, point = call
        local.point, local.call_id = point, call_id
        try:
            run(call_id, tool, args)
        except Exception as exc:  # reported to the parent, which fails the test
            with cond:
                errors.append(f"{call_id}: {type(exc).__name__}: {exc}")
                cond.notify_all()

    _hook_points(on_point)
    for call in calls:
        threading.Thread(target=one, args=(call,), daemon=True).start()
    with cond:
        if not cond.wait_for(lambda: len(held) + len(errors) >= len(calls), timeout=120):
            print(f"only {len(held)} of {len(calls)} calls reached their points", file=sys.stderr)
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


def _hold_naive(journal_path: str, provider_url: str, calls: Sequence[HeldCall],
                ready: str, timeout: float) -> int:
    from poimen.testing import _naive

    journal = _naive.Journal(journal_path)
    with httpx.Client(base_url=provider_url, timeout=timeout) as client:
        tools = _naive.tools(client)
        return _hold(lambda step, tool, args: _naive.run_step(journal, tools, step, tool, args),
                     calls, ready)


def _stop_at(point: str, marker: str) -> None:
    """At `point`, write `marker` and SIGSTOP this process; the parent SIGCONTs it."""

    def on_point(p: str, call_id: str | None = None) -> None:
        if p == point:
            from poimen._capability import guard as _guard

            token = _guard.suspend()  # the marker is the harness's write, not the tool's
            try:
                Path(marker).write_text(f"{os.getpid()} {p}\n", encoding="ascii")
            finally:
                _guard.resume(token)
            os.kill(os.getpid(), signal.SIGSTOP)

    _hook_points(on_point)


# The drill: one plan, run without poimen and with it.
_EFFECT = {CHARGE: "idempotent", SHIP: "queryable", EMAIL: "unsafe"}
_CLASSES = {CHARGE: "charge (Idempotent)", SHIP: "ship (Queryable)", EMAIL: "email (Unsafe)"}
_KILLED = {"after_effect": "after the effect", "mid_call": "before the effect"}
# (tool, args, the point the agent is killed at, poimen's state and effect count)
DRILL_PLAN: tuple[tuple[str, dict[str, Any], str, str, int], ...] = (
    (CHARGE, {"order_id": "o-1", "amount_cents": 1200}, "after_effect", "COMPLETED", 1),
    (CHARGE, {"order_id": "o-2", "amount_cents": 900}, "mid_call", "COMPLETED", 1),
    (SHIP, {"order_id": "o-1", "address": "1 Main St"}, "after_effect", "COMPLETED", 1),
    (SHIP, {"order_id": "o-2", "address": "2 Main St"}, "mid_call", "COMPLETED", 1),
    (EMAIL, {"to": "a@example.com", "subject": "hi"}, "after_effect", "INDETERMINATE", 1),
    (EMAIL, {"to": "b@example.com", "subject": "hi"}, "mid_call", "INDETERMINATE", 0),
)
_LEGEND = """\
killed          where the agent process was SIGKILLed: before the tool's request went out, or
                after the provider applied it but before the outcome was recorded
effects         how many times the provider applied the call, counted in its own ledger (a
                separate process): 2 is a second charge, a second parcel, a second email
without poimen  a runner that journals each step and runs unfinished ones again on restart,
                as a framework's retry does; its charge sends no idempotency key
with poimen     recovery settles each call by its effect class: Idempotent is sent again with
                the same key, Queryable is looked up first, Unsafe is never sent again
state           the call in poimen's log after recovery. INDETERMINATE: nothing can make a
                retry safe, so an operator checks the provider and records what happened
                (here the first email went out, the second never did)
ok              poimen's guarantee held: this state, this many effects, the operator notified"""


@dataclass
class DrillReport:
    """What the crash drill saw, per scenario: the naive runner's effects, poimen's state and
    effects (both counted in the provider's ledger), and whether poimen's guarantee held."""

    scenarios: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    notified: int = 0
    kept: str | None = None  # the drill's directory, when asked to keep it

    def ok(self) -> bool:
        """Whether every poimen guarantee held in the drill."""
        return bool(self.scenarios) and all(s["ok"] for s in self.scenarios)

    def table(self) -> str:
        """The drill's result as the table it prints."""
        rows = [("call", "killed", "effects", "state", "effects", "ok")]
        for s in self.scenarios:
            naive = f"{s['naive_effects']}{'  twice!' if s['naive_effects'] > 1 else ''}"
            rows.append((s["call"], s["killed"], naive, s["state"], str(s["effects"]),
                         "yes" if s["ok"] else "NO"))
        w = [max(len(r[i]) for r in rows) for i in range(6)]
        w[2] = max(w[2], len("without poimen"))
        lines = [
            "six tool calls in flight when their agent process is SIGKILLed, then a restart",
            "",
            f"{'':{w[0] + w[1] + 4}}{'without poimen':{w[2]}} | with poimen",
        ]
        for r in rows:
            lines.append(f"{r[0]:{w[0]}}  {r[1]:{w[1]}}  {r[2]:{w[2]}} | {r[3]:{w[3]}}  "
                         f"{r[4]:>{w[4]}}  {r[5]}".rstrip())
        doubles = sum(1 for s in self.scenarios if s["naive_effects"] > 1)
        fixed = sum(1 for s in self.scenarios if s["effects"] > 1)
        waiting = sum(1 for s in self.scenarios if s["state"] == "INDETERMINATE")
        lines += [
            "",
            _LEGEND,
            "",
            f"operator notified: {self.notified} (the INDETERMINATE calls; in your application "
            "a log line,\n  a webhook or your own callback)",
            f"without poimen {doubles} of {len(self.scenarios)} calls took effect twice; with "
            f"poimen {fixed or 'none'} did, and {waiting} wait for an operator",
            f"drill took {self.seconds:.2f}s; "
            f"{'all poimen guarantees held' if self.ok() else 'A POIMEN GUARANTEE FAILED'}",
            "",
        ]
        if self.kept is None:
            lines.append("next: run it again with --keep DIR to keep its log, and look at it with\n"
                         "  poimen status --db ...  and  poimen console --db ...")
        else:
            db = f"sqlite:///{Path(self.kept, 'intents.db')}"
            cmd = _poimen_command()
            lines += [
                f"the drill's log is kept in {self.kept}; look at it:",
                f"  {cmd} status --db {db}    # counts, the oldest INDETERMINATE call",
                f"  {cmd} intents --db {db} --state INDETERMINATE",
                f"  {cmd} console --db {db}   # the web console: resolve the emails",
            ]
        return "\n".join(lines)


def _poimen_command() -> str:
    """The `poimen` command beside this interpreter, spelt so that it runs when pasted."""
    script = Path(sys.executable).with_name("poimen")
    if not script.exists():
        return "poimen"
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return "poimen" if shutil.which("poimen") == str(script) else str(script)


def _drill_effects(entries: Sequence[Mapping[str, Any]], tool: str, args: Mapping[str, Any]) -> int:
    """The provider's effects for one call, whichever endpoint it used: a charge by order and
    amount, a shipment by order and address, an email by recipient."""
    fields = {CHARGE: ("order_id", "amount_cents"), SHIP: ("order_id", "address"),
              EMAIL: ("to",)}[tool]
    return sum(1 for e in entries if all(e["body"].get(f) == args[f] for f in fields))


def _naive_args(args: Mapping[str, Any]) -> dict[str, Any]:
    # The same calls under other names, so that one ledger tells the two halves apart.
    return {k: f"naive-{v}" if k in ("order_id", "to") else v for k, v in args.items()}


def _settle(kernel: Kernel, call_ids: Sequence[str], *, within: float = 60.0) -> None:
    """Recover until no drill call is DISPATCHED. A Queryable call whose owner died is looked
    up only once the deadline recorded for it has passed: wait for that time, then recover."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        left = [i for i in map(kernel.store.get_by_call_id, call_ids)
                if i is not None and i.state.value == "DISPATCHED"]
        if not left:
            return
        due = max((i.next_check_at or i.deadline_at or 0.0) for i in left)
        while kernel.store.now() < due and time.monotonic() < end:
            time.sleep(min(0.02, max(due - kernel.store.now(), 0.0)))
        kernel.recover()
    raise TimeoutError(f"drill calls still unfinished after {within}s")


def crash_drill(
    workdir: str | os.PathLike[str] | None = None, *, lookup_mode: str = "truthful"
) -> DrillReport:
    """The same six calls killed mid-flight twice: once in a naive at-least-once runner
    (`poimen.testing._naive`) that runs unfinished steps again on restart, once through poimen,
    whose restarted kernel recovers them. Both halves are counted in one provider's ledger.

    `workdir` keeps the drill's files (its log `intents.db`, the provider's ledger, the naive
    runner's journal) there; it must not hold a drill's log already. Without it they go to a
    temporary directory that is removed at the end. `lookup_mode` makes the provider's
    lookup answer as `ProviderProcess` describes; anything but "truthful" shows the drill
    catching a wrong answer (and failing)."""
    started = time.monotonic()
    if workdir is not None:
        base = Path(workdir).absolute()
        base.mkdir(parents=True, exist_ok=True)
        if (base / "intents.db").exists():
            raise FileExistsError(f"{base} holds a drill's log already: give an empty directory")
    else:
        base = Path(tempfile.mkdtemp(prefix="poimen-drill-"))
    try:
        report = _drill(base, lookup_mode)
    finally:
        if workdir is None:
            shutil.rmtree(base, ignore_errors=True)
    report.kept = None if workdir is None else str(base)
    report.seconds = time.monotonic() - started
    return report


def _drill(base: Path, lookup_mode: str) -> DrillReport:
    from poimen._engine.notify import CallbackNotifier
    from poimen.testing import _naive

    db_url = f"sqlite:///{base / 'intents.db'}"
    journal = base / "naive-journal.jsonl"
    plan = [(f"drill-{i}", tool, args, point)
            for i, (tool, args, point, _, _) in enumerate(DRILL_PLAN)]
    naive_plan = [(f"naive-{i}", tool, _naive_args(args), point)
                  for i, (tool, args, point, _, _) in enumerate(DRILL_PLAN)]
    report = DrillReport()
    with ProviderProcess(base / "ledger.db", lookup_mode=lookup_mode) as provider, \
            ProviderClient(provider.url) as ledger:
        # Both agents run at once; each is killed with all six calls in flight.
        held = [
            (spawn_held_plan(provider.url, plan, base / "ready-poimen", db_url=db_url,
                             timeout=0.5), base / "ready-poimen"),
            (spawn_held_plan(provider.url, naive_plan, base / "ready-naive",
                             naive_journal=journal, timeout=0.5), base / "ready-naive"),
        ]
        for proc, ready in held:
            kill_when_held(proc, ready)
        # Without poimen: the restart runs every unfinished step again (beside poimen's).
        naive = threading.Thread(target=_naive.restart, args=(journal, provider.url))
        naive.start()

        notified: dict[str, str] = {}  # delivery id -> intent id, as the operator got them
        kernel = Kernel(db_url, deadline_margin=0.1, notifiers=[CallbackNotifier(
            lambda n: notified.setdefault(n.delivery_id, n.intent_id), name="drill-operator")])
        register_test_tools(kernel, provider.url, timeout=0.5)
        try:
            kernel.launch(background=False)
            _settle(kernel, [cid for cid, *_ in plan])
            kernel.deliver_notifications()
            naive.join()
            entries = ledger.entries()
            for (cid, tool, args, point), (_, _, naive_args, _), (*_, state, n) in zip(
                plan, naive_plan, DRILL_PLAN, strict=True
            ):
                intent = kernel.store.get_by_call_id(cid)
                assert intent is not None
                effects = _drill_effects(entries, tool, args)
                was_notified = intent.id in notified.values()
                report.scenarios.append({
                    "name": f"{_EFFECT[tool]}, killed {_KILLED[point]}",
                    "call": _CLASSES[tool],
                    "killed": _KILLED[point],
                    "tool": tool,
                    "naive_effects": _drill_effects(entries, tool, naive_args),
                    "state": intent.state.value,
                    "effects": effects,
                    "notified": was_notified,
                    "ok": intent.state.value == state and effects == n
                    and was_notified == (state == "INDETERMINATE"),
                })
            report.notified = len(notified)
        finally:
            kernel.close()
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
    where = h.add_mutually_exclusive_group(required=True)
    where.add_argument("--db", help="through poimen, with this log")
    where.add_argument("--naive", metavar="JOURNAL", help="through the naive runner instead")
    h.add_argument("--provider", required=True)
    calls = h.add_mutually_exclusive_group(required=True)
    calls.add_argument("--count", type=int, help="this many mixed calls (see held_call)")
    calls.add_argument("--plan", help="JSON list of [call id, tool, args, point]")
    h.add_argument("--ready", required=True)
    h.add_argument("--prefix", default="held")
    h.add_argument("--timeout", type=float, default=1.0)
    h.add_argument("--worker-id")
    h.add_argument("--host")
    h.add_argument("--lease-ttl", type=float, default=30.0)
    d = sub.add_parser("drill", help="the end-to-end crash drill, without poimen and with it")
    d.add_argument("--keep", metavar="DIR",
                   help="keep the drill's log, ledger and journal in DIR (default: removed)")
    d.add_argument("--json", action="store_true")
    d.add_argument("--lookup-mode", default="truthful", choices=LOOKUP_MODES,
                   help="how the provider answers lookups; a lying one makes the drill fail")
    ns = p.parse_args(argv)
    if ns.cmd == "drill":
        try:
            report = crash_drill(ns.keep, lookup_mode=ns.lookup_mode)
        except FileExistsError as exc:
            print(f"drill: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(asdict(report), indent=2) if ns.json else report.table())
        return 0 if report.ok() else 1
    if ns.cmd == "hold":
        held: list[HeldCall] = (
            [tuple(c) for c in json.loads(ns.plan)]
            if ns.plan else [held_call(ns.prefix, i) for i in range(ns.count)]
        )
        if ns.naive:
            return _hold_naive(ns.naive, ns.provider, held, ns.ready, ns.timeout)
    kernel = Kernel(ns.db, worker_id=ns.worker_id, host=ns.host, deadline_margin=0.1,
                    lease_ttl=ns.lease_ttl)
    register_test_tools(kernel, ns.provider, timeout=ns.timeout)
    try:
        if ns.cmd == "hold":
            return _hold(lambda cid, tool, args: kernel.call(tool, args, call_id=cid),
                         held, ns.ready)
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
