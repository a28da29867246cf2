"""The provider's key window with back-off: an Idempotent call retried under one key, which
the provider forgets `key_ttl` after its first effect (docs/verification.md, "The rules of
issue 20").

One worker drives one Idempotent call (optionally recorded awaiting approval first, approved
any time within `approval_wait`). Each attempt's request passes the send gate
(`_decide.send_gate`) as it leaves, then lands within the timeout, is lost, or never leaves
(`NotSent`: the tool runs again in place, through the gate again). A reply may be lost while
its request still flies. After an unknown outcome the call is decided (`_decide.decide`, which
judges the key window too) and a retry waits up to `max_backoff` ticks before it claims its
attempt. The provider deduplicates a request on its key while it remembers the key: up to
`key_ttl` ticks after the key's first effect; later, the same key applies again.

Property: one effect for the key (and no FAILED call with an effect, no COMPLETED one
without). It holds because the gate judges the key's age, plus the request's time in transit,
with the clock read as the request leaves.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from poimen._core.decide import (
    KeyDerived,
    MarkIndeterminate,
    Policy,
    RetryDecision,
    Send,
    after_refusal,
)
from poimen._core.effects import Idempotent, KeyDerivation
from poimen._core.intents import IntentState
from verification.model._focus import Focused, Step, intent
from verification.model._world import BASE, Rules

S = IntentState
_TERMINAL = (S.COMPLETED, S.FAILED, S.INDETERMINATE)


@dataclass(frozen=True, slots=True)
class KeyWindowConfig:
    """One bounded world. Times are whole ticks."""

    key_ttl: int = 3
    timeout: int = 1  # the tool's timeout: a request lands within it of leaving
    max_backoff: int = 2  # the longest wait between a retry's decision and its claim
    max_attempts: int = 3
    not_sent: bool = True  # a connection may never open: the tool runs again in place
    approval_wait: int = 0  # the call may await approval this long before attempt 1
    max_states: int = 2_000_000

    def describe(self) -> str:
        return (
            f"key window: key_ttl={self.key_ttl} timeout={self.timeout} "
            f"max_backoff={self.max_backoff} max_attempts={self.max_attempts} "
            f"not_sent={self.not_sent} approval_wait={self.approval_wait}"
        )

    def system(self, rules: Rules) -> KeyWindow:
        return KeyWindow(self, rules)


class State(NamedTuple):
    st: IntentState
    age: int  # ticks since the call was recorded (kept up to key_ttl + 1: older is alike)
    att: int  # attempts claimed
    pc: str  # approval, send, wait, decide, backoff, end
    decided: int  # the call's age when the attempt's retry was decided (or it was dispatched)
    since: int  # ticks since that decision (kept up to max_backoff)
    writes: int  # writes of this attempt let out
    inplace: int  # runs of this attempt again in place after NotSent
    req: int | None  # the request waited for: ticks until it must have landed or been lost
    landed: bool  # the request waited for has landed
    pool: tuple[int, ...]  # requests nobody waits for any more: ticks left each
    mem: int | None  # ticks the provider still remembers the key (None: no effect yet)
    eff: int  # effects at the provider


class KeyWindow(Focused):
    name = "key window"
    cfg: KeyWindowConfig

    def __init__(self, cfg: KeyWindowConfig, rules: Rules) -> None:
        super().__init__(cfg, rules)
        self.effect = Idempotent(key=KeyDerivation.fields("order"), key_ttl=float(cfg.key_ttl))
        self.policy = Policy(cfg.max_attempts, 2, 1.0, float(cfg.max_backoff))
        self.cap = cfg.key_ttl + 1

    def initial(self) -> State:
        if self.cfg.approval_wait:
            return State(S.AWAITING_APPROVAL, 0, 0, "approval", 0, 0, 0, 0, None, False, (), None, 0)
        return State(S.DISPATCHED, 0, 1, "send", 0, 0, 0, 0, None, False, (), None, 0)

    def check(self, s: State) -> str | None:
        if s.eff > 1:
            return f"the key applied {s.eff} times: the provider had forgotten it"
        if s.st == S.FAILED and s.eff:
            return "the call is FAILED but its effect landed"
        if s.st == S.COMPLETED and not s.eff:
            return "the call is COMPLETED without an effect"
        return None

    def settled(self, s: State) -> bool:
        return s.st in _TERMINAL and s.req is None and not s.pool

    # Time.

    def successors(self, s: State) -> Iterator[Step]:
        if self._tick_enabled(s):
            yield Step(("tick",), self._tick(s))
        for k, _left in enumerate(s.pool):
            rest = s.pool[:k] + s.pool[k + 1 :]
            yield Step(("a request nobody waits for lands",), self._land(s)._replace(pool=rest))
            yield Step(("a request nobody waits for is lost",), s._replace(pool=rest))
        yield from self._step(s)

    def _tick_enabled(self, s: State) -> bool:
        if any(left <= 0 for left in s.pool) or (s.req is not None and s.req <= 0):
            return False
        if s.pc == "backoff" and s.since >= self.cfg.max_backoff:
            return False  # the back-off is over: the retry claims its attempt
        return not (s.pc == "approval" and s.age >= self.cfg.approval_wait)

    def _tick(self, s: State) -> State:
        return s._replace(
            age=min(s.age + 1, self.cap),
            since=min(s.since + 1, self.cfg.max_backoff),
            req=None if s.req is None else max(s.req - 1, 0),
            pool=tuple(left - 1 for left in s.pool),
            mem=None if s.mem is None else max(s.mem - 1, -1),
        )

    def _land(self, s: State) -> State:
        """A request carrying the key reaches the provider and applies, unless it remembers
        the key (from its first effect, for key_ttl)."""
        if s.mem is not None and s.mem >= 0:
            return s
        return s._replace(eff=s.eff + 1, mem=self.cfg.key_ttl)

    # The worker.

    def _step(self, s: State) -> Iterator[Step]:
        pc = s.pc
        if pc == "approval":
            yield Step(("operator", "approves: attempt 1 claimed"),
                       s._replace(st=S.DISPATCHED, att=1, pc="send", decided=s.age, since=0))
        elif pc == "send":
            yield from self._send(s)
        elif pc == "wait":
            yield from self._wait(s)
        elif pc == "decide":
            it = intent(effect="idempotent", key="k", attempts=s.att,
                        timeout_s=float(self.cfg.timeout))
            d = self.rules.decide(self.effect, it, KeyDerived("k"), BASE + s.age, self.policy)
            if isinstance(d, RetryDecision):
                yield Step(("worker", f"decides at age {s.age}: Retry; backs off"),
                           s._replace(pc="backoff", decided=s.age, since=0))
            else:
                assert isinstance(d, MarkIndeterminate), d
                yield Step(("worker", f"decides at age {s.age}: {d!r}"),
                           s._replace(st=S.INDETERMINATE, pc="end"))
        elif pc == "backoff":
            yield Step(("worker", f"back-off over: claims attempt {s.att + 1}"),
                       s._replace(att=s.att + 1, pc="send", writes=0, inplace=0))

    def _send(self, s: State) -> Iterator[Step]:
        # As built the gate reads the clock as the request leaves; the old rule judged the
        # key's age when the retry was decided, before the back-off.
        clock = s.age if self.rules.gate_clock_at_send else s.decided
        refused = self.rules.send_gate(Send(
            effect=self.effect, recorded="idempotent", write=True, live=True,
            state=S.DISPATCHED, attempt=s.att, writes=s.writes, key_from=BASE,
            now=BASE + clock, within=float(self.cfg.timeout),
        ))  # fmt: skip
        if refused is not None:
            end = after_refusal(self.effect, s.att, s.writes, refused)
            st = S.FAILED if not isinstance(end, MarkIndeterminate) else S.INDETERMINATE
            yield Step(("gate", f"refuses at age {s.age}: {refused.reason}; {st.value}"),
                       s._replace(st=st, pc="end"))
            return
        yield Step(("worker", f"attempt {s.att}: request leaves at age {s.age}"),
                   s._replace(pc="wait", writes=s.writes + 1, req=self.cfg.timeout,
                              landed=False))
        if not self.cfg.not_sent:
            return
        n = s.inplace + 1
        it = intent(effect="idempotent", attempts=s.att)
        if self.rules.failure_is_final(self.effect, it):
            yield Step(("worker", f"attempt {s.att}: NotSent; FAILED"),
                       s._replace(st=S.FAILED, pc="end"))
        else:
            yield Step(("worker", f"attempt {s.att}: NotSent; outcome unknown"),
                       s._replace(pc="decide"))
        if n < self.cfg.max_attempts:
            yield Step(("worker", f"attempt {s.att}: NotSent; runs again in place"),
                       s._replace(inplace=n))

    def _wait(self, s: State) -> Iterator[Step]:
        if not s.landed:
            yield Step(("the request lands",), self._land(s)._replace(landed=True))
        if s.landed:
            yield Step(("worker", "reply: COMPLETED"),
                       s._replace(st=S.COMPLETED, pc="end", req=None))
        # A timeout, a reset, a lost reply: unknown; a request still flying may land later.
        pool = s.pool if s.landed or s.req is None else tuple(sorted((*s.pool, s.req)))
        yield Step(("worker", "reply lost: outcome unknown"),
                   s._replace(pc="decide", req=None, pool=pool))

    def show(self, s: State) -> list[str]:
        return [
            f"call: {s.st.value} age={s.age} attempts={s.att} at {s.pc}",
            f"provider: effects={s.eff} key remembered "
            + ("(no effect yet)" if s.mem is None else f"for {s.mem} more ticks"),
            f"requests in flight nobody waits for: {list(s.pool)}",
        ]
