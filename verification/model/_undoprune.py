"""Undo beside retention: undo runs reversing one call while prune runs remove what is old
(docs/verification.md, "The rules of issue 20").

The original is a completed call whose effect landed; its undo tool is an Unsafe refund. Undo
runs follow `poimen._undo` step by step: the scope read, the original's events read (an
`undone` event means undone), the undo intents read one call id at a time (`undo/<call id>/1`,
`/2`, ...), then the decision on the latest: a completed one marks the original undone, an
unknown one stops, a running one is resumed, none or a failed one makes the next after an
`undo_requested` event (which the store refuses on an original already undone). An undo call
is an ordinary call: dispatched (or found by its call id: a settled one answers, a running
one whose driver is gone is taken over, Unsafe, and marked Indeterminate), its refund sent
(landed, refused, or unknown), its outcome committed, then `undone` recorded on the original.
Any run may crash between any two steps; recovery marks an undo whose driver is gone
Indeterminate.

Prune runs follow `poimen.operator._prune` and the store: candidates (settled for longer than the
window), their histories read and archived, then one delete transaction that re-checks each
(still settled and old; its history the one archived; an undo intent stays while its original
does). "Old" is abstract: an undo intent that settled becomes old only once every undo run
that was running when it settled has ended (a run takes less than the window); the original
is old from the start, and may be kept by retention for good (`original_prunable=False`: its
key window, a notification, an unresolved decision) or not.

Properties: the original is reversed at most once (refunds at the provider); every event and
state committed for an intent is in the log or in the archive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from poimen._core.intents import IntentState
from verification.model._focus import Focused, Step
from verification.model._world import Rules, put

S = IntentState
_PRUNABLE = (S.COMPLETED, S.FAILED)


@dataclass(frozen=True, slots=True)
class UndoPruneConfig:
    """One bounded world."""

    undo_runs: int = 2  # runs of `undo` over the original's scope
    prunes: int = 1  # runs of `prune`
    max_undos: int = 2  # the most undo intents a run makes by number (the world's bound)
    original_prunable: bool = False  # False: retention keeps the original
    refusals: bool = True  # the refund's provider may refuse: nothing reversed, FAILED
    crashes: bool = True
    max_states: int = 2_000_000

    def describe(self) -> str:
        return (
            f"undo vs prune: undo_runs={self.undo_runs} prunes={self.prunes} "
            f"max_undos={self.max_undos} original_prunable={self.original_prunable} "
            f"refusals={self.refusals} crashes={self.crashes}"
        )

    def system(self, rules: Rules) -> UndoPrune:
        return UndoPrune(self, rules)


class Undo(NamedTuple):
    """An undo intent (its serial is its place in `State.undos`)."""

    n: int  # its call id: undo/<original's call id>/n
    st: IntentState
    run: int  # the undo run driving it; -1: none (it settled, or its driver crashed)
    present: bool  # in the log; False: pruned
    old: bool  # settled longer ago than the prune window
    young: frozenset[int]  # the runs running when it settled: it is old once they ended
    ver: int  # writes to its history


class UndoRun(NamedTuple):
    pc: str  # idle, scope, events, latest, decide, request, call, send, outcome, mark, done
    k: int = 0  # latest: the next call number to read
    latest: int = -1  # the undo intent read last (its serial), -1: none
    seen: IntentState | None = None  # its state as read
    n: int = 0  # the call number this run calls
    serial: int = -1  # the undo intent this run drives or answers with
    out: str = ""  # its refund's fate: landed, refused, lost (landed, reply lost), unsent


class Prune(NamedTuple):
    pc: str  # idle, candidates, histories, delete, done
    cand: tuple[int, ...] = ()  # candidates: -1 the original, else an undo's serial
    read: tuple[tuple[int, int], ...] = ()  # (candidate, its history's length) as archived


class State(NamedTuple):
    present: bool  # the original is in the log
    events: tuple[tuple[str, int], ...]  # its events ever committed: (kind, undo number/serial)
    undos: tuple[Undo, ...]
    runs: tuple[UndoRun, ...]
    prunes: tuple[Prune, ...]
    archive: frozenset[tuple[int, int]]  # (intent, history length) lines written
    refunds: int  # effects at the refund's provider


Go = Callable[..., Step]  # a step of one run: (label, its next step, changes to the state)
_ORIGINAL = -1
_IDLE, _DONE = UndoRun("idle"), UndoRun("done")
_ACTIVE = frozenset({"idle", "done"})


class UndoPrune(Focused):
    name = "undo vs prune"
    cfg: UndoPruneConfig

    def initial(self) -> State:
        c = self.cfg
        return State(
            True, (), (), (_IDLE,) * c.undo_runs, (Prune("idle"),) * c.prunes, frozenset(), 0
        )

    def check(self, s: State) -> str | None:
        if s.refunds > 1:
            return f"the original was reversed {s.refunds} times"
        archived: dict[int, int] = {}
        for i, v in s.archive:
            archived[i] = max(v, archived.get(i, 0))
        if not s.present and archived.get(_ORIGINAL, 0) < len(s.events):
            lost = s.events[archived.get(_ORIGINAL, 0) :]
            return f"the original's events {lost} were committed, then lost: in neither the " \
                   "log nor the archive"  # fmt: skip
        for k, u in enumerate(s.undos):
            if not u.present and archived.get(k, 0) < u.ver:
                return f"undo intent {k}'s last write was committed, then lost"
        return None

    def settled(self, s: State) -> bool:
        return all(r.pc == "done" for r in s.runs) and all(p.pc == "done" for p in s.prunes)

    def _live(self, s: State) -> frozenset[int]:
        return frozenset(k for k, r in enumerate(s.runs) if r.pc not in _ACTIVE)

    def _undone(self, s: State) -> bool:
        return any(kind == "undone" for kind, _ in s.events)

    def _called(self, s: State, n: int) -> int:
        """The undo intent the log holds under call number n, or -1."""
        return next((k for k, u in enumerate(s.undos) if u.present and u.n == n), -1)

    # Transitions.

    def successors(self, s: State) -> Iterator[Step]:
        for k, r in enumerate(s.runs):
            yield from self._run(s, k, r)
            if self.cfg.crashes and r.pc not in _ACTIVE:
                yield self._crash(s, k)
        for k, p in enumerate(s.prunes):
            yield from self._prune(s, k, p)
            if self.cfg.crashes and p.pc not in ("idle", "done"):
                done = s._replace(prunes=put(s.prunes, k, Prune("done")))
                yield Step((f"prune {k}", "crashes"), done, True)
        live = self._live(s)
        for k, u in enumerate(s.undos):
            if u.st == S.DISPATCHED and u.run < 0 and u.present:
                undos = put(s.undos, k, self._settle(u, S.INDETERMINATE, live))
                yield Step(("recovery", f"undo intent {k}: its driver is gone; Indeterminate"),
                           s._replace(undos=undos))
            if u.present and u.st != S.DISPATCHED and not u.old and not (u.young & live):
                yield Step(("time", f"undo intent {k} grows older than the prune window"),
                           s._replace(undos=put(s.undos, k, u._replace(old=True))))

    def _settle(self, u: Undo, st: IntentState, live: frozenset[int]) -> Undo:
        return u._replace(st=st, run=-1, young=live, ver=u.ver + 1)

    def _crash(self, s: State, k: int) -> Step:
        undos = tuple(u._replace(run=-1) if u.run == k else u for u in s.undos)
        done = s._replace(runs=put(s.runs, k, _DONE), undos=undos)
        return Step((f"undo {k}", "crashes"), done, True)

    def _run(self, s: State, k: int, r: UndoRun) -> Iterator[Step]:

        def go(label: str, run: UndoRun, **kw: Any) -> Step:
            return Step((f"undo {k}", label), s._replace(runs=put(s.runs, k, run), **kw))

        pc = r.pc
        if pc == "idle":
            yield go("starts", UndoRun("scope"))
        elif pc == "scope":
            if not s.present:
                yield go("the scope holds no call: done", _DONE)
            else:
                yield go("finds the original in its scope", UndoRun("events"))
        elif pc == "events":
            undone = s.present and self._undone(s)  # a pruned original reads as no events
            if undone and self.rules.undo_reads_undone:
                yield go("the original has an 'undone' event: already undone", _DONE)
            else:
                yield go("the original's events: no 'undone'", UndoRun("latest", k=1))
        elif pc == "latest":
            j = self._called(s, r.k)
            if j >= 0:
                yield go(f"reads undo/{r.k}: intent {j}, {s.undos[j].st.value}",
                         r._replace(k=r.k + 1, latest=j, seen=s.undos[j].st))
            else:
                yield go(f"reads undo/{r.k}: none", r._replace(pc="decide", n=r.k - 1))
        elif pc == "decide":
            if r.seen == S.COMPLETED:
                yield go(f"undo intent {r.latest} completed: marks the original undone",
                         r._replace(pc="mark", serial=r.latest))
            elif r.seen == S.INDETERMINATE:
                yield go(f"undo intent {r.latest} is unknown: stops", _DONE)
            elif r.seen == S.DISPATCHED:
                yield go(f"resumes undo/{r.n}", r._replace(pc="call"))
            elif r.n + 1 > self.cfg.max_undos:
                yield go("(the world's bound on undo intents: stops)", _DONE)
            else:
                yield go(f"makes undo/{r.n + 1}", r._replace(pc="request", n=r.n + 1))
        elif pc == "request":
            if not s.present:
                yield go("undo_requested: the original is gone (error)", _DONE)
            elif self.rules.undo_reads_undone and self._undone(s):
                yield go("undo_requested refused: the original was undone", _DONE)
            else:
                ev = ("undo_requested", r.n)
                events = s.events if ev in s.events else (*s.events, ev)
                yield go(f"records undo_requested for undo/{r.n}", r._replace(pc="call"),
                         events=events)
        elif pc == "call":
            yield from self._call(s, k, r, go)
        elif pc == "send":
            outs = ["landed", "lost", "unsent"] + (["refused"] if self.cfg.refusals else [])
            for out in outs:
                refunds = s.refunds + (out in ("landed", "lost"))
                yield go(f"the refund of undo intent {r.serial}: {out}",
                         r._replace(pc="outcome", out=out), refunds=refunds)
        elif pc == "outcome":
            u = s.undos[r.serial]
            st = {"landed": S.COMPLETED, "refused": S.FAILED}.get(r.out, S.INDETERMINATE)
            undos = put(s.undos, r.serial, self._settle(u, st, self._live(s)))
            nxt = r._replace(pc="mark") if st == S.COMPLETED else _DONE
            yield go(f"commits undo intent {r.serial}: {st.value}", nxt, undos=undos)
        elif pc == "mark":
            if not s.present:
                yield go("'undone': the original is gone (error)", _DONE)
            else:
                ev = ("undone", r.serial)
                events = s.events if ev in s.events else (*s.events, ev)
                yield go(f"records 'undone' by undo intent {r.serial}", _DONE, events=events)

    def _call(self, s: State, k: int, r: UndoRun, step: Go) -> Iterator[Step]:
        """kernel.call(undo tool, call_id=undo/<call id>/n): the call id's intent, or a new one."""
        j = self._called(s, r.n)
        if j < 0:
            u = Undo(r.n, S.DISPATCHED, k, True, False, frozenset(), 1)
            yield step(f"dispatches undo/{r.n}: undo intent {len(s.undos)}",
                       r._replace(pc="send", serial=len(s.undos)), undos=(*s.undos, u))
            return
        u = s.undos[j]
        if u.st == S.COMPLETED:
            yield step(f"undo/{r.n} is intent {j}, completed", r._replace(pc="mark", serial=j))
        elif u.st != S.DISPATCHED:
            yield step(f"undo/{r.n} is intent {j}, {u.st.value}: stops", _DONE)
        elif u.run >= 0:
            yield step(f"undo/{r.n} is intent {j}, run by undo {u.run}: pending, stops", _DONE)
        else:  # taken over: an Unsafe call whose outcome is unknown
            undos = put(s.undos, j, self._settle(u, S.INDETERMINATE, self._live(s)))
            yield step(f"takes undo/{r.n} over: Indeterminate; stops", _DONE, undos=undos)

    def _prune(self, s: State, k: int, p: Prune) -> Iterator[Step]:

        def go(label: str, nxt: Prune, **kw: Any) -> Step:
            return Step((f"prune {k}", label), s._replace(prunes=put(s.prunes, k, nxt), **kw))

        if p.pc == "idle":
            yield go("starts", Prune("candidates"))
        elif p.pc == "candidates":
            cand = tuple(j for j, u in enumerate(s.undos) if self._prunable(u))
            if self.cfg.original_prunable and s.present:
                cand = (_ORIGINAL, *cand)
            yield go(f"candidates {list(cand)}", Prune("histories", cand))
        elif p.pc == "histories":
            read = tuple((j, self._version(s, j)) for j in p.cand if self._there(s, j))
            yield go(f"reads and archives {list(read)}", Prune("delete", p.cand, read),
                     archive=s.archive | set(read))
        elif p.pc == "delete":
            yield self._delete(s, k, p, go)

    def _prunable(self, u: Undo) -> bool:
        return u.present and u.st in _PRUNABLE and u.old

    def _there(self, s: State, j: int) -> bool:
        return s.present if j == _ORIGINAL else self._prunable(s.undos[j])

    def _version(self, s: State, j: int) -> int:
        return len(s.events) if j == _ORIGINAL else s.undos[j].ver

    def _delete(self, s: State, k: int, p: Prune, step: Go) -> Step:
        """The store's delete transaction: each intent still settled and old, its history the
        one archived (as built), and an undo intent only with its original (as built)."""
        going = {
            j for j, v in p.read
            if self._there(s, j)
            and (not self.rules.prune_compares_history or self._version(s, j) == v)
        }  # fmt: skip
        kept = sorted(
            j for j in going
            if j == _ORIGINAL or not self.rules.prune_keeps_undo_of_original
            or not s.present or _ORIGINAL in going
        )  # fmt: skip
        undos = tuple(u._replace(present=False) if j in kept else u for j, u in enumerate(s.undos))
        present = s.present and _ORIGINAL not in kept
        return step(f"deletes {kept}", Prune("done"), undos=undos, present=present)

    def show(self, s: State) -> list[str]:
        out = [
            f"original: {'in the log' if s.present else 'pruned'}; events {list(s.events)}",
            f"refunds at the provider: {s.refunds}",
        ]
        out += [
            f"undo intent {k}: undo/{u.n} {u.st.value} "
            + ("pruned" if not u.present else f"old={u.old}")
            for k, u in enumerate(s.undos)
        ]
        out += [f"undo {k}: {r.pc}" for k, r in enumerate(s.runs)]
        out += [f"prune {k}: {p.pc}" for k, p in enumerate(s.prunes)]
        out.append(f"archive: {sorted(s.archive)}")
        return out
