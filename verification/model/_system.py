"""The transition system of one configuration: the initial state, the properties of a state,
and every step the world may take from it (a run's step, a tick of the clock, a renewal, a
crash, a request nobody waits for landing)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import cast

from verification.model._steps import Protocol
from verification.model._world import (
    TERMINAL,
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
    owner_text,
    put,
    shift_row,
)


class Model(Protocol):
    """The transition system of one configuration."""

    def __init__(self, cfg: Config, rules: Rules | None = None) -> None:
        super().__init__(cfg, rules)
        self._identity = list(range(cfg.workers))

    # The initial state and the goal.

    def initial(self) -> State:
        return State(
            log=(None,) * self.N,
            pool=(),
            thr=((None,) * self.N,) * self.W,
            ghost=(Ghost(0, 0, False, False),) * self.N,
        )

    def excused(self, s: State) -> bool:
        """Does this state hold two effects the contract's stated limit allows?"""
        return any(g.excused and g.eff > 1 for g in s.ghost)

    def say(self, label: Label) -> str:
        from verification.model._explore import say

        return say(self, label)

    def show(self, s: State) -> list[str]:
        from verification.model._explore import show

        return show(self, s)

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
            if kind == "transactional" and g.eff > 1:
                return f"Transactional intent {i} committed {g.eff} times"
            # The marker's fence leaves no limit to excuse: not even an owner cut off past its
            # lease commits after a lookup said "not landed".
            if kind == "transactional" and r is not None and r.st == S.FAILED and g.eff:
                return f"intent {i} (transactional) is FAILED but its write committed"
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
            if self.cfg.stale_reads:  # a read row names its owner: as "me" or "another"
                ts = tuple(_as_seen_by(t, w) for t in ts)
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
            return r._replace(ow=(perm[r.ow[0]], r.ow[1]))

        thr: list[tuple[Thread | None, ...]] = [()] * self.W
        for w, ts in enumerate(s.thr):
            if self.cfg.stale_reads:  # only a stale read keeps its row's owner
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
                    yield from self.step(s, w, i, th)
            if self.cfg.crashes:
                yield from self._crash(s, w)
        for k, (i, latest) in enumerate(s.pool):
            if k and s.pool[k - 1] == (i, latest):
                continue
            rest = s.pool[:k] + s.pool[k + 1 :]
            for how in self.arrivals(s, i):
                ghost = self.landed(s.ghost, i) if how == "landed" else s.ghost
                yield Edge(("pool", i, how), s._replace(pool=rest, ghost=ghost), False, None)

    def _tick_enabled(self, s: State) -> bool:
        """Time may pass unless something must happen before it does."""
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
        log = tuple(None if r is None else shift_row(r) for r in s.log)
        if self.cfg.slow_renewals:
            # How long ago a lease ran out matters to a renewal whose clock is that old.
            log = tuple(
                r if r is None or o is None or o.lease is None or o.lease > 0
                else r._replace(lease=max(o.lease - 1, -float(self.cfg.commit_delay)))
                for r, o in zip(log, s.log, strict=True)
            )  # fmt: skip
        pool = tuple(sorted((i, latest - 1) for i, latest in s.pool))
        thr = tuple(
            tuple(None if th is None else self.tick_thread(th) for th in row) for row in s.thr
        )
        return self.lapse(State(log, pool, thr, s.ghost))

    def _start(self, s: State, w: int, i: int) -> Iterator[Edge]:
        r = s.log[i]
        if r is None:
            # The agent calls: prepare (deadline and lease from now), hold, dispatch commit.
            lease = float(max(self.cfg.lease_ttl, self.cfg.timeout))
            # Only a Queryable rule reads a deadline: the others' is left out of the state.
            dl = self.deadline(0.0, self.M) if self.kinds[i] == "queryable" else None
            op = Commit("dispatch", 0, 0, lease, dl)
            th = Thread("dispatch", None, False, 0.0, 0, 0, 0, "unasked", op)
            yield Edge(("call", w, i), self.set_thread(s, w, i, th), False, None)
            return
        if r.st != S.DISPATCHED:
            return
        # Recovery's scan, or the agent calling the same call id again (existing_steps).
        if self.cfg.stale_reads:
            th = Thread("existing", r, False, 0.0, 0, 0, 0, "unasked", None)
            yield Edge(("read", w, i, owner_text(r.ow)), self.set_thread(s, w, i, th), False, None)
        elif self.claimable(w, i, r) == "claimable":
            th = self.taking(Thread("take", r, False, 0.0, 0, 0, 0, "unasked", None), r)
            label = ("recover", w, i, owner_text(r.ow))
            yield Edge(label, self.set_thread(s, w, i, th), False, None)

    def _renew(self, s: State, w: int, i: int, th: Thread) -> Iterator[Edge]:
        """renew_leases: the lease set to now + lease_ttl if it is later, unless it has run
        out by the renewer's clock. With slow renewals, that clock was read up to a commit's
        time before the renewal applies."""
        r = s.log[i]
        if (
            r is None
            or th.pc in ("dispatch", "existing")  # it holds another intent id
            or r.st != S.DISPATCHED
            or r.nxt is not None
            or r.ow[0] != w  # renew_leases matches the worker id, whatever the pid
            or r.lease is None
        ):
            return
        ttl = self.cfg.lease_ttl
        for age in range(self.cfg.commit_delay + 1 if self.cfg.slow_renewals else 1):
            if r.lease >= ttl - age or (self.rules.renewal_never_revives and r.lease <= -age):
                continue
            log = put(s.log, i, r._replace(lease=float(ttl - age)))
            yield Edge(("renew", w, i, age), s._replace(log=log), False, None)

    def _crash(self, s: State, w: int) -> Iterator[Edge]:
        me = (w, True)
        mine = s.thr[w]
        owns = any(r is not None and r.ow == me for r in s.log)
        if not owns and not any(mine):
            return
        # Commits already sent land or not; requests already sent stay in the network.
        commits = [(i, th) for i, th in enumerate(mine) if th and isinstance(th.op, Commit)]
        flying = [
            (i, th.op.latest)
            for i, th in enumerate(mine)
            if th and isinstance(th.op, Req) and th.op.status == "flying"
        ]
        pool = tuple(sorted(s.pool + tuple(flying))) if flying else s.pool
        thr = put(s.thr, w, (None,) * self.N)
        if self.cfg.stale_reads:  # a row read before the crash shows the old process
            thr = tuple(tuple(_dead(t, w) for t in ts) for ts in thr)
        base = State(s.log, pool, thr, s.ghost)
        for mask in range(1 << len(commits)):
            t = base
            landed = []
            for k, (i, th0) in enumerate(commits):
                if mask >> k & 1:
                    op = cast(Commit, th0.op)
                    t, _, _ = self.apply(t, w, i, th0, op)
                    landed.append(op.name)
            log = t.log
            if owns or landed:
                dead = (w, False)
                log = tuple(r._replace(ow=dead) if r is not None and r.ow == me else r for r in log)
            end = self.lapse(State(log, t.pool, t.thr, t.ghost))
            yield Edge(("crash", w, tuple(landed)), end, True, None)


def _as_seen_by(th: Thread | None, w: int) -> Thread | None:
    if th is None or th.snap is None or th.snap.ow[0] < 0:
        return th
    return th._replace(snap=th.snap._replace(ow=(int(th.snap.ow[0] == w), th.snap.ow[1])))


def _dead(th: Thread | None, w: int) -> Thread | None:
    if th is None or th.snap is None or th.snap.ow != (w, True):
        return th
    return th._replace(snap=th.snap._replace(ow=(w, False)))
