"""The model's world: a configuration, the rules under check, and the state they act on.

Times in a state are whole ticks relative to now, and a time already past counts as now: the
rules only ever compare a time with now or with now plus a positive span, so two states that
differ only in how long ago something passed behave alike, and the state space is finite.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar

from poimen._core import decide as _decide
from poimen._core.approval import approval_due
from poimen._core.decide import Answer, Policy
from poimen._core.effects import (
    EffectClass,
    Idempotent,
    KeyDerivation,
    LookupAnswer,
    Queryable,
    Transactional,
    Unsafe,
)
from poimen._core.intents import Intent, IntentState

S = IntentState
X = TypeVar("X")
BASE = 1000.0  # "now" when a rule is asked: the state's relative times are added to it
TERMINAL = frozenset({S.COMPLETED, S.FAILED, S.INDETERMINATE})
Kind = Literal["idempotent", "queryable", "unsafe", "transactional"]
KINDS: tuple[Kind, ...] = ("idempotent", "queryable", "unsafe", "transactional")


def _no_lookup(request_id: str, /) -> LookupAnswer:
    raise AssertionError("the model answers lookups itself")


EFFECTS: dict[Kind, EffectClass] = {
    "idempotent": Idempotent(key=KeyDerivation.fields("order")),
    "queryable": Queryable(lookup=_no_lookup),
    "unsafe": Unsafe(),
    # Its marker is the model's `Ghost.mark` and `Ghost.eff`: no database is opened.
    "transactional": Transactional(database="sqlite:///model.db"),
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
    # A run may be slow between reading a row and judging it; off, it judges it at the read.
    stale_reads: bool = False
    # A renewal may apply up to commit_delay ticks after its clock was read; off, at once.
    slow_renewals: bool = False
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
            f"refusals={self.refusals} stale_reads={self.stale_reads}"
            + (" slow_renewals=True" if self.slow_renewals else "")
        )


@dataclass(frozen=True, slots=True)
class Rules:
    """The rules under check: the project's own, unless a test puts one back as it was to see
    the check catch it. The functions are `poimen._core.decide`'s; the flags say how the protocol
    and the stores use them, each True as built (docs/verification.md, "What the model check
    found", names the finding each one fixed)."""

    decide: Callable[[EffectClass, Intent, Answer, float, Policy], _decide.Decision] = (
        _decide.decide
    )
    claimability: Callable[..., _decide.Claimability] = _decide.claimability
    takeover_deadline: Callable[[Intent, float, float], float | None] = _decide.takeover_deadline
    attempt_deadline: Callable[[float, float, float], float] = _decide.attempt_deadline
    failure_is_final: Callable[[EffectClass, Intent], bool] = _decide.failure_is_final
    # decide_steps judges a lookup's answer as of when the lookup was asked (finding 1).
    lookup_judged_as_asked: bool = True
    # A row is judged against a clock read before the row (finding 3).
    clock_before_read: bool = True
    # renew_leases renews only a lease that has not run out (finding 3).
    renewal_never_revives: bool = True
    # defer writes the deadline its decision relied on, a takeover's included (finding 4).
    defer_keeps_deadline: bool = True
    # A takeover's first write seizes the lease it judged, so a renewal applied since wins
    # and none applies after (finding 5).
    takeover_seizes: bool = True
    # A Transactional marker lookup fences out the attempts it answers for (no attempt up to
    # the intent's latest lands after a "not landed"), as `poimen._engine.transactional` does.
    marker_fences: bool = True
    # The rules of issue 20, each checked by a model of its own (docs/verification.md).
    send_gate: Callable[[_decide.Send], _decide.Refused | None] = _decide.send_gate
    approval_due: Callable[[Intent, float], bool] = approval_due
    # An operator's decision counts only within the approval window (`decide_approval`).
    approval_window_checked: bool = True
    # A waiting caller and a repeated call expire a call past its window (`wait`, the call
    # path), so that a window ends without background upkeep.
    waiter_expires: bool = True
    # The send gate judges the key's age with the clock read as the request leaves, not the
    # one its retry was decided on before the back-off.
    gate_clock_at_send: bool = True
    # The store keeps an undo intent while its original remains (`prune`).
    prune_keeps_undo_of_original: bool = True
    # An original with an `undone` event is undone: undo takes no new undo of it, and the
    # store refuses its `undo_requested` (`undo`, `record_event`).
    undo_reads_undone: bool = True
    # A prune deletes an intent only if its whole history is the one it archived, not only
    # its `updated_at` (which an event written since does not change).
    prune_compares_history: bool = True
    # PostgreSQL's one-statement settle matches only where its snapshot put the history
    # (`_SETTLE`: a concurrent spill makes it fall back to a write with fresh snapshots).
    settle_checks_snapshot: bool = True
    # A reader of a history (`events`, `attempts`, prune's `histories`) reads the tables and
    # the intent row in one snapshot.
    history_one_snapshot: bool = True


# What each finding's fix was, put back: the command line's --old-rule.
OLD_RULES: dict[str, dict[str, Any]] = {
    "lookup-judged-when-answered": {"lookup_judged_as_asked": False},
    "refusal-always-final": {"failure_is_final": lambda current, intent: True},
    # Before finding 5's fix a takeover's seize would also have caught a stale row.
    "clock-after-read": {"clock_before_read": False, "takeover_seizes": False},
    "renewal-revives": {"renewal_never_revives": False},
    "defer-drops-deadline": {"defer_keeps_deadline": False},
    "takeover-fence-only": {"takeover_seizes": False},
    # Not a finding's: the rule Transactional recovery rests on, taken out to see it matter.
    "marker-lookup-reads-only": {"marker_fences": False},
    # Issue 20's defects, each rule put back as it was before its fix.
    "approval-after-window": {"approval_window_checked": False},  # defect 4
    "waiter-ignores-window": {"waiter_expires": False},  # defect 4
    "gate-before-backoff": {"gate_clock_at_send": False},  # defect 3
    "undo-twice-after-prune": {  # defect 5: both of its rules
        "prune_keeps_undo_of_original": False,
        "undo_reads_undone": False,
    },
    "prune-drops-undo": {"prune_keeps_undo_of_original": False},  # defect 5, one rule
    "prune-updated-at-only": {"prune_compares_history": False},  # defect 6
    "settle-stale-snapshot": {"settle_checks_snapshot": False},  # defect 11
    "history-read-twice": {"history_one_snapshot": False},  # defect 12
}


NOBODY = (-1, False)  # an owner no rule will read

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
    # The intent as this run last read or wrote it. Frozen while the run waits on a lookup or
    # decides on its answer (times relative to when it was asked) and while a stale read waits
    # to be judged as built (relative to the read); shifted with the clock otherwise.
    snap: Row | None
    owns: bool  # it committed the dispatch or claimed the current attempt
    stamped: float  # when its current deadline was computed (relative)
    si: int  # deadline stamps so far
    runs: int  # tool invocations in this run (0 or 1: only "any" matters)
    inplace: int  # not-sent tries of this attempt
    got: str  # the evidence for the next decision ("refused": Indeterminate after "unknown")
    op: Commit | Req | Look | None
    since: int = 0  # ticks since the lookup now answered was asked (its snap is frozen)


class Ghost(NamedTuple):
    """What the world knows and the log does not: the witness."""

    eff: int  # effects at the provider (Transactional: its write committed with its marker)
    sends: int  # requests sent
    lapsed: bool  # the current attempt's live owner let its lease run out
    excused: bool  # taken over from such an owner: the contract's stated limit applies
    mark: int = 0  # Transactional: the attempts up to this one a lookup fenced out


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


def settled_row(st: IntentState) -> Row:
    """A settled row: no rule reads more of it than its state."""
    return Row(st, 0, NOBODY, None, None, None, 0, 0)


def absolute(x: float | None) -> float | None:
    return None if x is None else BASE + x


def earlier(x: float | None, by: float = 1.0) -> float | None:
    """A relative time `by` ticks later: past counts as now."""
    return None if x is None else max(x - by, 0.0)


def shift_row(r: Row, by: float = 1.0) -> Row:
    if r.lease is None and r.dl is None and r.nxt is None:
        return r
    return Row(
        r.st, r.fence, r.ow, earlier(r.lease, by), earlier(r.dl, by), earlier(r.nxt, by), r.att,
        r.uc,
    )  # fmt: skip


def later_of(a: float | None, b: float | None) -> float | None:
    """The store's GREATEST with NULL meaning "no value": deadlines only move later."""
    if a is None:
        return b
    return a if b is None else max(a, b)


def put(t: tuple[X, ...], k: int, v: X) -> tuple[X, ...]:
    return (*t[:k], v, *t[k + 1 :])


def owner_text(ow: object) -> str:
    if isinstance(ow, tuple):
        return f"w{ow[0]}" + ("" if ow[1] else " (dead)")
    return str(ow)
