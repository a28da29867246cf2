"""One run's steps, as `poimen._engine.protocol` writes them, and the store's commits they send.

A run is a call (hold, dispatch commit, deadline stamp, invoke, outcome commit; an unknown
outcome recorded with the deadline moved, decide, lookup, defer, a new attempt claimed on
fence + 1, Indeterminate) or a takeover (recovery, or the same call id again, finding the
intent claimable). Every decision is the project's own rule (`Rules`), imported, never copied.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, cast

from poimen._core import decide as _decide
from poimen._core.decide import (
    Answer,
    Ask,
    Complete,
    Defer,
    Fail,
    KeyDerived,
    MarkIndeterminate,
    Policy,
    RetryDecision,
    Unasked,
)
from poimen._core.effects import Landed, NotLanded, Unknown
from poimen._core.intents import Intent, Owner
from verification.model._world import (
    BASE,
    EFFECTS,
    NOBODY,
    Commit,
    Config,
    Edge,
    Ghost,
    Label,
    Look,
    Req,
    Row,
    Rules,
    S,
    State,
    Thread,
    absolute,
    earlier,
    later_of,
    put,
    settled_row,
    shift_row,
)

_FENCE_ONLY = frozenset({"claim", "decision", "outcome"})
_STAMPING = frozenset({"dispatch", "stamp", "stamp_c", "claim"})
_STAMPS = frozenset({"stamp", "stamp_c"})
_ANSWERS: dict[str, Answer] = {
    "unasked": Unasked(),
    "landed": Landed(None),
    "notlanded": NotLanded(),
    "unknown": Unknown("no answer"),
}


class Protocol:
    """The steps of one worker's runs; `verification.model._system.Model` adds the world's."""

    def __init__(self, cfg: Config, rules: Rules | None = None) -> None:
        if not 1 <= cfg.workers <= 4 or not 1 <= len(cfg.intents) <= 6:
            raise ValueError("the model is for 1-4 workers and 1-6 intents")
        self.cfg = cfg
        self.rules = rules or Rules()
        self.W = cfg.workers
        self.N = len(cfg.intents)
        self.kinds = cfg.intents
        self.T = float(cfg.timeout)
        self.M = float(cfg.margin)
        self.L = cfg.land_within
        self.clip_stamp = -float(cfg.timeout + cfg.margin + cfg.commit_delay + 1)
        self.policy = Policy(
            max_attempts=cfg.max_attempts,
            lookup_limit=cfg.lookup_limit,
            lookup_backoff=1.0,
            max_backoff=2.0,
        )
        self.max_backoff = int(self.policy.max_backoff)
        self.owners = {
            (w, cur): Owner(f"w{w}", "h" if cfg.same_host else f"h{w}", 2 if cur else 1, "s")
            for w in range(cfg.workers)
            for cur in (True, False)
        }
        self._intents: dict[tuple[int, Row], Intent] = {}
        self._decisions: dict[tuple[int, Row, str, float], _decide.Decision] = {}
        self._ticked: dict[Thread, Thread] = {}
        self._normed: dict[Thread, Thread] = {}

    # Bridges to the rules.

    def intent(self, i: int, r: Row) -> Intent:
        got = self._intents.get((i, r))
        if got is None:
            kind = self.kinds[i]
            got = self._intents[(i, r)] = Intent(
                id=f"in_{i}",
                call_id=f"c{i}",
                tool_id=f"t{i}",
                effect=kind,
                args="{}",
                args_hash="h",
                key=f"k{i}" if kind == "idempotent" else None,
                request_id=f"rq_{i}" if kind == "queryable" else None,
                state=r.st,
                fence=r.fence,
                owner=self.owners.get(r.ow),
                lease_expires_at=absolute(r.lease),
                timeout_s=self.T,
                deadline_at=absolute(r.dl),
                next_check_at=absolute(r.nxt),
                unknown_count=r.uc,
                attempts=r.att,
                result=None,
                error=None,
                reason=None,
                created_at=BASE,
                updated_at=BASE,
            )
        return got

    def claimable(self, w: int, i: int, r: Row) -> str:
        return self.rules.claimability(
            self.intent(i, r),
            self.owners[(w, True)],
            held=False,
            now=BASE,
            alive=lambda o: o.pid == 2,
        )

    def decision(self, i: int, r: Row, got: str, at: float = 0.0) -> _decide.Decision:
        """The rule's decision on row `r` with evidence `got`, now being `at` ticks after the
        instant `r`'s times are relative to."""
        memo = (i, r, got, at)
        d = self._decisions.get(memo)
        if d is None:
            it = self.intent(i, r)
            eff = EFFECTS[self.kinds[i]]
            now = BASE + at
            d = self.rules.decide(eff, it, _ANSWERS[got], now, self.policy)
            if isinstance(d, Ask) and d.what == "key":
                assert it.key is not None
                d = self.rules.decide(eff, it, KeyDerived(it.key), now, self.policy)
            self._decisions[memo] = d
        return d

    def final(self, i: int, r: Row) -> bool:
        """May a refusal, or a request that never left, end this attempt FAILED?"""
        return self.rules.failure_is_final(EFFECTS[self.kinds[i]], self.intent(i, r))

    def deadline(self, start: float, margin: float) -> float:
        """attempt_deadline as a time relative to now."""
        return self.rules.attempt_deadline(BASE + start, self.T, margin) - BASE

    def taking(self, th: Thread, r: Row) -> Thread:
        """A run that judged row `r` claimable: it takes it over, after its seize commit
        (compared with the lease it judged) when the rule has one."""
        nxt = th._replace(pc="take", snap=r, owns=False, got="unasked", op=None)
        # A stale read judged late (`existing`) compares its lease as of its clock: a seize
        # after ticks since then loses, as if a write came first (fewer takeovers, not more).
        if self.rules.takeover_seizes:
            return nxt._replace(op=Commit("seize", 0, r.fence, r.lease))
        return nxt

    def tick_lease(self, x: float | None) -> float | None:
        """One tick for a lease as the log keeps it: with slow renewals, how long ago it ran
        out is kept up to a commit's time (`Model._tick`)."""
        if x is None or x > 0 or not self.cfg.slow_renewals:
            return earlier(x)
        return max(x - 1, -float(self.cfg.commit_delay))

    def seized(self) -> float:
        """The lease a seize leaves: run out as long ago as the log tells apart."""
        return -float(self.cfg.commit_delay) if self.cfg.slow_renewals else 0.0

    # A run's state, kept small.

    def asks(self, th: Thread) -> bool:
        """Does this run wait on a lookup or decide on its answer (its snap frozen as asked)?"""
        return th.pc == "lookup" or (th.pc == "decide" and th.got != "unasked")

    def frozen(self, th: Thread) -> bool:
        return self.asks(th) or (th.pc == "existing" and self.rules.clock_before_read)

    def norm(self, th: Thread) -> Thread:
        """Forget what a run will never read again, so that runs that differ only there are
        one state (a pure function of the run: remembered)."""
        got = self._normed.get(th)
        if got is None:
            got = self._normed[th] = self._norm(th)
        return got

    def _norm(self, th: Thread) -> Thread:
        pc = th.pc
        snap = th.snap
        if snap is not None and pc != "existing":  # a stale read is judged on all of its row
            if pc in _FENCE_ONLY:
                snap = Row(S.DISPATCHED, snap.fence, NOBODY, None, None, None, 0, 0)
            else:
                nxt = snap.nxt if pc == "take" else None
                snap = Row(snap.st, snap.fence, NOBODY, None, snap.dl, nxt, snap.att, snap.uc)
        return Thread(
            pc,
            snap,
            th.owns,
            th.stamped if pc in _STAMPING else 0.0,
            th.si if pc in _STAMPS else 0,
            th.runs,
            th.inplace if pc == "invoke" else 0,
            th.got if pc in ("decide", "unknown", "unknown_c") else "unasked",
            th.op,
            th.since if self.asks(th) else 0,
        )

    def _since_cap(self, snap: Row | None) -> int:
        """How long ago a lookup was asked matters only until the asked-for row's deadline
        and the longest back-off have passed: the decision and every time it writes are the
        same from then on."""
        dl = 0.0 if snap is None or snap.dl is None else snap.dl
        return max(math.ceil(dl), self.max_backoff)

    def tick_thread(self, th: Thread) -> Thread:
        """One tick passes for a run (a pure function of the run: remembered)."""
        got = self._ticked.get(th)
        if got is None:
            got = self._ticked[th] = self._tick_thread(th)
        return got

    def _tick_thread(self, th: Thread) -> Thread:
        op = th.op
        if isinstance(op, Commit):
            b = op.b
            if b is not None:
                b = max(b - 1, self.clip_stamp) if op.name == "extend" else earlier(b)
            # A seize compares the lease it judged with the log's: both tick alike.
            a = self.tick_lease(op.a) if op.name == "seize" else earlier(op.a)
            op = Commit(op.name, op.age + 1, op.fence, a, b, op.n, op.text)
        elif isinstance(op, Req):
            if op.latest:
                op = Req(op.status, op.latest - 1)
        elif isinstance(op, Look):
            op = Look(op.phase, op.ans, op.age + 1)
        snap = th.snap
        if snap is not None and not self.frozen(th):
            snap = shift_row(snap)
        return Thread(
            th.pc,
            snap,
            th.owns,
            max(th.stamped - 1, self.clip_stamp) if th.pc in _STAMPING else 0.0,
            th.si,
            th.runs,
            th.inplace,
            th.got,
            op,
            min(th.since + 1, self._since_cap(th.snap)) if self.asks(th) else 0,
        )

    def set_thread(
        self,
        s: State,
        w: int,
        i: int,
        th: Thread | None,
        *,
        pool: tuple[tuple[int, int], ...] | None = None,
        ghost: tuple[Ghost, ...] | None = None,
    ) -> State:
        row = s.thr[w]
        thr = put(s.thr, w, put(row, i, None if th is None else self.norm(th)))
        return State(
            s.log, s.pool if pool is None else pool, thr, s.ghost if ghost is None else ghost
        )

    def lapse(self, s: State) -> State:
        """Mark an attempt whose live owner still drives it but whose lease has run out."""
        ghost = s.ghost
        for i, r in enumerate(s.log):
            if (
                r is None
                or ghost[i].lapsed
                or r.st != S.DISPATCHED
                or r.nxt is not None
                or r.lease is None
                or r.lease > 0
                or not r.ow[1]
            ):
                continue
            th = s.thr[r.ow[0]][i]
            if th is not None and th.owns and th.snap is not None and th.snap.fence == r.fence:
                ghost = put(ghost, i, ghost[i]._replace(lapsed=True))
        return s if ghost is s.ghost else s._replace(ghost=ghost)

    # The steps.

    def step(self, s: State, w: int, i: int, th: Thread) -> Iterator[Edge]:
        op = th.op
        if isinstance(op, Commit):
            yield from self._commit_events(s, w, i, th, op)
            return
        if isinstance(op, Req):
            yield from self._request_events(s, w, i, th, op)
            return
        if isinstance(op, Look):
            yield from self._lookup_events(s, w, i, th, op)
            return
        r = th.snap
        assert r is not None
        pc = th.pc
        if pc == "existing":
            # A row read a while ago, judged now: as built, against a clock read before it.
            if r.st == S.DISPATCHED and self.claimable(w, i, r) == "claimable":
                yield self._edge(s, w, i, self.taking(th, r), ("existing", w, i, "claimable"))
            else:
                yield self._edge(s, w, i, None, ("existing", w, i, "answered"))
        elif pc == "take":
            # orphan_steps: a request the owner sent just before it stopped may still land.
            later = self.rules.takeover_deadline(self.intent(i, r), BASE, self.M)
            moved = None
            if later is not None and self.kinds[i] == "queryable":
                moved = later - BASE
                r = r._replace(dl=moved)
            nxt = th._replace(pc="decide", snap=r, got="unasked")
            yield self._edge(s, w, i, nxt, ("take", w, i, moved))
        elif pc == "decide":
            yield from self._decide(s, w, i, th, r)
        elif pc == "retry":
            yield from self._retry(s, w, i, th, r)
        elif pc == "stamp":
            yield from self._stamp(s, w, i, th, r)
        elif pc == "invoke":
            yield from self._invoke(s, w, i, th, r)
        elif pc == "tx":
            yield from self._tx(s, w, i, th, r)
        elif pc == "unknown":
            dl = None
            if self.kinds[i] == "queryable":
                dl = max(r.dl or 0.0, self.deadline(0.0, self.M))
                r = r._replace(dl=dl)
            nxt = th._replace(pc="unknown_c", snap=r, op=Commit("unknown", 0, r.fence, dl))
            yield self._edge(s, w, i, nxt, ("unknown", w, i, dl))
        else:
            raise AssertionError(pc)

    def _edge(self, s: State, w: int, i: int, th: Thread | None, label: Label, **kw: Any) -> Edge:
        return Edge(label, self.set_thread(s, w, i, th, **kw), False, None)

    def _decide(self, s: State, w: int, i: int, th: Thread, r: Row) -> Iterator[Edge]:
        # On a lookup's answer, `r` is frozen as of the asking, `since` ticks ago.
        since = th.since if th.got != "unasked" else 0
        as_of = 0 if th.got == "unasked" or self.rules.lookup_judged_as_asked else since
        d = self.decision(i, r, th.got, float(as_of))
        now_r = shift_row(r, since) if since else r
        label: Label = ("decide", w, i, th.got, d, since, as_of)
        if isinstance(d, Ask):
            nxt = th._replace(pc="lookup", snap=now_r, op=Look("sent", "", 0), since=0)
        elif isinstance(d, Complete):
            nxt = th._replace(pc="decision", snap=now_r, op=Commit("landed", 0, r.fence))
        elif isinstance(d, Defer):
            at = max(d.at - BASE - since, 0.0)
            keep = now_r.dl if self.rules.defer_keeps_deadline else None
            op = Commit("defer", 0, r.fence, at, keep, d.unknown_count, d.reason)
            nxt = th._replace(pc="decision", snap=now_r, op=op)
        elif isinstance(d, MarkIndeterminate):
            nxt = th._replace(
                pc="decision", snap=now_r, op=Commit("indet", 0, r.fence, text=d.reason)
            )
        elif isinstance(d, RetryDecision):
            nxt = th._replace(pc="retry", snap=now_r)
        elif isinstance(d, Fail):
            nxt = th._replace(pc="outcome", snap=now_r,
                              op=Commit("outcome", 0, r.fence, text="FAILED"))
        else:
            raise AssertionError(f"the model does not know the decision {d!r}")
        yield self._edge(s, w, i, nxt, label)

    def _retry(self, s: State, w: int, i: int, th: Thread, r: Row) -> Iterator[Edge]:
        if th.runs:
            # Out of this caller's retry budget: recovery takes the next attempt (its
            # deadline stands: the defer writes none).
            op = Commit("defer", 0, r.fence, 1.0, None, r.uc, "retry_deferred")
            yield self._edge(
                s, w, i, th._replace(pc="decision", op=op), ("retry", w, i, "deferred")
            )
        lease = float(max(self.cfg.lease_ttl, self.cfg.timeout))
        dl = self.deadline(0.0, self.M) if self.kinds[i] == "queryable" else None
        op = Commit("claim", 0, r.fence, lease, dl)
        nxt = th._replace(pc="claim", op=op, stamped=0.0)
        yield self._edge(s, w, i, nxt, ("retry", w, i, "claim"))

    def _stamp(self, s: State, w: int, i: int, th: Thread, r: Row) -> Iterator[Edge]:
        needed = self.deadline(0.0, self.M - self.M / 4)
        if (r.dl is not None and r.dl >= needed) or th.si >= 3:
            yield self._edge(s, w, i, th._replace(pc="invoke"), ("stamp", w, i, "ok"))
            return
        later = self.deadline(0.0, self.M) + (0.0 - th.stamped)
        op = Commit("extend", 0, r.fence, later, 0.0)
        yield self._edge(s, w, i, th._replace(pc="stamp_c", op=op), ("stamp", w, i, later))

    def _invoke(self, s: State, w: int, i: int, th: Thread, r: Row) -> Iterator[Edge]:
        g = s.ghost[i]
        if self.kinds[i] == "transactional":
            # Its transaction opens; the tool writes in it; nothing is out of the process.
            nxt = th._replace(pc="tx", runs=1, op=None)
            yield self._edge(s, w, i, nxt, ("invoke", w, i, r.att))
            yield from self._not_sent(s, w, i, th, r)
            return
        nxt = th._replace(pc="wait", runs=1, op=Req("flying", self.L))
        # Sent by an owner whose lease ran out (its attempt lapsed, or was taken over since):
        # a second landing of a Queryable request is then the limit the contract states.
        row = s.log[i]
        late = g.excused or (
            self.kinds[i] == "queryable"
            and row is not None
            and (row.fence != r.fence or (g.lapsed and row.ow == (w, True)))
        )
        ghost = put(s.ghost, i, g._replace(sends=g.sends + 1, excused=late))
        yield self._edge(s, w, i, nxt, ("invoke", w, i, r.att), ghost=ghost)
        yield from self._not_sent(s, w, i, th, r)

    def _not_sent(self, s: State, w: int, i: int, th: Thread, r: Row) -> Iterator[Edge]:
        if not self.cfg.not_sent:
            return
        n = th.inplace + 1
        if self.final(i, r):
            op = Commit("outcome", 0, r.fence, text="FAILED")
            stop = th._replace(pc="outcome", runs=1, inplace=n, op=op)
            yield self._edge(s, w, i, stop, ("not_sent", w, i, "failed"))
        else:
            # This attempt sent nothing; an earlier one's outcome is still unknown.
            stop = th._replace(pc="unknown", runs=1, inplace=n, op=None)
            yield self._edge(s, w, i, stop, ("not_sent", w, i, "unknown"))
        if n < self.cfg.max_attempts:
            again = th._replace(runs=1, inplace=n)
            yield self._edge(s, w, i, again, ("not_sent", w, i, "again"))

    def _tx(self, s: State, w: int, i: int, th: Thread, r: Row) -> Iterator[Edge]:
        """A Transactional attempt's transaction ends: the tool raised (rolled back), or it
        commits with its marker, which lands only if no attempt landed and no lookup fenced
        this one out (a crash before this step rolls it back; one after it, before the reply,
        leaves it landed)."""
        g = s.ghost[i]
        unknown = th._replace(pc="unknown", op=None)
        yield self._edge(s, w, i, unknown, ("tx", w, i, "rolled_back"))
        if g.eff == 0 and g.mark < r.att:
            ghost = put(s.ghost, i, g._replace(eff=1))
            done = th._replace(pc="outcome", op=Commit("outcome", 0, r.fence, text="COMPLETED"))
            yield self._edge(s, w, i, done, ("tx", w, i, "committed"), ghost=ghost)
            yield self._edge(s, w, i, unknown, ("tx", w, i, "committed_reply_lost"), ghost=ghost)
        elif g.eff:  # refused: another attempt's write is the call's
            done = th._replace(pc="outcome", op=Commit("outcome", 0, r.fence, text="COMPLETED"))
            yield self._edge(s, w, i, done, ("tx", w, i, "refused_landed"))
        else:
            yield self._edge(s, w, i, unknown, ("tx", w, i, "refused_fenced"))

    def arrivals(self, s: State, i: int) -> list[str]:
        # A provider refuses only what it has no effect for; a refusal is "nothing happened".
        refuse = self.cfg.refusals and s.ghost[i].eff == 0
        return ["landed", "lost", "refused"] if refuse else ["landed", "lost"]

    def landed(self, ghost: tuple[Ghost, ...], i: int) -> tuple[Ghost, ...]:
        g = ghost[i]
        if self.kinds[i] == "idempotent" and g.eff:
            return ghost  # the provider deduplicates on the key
        return put(ghost, i, g._replace(eff=g.eff + 1))

    def _request_events(self, s: State, w: int, i: int, th: Thread, op: Req) -> Iterator[Edge]:
        r = th.snap
        assert r is not None
        if op.status == "flying":
            for how in self.arrivals(s, i):
                ghost = self.landed(s.ghost, i) if how == "landed" else s.ghost
                nxt = th._replace(op=Req(cast(Any, how), 0))
                yield self._edge(s, w, i, nxt, ("arrive", w, i, how), ghost=ghost)
        if op.status == "landed":
            nxt = th._replace(pc="outcome", op=Commit("outcome", 0, r.fence, text="COMPLETED"))
            yield self._edge(s, w, i, nxt, ("reply", w, i, "COMPLETED"))
        elif op.status == "refused" and self.final(i, r):
            nxt = th._replace(pc="outcome", op=Commit("outcome", 0, r.fence, text="FAILED"))
            yield self._edge(s, w, i, nxt, ("reply", w, i, "FAILED"))
        elif op.status == "refused":
            # The refusal says nothing of an earlier attempt: recorded, then Indeterminate.
            nxt = th._replace(pc="unknown", got="refused", op=None)
            yield self._edge(s, w, i, nxt, ("reply", w, i, "refused_after_unknown"))
        # A timeout, a reset, a lost reply, a 5xx: the outcome is unknown.
        pool = s.pool
        if op.status == "flying":
            pool = tuple(sorted((*pool, (i, op.latest))))
        nxt = th._replace(pc="unknown", op=None)
        yield self._edge(s, w, i, nxt, ("reply", w, i, "unknown"), pool=pool)

    def _lookup_events(self, s: State, w: int, i: int, th: Thread, op: Look) -> Iterator[Edge]:
        if op.phase == "sent":
            g = s.ghost[i]
            ans = "landed" if g.eff else "notlanded"
            nxt = th._replace(op=op._replace(phase="read", ans=ans))
            ghost = s.ghost
            if self.kinds[i] == "transactional" and not g.eff and self.rules.marker_fences:
                # The lookup's one transaction: fence the attempts so far, then read.
                assert th.snap is not None
                ghost = put(ghost, i, g._replace(mark=max(g.mark, th.snap.att)))
            yield self._edge(s, w, i, nxt, ("lookup_read", w, i, ans), ghost=ghost)
        else:
            nxt = th._replace(pc="decide", got=op.ans, op=None)
            yield self._edge(s, w, i, nxt, ("lookup_answer", w, i, op.ans))
        nxt = th._replace(pc="decide", got="unknown", op=None)
        yield self._edge(s, w, i, nxt, ("lookup_answer", w, i, "unknown"))

    def _commit_events(self, s: State, w: int, i: int, th: Thread, op: Commit) -> Iterator[Edge]:
        t, nxt, violation = self.apply(s, w, i, th, op)
        yield Edge(
            ("commit", w, i, op.name, "ok" if nxt is not None else "done"),
            self.set_thread(t, w, i, nxt),
            False,
            violation,
        )
        if self.cfg.lost_commit_replies:
            # The commit raised in the caller (applied or not): the run ends, its hold goes.
            yield Edge(
                ("commit_lost", w, i, op.name, True),
                self.lapse(self.set_thread(t, w, i, None)),
                False,
                violation,
            )
            lost = self.set_thread(s, w, i, None)
            yield Edge(("commit_lost", w, i, op.name, False), lost, False, None)

    def apply(
        self, s: State, w: int, i: int, th: Thread, op: Commit
    ) -> tuple[State, Thread | None, str | None]:
        """Apply a commit as the store does (compare-and-set on the fence); returns the new
        state, the thread after it (None: its run ended) and a violated property."""
        r = s.log[i]
        kind = self.kinds[i]
        name = op.name
        if name == "dispatch":
            if r is None:
                row = Row(S.DISPATCHED, 1, (w, True), op.a, op.b, None, 1, 0)
                pc = "stamp" if kind == "queryable" else "invoke"
                t = s._replace(log=put(s.log, i, row))
                return self.lapse(t), th._replace(pc=pc, snap=row, owns=True, op=None), None
            if self.cfg.stale_reads:
                return s, th._replace(pc="existing", snap=r, owns=False, op=None), None
            if r.st == S.DISPATCHED and self.claimable(w, i, r) == "claimable":
                return s, self.taking(th, r), None
            return s, None, None
        if r is None or r.fence != op.fence or r.st != S.DISPATCHED:
            return s, None, None  # fenced out: the run answers from the log
        if name == "seize":
            if r.lease != op.a:
                return s, None, None  # a renewal came first: not taken over this time
            # Its first write: a live owner it seizes from must be one whose lease ran out.
            ghost, violation = self._takeover(s, w, i, r, th)
            t = State(put(s.log, i, r._replace(lease=self.seized())), s.pool, s.thr, ghost)
            return self.lapse(t), th._replace(op=None), violation
        ghost, violation = s.ghost, None
        if name in ("claim", "landed", "defer", "indet"):
            ghost, violation = self._takeover(s, w, i, r, th)
        if name == "claim":
            dl = op.b if op.b is not None else r.dl
            row = Row(S.DISPATCHED, r.fence + 1, (w, True), op.a, dl, None, r.att + 1, r.uc)
            ghost = put(ghost, i, ghost[i]._replace(lapsed=False))
            pc = "stamp" if kind == "queryable" else "invoke"
            nxt = th._replace(pc=pc, snap=row, owns=True, si=0, inplace=0, op=None)
            return self.lapse(State(put(s.log, i, row), s.pool, s.thr, ghost)), nxt, violation
        if name == "extend":
            assert op.a is not None and op.b is not None
            row = r._replace(dl=later_of(r.dl, op.a))
            snap = r._replace(dl=op.a) if th.snap is None else th.snap._replace(dl=op.a)
            nxt = th._replace(pc="stamp", snap=snap, stamped=op.b, si=th.si + 1, op=None)
            return s._replace(log=put(s.log, i, row)), nxt, None
        if name == "unknown":
            row = r._replace(dl=later_of(r.dl, op.a))
            t = s._replace(log=put(s.log, i, row))
            if th.got == "refused":
                indet = Commit("indet", 0, op.fence, text="refused_after_unknown")
                return t, th._replace(pc="decision", got="unasked", op=indet), None
            return t, th._replace(pc="decide", got="unasked", op=None), None
        settled = s._replace(ghost=ghost)
        if name == "outcome":
            st = S.COMPLETED if op.text == "COMPLETED" else S.FAILED
            if st == S.COMPLETED and s.ghost[i].eff == 0:
                violation = f"intent {i} ({kind}) COMPLETED without an effect"
            return settled._replace(log=put(s.log, i, settled_row(st))), None, violation
        if name == "landed":
            if s.ghost[i].eff == 0:
                violation = violation or f"intent {i} completed by lookup without an effect"
            return settled._replace(log=put(s.log, i, settled_row(S.COMPLETED))), None, violation
        if name == "defer":
            row = r._replace(nxt=op.a, lease=op.a, uc=op.n, dl=later_of(r.dl, op.b))
            return settled._replace(log=put(s.log, i, row)), None, violation
        if name == "indet":
            row = settled_row(S.INDETERMINATE)
            return settled._replace(log=put(s.log, i, row)), None, violation
        raise AssertionError(name)

    def _takeover(
        self, s: State, w: int, i: int, r: Row, th: Thread
    ) -> tuple[tuple[Ghost, ...], str | None]:
        """A write by a run that does not own the attempt: its live owner must not be running it
        with a valid lease. One whose lease ran out is the limit the contract states, as long
        as it stays out: a lease renewed after it ran out is valid again."""
        ow, cur = r.ow
        if th.owns or not cur or ow == w:
            return s.ghost, None
        other = s.thr[ow][i]
        if other is None or not other.owns or other.snap is None or other.snap.fence != r.fence:
            return s.ghost, None
        g = s.ghost[i]
        took = f"w{w} took intent {i} over from w{ow}, which is alive and still drives it"
        if not g.lapsed:
            return s.ghost, f"{took}, and whose lease never ran out"
        if r.lease is not None and r.lease > 0:
            return s.ghost, f"{took}, and whose lease ran out and was renewed since"
        return put(s.ghost, i, g._replace(excused=True)), None
