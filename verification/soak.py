"""The kill soak (docs/verification.md): worker processes on one log, SIGKILLed at random.

K worker processes make calls of every effect class against the witness provider (with its
faults on) and run recovery passes; the driver SIGKILLs one at a random moment, starts another
in its place, and so on until N kills. A new worker calls again some of the calls the killed
one had in flight (the same call ids: a takeover by call id), and every worker's recovery takes
over the others' orphans. Beside the calls, workers act as operators (approving or rejecting
calls that await approval, some of which expire), undo completed charges (a refund, an Unsafe
call counted by the provider's ledger) and prune the log into an archive. A last recovery,
not killed, settles what is left. Then `verification.soak_check` judges the run by the provider's
ledger, never by the log alone.

Workers are forked from a server that has imported poimen already (multiprocessing's
forkserver), so a kill costs milliseconds, not an interpreter start. Each worker writes its own
append-only side file: what it held, the leases it was given and renewed, each write to the
log with its outcome, each tool run, each call and recovery pass, with its own clock.

The seed decides the plan: the kill delays, which tools are called, which call ids are called
again, and the provider's faults (per request, see `poimen.testing._faults`). A machine's timing is
not reproducible: the same seed gives the same plan, not the same interleaving.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from poimen._capability.context import ToolContext
from poimen._core.effects import (
    Idempotent,
    KeyDerivation,
    Queryable,
    ReadOnly,
    Transactional,
    Unsafe,
)
from poimen._core.intents import Completed, Intent, IntentState
from poimen._core.tools import Caps
from poimen._engine.steps import Holds
from poimen._kernel import Kernel
from poimen._runtime import engine_of
from poimen.errors import ApprovalExpiredError, NotAwaitingApprovalError
from poimen.operator._prune import prune
from poimen.testing._faults import Faults
from poimen.testing._provider import ProviderProcess

__all__ = ["SoakConfig", "run_soak"]

DEFAULT_FAULTS = ("before=0.04,after=0.04,lost=0.04,refuse=0.02,latency=0.3,max_latency=0.25,"
                  "lookup_error=0.05")
POSTGRES_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"

# A call id says which tool it calls, so that a later worker can call it again. It ends with
# a dot, so that it is the prefix of no other: a charge's call id is its undo's scope.
TOOLS = {"i": "soak.charge", "q": "soak.ship", "u": "soak.email", "r": "soak.read",
         "a": "soak.wire", "t": "soak.note"}
CLASS = {"soak.charge": "idempotent", "soak.ship": "queryable", "soak.email": "unsafe",
         "soak.read": "readonly", "soak.wire": "unsafe", "soak.refund": "unsafe",
         "soak.note": "transactional"}
APPROVED = "soak.wire"  # the tool whose calls await an operator's approval
REFUND = "soak.refund"  # the charge's undo
_WEIGHTS = (("i", 0.25), ("q", 0.2), ("u", 0.15), ("r", 0.1), ("a", 0.15), ("t", 0.15))


def call_of(call_id: str) -> tuple[str, dict[str, Any]]:
    """The tool and arguments of a soak call id (they follow from it, always the same)."""
    tool = TOOLS[call_id[0]]
    every: dict[str, dict[str, Any]] = {
        "soak.charge": {"order_id": call_id, "amount_cents": 100},
        "soak.ship": {"order_id": call_id, "address": "1 Main St"},
        "soak.email": {"to": call_id, "subject": "soak"},
        "soak.read": {"order_id": call_id},
        "soak.wire": {"to": call_id, "subject": "wire"},
        "soak.note": {"order_id": call_id},
    }
    return tool, every[tool]


@dataclass(frozen=True, slots=True)
class SoakConfig:
    kills: int = 100
    seed: int = 0
    workers: int = 2
    db: str = "sqlite"  # sqlite, postgres, or a URL
    faults: str = DEFAULT_FAULTS
    threads: int = 3  # calls in flight per worker
    timeout: float = 0.5  # the tools' (and lookups') timeout: short, as a takeover waits it out
    margin: float = 0.2
    lease_ttl: float = 3.0
    min_delay: float = 0.02  # a worker lives this long at least before its SIGKILL
    max_delay: float = 0.8
    recover_share: float = 0.3  # how often a worker's first thread runs a recovery pass
    prune_share: float = 0.15  # how often it runs a prune instead (into its archive file)
    prune_age: float = 20.0  # what a prune removes: settled longer ago than this
    approval_ttl: float = 1.0  # the approval window of the calls that await one
    operator_share: float = 0.5  # how often a worker's second thread decides an approval
    undo_share: float = 0.35  # how often its third thread undoes a completed charge
    final_within: float = 120.0  # the final recovery gives up after this long
    workdir: str | None = None  # keep the log, ledger and side files here
    progress: bool = True
    # The soak's own test breaks a rule on purpose to show that the check catches it:
    # "claimable" lets every worker take over any call, live or not.
    break_rule: str | None = None


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    db: str
    provider: str
    worker_id: str
    side: str
    errors: str
    seed: str
    threads: int
    timeout: float
    margin: float
    lease_ttl: float
    recover_share: float
    prune_share: float
    prune_age: float
    approval_ttl: float
    operator_share: float
    undo_share: float
    archive: str
    reuse: tuple[str, ...]
    recover_first: bool = False  # one recovery pass before any call
    break_rule: str | None = None
    flat: bool = True  # Kernel.call's flat path (False: the generator protocol only)
    asynchronous: bool = False  # calls by `acall` of async tools (the sync ones stay sync)


@dataclass(slots=True)
class WorkerRecord:
    """What the driver knows of one worker process (times on this machine's clock)."""

    worker_id: str
    pid: int = 0
    started: float = 0.0
    kill_sent: float | None = None  # just before the SIGKILL: alive until at least then
    ended: float | None = None
    exitcode: int | None = None
    reused: int = 0


# --------------------------------------------------------------------------- side files


class Side:
    """An append-only JSON-lines file; one write(2) per record, so a SIGKILL cuts none."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(self, **rec: Any) -> None:
        os.write(self._fd, (json.dumps(rec, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


class _LoggedHolds(Holds):
    __slots__ = ("_side",)

    def __init__(self, side: Side) -> None:
        super().__init__()
        self._side = side

    def take(self, intent_id: str) -> bool:
        taken = super().take(intent_id)
        if taken:
            self._side.log(e="hold", i=intent_id, t=time.time())
        return taken

    def drop(self, intent_id: str) -> None:
        super().drop(intent_id)
        self._side.log(e="drop", i=intent_id, t=time.time())


# Writes on a fence: (intent id, fence) are their first two arguments.
_FENCED = ("record_outcome", "complete_landed", "mark_indeterminate", "defer", "record_unknown",
           "extend_deadline")


def instrument(kernel: Kernel, side: Side) -> None:
    """Log this kernel's holds and every write it makes to the log, after it returned."""
    engine = engine_of(kernel)
    engine.holds = _LoggedHolds(side)
    store = engine.store

    def wrap(name: str, note: Any) -> None:
        original = getattr(store, name)

        def logged(*a: Any, **kw: Any) -> Any:
            t0 = time.time()
            res = original(*a, **kw)
            side.log(e="w", op=name, t0=t0, t1=time.time(), **note(res, *a, **kw))
            return res

        setattr(store, name, logged)

    wrap("record_dispatch", lambda res, d: {
        "i": res[0].id, "f": res[0].fence, "ok": res[1], "lease": d.lease_expires_at})
    wrap("claim", lambda res, intent_id, fence, owner, **kw: {
        "i": intent_id, "f": fence, "ok": res is not None, "lease": kw["lease_expires_at"],
        "nf": None if res is None else res.fence})
    for name in _FENCED:
        wrap(name, lambda res, intent_id, fence, *a, **kw: {
            "i": intent_id, "f": fence, "ok": bool(res)})
    # Calls awaiting approval and undo's events: the check finds each one in the log or in a
    # prune's archive.
    wrap("record_awaiting", lambda res, d, *a, **kw: {"i": res[0].id, "ok": res[1]})
    wrap("record_event", lambda res, intent_id, kind, **kw: {
        "i": intent_id, "k": kind, "ok": bool(res), "d": kw["detail"]})
    wrap("renew_leases", lambda res, worker_id, ids, until, now: {
        "ids": list(ids), "until": until, "n": res})


# --------------------------------------------------------------------------- the tools


@dataclass(frozen=True, slots=True)
class _Req:
    """What a soak tool sends: through the kernel's keyed handle or a plain client."""

    method: str
    path: str
    kw: dict[str, Any]
    keyed: bool = False
    status: bool = False  # the answer is the status code (a read), not the provider's body


Build = Callable[..., _Req]


def register_soak_tools(
    kernel: Kernel, url: str, side: Side, timeout: float, approval_ttl: float = 1.0,
    *, asynchronous: bool = False,
) -> None:
    """One tool per effect class against the provider, an Unsafe one whose calls await
    approval, the charge's undo (a refund) and a Transactional one writing the application's
    table; each logs its runs to `side`. `asynchronous`: the provider's tools are coroutines
    (`acall` takes the async flat path), the same ids and effects as the others'."""
    # Imported here: a worker's process runs `poimen.testing` as its main module first, when
    # the soak was started with `python -m poimen.testing`.
    from poimen.testing import provider_lookup, provider_result

    client = httpx.Client(base_url=url, timeout=timeout, verify=False)  # plain HTTP: no CA load
    kernel.on_close(client.close)
    u = httpx.URL(url)
    caps = Caps(hosts=(f"{u.host}:{u.port}",))

    @contextlib.contextmanager
    def run(ctx: ToolContext) -> Iterator[None]:
        side.log(e="run", i=ctx.intent_id, a=ctx.attempt, t=time.time())
        try:
            yield
        finally:
            side.log(e="ran", i=ctx.intent_id, a=ctx.attempt, t=time.time())

    def answer(req: _Req, r: httpx.Response) -> Any:
        return r.status_code if req.status else provider_result(r)

    def tool(**registration: Any) -> Callable[[Build], Build]:
        """Registers `build` (the tool's arguments, what it sends) as a sync or async tool."""

        def register(build: Build) -> Build:
            fn: Callable[..., Any]
            if asynchronous:
                @functools.wraps(build)
                async def fn(ctx: ToolContext, **kw: Any) -> Any:
                    req = build(ctx, **kw)
                    with run(ctx):
                        if req.keyed:
                            r = await ctx.ahttp.request(req.method, url + req.path, **req.kw)
                        else:
                            async with httpx.AsyncClient(timeout=timeout, verify=False) as plain:
                                r = await plain.request(req.method, url + req.path, **req.kw)
                        return answer(req, r)
            else:
                @functools.wraps(build)
                def fn(ctx: ToolContext, **kw: Any) -> Any:
                    req = build(ctx, **kw)
                    with run(ctx):
                        handle = ctx.http if req.keyed else client
                        return answer(req, handle.request(req.method, url + req.path, **req.kw))

            kernel.tool(caps=caps, timeout=timeout, **registration)(fn)
            return build

        return register

    @tool(id=REFUND, effects=Unsafe())
    def refund(ctx: ToolContext, order_id: str, amount_cents: int) -> _Req:
        return _Req("POST", "/plain", {"json": {"to": ctx.call_id, "refund_of": order_id,
                                                 "amount_cents": amount_cents}})

    @tool(id="soak.charge", undo=REFUND,
          effects=Idempotent(key=KeyDerivation.fields("order_id", "amount_cents")))
    def charge(ctx: ToolContext, order_id: str, amount_cents: int) -> _Req:
        return _Req("POST", "/keyed", {"json": {"order_id": order_id,
                                                 "amount_cents": amount_cents}}, keyed=True)

    @tool(id="soak.ship", effects=Queryable(lookup=provider_lookup(url, client)))
    def ship(ctx: ToolContext, order_id: str, address: str) -> _Req:
        assert ctx.request_id is not None
        return _Req("POST", "/requests", {"json": {"order_id": order_id, "address": address},
                                          "headers": {"X-Request-Id": ctx.request_id}})

    @tool(id="soak.email", effects=Unsafe())
    def email(ctx: ToolContext, to: str, subject: str) -> _Req:
        return _Req("POST", "/plain", {"json": {"to": to, "subject": subject}})

    @tool(id="soak.read", effects=ReadOnly())
    def read(ctx: ToolContext, order_id: str) -> _Req:
        return _Req("GET", f"/requests/{order_id}", {}, keyed=True, status=True)

    @tool(id=APPROVED, effects=Unsafe(), requires_approval=True, approval_ttl=approval_ttl)
    def wire(ctx: ToolContext, to: str, subject: str) -> _Req:
        return _Req("POST", "/plain", {"json": {"to": to, "subject": subject}})

    # Its witness is the application's own table (`app_db`): a row per landed write.
    @kernel.tool(id="soak.note", effects=Transactional(database=app_db(kernel.store.url)),
                 caps=caps, timeout=timeout)
    def note(ctx: ToolContext, order_id: str) -> int:
        with run(ctx):
            q = "?" if ctx.tx.paramstyle == "qmark" else "%s"
            ctx.tx.execute(f"INSERT INTO soak_notes (call_id) VALUES ({q})", (order_id,))
            if ctx.attempt == 1 and zlib.crc32(order_id.encode()) % 8 == 0:
                raise RuntimeError("soak: a tool that fails after its write")  # rolled back
            return ctx.attempt


def app_db(log_url: str) -> str:
    """The Transactional tool's database: on SQLite a file beside the log, on PostgreSQL the
    log's own database (its outcome commits with the write)."""
    if log_url.startswith("sqlite:///"):
        return log_url.rsplit("/", 1)[0] + "/app.db"
    return log_url


def make_app_table(log_url: str) -> None:
    url = app_db(log_url)
    sql = "CREATE TABLE IF NOT EXISTS soak_notes (call_id TEXT NOT NULL)"
    if url.startswith("sqlite:///"):
        import sqlite3

        with contextlib.closing(sqlite3.connect(url[len("sqlite:///") :])) as conn:
            conn.execute(sql)
            conn.commit()
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as pg:
        pg.execute(sql)


def soak_kernel(db: str, provider: str, worker_id: str, side: Side, *, timeout: float,
                margin: float, lease_ttl: float, approval_ttl: float = 1.0,
                asynchronous: bool = False) -> Kernel:
    """A kernel as the soak runs it: short back-offs (a deferral waits no longer than the soak
    needs), no notifiers, every hold and write logged."""
    kernel = Kernel(db, worker_id=worker_id, lease_ttl=lease_ttl, deadline_margin=margin,
                    lookup_backoff=0.05, max_backoff=0.5, max_attempts=4, wait_bound=0.5,
                    notifiers=[], log_events=False)
    instrument(kernel, side)
    register_soak_tools(kernel, provider, side, timeout, approval_ttl, asynchronous=asynchronous)
    return kernel


# --------------------------------------------------------------------------- a worker


def worker_main(plan: WorkerPlan, up: Any) -> None:
    """A worker process: calls and recovery passes until its SIGKILL. It says on `up` (a
    pipe) when its kernel is open: the driver counts its kill delay from then."""
    err = os.open(plan.errors, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(err, 2)
    os.close(err)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    side = Side(plan.side)
    side.log(e="start", t=time.time(), flat=plan.flat, aio=plan.asynchronous)
    kernel = soak_kernel(plan.db, plan.provider, plan.worker_id, side, timeout=plan.timeout,
                         margin=plan.margin, lease_ttl=plan.lease_ttl,
                         approval_ttl=plan.approval_ttl, asynchronous=plan.asynchronous)
    engine = engine_of(kernel)
    engine.flat = plan.flat
    if plan.break_rule == "claimable":
        engine.claimable = lambda intent, now: "claimable"  # type: ignore[method-assign]
    reuse = deque(plan.reuse)
    lock = threading.Lock()
    side.log(e="up", t=time.time())
    up.send(True)
    up.close()
    if plan.recover_first:  # the killed workers' orphans are still there: a long pass
        side.log(e="rec", t=time.time())
        kernel.recover()
        side.log(e="rec_end", t=time.time())

    def one(n: int) -> None:
        rng = random.Random(f"{plan.seed}/{n}")
        loop = asyncio.new_event_loop() if plan.asynchronous else None  # one per thread
        i = 0
        while True:
            if n == 0 and rng.random() < plan.prune_share:
                side.log(e="prune", t=time.time())
                pruned = prune(kernel.store, older_than=plan.prune_age, allow_short=True,
                               archive=plan.archive, batch=rng.choice((5, 50)))
                side.log(e="prune_end", t=time.time(), n=pruned.pruned)
                continue
            if n == 0 and rng.random() < plan.recover_share:
                side.log(e="rec", t=time.time())
                report = kernel.recover()
                side.log(e="rec_end", t=time.time(), scanned=report.scanned)
                time.sleep(rng.uniform(0.0, 0.1))  # passes spaced as a recovery duty spaces them
                continue
            turn = decide_one if n == 1 and rng.random() < plan.operator_share else (
                undo_one if n == 2 and rng.random() < plan.undo_share else None)
            if turn is not None:
                try:
                    turn(kernel, side, rng, plan.worker_id)
                except Exception as exc:  # reported by the driver, as for a call
                    side.log(e="err", c=turn.__name__, t=time.time(),
                             m=f"{type(exc).__name__}: {exc}")
                    time.sleep(0.05)
                continue
            with lock:
                again = reuse.popleft() if reuse and rng.random() < 0.5 else None
            if again is None:
                prefix = rng.choices([p for p, _ in _WEIGHTS], [w for _, w in _WEIGHTS])[0]
                call_id = f"{prefix}.{plan.worker_id}.{n}.{i}."
                i += 1
            else:
                call_id = again
            tool, args = call_of(call_id)
            side.log(e="call", c=call_id, t=time.time(), again=again is not None)
            try:
                if loop is not None:
                    out = loop.run_until_complete(kernel.acall(tool, args, call_id=call_id))
                else:
                    out = kernel.call(tool, args, call_id=call_id)
                side.log(e="called", c=call_id, t=time.time(), o=type(out).__name__)
            except Exception as exc:  # reported by the driver: a harness or a poimen bug
                side.log(e="err", c=call_id, t=time.time(), m=f"{type(exc).__name__}: {exc}")
                time.sleep(0.05)

    for n in range(plan.threads):
        threading.Thread(target=one, args=(n,), daemon=True).start()
    threading.Event().wait()  # the driver's SIGKILL ends this process


def left_to_expire(call_id: str) -> bool:
    """One call awaiting approval in five, chosen by its call id, is never decided: it expires
    in every run, however fast the operators turn (a random "leave this turn" did not)."""
    return zlib.crc32(call_id.encode()) % 5 == 0


def decide_one(kernel: Kernel, side: Side, rng: random.Random, worker_id: str) -> None:
    """An operator's turn: one call awaiting approval approved or rejected (those
    `left_to_expire` are never chosen); an approved call is then run by the same call id again
    (else recovery runs it)."""
    waiting = [i for i in kernel.store.list_intents(state=IntentState.AWAITING_APPROVAL,
                                                    limit=40) if not left_to_expire(i.call_id)]
    if not waiting:
        time.sleep(0.02)
        return
    it = rng.choice(waiting)
    what = rng.choices(("approve", "reject"), (0.7, 0.3))[0]
    side.log(e="decide", i=it.id, c=it.call_id, d=what, t=time.time())
    try:
        decide = kernel.approve if what == "approve" else kernel.reject
        decide(it.id, operator=f"op-{worker_id}", reason="soak")
        side.log(e="decided", i=it.id, t=time.time())
    except (ApprovalExpiredError, NotAwaitingApprovalError) as exc:  # another came first
        side.log(e="decided", i=it.id, t=time.time(), x=type(exc).__name__)
        return
    if what == "approve" and rng.random() < 0.5:
        tool, args = call_of(it.call_id)
        side.log(e="call", c=it.call_id, t=time.time(), again=True)
        out = kernel.call(tool, args, call_id=it.call_id)
        side.log(e="called", c=it.call_id, t=time.time(), o=type(out).__name__)


def undo_one(kernel: Kernel, side: Side, rng: random.Random, worker_id: str) -> None:
    """Undo a completed charge, chosen among a few so that undos of one charge meet: at
    once, after a kill, after a prune. With none in the log, charge one first."""
    done = kernel.store.list_intents(state=IntentState.COMPLETED, tool_id="soak.charge",
                                     limit=8)
    if done:
        scope = rng.choice(done).call_id
    else:
        scope = f"i.{worker_id}.u.{rng.randrange(10**9)}."
        tool, args = call_of(scope)
        side.log(e="call", c=scope, t=time.time(), again=False)
        out = kernel.call(tool, args, call_id=scope)
        side.log(e="called", c=scope, t=time.time(), o=type(out).__name__)
        if not isinstance(out, Completed):
            side.log(e="undo_none", t=time.time())
            return
    side.log(e="undo", c=scope, t=time.time())
    report = kernel.undo(scope, operator=f"op-{worker_id}", reason="soak")
    side.log(e="undone", c=scope, t=time.time(), ok=report.complete)


# --------------------------------------------------------------------------- the driver


@contextlib.contextmanager
def _database(db: str, base: Path, keep: bool) -> Iterator[str]:
    if db == "sqlite":
        yield f"sqlite:///{base / 'intents.db'}"
        return
    if db != "postgres":
        yield db
        return
    import psycopg

    admin = os.environ.get("POIMEN_SOAK_POSTGRES", POSTGRES_ADMIN)
    name = f"poimen_soak_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE template0")
    try:
        yield admin.rsplit("/", 1)[0] + f"/{name}"
    finally:
        if not keep:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@dataclass(slots=True)
class _Live:
    process: Any
    record: WorkerRecord
    delay: float
    kill_at: float  # monotonic; counted from when the worker is up, unless from its start
    up: Any  # the pipe it says it is up on, until it has


@dataclass(slots=True)
class SoakRun:
    """What the driver hands to the check."""

    config: SoakConfig
    db_url: str
    base: Path
    workers: list[WorkerRecord] = field(default_factory=list)
    seconds: float = 0.0
    final_passes: int = 0
    final_seconds: float = 0.0


def _in_flight(side: Path) -> list[str]:
    """Call ids a worker had started and not finished when it was killed."""
    open_calls: dict[str, None] = {}
    with contextlib.suppress(FileNotFoundError), side.open(encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec["e"] == "call":
                open_calls[rec["c"]] = None
            elif rec["e"] in ("called", "err"):
                open_calls.pop(rec["c"], None)
    return list(open_calls)


def drive(cfg: SoakConfig, base: Path, db_url: str, provider_url: str) -> SoakRun:
    """Start workers, SIGKILL them one by one at random delays, `cfg.kills` times."""
    run = SoakRun(cfg, db_url, base)
    (base / "sides").mkdir(exist_ok=True)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["verification.soak"])
    rng = random.Random(cfg.seed)
    # (call id, when its worker was killed): called again only while far younger than what
    # a prune removes (a call id used again after a prune is a new call: docs/retention.md).
    reuse: deque[tuple[str, float]] = deque(maxlen=200)
    live: list[_Live] = []
    spawned = killed = crashed = 0
    started = time.monotonic()
    last_note = started

    def spawn() -> None:
        nonlocal spawned
        wid = f"w{spawned}"
        spawned += 1
        while reuse and reuse[0][1] < time.monotonic() - cfg.prune_age / 4:
            reuse.popleft()
        again = tuple(reuse.popleft()[0] for _ in range(min(len(reuse), 2 * cfg.threads)))
        # One worker in four recovers first and is killed soon: kills inside recovery.
        first = rng.random() < 0.25
        plan = WorkerPlan(db=db_url, provider=provider_url, worker_id=wid,
                          side=str(base / "sides" / f"{wid}.jsonl"),
                          errors=str(base / "sides" / f"{wid}.err"), seed=f"{cfg.seed}/{wid}",
                          threads=cfg.threads, timeout=cfg.timeout, margin=cfg.margin,
                          lease_ttl=cfg.lease_ttl, recover_share=cfg.recover_share,
                          prune_share=cfg.prune_share, prune_age=cfg.prune_age,
                          approval_ttl=cfg.approval_ttl, operator_share=cfg.operator_share,
                          undo_share=cfg.undo_share,
                          archive=str(base / "sides" / f"{wid}.archive.jsonl"), reuse=again,
                          recover_first=first, break_rule=cfg.break_rule,
                          # w1, w3, ...: flat, w0, w2, ...: not; w1, w2, w5, w6, ...: acall
                          flat=spawned % 2 == 0, asynchronous=spawned // 2 % 2 == 1)
        rec = WorkerRecord(wid, started=time.time(), reused=len(again))
        up, tell = ctx.Pipe(duplex=False)
        p = ctx.Process(target=worker_main, args=(plan, tell), daemon=True)
        p.start()
        tell.close()
        rec.pid = p.pid or 0
        run.workers.append(rec)
        delay = rng.uniform(cfg.min_delay, cfg.max_delay / 3 if first else cfg.max_delay)
        # One kill in ten counts from the start, so that some land while a kernel opens.
        from_start = rng.random() < 0.1
        live.append(_Live(p, rec, delay, time.monotonic() + delay if from_start else math.inf,
                          up))

    def reap(w: _Live, *, kill: bool) -> None:
        if w.up is not None:
            w.up.close()
        if kill:
            w.record.kill_sent = time.time()
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.process.pid, signal.SIGKILL)
        w.process.join()
        w.record.ended = time.time()
        w.record.exitcode = w.process.exitcode
        w.process.close()
        live.remove(w)
        killed_at = time.monotonic()
        reuse.extend((c, killed_at) for c in _in_flight(base / "sides" / f"{w.record.worker_id}.jsonl"))

    if cfg.progress:
        print(f"soak: seed {cfg.seed}, {cfg.kills} kills, {cfg.workers} worker(s), log "
              f"{db_url}, files in {base}", file=sys.stderr, flush=True)
    while killed < cfg.kills:
        while len(live) < cfg.workers and spawned < cfg.kills + crashed:
            spawn()
        nxt = min(w.kill_at for w in live)
        ready = multiprocessing.connection.wait(
            [w.process.sentinel for w in live] + [w.up for w in live if w.up is not None],
            timeout=min(1.0, max(0.0, nxt - time.monotonic())))
        for w in live:
            if w.up is not None and w.up in ready:
                with contextlib.suppress(EOFError, OSError):
                    w.up.recv()
                    w.kill_at = min(w.kill_at, time.monotonic() + w.delay)
                w.up.close()
                w.up = None
        for w in list(live):
            if w.process.exitcode is not None:  # died on its own: reported by the check
                crashed += 1
                reap(w, kill=False)
                if crashed > 5 + cfg.kills // 10:
                    raise RuntimeError(f"{crashed} workers died on their own; see {base}/sides")
            elif w.kill_at <= time.monotonic():
                reap(w, kill=True)
                killed += 1
        if cfg.progress and time.monotonic() - last_note > 60:
            last_note = time.monotonic()
            rate = killed / (last_note - started)
            print(f"soak: {killed}/{cfg.kills} kills in {last_note - started:.0f}s "
                  f"({rate:.2f}/s)", file=sys.stderr, flush=True)
    run.seconds = time.monotonic() - started
    return run


def final_recovery(run: SoakRun, provider_url: str) -> list[Intent]:
    """Recovery passes, none killed, until nothing is due; returns what is still unfinished.
    Between passes it waits for the rows' own times (next check, lease), never a fixed sleep."""
    cfg = run.config
    started = time.monotonic()
    side = Side(str(run.base / "sides" / "final.jsonl"))
    rec = WorkerRecord("final", pid=os.getpid(), started=time.time())
    run.workers.append(rec)
    kernel = soak_kernel(run.db_url, provider_url, "final", side, timeout=cfg.timeout,
                         margin=cfg.margin, lease_ttl=cfg.lease_ttl,
                         approval_ttl=cfg.approval_ttl)
    try:
        end = time.monotonic() + cfg.final_within
        while True:
            # Unfinished, and awaiting an approval nobody gives: recovery expires it.
            left = kernel.store.list_unfinished(after_id="", limit=100_000)
            left += kernel.store.list_intents(state=IntentState.AWAITING_APPROVAL,
                                              limit=100_000)
            if not left or time.monotonic() > end:
                break
            now = kernel.store.now()
            due = min((i.next_check_at or now) for i in left)
            if due > now:
                time.sleep(min(due - now, max(0.0, end - time.monotonic())) + 0.01)
            side.log(e="rec", t=time.time())
            report = kernel.recover()
            side.log(e="rec_end", t=time.time())
            run.final_passes += 1
            if not (report.completed or report.failed or report.indeterminate):
                time.sleep(0.05)  # nothing settled: let the rows' times come
        return left
    finally:
        kernel.close()
        side.close()
        rec.ended = time.time()
        run.final_seconds = time.monotonic() - started


def run_soak(cfg: SoakConfig) -> Any:
    """The whole soak: drive, recover, check. Returns a `verification.soak_check.SoakReport`."""
    from verification.soak_check import check_run, save_run

    if cfg.kills < 1 or cfg.workers < 1 or cfg.threads < 1:
        raise ValueError("kills, workers and threads must be at least 1")
    if not (cfg.prune_age > 0 and cfg.approval_ttl > 0):
        raise ValueError("prune_age and approval_ttl must be positive durations")
    if cfg.break_rule not in (None, "claimable"):
        raise ValueError(f"unknown rule to break {cfg.break_rule!r}")
    Faults.parse(cfg.faults)  # refused before anything starts
    base = Path(cfg.workdir).absolute() if cfg.workdir else Path(
        tempfile.mkdtemp(prefix="poimen-soak-"))
    base.mkdir(parents=True, exist_ok=True)
    if (base / "run.json").exists():
        raise FileExistsError(f"{base} holds a soak already: give an empty directory")
    # The faults follow the soak's seed unless the spec names its own.
    spec = cfg.faults if "seed=" in cfg.faults else f"{cfg.faults},seed={cfg.seed}".lstrip(",")
    try:
        with _database(cfg.db, base, keep=cfg.workdir is not None) as db_url:
            Kernel(db_url, worker_id="migrate", notifiers=[]).close()  # one migrator, first
            make_app_table(db_url)
            with ProviderProcess(base / "ledger.db", faults=spec) as provider:
                run = drive(cfg, base, db_url, provider.url)
                final_recovery(run, provider.url)
            save_run(run)
            return check_run(base)
    finally:
        if cfg.workdir is None:
            shutil.rmtree(base, ignore_errors=True)


# --------------------------------------------------------------------------- the command


def main(argv: list[str] | None = None) -> int:
    """`python -m verification soak` (`scripts/soak`)."""
    s = argparse.ArgumentParser(prog="python -m verification soak", description="the kill soak: "
                                "workers SIGKILLed at random, checked by the provider's ledger "
                                "(docs/verification.md)")
    s.add_argument("--kills", type=int, default=100)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--workers", type=int, default=2, help="worker processes on one log")
    s.add_argument("--db", default="sqlite",
                   help="sqlite, postgres (a fresh database on the local server) or a URL")
    s.add_argument("--faults", default=DEFAULT_FAULTS,
                   help="the provider's faults (poimen.testing._faults); '' for none")
    s.add_argument("--threads", type=int, default=3, help="calls in flight per worker")
    s.add_argument("--max-delay", type=float, default=0.8,
                   help="a worker is SIGKILLed a random time up to this after its start")
    s.add_argument("--keep", metavar="DIR", help="keep the log, ledger and side files in DIR")
    s.add_argument("--check", metavar="DIR", help="only judge the soak kept in DIR again")
    s.add_argument("--json", action="store_true")
    ns = s.parse_args(argv)
    from verification.soak_check import check_run

    try:
        if ns.check:
            report = check_run(ns.check)
        else:
            report = run_soak(SoakConfig(
                kills=ns.kills, seed=ns.seed, workers=ns.workers, db=ns.db, faults=ns.faults,
                threads=ns.threads, max_delay=ns.max_delay, workdir=ns.keep,
                progress=True))
    except (FileExistsError, ValueError) as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_json(), indent=1) if ns.json else report.table())
    return 0 if report.ok() else 1

