"""The search: every state reachable in a configuration, breadth first, the properties checked
in each; a violation printed as the shortest trace to it, in words."""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from poimen._core.decide import Defer
from verification.model._system import Model
from verification.model._world import BASE, Config, Label, Rules, State, owner_text


def system(cfg: Any, rules: Rules | None = None) -> Any:
    """The transition system of a configuration: the call protocol's (`Config`), or the one
    a focused model's configuration builds (`verification.model._focus`)."""
    return Model(cfg, rules) if isinstance(cfg, Config) else cfg.system(rules or Rules())


@dataclass(slots=True)
class Result:
    config: Any  # a Config, or a focused model's configuration
    states: int = 0
    transitions: int = 0
    seconds: float = 0.0
    cpu: float = 0.0  # this process's CPU seconds: the machine may be shared
    violation: str | None = None
    trace: list[str] = field(default_factory=list)
    live_checked: bool = False
    stuck: int = 0  # states from which no crash-free path settles every intent
    excused: int = 0  # states with a double effect after a lapsed lease (the stated limit)
    truncated: bool = False
    depth: int = 0  # when truncated: every state this many steps from the start was checked

    def ok(self) -> bool:
        return self.violation is None and self.stuck == 0 and not self.truncated

    def report(self) -> str:
        lines = [
            f"config: {self.config.describe()}",
            f"states explored: {self.states}  transitions: {self.transitions}  "
            f"time: {self.seconds:.1f}s (CPU {self.cpu:.1f}s)"
            + (
                f"  (TRUNCATED at max_states: every state within {self.depth} steps of the "
                "start was checked)"
                if self.truncated
                else ""
            ),
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


def explore(cfg: Any, rules: Rules | None = None, *, liveness: bool = True) -> Result:
    """Visit every reachable state breadth-first; stop at the first violated property."""
    m = system(cfg, rules)
    res = Result(cfg)
    started, cpu = time.monotonic(), time.process_time()
    s0 = m.initial()
    ids: dict[Any, int] = {s0: 0}
    states: list[Any] = [s0]
    parent = array("l", [-1])
    src, dst = array("l"), array("l")  # crash-free edges, for liveness
    queue = deque([0])

    def stop(v: int, violation: str, last: Any = None) -> Result:
        res.trace, named = _trace(m, states, parent, v, last)
        res.violation = named or violation
        res.states = len(states)
        res.seconds, res.cpu = time.monotonic() - started, time.process_time() - cpu
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
                if m.excused(t):
                    res.excused += 1
                queue.append(v)
                if len(states) >= cfg.max_states:
                    res.truncated = True
                    res.depth = _depth(parent, u)
                    queue.clear()
                    break
            elif e.violation is not None:
                return stop(u, e.violation, t)
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
    res.seconds, res.cpu = time.monotonic() - started, time.process_time() - cpu
    return res


def replay(cfg: Any, steps: Sequence[str], rules: Rules | None = None) -> Result:
    """Follow one run step by step: each step names a transition (``tick``, ``invoke``,
    ``commit:claim``, ``lookup_answer:notlanded``...: its kind and, after a colon, a word of
    its label). Returns the trace and the first property it breaks, as `explore` would;
    raises ValueError, naming the step and what was possible instead, if the run cannot go
    on."""
    m = system(cfg, rules)
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
            could = sorted({m.say(e.label) for e in m.successors(s) if e.label[0] != "crash"})
            raise ValueError(
                f"no transition {step!r} at t={t}: the run is not possible; after\n"
                + "\n".join(res.trace[1:])
                + "\nthe possible steps are:\n  "
                + "\n  ".join(could)
            )
        s = e.state
        res.states += 1
        if kind == "tick":
            t += 1
        else:
            res.trace.append(f"  t={t:<3} {m.say(e.label)}")
        bad = e.violation or m.check(s)
        if bad is not None:
            res.violation = bad
            break
    res.trace.append("final state:")
    res.trace.extend("  " + x for x in m.show(s))
    return res


def _depth(parent: array[int], v: int) -> int:
    n = 0
    while v > 0:
        v = parent[v]
        n += 1
    return n


def _stuck(m: Any, states: list[Any], src: array[int], dst: array[int]) -> list[int]:
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
    m: Any, states: list[Any], parent: array[int], v: int, last: Any = None
) -> tuple[list[str], str | None]:
    """The shortest path to state `v` (then, if given, over a violating step to `last`) in
    words, and the violation as this path names it: its workers named as one run names them
    (the search keeps one state per renaming of the workers; the trace is replayed)."""
    path = []
    while v > 0:
        path.append(v)
        v = parent[v]
    path.reverse()
    targets = [states[k] for k in path]
    if last is not None:
        targets.append(last)
    lines = ["trace (t = ticks since the start):"]
    t = 0
    s = m.initial()
    violation = None
    for n, target in enumerate(targets):
        final = last is not None and n == len(targets) - 1
        e = next(
            e
            for e in m.successors(s)
            if target in m.orbit(e.state) and (not final or e.violation is not None)
        )
        s = e.state
        violation = e.violation
        if e.label[0] == "tick":
            t += 1
        else:
            lines.append(f"  t={t:<3} {m.say(e.label)}")
    lines.append("final state:")
    lines.extend("  " + x for x in m.show(s))
    return lines, violation or m.check(s)


_WORDS = {
    "call": "the agent calls {it}: hold, dispatch commit sent",
    "recover": "recovery (or the call id again) finds {it} claimable; owner {r0}",
    "read": "recovery (or the call id again) reads the row of {it}; owner {r0}",
    "existing": "judges the row of {it} it read: {r0}",
    "renew": "renews the lease of {it}",
    "retry": "retry of {it}: {r0}",
    "invoke": "invokes the tool of {it} (attempt {r0}): request sent",
    "not_sent": "the tool of {it} could not connect (NotSent): {r0}",
    "arrive": "'s request of {it} at the provider: {r0}",
    "reply": "the tool of {it} returns: {r0}",
    "lookup_read": "the provider reads its ledger for the lookup of {it}: {r0}",
    "lookup_answer": "the lookup of {it} answers {r0}",
}


def say(m: Model, label: Label) -> str:
    """A transition in words."""
    what, args = label[0], label[1:]
    if what == "tick":
        return "a tick passes"
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
    if what == "renew" and r0:
        return f"{who}: renews the lease of {it}, by its clock read {r0} ticks before"
    if what in _WORDS:
        text = _WORDS[what].format(it=it, r0=r0)
        return who + ("" if text.startswith("'") else ": ") + text
    if what == "take":
        return f"{who}: takes {it} over; " + (
            "its deadline stands" if r0 is None else f"takeover deadline now+{r0:g}"
        )
    if what == "decide":
        d, since, as_of = rest[1], rest[2], rest[3]
        if isinstance(d, Defer):
            at = max(d.at - BASE - since, 0.0)
            d_text = f"Defer(next check now+{at:g}, {d.reason})"
        else:
            d_text = repr(d)
        judged = "now" if as_of else "then"
        asked = f" (asked {since} ticks ago, judged as of {judged})" if since else ""
        return f"{who}: decides {it} on {r0}{asked}: {d_text}"
    if what == "stamp":
        return f"{who}: deadline of {it} " + (
            "stands" if r0 == "ok" else f"to be stamped again to now+{r0}"
        )
    if what == "unknown":
        return f"{who}: records the unknown outcome of {it}" + (
            "" if r0 is None else f", deadline now+{r0}"
        )
    if what == "commit":
        return f"{who}: commit {r0} of {it} applied" + (
            "" if rest[1] == "ok" else " (or fenced out); the run ends"
        )
    if what == "commit_lost":
        return f"{who}: commit {r0} of {it} {'applied' if rest[1] else 'not applied'}, " + (
            "its reply lost: the run ends"
        )
    return repr(label)


def show(m: Model, s: State) -> list[str]:
    """A state in words."""
    out = []
    for i, r in enumerate(s.log):
        g = s.ghost[i]
        row = (
            "not in the log"
            if r is None
            else (
                f"{r.st.value} fence={r.fence} owner={owner_text(r.ow)} lease=now+{r.lease} "
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
