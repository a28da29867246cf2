"""The kill soak's verdict: invariants judged by the provider's ledger and the workers' own
side files, never by the log alone (docs/verification.md).

The log says which calls exist and how each ended; whether an effect happened, and how often,
only the ledger says (its ``entries``, and its ``received`` writes: what was sent, landed or
not). Who drove a call when is in each worker's side file, written by the worker itself, and in
the driver's record of when it sent each SIGKILL. What a prune removed from the log is in the
workers' archive files: the log and the archives together must hold every intent and event
the side files say was committed.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from poimen._core.intents import Attempt, Event, Intent, IntentState, Owner
from poimen.store import open_store
from poimen.store._inline import detail_json
from poimen.store._retention import PRUNABLE
from verification.soak import APPROVED, CLASS, SoakConfig, SoakRun, WorkerRecord, app_db

__all__ = ["Check", "SoakReport", "check_run", "save_run"]

# Leases are on the log's clock (PostgreSQL: the server's), side files on the worker's: a
# takeover is judged a violation only when it is one by more than this.
CLOCK_TOLERANCE = 0.05
_ENDING = frozenset({"record_outcome", "complete_landed", "mark_indeterminate", "defer"})
_UNFENCED = frozenset({"record_awaiting", "record_event"})  # writes on no attempt's fence
_KIND_CLASS = {"keyed": "idempotent", "request": "queryable", "plain": "unsafe"}
_SHOWN = 5  # violations printed per invariant (all are in the JSON)


@dataclass(slots=True)
class Check:
    name: str
    checked: int = 0
    violations: list[str] = field(default_factory=list)
    allowed: int = 0  # cases the rule lets pass (a live owner taken over once its lease ran out)


@dataclass(slots=True)
class SoakReport:
    seed: int
    kills: int
    workers: int
    db: str
    faults: str
    seconds: float
    final_seconds: float
    final_passes: int
    checks: list[Check]
    stats: dict[str, Any]
    workdir: str | None = None

    def ok(self) -> bool:
        return all(not c.violations for c in self.checks)

    def violations(self) -> int:
        return sum(len(c.violations) for c in self.checks)

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok()
        out["kills_per_second"] = self.kills / self.seconds if self.seconds else None
        return out

    def table(self) -> str:
        w = max(len(c.name) for c in self.checks)
        lines = [
            f"poimen kill soak: seed {self.seed}, {self.kills} kills, {self.workers} worker(s), "
            f"{self.db}",
            f"provider faults: {self.faults or 'none'}",
            "",
            f"{'invariant':{w}}  {'checked':>8}  violations",
        ]
        for c in self.checks:
            lines.append(f"{c.name:{w}}  {c.checked:>8}  {len(c.violations)}")
            lines += [f"    {v}" for v in c.violations[:_SHOWN]]
            if len(c.violations) > _SHOWN:
                lines.append(f"    ... {len(c.violations) - _SHOWN} more (--json lists all)")
        lines += ["", "what happened:"]
        lines += [f"  {k}: {v}" for k, v in self.stats.items()]
        rate = self.kills / self.seconds if self.seconds else 0.0
        lines += [
            "",
            f"kills took {self.seconds:.1f}s ({rate:.2f} kills/s); final recovery "
            f"{self.final_seconds:.1f}s in {self.final_passes} pass(es)",
            f"seed {self.seed}: "
            + ("0 violations" if self.ok() else f"{self.violations()} VIOLATION(S)"),
        ]
        if self.workdir:
            lines.append(f"log, ledger and side files kept in {self.workdir}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- run.json


def save_run(run: SoakRun) -> None:
    data = {"config": asdict(run.config), "db_url": run.db_url, "seconds": run.seconds,
            "final_passes": run.final_passes, "final_seconds": run.final_seconds,
            "workers": [asdict(w) for w in run.workers]}
    (run.base / "run.json").write_text(json.dumps(data, indent=1), encoding="utf-8")


class Sides:
    """The workers' side files, read again by each consumer: a long soak's do not fit in
    memory at once."""

    def __init__(self, directory: Path) -> None:
        self.paths = {p.stem: p for p in sorted(directory.glob("*.jsonl"))
                      if not p.name.endswith(".archive.jsonl")}

    def __iter__(self) -> Iterator[tuple[str, Iterator[dict[str, Any]]]]:
        for wid, path in self.paths.items():
            yield wid, _records(path)

    def of(self, worker_id: str) -> Iterator[dict[str, Any]]:
        path = self.paths.get(worker_id)
        return iter(()) if path is None else _records(path)


def _records(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):  # a line cut by a SIGKILL mid-write is not a record
                yield json.loads(line)


# --------------------------------------------------------------------------- the check


def check_run(base: str | Path) -> SoakReport:
    """Judge a soak whose files are in `base` (its log must still exist)."""
    base = Path(base)
    data = json.loads((base / "run.json").read_text(encoding="utf-8"))
    cfg = SoakConfig(**data["config"])
    workers = [WorkerRecord(**w) for w in data["workers"]]
    sides = Sides(base / "sides")
    archive = Archive(base / "sides")
    ledger = sqlite3.connect(f"file:{base / 'ledger.db'}?mode=ro", uri=True)
    try:
        entries = ledger.execute("SELECT kind, key, request_id, body FROM entries").fetchall()
        received = ledger.execute("SELECT kind, body, fault FROM received").fetchall()
    finally:
        ledger.close()
    store = open_store(data["db_url"])
    try:
        in_log = store.list_intents(limit=2**62)
        present = {i.id for i in in_log}
        # What a prune removed is judged by its archive, like what the log still holds.
        intents = in_log + [archive.intent(i) for i in archive.ids() if i not in present]
        unfinished = store.list_unfinished(after_id="", limit=2**62)

        def events(intent_id: str) -> list[Event]:
            return store.events(intent_id) if intent_id in present else archive.events(intent_id)

        def attempts(intent_id: str) -> list[Attempt]:
            if intent_id in present:
                return store.attempts(intent_id)
            return archive.attempts(intent_id)

        runners = _runs_by_owner(sides, attempts)
        kept = _nothing_lost(sides, present, archive, events)
        approvals = _approvals(intents, events, received)
    finally:
        store.close()
    checks, effects = _ledger_checks(intents, entries, received)
    checks += [_rows_check(intents, _app_rows(data["db_url"])), _refunds(entries), approvals,
               kept]
    waiting = [i for i in intents if i.state == IntentState.AWAITING_APPROVAL]
    left = Check("nothing unfinished after the final recovery", len(intents))
    left.violations += [f"{i.call_id} ({i.tool_id}) still {i.state.value}"
                        for i in [*unfinished, *waiting]]
    checks.append(left)
    takeovers = _takeovers(workers, sides)
    checks += [takeovers, runners]
    db = data["db_url"].split(":", 1)[0]
    return SoakReport(
        seed=cfg.seed, kills=sum(1 for w in workers if w.kill_sent is not None),
        workers=cfg.workers, db="sqlite" if db == "sqlite" else "postgresql", faults=cfg.faults,
        seconds=data["seconds"], final_seconds=data["final_seconds"],
        final_passes=data["final_passes"], checks=checks,
        stats={**_stats(intents, effects, received, workers, sides),
               "acts on a live owner's call after its known lease ran out (allowed)":
               takeovers.allowed,
               "intents pruned (in an archive, gone from the log)": len(intents) - len(present),
               **_feature_stats(intents, sides)},
        workdir=str(base) if cfg.workdir else None,
    )


def _ledger_checks(
    intents: list[Intent], entries: list[Any], received: list[Any]
) -> tuple[list[Check], dict[str, int]]:
    """The invariants the ledger decides; also each intent's effect count, by intent id."""
    by_key = {i.key: i for i in intents if CLASS.get(i.tool_id) == "idempotent"}
    by_request = {i.request_id: i for i in intents if CLASS.get(i.tool_id) == "queryable"}
    by_call = {i.call_id: i for i in intents}
    effects: dict[str, int] = defaultdict(int)
    one_key = Check("Idempotent: at most one effect per key and per call")
    one_request = Check("Queryable: at most one effect per call (request id)")
    sent_once = Check("Unsafe: never sent twice")
    owned = Check("every effect belongs to an intent in the log", len(entries))
    per_key: dict[str, int] = defaultdict(int)
    per_request: dict[str, int] = defaultdict(int)
    per_call: dict[tuple[str, str], int] = defaultdict(int)
    for kind, key, request_id, body_text in entries:
        body = json.loads(body_text)
        call = body.get("order_id") or body.get("to")
        per_call[kind, call] += 1
        it = {"keyed": by_key.get(key), "request": by_request.get(request_id),
              "plain": by_call.get(call)}.get(kind)
        if kind == "keyed":
            per_key[key] += 1
        elif kind == "request":
            per_request[request_id] += 1
        if it is None or it.call_id != call or CLASS.get(it.tool_id) != _KIND_CLASS[kind]:
            owned.violations.append(f"{kind} effect {body_text} (key {key}, request id "
                                    f"{request_id}) matches no intent")
            continue
        effects[it.id] += 1
    for key, n in per_key.items():
        if n > 1:
            one_key.violations.append(f"key {key}: {n} effects")
    for request_id, n in per_request.items():
        if n > 1:
            one_request.violations.append(f"request id {request_id}: {n} effects")
    for (kind, call), n in per_call.items():
        if n > 1:
            target = {"keyed": one_key, "request": one_request, "plain": sent_once}[kind]
            target.violations.append(f"call {call}: {n} {kind} effects")
    sends: dict[str, int] = defaultdict(int)
    for kind, body_text, _fault in received:
        if kind == "plain":
            sends[json.loads(body_text)["to"]] += 1
    for call, n in sends.items():
        if n > 1:
            sent_once.violations.append(f"call {call}: sent {n} times")
    classes: dict[str, int] = defaultdict(int)
    for i in intents:
        classes[CLASS.get(i.tool_id, "?")] += 1
    one_key.checked, one_request.checked = classes["idempotent"], classes["queryable"]
    sent_once.checked = classes["unsafe"]
    never_failed = Check("no landed call is FAILED (Unsafe included)")
    has_effect = Check("a COMPLETED call has its effect")
    for i in intents:
        if CLASS.get(i.tool_id) in (None, "readonly", "transactional"):
            continue  # no effect in the ledger: a Transactional one's is in its own table
        n = effects.get(i.id, 0)
        if i.state == IntentState.FAILED:
            never_failed.checked += 1
            if n:
                never_failed.violations.append(f"{i.call_id} FAILED ({i.error}) with {n} effect(s)")
        if i.state == IntentState.COMPLETED:
            has_effect.checked += 1
            if not n:
                has_effect.violations.append(f"{i.call_id} COMPLETED without an effect")
    return [one_key, one_request, sent_once, owned, never_failed, has_effect], effects


def _app_rows(log_url: str) -> dict[str, int]:
    """The Transactional tool's witness: its rows in the application's own table, by call."""
    url, sql = app_db(log_url), "SELECT call_id, COUNT(*) FROM soak_notes GROUP BY call_id"
    if url.startswith("sqlite:///"):
        conn = sqlite3.connect(f"file:{url[len('sqlite:///'):]}?mode=ro", uri=True)
        try:
            return {str(c): int(n) for c, n in conn.execute(sql).fetchall()}
        finally:
            conn.close()
    import psycopg

    with psycopg.connect(url, autocommit=True) as pg:
        return {str(c): int(n) for c, n in pg.execute(sql).fetchall()}


def _rows_check(intents: list[Intent], rows: dict[str, int]) -> Check:
    """Each Transactional write exactly once: a COMPLETED call's row is in the application's
    table once, a FAILED call's never, no call's twice, and no row without its call."""
    check = Check("Transactional: each write once in the application's table, never lost")
    calls = {i.call_id: i for i in intents if CLASS.get(i.tool_id) == "transactional"}
    check.checked = len(calls)
    for call, n in rows.items():
        if call not in calls:
            check.violations.append(f"{n} row(s) of {call} match no intent")
    for call, it in calls.items():
        n = rows.get(call, 0)
        if n > 1 or (it.state == IntentState.COMPLETED and n != 1) or (
            it.state == IntentState.FAILED and n
        ):
            check.violations.append(f"{call} {it.state.value} with {n} row(s)")
    return check


# --------------------------------------------------------------------------- takeovers


@dataclass(slots=True)
class _Ownership:
    """A worker drives an intent's fence: from its dispatch or claim committed, until it lets
    go of the intent, settles or defers it, or is SIGKILLed."""

    worker: str
    fence: int
    start: float
    lease: float
    end: float = math.inf


def _alive_until(workers: list[WorkerRecord], sides: Sides) -> dict[str, float]:
    """Until when each worker was certainly alive: its SIGKILL's sending; one that died on its
    own, its last record; one never killed (the final recovery), always."""
    out: dict[str, float] = {}
    for w in workers:
        if w.kill_sent is not None:
            out[w.worker_id] = w.kill_sent
        elif w.exitcode is not None:
            times = [r.get("t1", r.get("t", 0.0)) for r in sides.of(w.worker_id)]
            out[w.worker_id] = max(times, default=w.started)
        else:
            out[w.worker_id] = math.inf
    return out


def _takeovers(workers: list[WorkerRecord], sides: Sides) -> Check:
    """No live call claimed by another worker: no worker writes on (or runs) an intent while
    another owns it, is alive, and holds a lease that has not run out."""
    alive = _alive_until(workers, sides)
    owns: dict[str, list[_Ownership]] = defaultdict(list)
    renewals: dict[str, list[tuple[float, float, frozenset[str]]]] = defaultdict(list)
    acts: list[tuple[str, str, str, float, int | None]] = []  # worker, intent, what, when, fence
    for wid, recs in sides:
        held: dict[str, list[_Ownership]] = defaultdict(list)
        for r in recs:
            e = r["e"]
            if e == "w" and r["op"] in _UNFENCED:
                continue
            if e == "w" and r["op"] == "renew_leases":
                if r["n"] == len(r["ids"]):  # every id renewed: credit each (else none)
                    renewals[wid].append((r["t1"], r["until"], frozenset(r["ids"])))
                continue
            if e == "w" and r["ok"]:
                if r["op"] in ("record_dispatch", "claim"):
                    fence = r["f"] if r["op"] == "record_dispatch" else r["nf"]
                    o = _Ownership(wid, fence, r["t1"], r["lease"], alive.get(wid, math.inf))
                    owns[r["i"]].append(o)
                    held[r["i"]].append(o)
                    if r["op"] == "claim":
                        acts.append((wid, r["i"], "claimed", r["t0"], r["f"]))
                    continue
                acts.append((wid, r["i"], r["op"], r["t0"], r["f"]))
                if r["op"] in _ENDING:
                    _end(held.get(r["i"], ()), r["t0"])
            elif e == "drop":
                _end(held.get(r["i"], ()), r["t"])
            elif e == "run":
                acts.append((wid, r["i"], f"ran attempt {r['a']}", r["t"], None))
    check = Check("no live call taken over by another worker", len(acts))
    for wid, intent_id, what, at, fence in acts:
        for o in owns.get(intent_id, ()):
            if o.worker == wid or not (o.start < at < o.end) or (
                fence is not None and fence != o.fence
            ):
                continue
            lease = max([o.lease, *(until for t1, until, ids in renewals[o.worker]
                                    if o.start <= t1 < at and intent_id in ids)])
            if lease <= at + CLOCK_TOLERANCE:
                check.allowed += 1  # a live owner cut off longer than its lease (§8's limit)
            else:
                check.violations.append(
                    f"intent {intent_id}: {wid} {what} at {at:.3f} while {o.worker} drove "
                    f"fence {o.fence} (since {o.start:.3f}, lease until >= {lease:.3f}, alive "
                    f"until >= {min(o.end, alive.get(o.worker, math.inf)):.3f})")
    return check


def _runs_by_owner(sides: Sides, attempts: Callable[[str], list[Attempt]]) -> Check:
    """Every tool run was made by the worker the log's attempts table names as that attempt's
    owner: nobody runs a tool without having dispatched or claimed its attempt."""
    ran: dict[str, set[tuple[int, str]]] = defaultdict(set)
    for wid, recs in sides:
        for r in recs:
            if r["e"] == "run":
                ran[r["i"]].add((r["a"], wid))
    check = Check("each tool run by its attempt's owner in the log", sum(map(len, ran.values())))
    for intent_id, runs in ran.items():
        owners = {a.number: a.owner.worker_id if a.owner else None for a in attempts(intent_id)}
        for number, wid in sorted(runs):
            if owners.get(number) != wid:
                check.violations.append(f"intent {intent_id}: {wid} ran attempt {number}, which "
                                        f"the log gives to {owners.get(number)}")
    return check


def _end(owned: Any, at: float) -> None:
    for o in owned:
        if o.start <= at < o.end:
            o.end = at


# --------------------------------------------------------------------------- approvals, undo, prune


class Archive:
    """What the soak's prunes archived (each worker's archive file), by intent id: the line
    with the longest history (a batch archived again after a crash appears twice). A line a
    SIGKILL cut was never synced, so nothing was deleted after it: it is skipped."""

    def __init__(self, directory: Path) -> None:
        self._lines: dict[str, dict[str, Any]] = {}
        for path in sorted(directory.glob("*.archive.jsonl")):
            for rec in _records(path):
                iid = rec["intent"]["id"]
                old = self._lines.get(iid)
                if old is None or _length(rec) >= _length(old):
                    self._lines[iid] = rec

    def ids(self) -> list[str]:
        return list(self._lines)

    def __contains__(self, intent_id: object) -> bool:
        return intent_id in self._lines

    def intent(self, intent_id: str) -> Intent:
        d = dict(self._lines[intent_id]["intent"])
        d["state"] = IntentState(d["state"])
        d["owner"] = None if d["owner"] is None else Owner(**d["owner"])
        return Intent(**d)

    def events(self, intent_id: str) -> list[Event]:
        rec = self._lines.get(intent_id)
        return [] if rec is None else [Event(**e) for e in rec["events"]]

    def attempts(self, intent_id: str) -> list[Attempt]:
        rec = self._lines.get(intent_id)
        if rec is None:
            return []
        return [Attempt(**{**a, "owner": None if a["owner"] is None else Owner(**a["owner"])})
                for a in rec["attempts"]]


def _length(rec: dict[str, Any]) -> tuple[int, int, float]:
    return len(rec["events"]), len(rec["attempts"]), rec["intent"]["updated_at"]


def _nothing_lost(
    sides: Sides, present: set[str], archive: Archive, events: Callable[[str], list[Event]]
) -> Check:
    """Every intent a worker recorded, and every event it wrote, is in the log or, once a
    prune removed it, in the archive; and a prune removed only settled intents."""
    check = Check("nothing committed lost by prune (log + archive)")
    for wid, recs in sides:
        for r in recs:
            if r["e"] != "w" or not r.get("ok"):
                continue
            if r["op"] in ("record_dispatch", "record_awaiting"):
                check.checked += 1
                if r["i"] not in present and r["i"] not in archive:
                    check.violations.append(f"intent {r['i']} ({wid}'s {r['op']}) is in neither "
                                            "the log nor an archive")
            elif r["op"] == "record_event":
                check.checked += 1
                text = detail_json(r["d"])
                if not any(e.kind == r["k"] and e.detail == text for e in events(r["i"])):
                    where = "the log" if r["i"] in present else "the archive"
                    check.violations.append(f"intent {r['i']}: the {r['k']} event {wid} wrote "
                                            f"is not in {where}")
    for iid in archive.ids():
        if iid not in present and archive.intent(iid).state.value not in PRUNABLE:
            check.violations.append(f"intent {iid} pruned while "
                                    f"{archive.intent(iid).state.value}")
    return check


def _refunds(entries: list[Any]) -> Check:
    """Undo: every refund at the provider reverses a charge that landed, at most once."""
    charged = set()
    refunds: dict[str, int] = defaultdict(int)
    for kind, _key, _request_id, body_text in entries:
        body = json.loads(body_text)
        if kind == "keyed":
            charged.add(body.get("order_id"))
        elif kind == "plain" and "refund_of" in body:
            refunds[body["refund_of"]] += 1
    check = Check("undo: no charge refunded twice, none refunded uncharged", len(refunds))
    for call, n in sorted(refunds.items()):
        if n > 1:
            check.violations.append(f"charge {call}: refunded {n} times")
        if call not in charged:
            check.violations.append(f"charge {call}: refunded, and its charge never landed")
    return check


def _approvals(
    intents: list[Intent], events: Callable[[str], list[Event]], received: list[Any]
) -> Check:
    """A call that awaited approval is dispatched, and its request received by the provider,
    only under an approval given inside its window (the event's time before the window's
    end, both on the log's clock)."""
    sends: dict[str, int] = defaultdict(int)
    for kind, body_text, _fault in received:
        if kind == "plain":
            sends[json.loads(body_text).get("to", "")] += 1
    check = Check("nothing dispatched without an approval in its window")
    never = (IntentState.AWAITING_APPROVAL, IntentState.FAILED)
    for i in intents:
        if i.tool_id != APPROVED:
            continue
        check.checked += 1
        evs = events(i.id)
        ends = [json.loads(e.detail or "{}").get("expires_at")
                for e in evs if e.kind == "awaiting_approval"]
        approved = [e.at for e in evs if e.kind == "approved"]
        inside = any(end is None or at < end for at in approved for end in ends)
        sent = sends.get(i.call_id, 0)
        dispatched = approved or i.attempts or i.state not in never or (
            i.state == IntentState.FAILED and i.reason not in ("rejected", "approval_expired"))
        if sent and not inside:
            check.violations.append(f"{i.call_id}: {sent} write(s) received by the provider, "
                                    f"never approved inside its window ({i.state.value})")
        elif dispatched and not inside:
            check.violations.append(f"{i.call_id}: dispatched ({i.state.value}, approved at "
                                    f"{approved}) without an approval before {ends}")
    return check


def _feature_stats(intents: list[Intent], sides: Sides) -> dict[str, Any]:
    """How often the soak met approvals, undo and prune."""
    wire: dict[str, int] = defaultdict(int)
    for i in intents:
        if i.tool_id == APPROVED:
            # A call that failed after its approval (a refusal) keeps the reason "approved".
            ended = i.state == IntentState.FAILED and i.reason in ("rejected", "approval_expired")
            wire[str(i.reason) if ended else i.state.value] += 1
    undos = none = prunes = pruned = decisions = 0
    for _wid, recs in sides:
        for r in recs:
            undos += r["e"] == "undo"
            none += r["e"] == "undo_none"
            decisions += r["e"] == "decided" and "x" not in r
            if r["e"] == "prune_end":
                prunes += 1
                pruned += r["n"]
    return {
        "calls awaiting approval, by how they ended": dict(sorted(wire.items())),
        "operator decisions that took effect": decisions,
        "undo runs (refunds: intents of soak.refund above)": undos,
        "undo turns that found no completed charge": none,
        "prune runs finished (intents they removed)": f"{prunes} ({pruned})",
    }


# --------------------------------------------------------------------------- what happened


def _stats(
    intents: list[Intent], effects: dict[str, int], received: list[Any],
    workers: list[WorkerRecord], sides: Sides,
) -> dict[str, Any]:
    states: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for i in intents:
        states[CLASS.get(i.tool_id, i.tool_id)][i.state.value] += 1
    faults: dict[str, int] = defaultdict(int)
    for _kind, _body, fault in received:
        faults[fault or "none"] += 1
    at_kill = {"a tool running": 0, "a recovery pass running": 0, "a call in flight": 0,
               "a call in flight on the flat path": 0, "an acall in flight": 0,
               "an acall in flight on the async flat path": 0}
    again = errors = takeovers = late = 0
    for w in workers:
        recs = sides.of(w.worker_id)
        open_runs: set[tuple[str, int]] = set()
        open_calls: set[str] = set()
        in_recovery = flat = aio = False
        for r in recs:
            e = r["e"]
            if e == "start":
                flat, aio = bool(r.get("flat")), bool(r.get("aio"))
            elif e == "run":
                open_runs.add((r["i"], r["a"]))
            elif e == "ran":
                open_runs.discard((r["i"], r["a"]))
            elif e == "call":
                open_calls.add(r["c"])
                again += bool(r.get("again"))
            elif e in ("called", "err"):
                open_calls.discard(r["c"])
                errors += e == "err"
            elif e in ("rec", "rec_end"):
                in_recovery = e == "rec"
            elif e == "w" and r["op"] == "claim" and r["ok"]:
                takeovers += 1
            elif e == "w" and r["op"] == "record_outcome" and not r["ok"]:
                late += 1
        if w.kill_sent is not None:
            at_kill["a tool running"] += bool(open_runs)
            at_kill["a recovery pass running"] += in_recovery
            at_kill["a call in flight"] += bool(open_calls)
            at_kill["a call in flight on the flat path"] += bool(open_calls) and flat
            at_kill["an acall in flight"] += bool(open_calls) and aio
            at_kill["an acall in flight on the async flat path"] += bool(open_calls) and aio and flat
    return {
        "intents by class and state": {k: dict(v) for k, v in sorted(states.items())},
        "effects in the ledger": sum(effects.values()),
        "writes received, by injected fault": dict(sorted(faults.items())),
        "kills with ... at the SIGKILL": at_kill,
        "calls made again by call id": again,
        "claims of a new attempt (retries and takeovers)": takeovers,
        "outcomes refused on a stale fence (a late owner, or a recoverer that lost a race)": late,
        "workers that died on their own": sum(
            1 for w in workers if w.kill_sent is None and w.exitcode is not None),
        "exceptions raised to a worker's caller": errors,
    }
