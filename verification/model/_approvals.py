"""Approval vs expiry vs recovery: a call awaiting an operator, its window, and everyone who
may end it or run it (docs/verification.md, "The rules of issue 20").

One Unsafe call is recorded awaiting approval, its window `window` ticks long. Operators send
decisions (approve or reject), each judged by the store (`decide_approval`) under the row lock
against the clock the operator read up to a commit's time before. Callers waiting on the call
(`wait`, or the same call id again) and, with upkeep, recovery passes read the clock, then the
row: one whose window has passed they expire (a compare-and-set on the fence read, judged by
that clock); an approved call nobody runs they claim (a compare-and-set on the fence) and run,
its request passing the send gate. Decisions and expiries race, and any may be slow.

Properties: the call is sent at most once, only if approved, and only under an approval whose
clock was inside the window; an approval never takes effect beside a rejection or an expiry;
and from every state the call can settle (liveness), which without upkeep or operators holds
only if the callers end the window themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from poimen._core.decide import Send
from poimen._core.effects import Unsafe
from poimen._core.intents import IntentState
from verification.model._focus import OWNER, Focused, Step, intent
from verification.model._world import BASE, Rules, put

S = IntentState
_SETTLED = (S.COMPLETED, S.FAILED)


@dataclass(frozen=True, slots=True)
class ApprovalConfig:
    """One bounded world. Times are whole ticks."""

    window: int = 2  # approval_ttl
    operators: int = 1  # decisions sent by operators (each an approval or a rejection)
    waiters: int = 1  # callers waiting on the call: `wait`, or the same call id again
    upkeep: bool = True  # background recovery passes (expiry, approved calls run)
    commit_delay: int = 1  # a clock is read up to this long before its write applies
    max_states: int = 2_000_000

    def describe(self) -> str:
        return (
            f"approvals: window={self.window} operators={self.operators} "
            f"waiters={self.waiters} upkeep={self.upkeep} commit_delay={self.commit_delay}"
        )

    def system(self, rules: Rules) -> Approvals:
        return Approvals(self, rules)


class Row(NamedTuple):
    st: IntentState
    fence: int
    end: int  # the window's end, ticks from now (a passed end kept as far as a clock lags)
    claimed: bool  # an attempt was claimed: its driver runs it


class Actor(NamedTuple):
    """An operator's decision or a caller's (or a recovery pass's) run."""

    pc: str  # idle, decide, expire, claim, send, outcome, done
    age: int = 0  # ticks since its clock was read
    fence: int = 0  # the fence it read
    what: str = ""  # an operator's decision: approve or reject


class Ghost(NamedTuple):
    approved: bool
    late: bool  # approved by a decision whose clock was at or past the window's end
    ended: str  # "rejected" or "expired": ended without approval
    sends: int


class State(NamedTuple):
    row: Row
    ops: tuple[Actor, ...]
    callers: tuple[Actor, ...]  # the waiters, then (with upkeep) the recovery duty
    ghost: Ghost


_IDLE = Actor("idle")
_DONE = Actor("done")


class Approvals(Focused):
    name = "approvals"
    cfg: ApprovalConfig

    def initial(self) -> State:
        c = self.cfg
        return State(
            Row(S.AWAITING_APPROVAL, 1, c.window, False),
            (_IDLE,) * c.operators,
            (_IDLE,) * (c.waiters + c.upkeep),
            Ghost(False, False, "", 0),
        )

    def _upkeep(self, k: int) -> bool:
        return self.cfg.upkeep and k == self.cfg.waiters

    def _due(self, r: Row, age: int) -> bool:
        """The project's rule: is the window over by a clock read `age` ticks ago?"""
        it = intent(state=r.st, fence=r.fence, next_check_at=BASE + r.end + age, attempts=0)
        return self.rules.approval_due(it, BASE)

    def check(self, s: State) -> str | None:
        g = s.ghost
        if g.sends > 1:
            return f"the approved Unsafe call was sent {g.sends} times"
        if g.sends and not g.approved:
            return "the call was sent without an approval"
        if g.sends and g.late:
            return "the call was sent under an approval given after its window had ended"
        if g.approved and g.ended:
            return f"the call was both approved and {g.ended}"
        return None

    def settled(self, s: State) -> bool:
        return s.row.st in _SETTLED and all(
            a.pc in ("idle", "done") for a in (*s.ops, *s.callers)
        )

    def successors(self, s: State) -> Iterator[Step]:
        if self._tick_enabled(s):
            yield Step(("tick",), self._tick(s))
        for k, a in enumerate(s.ops):
            yield from self._operator(s, k, a)
        for k, a in enumerate(s.callers):
            yield from self._caller(s, k, a)

    def _tick_enabled(self, s: State) -> bool:
        # A write whose clock was read a commit's time ago applies before time goes on.
        return not any(
            a.pc in ("decide", "expire", "claim") and a.age >= self.cfg.commit_delay
            for a in (*s.ops, *s.callers)
        )

    def _tick(self, s: State) -> State:
        K = self.cfg.commit_delay
        r = s.row._replace(end=max(s.row.end - 1, -K))

        def older(a: Actor) -> Actor:
            return a._replace(age=min(a.age + 1, K)) if a.pc in ("decide", "expire", "claim") else a

        return s._replace(
            row=r, ops=tuple(map(older, s.ops)), callers=tuple(map(older, s.callers))
        )

    # Operators: read the clock, send the decision; the store judges it under the row lock.

    def _operator(self, s: State, k: int, a: Actor) -> Iterator[Step]:
        if a.pc == "idle":
            for what in ("approve", "reject"):
                nxt = s._replace(ops=put(s.ops, k, Actor("decide", 0, 0, what)))
                yield Step((f"operator {k}", f"reads the clock, sends {what}"), nxt)
            return
        if a.pc != "decide":
            return
        r, g = s.row, s.ghost
        done = s._replace(ops=put(s.ops, k, _DONE))
        if r.st != S.AWAITING_APPROVAL:
            yield Step((f"operator {k}", f"{a.what} refused: the call is {r.st.value}"), done)
            return
        if self.rules.approval_window_checked and self._due(r, a.age):
            row = Row(S.FAILED, r.fence + 1, r.end, False)
            nxt = done._replace(row=row, ghost=g._replace(ended=g.ended or "expired"))
            yield Step((f"operator {k}", f"{a.what} too late: the store expires the call"), nxt)
            return
        late = r.end + a.age <= 0
        if a.what == "approve":
            row = Row(S.DISPATCHED, r.fence + 1, r.end, False)
            ghost = g._replace(approved=True, late=g.late or late)
        else:
            row = Row(S.FAILED, r.fence + 1, r.end, False)
            ghost = g._replace(ended=g.ended or "rejected")
        when = "after" if late else "inside"
        yield Step(
            (f"operator {k}", f"{a.what} applied (its clock {when} the window)"),
            done._replace(row=row, ghost=ghost),
        )

    # Callers and recovery: the clock, then the row; expire, or claim and run, or answer.

    def _caller(self, s: State, k: int, a: Actor) -> Iterator[Step]:
        who = "recovery" if self._upkeep(k) else f"caller {k}"
        r = s.row

        def to(b: Actor, **kw: object) -> State:
            return s._replace(callers=put(s.callers, k, b), **kw)  # type: ignore[arg-type]

        if a.pc == "idle":
            waiter = not self._upkeep(k)
            if r.st == S.AWAITING_APPROVAL:
                if self._due(r, 0) and (self.rules.waiter_expires or not waiter):
                    yield Step((who, "reads the row: its window is over; expires it"),
                               to(Actor("expire", 0, r.fence)))
                elif waiter:
                    yield Step((who, "reads the row: answered 'awaiting approval'"), to(_IDLE))
            elif r.st == S.DISPATCHED and not r.claimed:
                claim = self.rules.claimability(
                    intent(fence=r.fence, attempts=0), OWNER, held=False, now=BASE,
                    alive=lambda o: True,
                )  # fmt: skip
                if claim == "claimable":
                    yield Step((who, "reads the row: approved, nobody runs it; claims it"),
                               to(Actor("claim", 0, r.fence)))
            elif r.st in _SETTLED and waiter:
                yield Step((who, f"reads the row: answered {r.st.value}"), to(_DONE))
        elif a.pc == "expire":
            # The store's expiry: on the fence read, if the window is over by that clock.
            g = s.ghost
            if r.fence == a.fence and r.st == S.AWAITING_APPROVAL and self._due(r, a.age):
                row = Row(S.FAILED, r.fence + 1, r.end, False)
                yield Step((who, "expiry applied"),
                           to(_IDLE, row=row, ghost=g._replace(ended=g.ended or "expired")))
            else:
                yield Step((who, "expiry matched nothing"), to(_IDLE))
        elif a.pc == "claim":
            if r.fence == a.fence and r.st == S.DISPATCHED and not r.claimed:
                row = r._replace(fence=r.fence + 1, claimed=True)
                yield Step((who, "claim applied: attempt 1"),
                           to(Actor("send", 0, r.fence + 1), row=row))
            else:
                yield Step((who, "claim lost (fenced out)"), to(_IDLE))
        elif a.pc == "send":
            refused = self.rules.send_gate(Send(
                effect=Unsafe(), recorded="unsafe", write=True, live=True, state=S.DISPATCHED,
                attempt=1, writes=0, key_from=BASE, now=BASE, within=1.0,
            ))  # fmt: skip
            if refused is not None:
                yield Step((who, f"send refused: {refused.reason}"), to(_IDLE))
                return
            g = s.ghost._replace(sends=s.ghost.sends + 1)
            yield Step((who, "request sent; it lands"), to(a._replace(pc="outcome"), ghost=g))
        elif a.pc == "outcome":
            row = r._replace(st=S.COMPLETED) if r.fence == a.fence else r
            yield Step((who, "outcome committed: COMPLETED"), to(_IDLE, row=row))

    def show(self, s: State) -> list[str]:
        r, g = s.row, s.ghost
        out = [
            f"call: {r.st.value} fence={r.fence} window ends now{r.end:+d} claimed={r.claimed}",
            f"witness: approved={g.approved} (late={g.late}) ended={g.ended or '-'} "
            f"sent={g.sends}",
        ]
        out += [f"operator {k}: {a.pc} {a.what}".rstrip() for k, a in enumerate(s.ops)]
        out += [f"{'recovery' if self._upkeep(k) else f'caller {k}'}: {a.pc}"
                for k, a in enumerate(s.callers)]
        return out
