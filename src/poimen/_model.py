"""An exhaustive model check of the call protocol (docs/verification.md).

The world is abstract and small: a log of intents (state, fence, owner, lease, deadline,
next check, attempts, unknown count), 2-3 workers that run the protocol's steps as
`poimen._protocol` writes them (hold, dispatch commit, deadline stamp, invoke, outcome
commit; unknown outcome, decide, lookup, defer, claim a new attempt; orphan takeover), a
provider with requests in flight, and a discrete clock. Every decision is taken by the
project's own pure rules (`poimen._decide.decide`, `claimability`, `takeover_deadline`,
`attempt_deadline`), imported, never copied.

At every step anything may happen that the real world allows: a worker crashes (its commits
in flight land or not, its requests stay in the network), a renewal does not come (the
lease runs out under a live owner), a commit is slow (up to `commit_delay` ticks) or its
reply is lost, a request lands, is refused or is lost, a reply or a lookup answer is lost,
a thread is slow between any two of its steps. A breadth-first search visits every state
reachable in a configuration; a violated property prints as the shortest trace to it.

Times in a state are relative to now and every time already past counts as now: the rules
only ever compare a time with now or with now plus a positive span, so two states that
differ only in how long ago something passed behave alike, and the state space is finite.

    python -m poimen._model --workers 2 --intents queryable,unsafe
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar, cast

from poimen import _decide
from poimen._decide import (
    Answer,
    Ask,
    Complete,
    Defer,
    KeyDerived,
    MarkIndeterminate,
    Policy,
    Retry,
    Unasked,
)
from poimen._effects import (
    EffectClass,
    Idempotent,
    KeyDerivation,
    Landed,
    LookupAnswer,
    NotLanded,
    Queryable,
    Unknown,
    Unsafe,
)
from poimen._intents import Intent, IntentState, Owner

S = IntentState
X = TypeVar("X")
BASE = 1000.0  # "now" when a rule is asked: the state's relative times are added to it
TERMINAL = frozenset({S.COMPLETED, S.FAILED, S.INDETERMINATE})
Kind = Literal["idempotent", "queryable", "unsafe"]
KINDS: tuple[Kind, ...] = ("idempotent", "queryable", "unsafe")


def _no_lookup(request_id: str, /) -> LookupAnswer:
    raise AssertionError("the model answers lookups itself")


EFFECTS: dict[Kind, EffectClass] = {
    "idempotent": Idempotent(key=KeyDerivation.fields("order")),
    "queryable": Queryable(lookup=_no_lookup),
    "unsafe": Unsafe(),
}


@dataclass(frozen=True, slots=True)
class Config:
    """One bounded world. Times are whole ticks."""

    workers: int = 2
    intents: tuple[Kind, ...] = ("queryable",)
    timeout: int = 3  # the tool's timeout: a request lands within it of being sent
    margin: int = 2  # the kernel's deadline_margin
    lease_ttl: int = 3
    latency: int | None = None  # longest send-to-land time; None: the timeout
    commit_delay: int = 2  # longest time a commit takes
    max_attempts: int = 2
    lookup_limit: int = 2
    same_host: bool = True  # one host: a dead owner's pid says it is gone
    crashes: bool = True
    lapses: bool = True  # a renewal may come late: a live owner's lease runs out
    lost_commit_replies: bool = True
    not_sent: bool = True  # a tool may fail to connect (NotSent): runs again in place
    refusals: bool = True  # the provider may refuse a request (nothing happened for it)
    # A run may be slow between reading a row and judging it against the clock. Off: the
    # judgement is made when the row is read, as the code does within microseconds.
    stale_reads: bool = False
    # Not the protocol as built: decide on a lookup's answer as of when the lookup was sent.
    decide_as_of_lookup: bool = False
    max_states: int = 3_000_000

    @property
    def land_within(self) -> int:
        return self.timeout if self.latency is None else self.latency

    def describe(self) -> str:
        return (
            f"workers={self.workers} intents={','.join(self.intents)} "
            f"timeout={self.timeout} margin={self.margin} lease_ttl={self.lease_ttl} "
            f"latency={self.land_within} commit_delay={self.commit_delay} "
            f"max_attempts={self.max_attempts} lookup_limit={self.lookup_limit} "
            f"hosts={'one' if self.same_host else 'one per worker'} "
            f"crashes={self.crashes} lapses={self.lapses} "
            f"lost_commit_replies={self.lost_commit_replies} not_sent={self.not_sent} "
            f"refusals={self.refusals} "
            f"stale_reads={self.stale_reads}"
            + (" decide_as_of_lookup=True" if self.decide_as_of_lookup else "")
        )


@dataclass(frozen=True, slots=True)
class Rules:
    """The rules under check: the project's own unless a test swaps one to see it caught."""

    decide: Callable[[EffectClass, Intent, Answer, float, Policy], _decide.Decision] = (
        _decide.decide
    )
    claimability: Callable[..., _decide.Claimability] = _decide.claimability
    takeover_deadline: Callable[[Intent, float, float], float | None] = _decide.takeover_deadline
    attempt_deadline: Callable[[float, float, float], float] = _decide.attempt_deadline


NOBODY = (-1, False)  # an owner no rule will read
_FENCE_ONLY = frozenset({"claim", "decision", "outcome"})
_STAMPING = frozenset({"dispatch", "stamp", "stamp_c", "claim"})
_STAMPS = frozenset({"stamp", "stamp_c"})

# The state. Owners are (worker, current incarnation?): a crash makes a worker's owners old.


class Row(NamedTuple):
    """An intent in the log."""

    st: IntentState
    fence: int
    ow: tuple[int, bool]
    lease: float | None
    dl: float | None
    nxt: float | None
    att: int
    uc: int


class Commit(NamedTuple):
    """A commit sent and not yet applied; `a`, `b` are times, `age` the ticks it took so far."""

    name: str
    age: int
    fence: int
    a: float | None = None
    b: float | None = None
    n: int = 0
    text: str = ""


class Req(NamedTuple):
    """A tool's request, while its thread waits for the reply."""

    status: Literal["flying", "landed", "refused", "lost"]
    latest: int  # ticks until it must have landed or been lost


class Look(NamedTuple):
    """A lookup in flight: sent, then read at the provider, then answered."""

    phase: Literal["sent", "read"]
    ans: str
    age: int


class Thread(NamedTuple):
    """One worker's protocol run for one intent (a call, or recovery / a call id seen again)."""

    pc: str
    snap: Row | None  # the intent as this thread last read or wrote it
    owns: bool  # it committed the dispatch or claimed the current attempt
    stamped: float  # when its current deadline was computed (relative)
    si: int  # deadline stamps so far
    runs: int  # tool invocations in this run (0 or 1: only "any" matters)
    inplace: int  # not-sent tries of this attempt
    got: str  # the evidence for the next decision
    op: Commit | Req | Look | None
    asked: float = 0.0  # when the lookup now answered was sent (decide_as_of_lookup)


class Ghost(NamedTuple):
    """What the world knows and the log does not: the witness."""

    eff: int  # effects at the provider
    sends: int  # requests sent
    lapsed: bool  # the current attempt's live owner let its lease run out
    excused: bool  # taken over from such an owner: the contract's stated limit applies


class State(NamedTuple):
    log: tuple[Row | None, ...]
    pool: tuple[tuple[int, int], ...]  # requests in flight nobody waits for: (intent, latest)
    thr: tuple[tuple[Thread | None, ...], ...]  # [worker][intent]
    ghost: tuple[Ghost, ...]


Label = tuple[Any, ...]


class Edge(NamedTuple):
    label: Label
    state: State
    crash: bool
    violation: str | None


@dataclass(slots=True)
class Result:
    config: Config
    states: int = 0
    transitions: int = 0
    seconds: float = 0.0
    violation: str | None = None
    trace: list[str] = field(default_factory=list)
    live_checked: bool = False
    stuck: int = 0  # states from which no crash-free path settles every intent
    excused: int = 0  # states with a double effect after a lapsed lease (the stated limit)
    truncated: bool = False

    def ok(self) -> bool:
        return self.violation is None and self.stuck == 0 and not self.truncated

    def report(self) -> str:
        lines = [
            f"config: {self.config.describe()}",
            f"states explored: {self.states}  transitions: {self.transitions}  "
            f"time: {self.seconds:.1f}s"
            + ("  (TRUNCATED at max_states)" if self.truncated else ""),
        ]
        if self.violation is not None:
            lines.append(f"VIOLATION: {self.violation}")
            lines.extend(self.trace)
            return "\n".join(lines)
        lines.append("safety: every property held in every state")
        if self.excused:
            lines.append(
                f"  ({self.excused} states hold two effects of a Queryable intent whose live "
                "owner let its lease run out: the limit docs/design.md states)"
            )
        if self.live_checked:
            lines.append(
                "liveness: from every state a crash-free run settles every intent"
                if self.stuck == 0
                else f"LIVENESS: {self.stuck} states cannot settle every intent"
            )
        return "\n".join(lines)


class Model:
    """The transition system of one configuration."""

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
        self.owners = {
            (w, cur): Owner(f"w{w}", "h" if cfg.same_host else f"h{w}", 2 if cur else 1, "s")
            for w in range(cfg.workers)
            for cur in (True, False)
        }
        self._identity = list(range(cfg.workers))
        self._intents: dict[tuple[int, Row], Intent] = {}
        self._decisions: dict[tuple[int, Row, str, float], _decide.Decision] = {}

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
                lease_expires_at=_abs(r.lease),
                timeout_s=self.T,
                deadline_at=_abs(r.dl),
                next_check_at=_abs(r.nxt),
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
        memo = (i, r, got, at)
        d = self._decisions.get(memo)
        if d is None:
            it = self.intent(i, r)
            eff = EFFECTS[self.kinds[i]]
            answers: dict[str, Answer] = {
                "unasked": Unasked(),
                "landed": Landed(None),
                "notlanded": NotLanded(),
                "unknown": Unknown("no answer"),
            }
            answer = answers[got]
            now = BASE + at
            d = self.rules.decide(eff, it, answer, now, self.policy)
            if isinstance(d, Ask) and d.what == "key":
                assert it.key is not None
                d = self.rules.decide(eff, it, KeyDerived(it.key), now, self.policy)
            self._decisions[memo] = d
        return d

    def deadline(self, start: float, margin: float) -> float:
        """attempt_deadline as a time relative to now."""
        return self.rules.attempt_deadline(BASE + start, self.T, margin) - BASE

    # The initial state and the goal.

    def initial(self) -> State:
        return State(
            log=(None,) * self.N,
            pool=(),
            thr=((None,) * self.N,) * self.W,
            ghost=(Ghost(0, 0, False, False),) * self.N,
        )

    def settled(self, s: State) -> bool:
        return all(r is not None and r.st in TERMINAL for r in s.log)

    def check(self, s: State) -> str | None:
        """The properties of one state."""
        for i, (g, r) in enumerate(zip(s.ghost, s.log, strict=True)):
            kind = self.kinds[i]
            if kind == "unsafe" and g.sends > 1:
                return f"Unsafe intent {i} was sent {g.sends} times"
            if kind == "queryable" and g.eff > 1 and not g.excused:
                return f"Queryable intent {i} landed {g.eff} times"
            if kind == "idempotent" and g.eff > 1:
                return f"Idempotent intent {i} has {g.eff} effects under one key"
            if r is not None and r.st == S.FAILED and g.eff > 0 and not g.excused:
                return f"intent {i} ({kind}) is FAILED but its effect landed"
        return None

    # Workers are alike: a state and the same state with workers renamed are one.

    def canon(self, s: State) -> State:
        """One representative of the states that differ only in the workers' names: workers
        sorted by what they run and which rows they own (a tie of unequal workers only costs
        a duplicate state, never a missed one)."""
        if self.W == 1:
            return s
        keys = []
        for w, ts in enumerate(s.thr):
            roles = tuple(0 if r is None or r.ow[0] != w else 1 + r.ow[1] for r in s.log)
            keys.append((hash(ts), roles))
        order = sorted(range(self.W), key=keys.__getitem__)
        if order == self._identity:
            return s
        perm = [0] * self.W
        for k, w in enumerate(order):
            perm[w] = k
        return self._rename(s, perm)

    def orbit(self, s: State) -> list[State]:
        """The state under every renaming of the workers."""
        return [self._rename(s, p) for p in itertools.permutations(range(self.W))]

    def _rename(self, s: State, perm: Sequence[int]) -> State:
        def row(r: Row | None) -> Row | None:
            if r is None or r.ow[0] < 0:
                return r
            return Row(r.st, r.fence, (perm[r.ow[0]], r.ow[1]), r.lease, r.dl, r.nxt, r.att, r.uc)

        thr: list[tuple[Thread | None, ...]] = [()] * self.W
        for w, ts in enumerate(s.thr):
            if self.cfg.stale_reads:
                ts = tuple(
                    t if t is None or t.snap is None else t._replace(snap=row(t.snap)) for t in ts
                )
            thr[perm[w]] = ts
        return State(tuple(row(r) for r in s.log), s.pool, tuple(thr), s.ghost)

    # Transitions.

    def successors(self, s: State) -> Iterator[Edge]:
        if self._tick_enabled(s):
            yield Edge(("tick",), self._tick(s), False, None)
        for w in range(self.W):
            for i in range(self.N):
                th = s.thr[w][i]
                if th is None:
                    yield from self._start(s, w, i)
                else:
                    yield from self._renew(s, w, i, th)
                    yield from self._step(s, w, i, th)
            if self.cfg.crashes:
                yield from self._crash(s, w)
        for k, (i, latest) in enumerate(s.pool):
            if k and s.pool[k - 1] == (i, latest):
                continue
            rest = s.pool[:k] + s.pool[k + 1 :]
            for how in self._arrivals(s, i):
                ghost = self._landed(s.ghost, i) if how == "landed" else s.ghost
                yield Edge(("pool", i, how), s._replace(pool=rest, ghost=ghost), False, None)

    def _tick_enabled(self, s: State) -> bool:
        if any(latest <= 0 for _, latest in s.pool):
            return False
        K, T = self.cfg.commit_delay, self.cfg.timeout
        for w, row in enumerate(s.thr):
            for i, th in enumerate(row):
                if th is None:
                    continue
                op = th.op
                if isinstance(op, Commit) and op.age >= K:
                    return False
                if isinstance(op, Req) and op.status == "flying" and op.latest <= 0:
                    return False
                if isinstance(op, Look) and op.age >= T:
                    return False
                if not self.cfg.lapses and th.owns:
                    r = s.log[i]
                    if (
                        r is not None
                        and r.st == S.DISPATCHED
                        and r.nxt is None
                        and r.ow == (w, True)
                        and r.lease is not None
                        and r.lease <= 1
                        and th.pc not in ("dispatch", "existing")
                    ):
                        return False  # the renewal comes in time
        return True

    def _tick(self, s: State) -> State:
        log = tuple(None if r is None else _shift_row(r) for r in s.log)
        pool = tuple(sorted((i, latest - 1) for i, latest in s.pool))
        thr = tuple(
            tuple(None if th is None else self._shift_thread(th) for th in row) for row in s.thr
        )
        return self._lapse(State(log, pool, thr, s.ghost))

    def _shift_thread(self, th: Thread) -> Thread:
        op = th.op
        if isinstance(op, Commit):
            b = op.b
            if b is not None:
                b = max(b - 1, self.clip_stamp) if op.name == "extend" else _dec(b)
            op = Commit(op.name, op.age + 1, op.fence, _dec(op.a), b, op.n, op.text)
        elif isinstance(op, Req):
            if op.latest:
                op = Req(op.status, op.latest - 1)
        elif isinstance(op, Look):
            op = Look(op.phase, op.ans, op.age + 1)
        snap = th.snap
        return Thread(
            th.pc,
            None if snap is None else _shift_row(snap),
            th.owns,
            max(th.stamped - 1, self.clip_stamp) if th.pc in _STAMPING else 0.0,
            th.si,
            th.runs,
            th.inplace,
            th.got,
            op,
            max(th.asked - 1, self.clip_stamp) if self._asks(th) else 0.0,
        )

    def _lapse(self, s: State) -> State:
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
                ghost = _set(ghost, i, ghost[i]._replace(lapsed=True))
        return s if ghost is s.ghost else s._replace(ghost=ghost)

    def _norm(self, th: Thread) -> Thread:
        """Forget what a run will never read again, so that runs that differ only there are
        one state."""
        pc = th.pc
        snap = th.snap
        if snap is not None and not (pc == "existing" and self.cfg.stale_reads):
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
            th.got if pc == "decide" else "unasked",
            th.op,
            th.asked if self._asks(th) else 0.0,
        )

    def _asks(self, th: Thread) -> bool:
        return self.cfg.decide_as_of_lookup and th.pc == "decide" and th.got != "unasked"

    def _put(
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
        thr = _set(s.thr, w, _set(row, i, None if th is None else self._norm(th)))
        return State(
            s.log, s.pool if pool is None else pool, thr, s.ghost if ghost is None else ghost
        )

    def _start(self, s: State, w: int, i: int) -> Iterator[Edge]:
        r = s.log[i]
        if r is None:
            # The agent calls: prepare (deadline and lease from now), hold, dispatch commit.
            lease = float(max(self.cfg.lease_ttl, self.cfg.timeout))
            # Only a Queryable rule reads a deadline: the others' is left out of the state.
            dl = self.deadline(0.0, self.M) if self.kinds[i] == "queryable" else None
            th = Thread(
                "dispatch",
                None,
                False,
                0.0,
                0,
                0,
                0,
                "unasked",
                Commit("dispatch", 0, 0, lease, dl),
            )
            yield Edge(("call", w, i), self._put(s, w, i, th), False, None)
            return
        if r.st != S.DISPATCHED:
            return
        # Recovery's scan, or the agent calling the same call id again (existing_steps).
        c = self.claimable(w, i, r)
        if c == "claimable":
            th = Thread("take", r, False, 0.0, 0, 0, 0, "unasked", None)
            yield Edge(("recover", w, i, _owner_text(r.ow)), self._put(s, w, i, th), False, None)

    def _renew(self, s: State, w: int, i: int, th: Thread) -> Iterator[Edge]:
        r = s.log[i]
        if (
            r is None
            or th.pc in ("dispatch", "existing")  # it holds another intent id
            or r.st != S.DISPATCHED
            or r.nxt is not None
            or r.ow[0] != w  # renew_leases matches the worker id, whatever the pid
            or r.lease is None
            or r.lease >= self.cfg.lease_ttl
        ):
            return
        log = _set(s.log, i, r._replace(lease=float(self.cfg.lease_ttl)))
        yield Edge(("renew", w, i), s._replace(log=log), False, None)

    def _crash(self, s: State, w: int) -> Iterator[Edge]:
        threads = [(i, th) for i, th in enumerate(s.thr[w]) if th is not None]
        owns = any(r is not None and r.ow == (w, True) for r in s.log)
        if not threads and not owns:
            return
        # Commits already sent land or not; requests already sent stay in the network.
        commits = [(i, th.op) for i, th in threads if isinstance(th.op, Commit)]
        pool = list(s.pool)
        for i, th in threads:
            if isinstance(th.op, Req) and th.op.status == "flying":
                pool.append((i, th.op.latest))
        base = s._replace(thr=_set(s.thr, w, (None,) * self.N), pool=tuple(sorted(pool)))
        for mask in range(1 << len(commits)):
            t = base
            landed = []
            for k, (i, op) in enumerate(commits):
                if mask >> k & 1:
                    th0 = s.thr[w][i]
                    assert th0 is not None
                    t, _, _ = self._apply(t, w, i, th0, op)
                    landed.append(op.name)
            log = tuple(
                r._replace(ow=(w, False)) if r is not None and r.ow == (w, True) else r
                for r in t.log
            )
            yield Edge(("crash", w, tuple(landed)), self._lapse(t._replace(log=log)), True, None)

    def _arrivals(self, s: State, i: int) -> list[str]:
        # A provider refuses only what it has no effect for; a refusal is "nothing happened".
        refuse = self.cfg.refusals and s.ghost[i].eff == 0
        return ["landed", "lost", "refused"] if refuse else ["landed", "lost"]

    def _landed(self, ghost: tuple[Ghost, ...], i: int) -> tuple[Ghost, ...]:
        g = ghost[i]
        if self.kinds[i] == "idempotent" and g.eff:
            return ghost  # the provider deduplicates on the key
        return _set(ghost, i, g._replace(eff=g.eff + 1))

    def _step(self, s: State, w: int, i: int, th: Thread) -> Iterator[Edge]:
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
        pc = th.pc
        r = th.snap
        assert r is not None
        kind = self.kinds[i]
        if pc == "existing":
            # existing_steps: settled answers; claimable is driven here; else Pending.
            if r.st == S.DISPATCHED and self.claimable(w, i, r) == "claimable":
                yield Edge(
                    ("existing", w, i, "claimable"),
                    self._put(s, w, i, th._replace(pc="take")),
                    False,
                    None,
                )
            else:
                yield Edge(("existing", w, i, "answered"), self._put(s, w, i, None), False, None)
        elif pc == "take":
            # orphan_steps: a request the owner sent just before it stopped may still land.
            later = self.rules.takeover_deadline(self.intent(i, r), BASE, self.M)
            if later is not None and kind == "queryable":
                r = r._replace(dl=later - BASE)
            nxt = th._replace(pc="decide", snap=r, got="unasked")
            yield Edge(
                ("take", w, i, None if later is None else later - BASE),
                self._put(s, w, i, nxt),
                False,
                None,
            )
        elif pc == "decide":
            yield from self._decide(s, w, i, th, r)
        elif pc == "retry":
            yield from self._retry(s, w, i, th, r)
        elif pc == "stamp":
            yield from self._stamp(s, w, i, th, r)
        elif pc == "invoke":
            yield from self._invoke(s, w, i, th, r)
        elif pc == "unknown":
            dl = None
            if kind == "queryable":
                dl = max(r.dl or 0.0, self.deadline(0.0, self.M))
                r = r._replace(dl=dl)
            nxt = th._replace(pc="unknown_c", snap=r, op=Commit("unknown", 0, r.fence, dl))
            yield Edge(("unknown", w, i, dl), self._put(s, w, i, nxt), False, None)
        else:
            raise AssertionError(pc)

    def _decide(self, s: State, w: int, i: int, th: Thread, r: Row) -> Iterator[Edge]:
        d = self.decision(i, r, th.got, th.asked)
        label: Label = ("decide", w, i, th.got, d)
        if isinstance(d, Ask):
            nxt = th._replace(pc="lookup", op=Look("sent", "", 0))
        elif isinstance(d, Complete):
            nxt = th._replace(pc="decision", op=Commit("landed", 0, r.fence))
        elif isinstance(d, Defer):
            at = d.at - BASE
            nxt = th._replace(
                pc="decision", op=Commit("defer", 0, r.fence, at, None, d.unknown_count, d.reason)
            )
        elif isinstance(d, MarkIndeterminate):
            nxt = th._replace(pc="decision", op=Commit("indet", 0, r.fence, text=d.reason))
        elif isinstance(d, Retry):
            nxt = th._replace(pc="retry")
        else:
            raise AssertionError(f"the model does not know the decision {d!r}")
        yield Edge(label, self._put(s, w, i, nxt), False, None)

    def _retry(self, s: State, w: int, i: int, th: Thread, r: Row) -> Iterator[Edge]:
        if th.runs:
            # Out of this caller's retry budget: recovery takes the next attempt.
            op = Commit("defer", 0, r.fence, 1.0, None, r.uc, "retry_deferred")
            yield Edge(
                ("retry", w, i, "deferred"),
                self._put(s, w, i, th._replace(pc="decision", op=op)),
                False,
                None,
            )
        lease = float(max(self.cfg.lease_ttl, self.cfg.timeout))
        dl = self.deadline(0.0, self.M) if self.kinds[i] == "queryable" else None
        op = Commit("claim", 0, r.fence, lease, dl)
        nxt = th._replace(pc="claim", op=op, stamped=0.0)
        yield Edge(("retry", w, i, "claim"), self._put(s, w, i, nxt), False, None)

    def _stamp(self, s: State, w: int, i: int, th: Thread, r: Row) -> Iterator[Edge]:
        needed = self.deadline(0.0, self.M - self.M / 4)
        if (r.dl is not None and r.dl >= needed) or th.si >= 3:
            yield Edge(
                ("stamp", w, i, "ok"), self._put(s, w, i, th._replace(pc="invoke")), False, None
            )
            return
        later = self.deadline(0.0, self.M) + (0.0 - th.stamped)
        op = Commit("extend", 0, r.fence, later, 0.0)
        yield Edge(
            ("stamp", w, i, later),
            self._put(s, w, i, th._replace(pc="stamp_c", op=op)),
            False,
            None,
        )

    def _invoke(self, s: State, w: int, i: int, th: Thread, r: Row) -> Iterator[Edge]:
        g = s.ghost[i]
        nxt = th._replace(pc="wait", runs=1, op=Req("flying", self.L))
        ghost = _set(s.ghost, i, g._replace(sends=g.sends + 1))
        yield Edge(("invoke", w, i, r.att), self._put(s, w, i, nxt, ghost=ghost), False, None)
        if not self.cfg.not_sent:
            return
        n = th.inplace + 1
        failed = th._replace(
            pc="outcome", runs=1, inplace=n, op=Commit("outcome", 0, r.fence, text="FAILED")
        )
        yield Edge(("not_sent", w, i, "failed"), self._put(s, w, i, failed), False, None)
        if n < self.cfg.max_attempts:
            again = th._replace(runs=1, inplace=n)
            yield Edge(("not_sent", w, i, "again"), self._put(s, w, i, again), False, None)

    def _request_events(self, s: State, w: int, i: int, th: Thread, op: Req) -> Iterator[Edge]:
        r = th.snap
        assert r is not None
        if op.status == "flying":
            for how in self._arrivals(s, i):
                ghost = self._landed(s.ghost, i) if how == "landed" else s.ghost
                nxt = th._replace(op=Req(cast(Any, how), 0))
                yield Edge(("arrive", w, i, how), self._put(s, w, i, nxt, ghost=ghost), False, None)
        if op.status in ("landed", "refused"):
            state = "COMPLETED" if op.status == "landed" else "FAILED"
            nxt = th._replace(pc="outcome", op=Commit("outcome", 0, r.fence, text=state))
            yield Edge(("reply", w, i, state), self._put(s, w, i, nxt), False, None)
        # A timeout, a reset, a lost reply, a 5xx: the outcome is unknown.
        pool = s.pool
        if op.status == "flying":
            pool = tuple(sorted((*pool, (i, op.latest))))
        nxt = th._replace(pc="unknown", op=None)
        yield Edge(("reply", w, i, "unknown"), self._put(s, w, i, nxt, pool=pool), False, None)

    def _lookup_events(self, s: State, w: int, i: int, th: Thread, op: Look) -> Iterator[Edge]:
        if op.phase == "sent":
            ans = "landed" if s.ghost[i].eff else "notlanded"
            nxt = th._replace(op=op._replace(phase="read", ans=ans))
            yield Edge(("lookup_read", w, i, ans), self._put(s, w, i, nxt), False, None)
        else:
            nxt = th._replace(pc="decide", got=op.ans, op=None, asked=self._asked(op))
            yield Edge(("lookup_answer", w, i, op.ans), self._put(s, w, i, nxt), False, None)
        nxt = th._replace(pc="decide", got="unknown", op=None, asked=self._asked(op))
        yield Edge(("lookup_answer", w, i, "unknown"), self._put(s, w, i, nxt), False, None)

    def _asked(self, op: Look) -> float:
        return -float(op.age) if self.cfg.decide_as_of_lookup else 0.0

    def _commit_events(self, s: State, w: int, i: int, th: Thread, op: Commit) -> Iterator[Edge]:
        t, nxt, violation = self._apply(s, w, i, th, op)
        yield Edge(
            ("commit", w, i, op.name, "ok" if nxt is not None else "done"),
            self._put(t, w, i, nxt),
            False,
            violation,
        )
        if self.cfg.lost_commit_replies:
            # The commit raised in the caller (applied or not): the run ends, its hold goes.
            yield Edge(
                ("commit_lost", w, i, op.name, True),
                self._lapse(self._put(t, w, i, None)),
                False,
                violation,
            )
            yield Edge(("commit_lost", w, i, op.name, False), self._put(s, w, i, None), False, None)

    def _apply(
        self, s: State, w: int, i: int, th: Thread, op: Commit
    ) -> tuple[State, Thread | None, str | None]:
        """Apply a commit as the store does (compare-and-set on the fence); returns the new
        state, the thread after it (None: its run ended) and a violated property."""
        r = s.log[i]
        kind = self.kinds[i]
        name = op.name
        fits = r is not None and r.fence == op.fence and r.st == S.DISPATCHED
        violation = None
        if name == "dispatch":
            if r is None:
                row = Row(S.DISPATCHED, 1, (w, True), op.a, op.b, None, 1, 0)
                pc = "stamp" if kind == "queryable" else "invoke"
                t = s._replace(log=_set(s.log, i, row))
                return self._lapse(t), th._replace(pc=pc, snap=row, owns=True, op=None), None
            if self.cfg.stale_reads:
                return s, th._replace(pc="existing", snap=r, owns=False, op=None), None
            if r.st == S.DISPATCHED and self.claimable(w, i, r) == "claimable":
                return s, th._replace(pc="take", snap=r, owns=False, op=None), None
            return s, None, None
        if not fits:
            return s, None, None  # fenced out: the run answers from the log
        assert r is not None
        ghost = s.ghost
        if name in ("claim", "landed", "defer", "indet"):
            ghost, violation = self._takeover(s, w, i, r, th)
        if name == "claim":
            row = Row(
                S.DISPATCHED,
                r.fence + 1,
                (w, True),
                op.a,
                op.b if op.b is not None else r.dl,
                None,
                r.att + 1,
                r.uc,
            )
            ghost = _set(ghost, i, ghost[i]._replace(lapsed=False))
            pc = "stamp" if kind == "queryable" else "invoke"
            nxt = th._replace(pc=pc, snap=row, owns=True, si=0, inplace=0, op=None)
            return self._lapse(State(_set(s.log, i, row), s.pool, s.thr, ghost)), nxt, violation
        if name == "extend":
            assert op.a is not None and op.b is not None
            row = r._replace(dl=op.a if r.dl is None else max(r.dl, op.a))
            snap = r._replace(dl=op.a) if th.snap is None else th.snap._replace(dl=op.a)
            nxt = th._replace(pc="stamp", snap=snap, stamped=op.b, si=th.si + 1, op=None)
            return s._replace(log=_set(s.log, i, row)), nxt, None
        if name == "unknown":
            row = r if op.a is None else r._replace(dl=op.a if r.dl is None else max(r.dl, op.a))
            return (
                s._replace(log=_set(s.log, i, row)),
                th._replace(pc="decide", got="unasked", op=None),
                None,
            )
        if name == "outcome":
            st = S.COMPLETED if op.text == "COMPLETED" else S.FAILED
            row = _settled(st)
            if st == S.COMPLETED and s.ghost[i].eff == 0:
                violation = f"intent {i} ({kind}) COMPLETED without an effect"
            return s._replace(log=_set(s.log, i, row), ghost=ghost), None, violation
        if name == "landed":
            row = _settled(S.COMPLETED)
            if s.ghost[i].eff == 0:
                violation = violation or f"intent {i} completed by lookup without an effect"
            return s._replace(log=_set(s.log, i, row), ghost=ghost), None, violation
        if name == "defer":
            row = r._replace(nxt=op.a, lease=op.a, uc=op.n)
            return s._replace(log=_set(s.log, i, row), ghost=ghost), None, violation
        if name == "indet":
            row = _settled(S.INDETERMINATE)
            return s._replace(log=_set(s.log, i, row), ghost=ghost), None, violation
        raise AssertionError(name)

    def _takeover(
        self, s: State, w: int, i: int, r: Row, th: Thread
    ) -> tuple[tuple[Ghost, ...], str | None]:
        """A write by a run that does not own the attempt: its live owner must not be running it
        with its lease valid. One whose lease ran out is the limit the contract states."""
        ow, cur = r.ow
        if th.owns or not cur or ow == w:
            return s.ghost, None
        other = s.thr[ow][i]
        if other is None or not other.owns or other.snap is None or other.snap.fence != r.fence:
            return s.ghost, None
        g = s.ghost[i]
        if g.lapsed:
            return _set(s.ghost, i, g._replace(excused=True)), None
        return s.ghost, (
            f"w{w} took intent {i} over from w{ow}, which is alive, still drives it and whose "
            "lease never ran out"
        )


# Exploration.


def explore(cfg: Config, rules: Rules | None = None, *, liveness: bool = True) -> Result:
    """Visit every reachable state breadth-first; stop at the first violated property."""
    m = Model(cfg, rules)
    res = Result(cfg)
    started = time.monotonic()
    s0 = m.initial()
    ids: dict[State, int] = {s0: 0}
    states: list[State] = [s0]
    parent = array("l", [-1])
    src, dst = array("l"), array("l")  # crash-free edges, for liveness
    queue = deque([0])

    def stop(v: int, violation: str, last: str | None = None) -> Result:
        res.violation = violation
        res.trace = _trace(m, states, parent, v, last)
        res.states = len(states)
        res.seconds = time.monotonic() - started
        return res

    while queue:
        u = queue.popleft()
        for e in m.successors(states[u]):
            res.transitions += 1
            t = m.canon(e.state)
            v = ids.get(t)
            if v is None:
                v = ids[t] = len(states)
                states.append(t)
                parent.append(u)
                bad = e.violation or m.check(t)
                if bad is not None:
                    return stop(v, bad)
                if any(g.excused and g.eff > 1 for g in t.ghost):
                    res.excused += 1
                queue.append(v)
                if len(states) >= cfg.max_states:
                    res.truncated = True
                    queue.clear()
                    break
            elif e.violation is not None:
                return stop(u, e.violation, e.violation)
            if liveness and not e.crash:
                src.append(u)
                dst.append(v)
    res.states = len(states)
    if liveness and not res.truncated:
        stuck = _stuck(m, states, src, dst)
        res.live_checked = True
        res.stuck = len(stuck)
        if stuck:
            return stop(min(stuck), "from this state no crash-free run settles every intent")
    res.seconds = time.monotonic() - started
    return res


def replay(cfg: Config, steps: Sequence[str], rules: Rules | None = None) -> Result:
    """Follow one run step by step: each step names a transition (``tick``, ``invoke``,
    ``commit:claim``, ``lookup_answer:notlanded``...: its kind and, after a colon, a word of
    its label). Returns the trace and the first property it breaks, as `explore` would."""
    m = Model(cfg, rules)
    res = Result(cfg)
    s = m.initial()
    res.trace = ["trace (t = ticks since the start):"]
    t = 0
    for step in steps:
        kind, _, word = step.partition(":")
        for e in m.successors(s):
            if e.label[0] != kind or (word and word not in e.label):
                continue
            if kind == "commit_lost" or (kind == "commit" and e.label[-1] not in ("ok", "done")):
                continue
            break
        else:
            raise ValueError(f"no transition {step!r} at t={t}: the run is not possible")
        s = e.state
        res.states += 1
        if kind == "tick":
            t += 1
        else:
            res.trace.append(f"  t={t:<3} {_say(m, e.label)}")
        bad = e.violation or m.check(s)
        if bad is not None:
            res.violation = bad
            break
    res.trace.append("final state:")
    res.trace.extend("  " + x for x in _show(m, s))
    return res


def _stuck(m: Model, states: list[State], src: array[int], dst: array[int]) -> list[int]:
    """States from which no crash-free path reaches a state with every intent settled."""
    n = len(states)
    count = array("l", [0]) * (n + 1)
    for v in dst:
        count[v + 1] += 1
    for k in range(n):
        count[k + 1] += count[k]
    preds = array("l", [0]) * len(dst)
    fill = array("l", count)
    for u, v in zip(src, dst, strict=True):
        preds[fill[v]] = u
        fill[v] += 1
    good = bytearray(n)
    queue = deque(k for k, s in enumerate(states) if m.settled(s))
    for k in queue:
        good[k] = 1
    while queue:
        v = queue.popleft()
        for k in range(count[v], count[v + 1]):
            u = preds[k]
            if not good[u]:
                good[u] = 1
                queue.append(u)
    return [k for k in range(n) if not good[k]]


def _trace(
    m: Model, states: list[State], parent: array[int], v: int, last: str | None = None
) -> list[str]:
    """The shortest path to state `v` in words, its workers named as one run names them (the
    search keeps one state per renaming of the workers; the trace is replayed concretely)."""
    path = []
    while v > 0:
        path.append(v)
        v = parent[v]
    path.reverse()
    lines = ["trace (t = ticks since the start):"]
    t = 0
    s = m.initial()
    for k in path:
        target = states[k]
        e = next(e for e in m.successors(s) if target in m.orbit(e.state))
        s = e.state
        if e.label[0] == "tick":
            t += 1
        else:
            lines.append(f"  t={t:<3} {_say(m, e.label)}")
    if last is not None:
        e = next(e for e in m.successors(s) if e.violation == last)
        lines.append(f"  t={t:<3} {_say(m, e.label)}")
        s = e.state
    lines.append("final state:")
    lines.extend("  " + x for x in _show(m, s))
    return lines


def _say(m: Model, label: Label) -> str:
    """A transition in words."""
    what, args = label[0], label[1:]
    if what == "pool":
        i, how = args
        return f"a request of intent {i} ({m.kinds[i]}) nobody waits for any more: {how}"
    if what == "crash":
        w, landed = args
        return f"w{w} crashes (its commits in flight that still land: {list(landed) or 'none'})"
    w, i, *rest = args
    who = f"w{w}"
    it = f"intent {i} ({m.kinds[i]})"
    r0 = rest[0] if rest else None
    if what == "call":
        return f"{who}: the agent calls {it}: hold, dispatch commit sent"
    if what == "recover":
        return f"{who}: recovery (or the call id again) finds {it} claimable; owner {r0}"
    if what == "renew":
        return f"{who}: renews the lease of {it}"
    if what == "existing":
        return f"{who}: the call id of {it} exists: {r0}"
    if what == "take":
        return f"{who}: takes {it} over; " + (
            "its deadline stands" if r0 is None else f"takeover deadline now+{r0:g}"
        )
    if what == "decide":
        return f"{who}: decides {it} on {r0}: {rest[1]!r}"
    if what == "retry":
        return f"{who}: retry of {it}: {r0}"
    if what == "stamp":
        return f"{who}: deadline of {it} " + (
            "stands" if r0 == "ok" else f"to be stamped again to now+{r0}"
        )
    if what == "invoke":
        return f"{who}: invokes the tool of {it} (attempt {r0}): request sent"
    if what == "not_sent":
        return f"{who}: the tool of {it} could not connect (NotSent): {r0}"
    if what == "arrive":
        return f"{who}'s request of {it} at the provider: {r0}"
    if what == "reply":
        return f"{who}: the tool of {it} returns: {r0}"
    if what == "unknown":
        return f"{who}: records the unknown outcome of {it}" + (
            "" if r0 is None else f", deadline now+{r0}"
        )
    if what == "lookup_read":
        return f"{who}: the provider reads its ledger for the lookup of {it}: {r0}"
    if what == "lookup_answer":
        return f"{who}: the lookup of {it} answers {r0}"
    if what == "commit":
        return f"{who}: commit {r0} of {it} applied" + (
            "" if rest[1] == "ok" else " (or fenced out); the run ends"
        )
    if what == "commit_lost":
        return f"{who}: commit {r0} of {it} {'applied' if rest[1] else 'not applied'}, " + (
            "its reply lost: the run ends"
        )
    return repr(label)


def _show(m: Model, s: State) -> list[str]:
    out = []
    for i, r in enumerate(s.log):
        g = s.ghost[i]
        row = (
            "not in the log"
            if r is None
            else (
                f"{r.st.value} fence={r.fence} owner={_owner_text(r.ow)} lease=now+{r.lease} "
                f"deadline=now+{r.dl} next_check={r.nxt} attempts={r.att} unknown={r.uc}"
            )
        )
        out.append(f"intent {i} ({m.kinds[i]}): {row}; effects={g.eff} sends={g.sends}")
    for w, row2 in enumerate(s.thr):
        for i, th in enumerate(row2):
            if th is not None:
                out.append(f"w{w} runs intent {i} at {th.pc} (owns={th.owns}, op={th.op})")
    if s.pool:
        out.append(f"requests in flight nobody waits for: {list(s.pool)}")
    return out


def _owner_text(ow: object) -> str:
    if isinstance(ow, tuple):
        return f"w{ow[0]}" + ("" if ow[1] else " (dead)")
    return str(ow)


def _settled(st: IntentState) -> Row:
    """A settled row: no rule reads more of it than its state."""
    return Row(st, 0, NOBODY, None, None, None, 0, 0)


def _abs(x: float | None) -> float | None:
    return None if x is None else BASE + x


def _dec(x: float | None) -> float | None:
    return None if x is None else max(x - 1.0, 0.0)


def _shift_row(r: Row) -> Row:
    if r.lease is None and r.dl is None and r.nxt is None:
        return r
    return Row(r.st, r.fence, r.ow, _dec(r.lease), _dec(r.dl), _dec(r.nxt), r.att, r.uc)


def _set(t: tuple[X, ...], k: int, v: X) -> tuple[X, ...]:
    return (*t[:k], v, *t[k + 1 :])


# The command line.


_FULL: tuple[tuple[Kind, tuple[int, ...]], ...] = (
    ("unsafe", (2, 3)),
    ("idempotent", (2, 3)),
    ("queryable", (1, 2)),
)


def configs(size: str) -> list[Config]:
    """Named sets: `ci` is what the test suite explores; `full` every class on one host and on
    many (Unsafe and Idempotent with two and three workers, Queryable, whose world is far
    larger, with one and two), and a recoverer slow between its read and its clock."""
    if size == "ci":
        return [
            *(Config(workers=2, intents=("unsafe",), same_host=h) for h in (True, False)),
            Config(
                workers=2, intents=("idempotent",), not_sent=False, refusals=False, commit_delay=1
            ),
        ]
    return [
        *(
            Config(workers=w, intents=(k,), same_host=h)
            for k, counts in _FULL
            for w in counts
            for h in (True, False)
        ),
        Config(workers=2, intents=("unsafe",), stale_reads=True),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m poimen._model",
        description="Exhaustive model check of poimen's call and recovery protocol.",
    )
    p.add_argument("--set", choices=("ci", "full"), help="run a named set of configurations")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--intents", default="queryable", help="classes, comma separated")
    p.add_argument("--timeout", type=int, default=3)
    p.add_argument("--margin", type=int, default=2)
    p.add_argument("--lease-ttl", type=int, default=3)
    p.add_argument("--latency", type=int)
    p.add_argument("--commit-delay", type=int, default=2)
    p.add_argument("--max-attempts", type=int, default=2)
    p.add_argument("--lookup-limit", type=int, default=2)
    p.add_argument("--hosts", choices=("one", "many"), default="one")
    p.add_argument("--no-crashes", action="store_true")
    p.add_argument("--no-lapses", action="store_true")
    p.add_argument("--no-lost-commit-replies", action="store_true")
    p.add_argument("--no-not-sent", action="store_true")
    p.add_argument("--no-refusals", action="store_true")
    p.add_argument("--stale-reads", action="store_true")
    p.add_argument(
        "--decide-as-of-lookup",
        action="store_true",
        help="not the protocol as built: judge a lookup's answer as of when it was sent",
    )
    p.add_argument("--no-liveness", action="store_true")
    p.add_argument("--max-states", type=int, default=3_000_000)
    ns = p.parse_args(argv)
    if ns.set:
        todo = configs(ns.set)
    else:
        kinds = tuple(k.strip() for k in ns.intents.split(",") if k.strip())
        for k in kinds:
            if k not in KINDS:
                p.error(f"unknown class {k!r}; expected {', '.join(KINDS)}")
        todo = [
            Config(
                workers=ns.workers,
                intents=cast(tuple[Kind, ...], kinds),
                timeout=ns.timeout,
                margin=ns.margin,
                lease_ttl=ns.lease_ttl,
                latency=ns.latency,
                commit_delay=ns.commit_delay,
                max_attempts=ns.max_attempts,
                lookup_limit=ns.lookup_limit,
                same_host=ns.hosts == "one",
                crashes=not ns.no_crashes,
                lapses=not ns.no_lapses,
                lost_commit_replies=not ns.no_lost_commit_replies,
                not_sent=not ns.no_not_sent,
                stale_reads=ns.stale_reads,
                refusals=not ns.no_refusals,
                decide_as_of_lookup=ns.decide_as_of_lookup,
                max_states=ns.max_states,
            )
        ]
    failed = 0
    for cfg in todo:
        res = explore(cfg, liveness=not ns.no_liveness)
        print(res.report(), flush=True)
        print(flush=True)
        failed += not res.ok()
    print(f"{len(todo) - failed} of {len(todo)} configurations hold every property")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
