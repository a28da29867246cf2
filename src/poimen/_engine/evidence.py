"""Evidence for the operator: what a tool's ``evidence=`` function finds about a call whose
outcome is unknown, and what its rule suggests. Facts, never a decision: a person still
resolves the call (docs/resolve-indeterminate.md, docs/design.md §5).

A tool declares it at registration::

    def sent_log(ctx: ToolContext, call: RecordedCall) -> list[Fact]:
        r = ctx.http.get(f"{API}/sent", params={"to": call.args["to"]})   # reads only
        return [Fact(text=f"sent {m['id']}", link=m["url"], data=m) for m in r.json()]

    @kernel.tool(..., evidence=Evidence(sent_log, suggest=exactly_one_match))

poimen runs it once when the call becomes Indeterminate, on the delivery duty's thread
(never the caller's, never recovery's), bounded by `Evidence.timeout`, and again whenever
an operator asks. Its handles deny every write, as a ReadOnly tool's do. What it returns,
or how it failed, is recorded as an ``evidence`` event; it never raises out of here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

from poimen._capability import guard as _guard
from poimen._capability.context import AttemptRecord, ToolContext
from poimen._core.effects import ReadOnly
from poimen._core.intents import Attempt, Event, Intent, IntentState, Notification
from poimen._core.keys import canonical, to_json_value
from poimen._core.present import redact, redact_store_url
from poimen.errors import PoimenError, RegistrationError

if TYPE_CHECKING:
    from poimen._capability.context import Issuer
    from poimen._core.tools import Caps, Tool
    from poimen.store._base import Store

#: The event an evidence gathering is recorded as (append-only, changes no state).
EVIDENCE = "evidence"
#: Limits on what one gathering keeps: a fact's text, its data, how many facts.
MAX_FACTS = 100
MAX_TEXT = 2000
MAX_LINK = 2000
MAX_DATA = 4096
#: Gatherings still running past their timeout, per kernel, before new ones are refused.
MAX_STUCK = 8
#: Gatherings run at once by the delivery duty.
WORKERS = 4
#: How many Indeterminate intents of one tool a scan looks at.
SCAN_LIMIT = 10_000


@dataclass(frozen=True, slots=True)
class Fact:
    """One thing an evidence function found: a sentence for the operator, where it was
    seen (`link`, an http(s) URL), and the data behind it (`data`, JSON, redacted like
    arguments when shown)."""

    text: str
    _: KW_ONLY
    link: str | None = None
    data: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Suggestion:
    """What a tool's rule concludes from conclusive evidence: landed or not, and why. The
    console pre-selects it; an operator still decides."""

    landed: bool
    reason: str


@dataclass(frozen=True, slots=True)
class RecordedCall:
    """The call as recorded, handed to an evidence function and its rule: its arguments
    (as recorded, not redacted), key or request id, its tool's timeout when it was made,
    attempts with their times and errors."""

    intent_id: str
    call_id: str
    tool_id: str
    effect: str
    state: IntentState
    reason: str | None
    args: Mapping[str, Any]
    key: str | None
    request_id: str | None
    created_at: float
    timeout: float
    error: str | None
    attempts: tuple[Attempt, ...]

    @property
    def first_sent_at(self) -> float:
        """When the first attempt started (the call's creation if none is recorded)."""
        return min((a.started_at for a in self.attempts), default=self.created_at)

    @property
    def last_attempt_at(self) -> float:
        """When the last attempt started: its effect, if any, landed after this."""
        return max((a.started_at for a in self.attempts), default=self.created_at)


Gather = Callable[[ToolContext, RecordedCall], Sequence[Fact] | Awaitable[Sequence[Fact]]]
Rule = Callable[[RecordedCall, Sequence[Fact]], Suggestion | None]


@dataclass(frozen=True, slots=True)
class Evidence:
    """A tool's evidence declaration (``@kernel.tool(..., evidence=Evidence(fn))``).

    Args:
        gather: ``gather(ctx, call) -> list[Fact]`` (sync or async): reads what an
            operator needs (a provider's sent log, a partner's delivery log) through
            `ctx.http`, whose every write is denied and recorded, as for a ReadOnly tool.
        suggest: ``suggest(call, facts) -> Suggestion | None``, pure: the tool's rule for
            when the facts are conclusive (e.g. exactly one message carrying this call's
            id). None: nothing is suggested.
        timeout: Seconds a gathering may take; past it, it is recorded as timed out.
        caps: What the gathering may read (its `hosts`); default: the tool's caps.
    """

    gather: Gather
    _: KW_ONLY
    suggest: Rule | None = None
    timeout: float = 10.0
    caps: Caps | None = None


def rule_of(tool_id: str, evidence: object) -> Evidence | None:
    """The registration's evidence declaration, checked: a function stands for
    ``Evidence(function)``."""
    if evidence is None:
        return None
    if not isinstance(evidence, Evidence):
        if not callable(evidence):
            raise RegistrationError(
                f"tool {tool_id!r}: evidence must be an Evidence(...) or a function "
                f"(ctx, call) -> list[Fact], not {evidence!r}",
                tool_id=tool_id,
                field="evidence",
            )
        evidence = Evidence(evidence)
    assert isinstance(evidence, Evidence)
    if not callable(evidence.gather):
        raise RegistrationError(f"tool {tool_id!r}: Evidence.gather must be a function",
                                tool_id=tool_id, field="evidence")
    if evidence.suggest is not None and not callable(evidence.suggest):
        raise RegistrationError(f"tool {tool_id!r}: Evidence.suggest must be a function",
                                tool_id=tool_id, field="evidence")
    t = evidence.timeout
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t <= 0:
        raise RegistrationError(
            f"tool {tool_id!r}: Evidence.timeout must be a positive number of seconds, "
            f"not {t!r}",
            tool_id=tool_id,
            field="evidence",
        )
    from poimen._core.tools import Caps

    if evidence.caps is not None and not isinstance(evidence.caps, Caps):
        raise RegistrationError(f"tool {tool_id!r}: Evidence.caps must be a Caps",
                                tool_id=tool_id, field="evidence")
    return evidence


def recorded_call(intent: Intent, attempts: Sequence[Attempt]) -> RecordedCall:
    try:
        args = json.loads(intent.args)
    except ValueError:
        args = {}
    return RecordedCall(
        intent_id=intent.id,
        call_id=intent.call_id,
        tool_id=intent.tool_id,
        effect=intent.effect,
        state=intent.state,
        reason=intent.reason,
        args=args if isinstance(args, dict) else {},
        key=intent.key,
        request_id=intent.request_id,
        created_at=intent.created_at,
        timeout=intent.timeout_s,
        error=intent.error,
        attempts=tuple(attempts),
    )


# Running one gathering, bounded.


class _Run:
    """One gathering on a thread of its own: a function that does not return in time is
    left behind (a thread cannot be stopped), never waited for."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self._fn = fn
        self.thread = threading.Thread(target=self._main, name="poimen-evidence", daemon=True)

    def _main(self) -> None:
        try:
            self.value = self._fn()
        except BaseException as exc:  # recorded, never raised: a failing function is a fact
            self.error = exc
        finally:
            self.done.set()


def _start(issuer: Issuer, tool: Tool, rule: Evidence, call: RecordedCall, intent: Intent) -> _Run:
    caps = rule.caps if rule.caps is not None else tool.registration.caps
    # The ReadOnly scope: every write through a handle, and out of band, is denied; the send
    # gate judges its requests as a ReadOnly call's, whatever the call's own class.
    scope = issuer.scope(tool.id, call.intent_id, max(len(call.attempts), 1), "", caps,
                         read_only=True)
    record = AttemptRecord(
        issuer, tool.id, dataclasses.replace(intent, effect="readonly"), ReadOnly(), rule.timeout
    )
    ctx = ToolContext(
        tool_id=tool.id,
        intent_id=call.intent_id,
        call_id=call.call_id,
        attempt=len(call.attempts),
        key=call.key,
        request_id=call.request_id,
        issuer=issuer,
        scope=scope,
        timeout=rule.timeout,
        record=record,
    )
    gather = rule.gather

    def body() -> Any:
        try:
            if inspect.iscoroutinefunction(gather):
                return asyncio.run(_guard.arun(scope, gather(ctx, call)))
            return _guard.run(scope, lambda c: gather(c, call), ctx, {})
        finally:
            scope.end()

    run = _Run(body)
    run.thread.start()
    return run


def _facts(value: Any) -> tuple[list[dict[str, Any]], list[Fact], int]:
    """What a gathering returned, as recorded (and the facts kept, and how many were left
    out); raises `PoimenError` naming what is wrong."""
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise PoimenError(
            f"the evidence function must return a list of Fact, not {type(value).__name__}"
        )
    every = list(value)
    kept = every[:MAX_FACTS]
    out: list[dict[str, Any]] = []
    for n, fact in enumerate(kept, 1):
        if not isinstance(fact, Fact):
            raise PoimenError(f"fact {n} is a {type(fact).__name__}, not a Fact")
        if not isinstance(fact.text, str) or not fact.text.strip():
            raise PoimenError(f"fact {n} has no text")
        text = fact.text if len(fact.text) <= MAX_TEXT else fact.text[: MAX_TEXT - 1] + "…"
        item: dict[str, Any] = {"text": text, "link": None, "data": None}
        if fact.link is not None:
            item["link"] = _link(n, fact.link)
        if fact.data is not None:
            if not isinstance(fact.data, Mapping):
                raise PoimenError(
                    f"fact {n}: data must be a mapping, not {type(fact.data).__name__}"
                )
            data = to_json_value(dict(fact.data), f"fact {n} data")
            if len(canonical(data)) > MAX_DATA:
                raise PoimenError(f"fact {n}: data is over {MAX_DATA} characters of JSON")
            item["data"] = redact(data)
        out.append(item)
    return out, kept, len(every) - len(kept)


def _link(n: int, link: object) -> str:
    if (
        not isinstance(link, str)
        or not link.lower().startswith(("http://", "https://"))
        or len(link) > MAX_LINK
        or any(c.isspace() or ord(c) < 32 or c in "<>\"'" for c in link)
    ):
        raise PoimenError(f"fact {n}: link {str(link)[:80]!r} is not an http(s) URL")
    return redact_store_url(link)  # a password or a token in it is not kept


def _suggestion(rule: Evidence, call: RecordedCall, facts: Sequence[Fact]) -> dict[str, Any]:
    if rule.suggest is None:
        return {}
    try:
        s = rule.suggest(call, facts)
        if s is None:
            return {"suggestion": None}
        if not isinstance(s, Suggestion) or not isinstance(s.landed, bool):
            raise PoimenError(f"the rule returned {type(s).__name__}, not a Suggestion or None")
        if not isinstance(s.reason, str) or not s.reason.strip():
            raise PoimenError("a suggestion needs a reason")
        return {"suggestion": {"landed": s.landed, "reason": s.reason.strip()[:MAX_TEXT]}}
    except Exception as exc:  # the rule's failure is recorded; nothing is suggested
        return {"suggestion": None, "suggest_error": _error_text(exc)}


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_TEXT]


def _finish(run: _Run, rule: Evidence, call: RecordedCall, waited: bool) -> dict[str, Any]:
    took = round(time.monotonic() - run.started, 3)
    detail: dict[str, Any] = {"facts": [], "suggestion": None, "error": None, "took_s": took,
                              "timeout_s": rule.timeout}
    if not waited:
        detail["error"] = f"timed out after {rule.timeout:g}s (left running, its answer unused)"
        return detail
    if run.error is not None:
        detail["error"] = _error_text(run.error)
        return detail
    try:
        facts, kept, omitted = _facts(run.value)
    except PoimenError as exc:
        detail["error"] = str(exc)
        return detail
    except Exception as exc:  # a value that does not encode, or worse
        detail["error"] = _error_text(exc)
        return detail
    detail["facts"] = facts
    if omitted:
        detail["omitted"] = omitted
    return {**detail, **_suggestion(rule, call, kept)}


class Gatherer:
    """A kernel's evidence: its tools' declarations, the Indeterminate intents waiting for
    their first gathering, and the gatherings that outlived their timeout."""

    def __init__(self, store: Store, issuer: Issuer, tools: Mapping[str, Tool]) -> None:
        self.store = store
        self.issuer = issuer
        self.tools = tools
        self.rules: dict[str, Evidence] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._checked: set[str] = set()  # have an evidence event (or just got one)
        self._pending: list[Intent] = []
        self._busy: set[str] = set()  # being gathered by the delivery duty right now
        self._stuck: list[_Run] = []
        self._closing = threading.Event()

    def close(self) -> None:
        self._closing.set()

    def after_fork(self) -> None:
        """In a forked child: the parent's gatherings and their threads are not ours."""
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._stuck, self._pending, self._busy = [], [], set()

    def scan(self) -> set[str]:
        """The INDETERMINATE intents of tools with evidence that have none yet: their
        notifications wait for it (a bounded while)."""
        found: list[Intent] = []
        listed: set[str] = set()
        with self._lock:
            skip = self._checked | self._busy
        for tool_id in list(self.rules):
            for it in self.store.list_intents(
                state=IntentState.INDETERMINATE, tool_id=tool_id, limit=SCAN_LIMIT
            ):
                listed.add(it.id)
                if it.id in skip:
                    continue
                if any(e.kind == EVIDENCE for e in self.store.events(it.id)):
                    self._checked.add(it.id)
                    continue
                found.append(it)
        with self._lock:
            self._checked &= listed
            self._pending = found
            return {i.id for i in found} | self._busy

    def gather_pending(self) -> bool:
        """Gather the next few pending intents at once, each within its timeout, and record
        what was found; False when none was pending."""
        with self._lock:
            # A scan that read before another thread took an intent may list it again.
            taken = self._busy | self._checked
            ready = [i for i in self._pending if i.id not in taken]
            batch, self._pending = ready[:WORKERS], ready[WORKERS:]
            self._busy.update(i.id for i in batch)
        try:
            return self._gather(batch)
        finally:
            with self._lock:
                self._busy.difference_update(i.id for i in batch)
                self._idle.notify_all()

    def wait_idle(self) -> bool:
        """Wait for the gatherings another thread has in flight (each is bounded by its
        timeout); True if there were any."""
        longest = max((r.timeout for r in self.rules.values()), default=0.0)
        with self._lock:
            if not self._busy:
                return False
            self._idle.wait_for(lambda: not self._busy or self._closing.is_set(), longest + 5)
            return True

    def _gather(self, batch: list[Intent]) -> bool:
        if not batch:
            return False
        started = []
        for it in batch:
            tool, rule = self.tools.get(it.tool_id), self.rules.get(it.tool_id)
            if tool is None or rule is None:
                continue
            call = recorded_call(it, self.store.attempts(it.id))
            started.append((it, rule, call, self._begin(tool, rule, call, it)))
        for it, rule, call, run in started:
            if run is None:
                detail = _refused(rule)
            else:
                left = rule.timeout - (time.monotonic() - run.started)
                waited = _wait(run, left, self._closing)
                if self._closing.is_set() and not run.done.is_set():
                    return False  # closing: recorded by the next process instead
                detail = self._end(run, rule, call, waited)
            record(self.store, it, "indeterminate", detail, actor="poimen")
            with self._lock:
                self._checked.add(it.id)
        return True

    def gather_now(
        self, intent: Intent, *, actor: str, context: Mapping[str, Any] | None = None
    ) -> Event | None:
        """An operator's gathering (in the caller's thread, bounded): recorded and returned."""
        tool, rule = self.tools.get(intent.tool_id), self.rules.get(intent.tool_id)
        if tool is None or rule is None:
            raise PoimenError(
                f"tool {intent.tool_id!r} declares no evidence here: register it with "
                "evidence=... (and load the application: --app)",
                tool_id=intent.tool_id,
            )
        call = recorded_call(intent, self.store.attempts(intent.id))
        run = self._begin(tool, rule, call, intent)
        if run is None:
            detail = _refused(rule)
        else:
            waited = _wait(run, rule.timeout, threading.Event())
            detail = self._end(run, rule, call, waited)
        return record(self.store, intent, "operator", {**(context or {}), **detail}, actor=actor)

    def _begin(
        self, tool: Tool, rule: Evidence, call: RecordedCall, intent: Intent
    ) -> _Run | None:
        with self._lock:
            self._stuck = [r for r in self._stuck if not r.done.is_set()]
            if len(self._stuck) >= MAX_STUCK:
                return None
        return _start(self.issuer, tool, rule, call, intent)

    def _end(self, run: _Run, rule: Evidence, call: RecordedCall, waited: bool) -> dict[str, Any]:
        if not waited:
            with self._lock:
                self._stuck.append(run)
        return _finish(run, rule, call, waited)


def _wait(run: _Run, seconds: float, closing: threading.Event) -> bool:
    end = time.monotonic() + max(0.0, seconds)
    while not run.done.wait(min(0.1, max(0.0, end - time.monotonic()))):
        if closing.is_set() or time.monotonic() >= end:
            return run.done.is_set()
    return True


def _refused(rule: Evidence) -> dict[str, Any]:
    return {"facts": [], "suggestion": None, "took_s": 0.0, "timeout_s": rule.timeout,
            "error": f"not run: {MAX_STUCK} earlier gatherings have not returned"}


def record(
    store: Store, intent: Intent, trigger: str, detail: Mapping[str, Any], *, actor: str
) -> Event | None:
    """Record one gathering as an ``evidence`` event; returns it as read back."""
    full = {**detail, "trigger": trigger, "state": intent.state.value, "at": store.now()}
    store.record_event(intent.id, EVIDENCE, actor=actor, detail=full, now=full["at"])
    found = [e for e in store.events(intent.id) if e.kind == EVIDENCE]
    return found[-1] if found else None


# Reading what was recorded: the page, `poimen show`, notifications, the audit of a decision.


@dataclass(frozen=True, slots=True)
class Found:
    """One recorded gathering, redacted: its facts, the rule's suggestion, or its failure."""

    event_id: int
    at: float
    actor: str
    trigger: str
    facts: tuple[Mapping[str, Any], ...]
    suggestion: Mapping[str, Any] | None
    error: str | None
    suggest_error: str | None
    omitted: int

    def to_json(self) -> dict[str, Any]:
        return {
            "event_id": self.event_id,
            "at": self.at,
            "actor": self.actor,
            "trigger": self.trigger,
            "facts": [dict(f) for f in self.facts],
            "suggestion": None if self.suggestion is None else dict(self.suggestion),
            "error": self.error,
            "suggest_error": self.suggest_error,
            "omitted": self.omitted,
        }


def found(event: Event) -> Found | None:
    try:
        d = json.loads(event.detail or "{}")
    except ValueError:
        return None
    if not isinstance(d, dict):
        return None
    d = redact(d)
    facts = [
        {**f, "link": f.get("link") if _shown_link(f.get("link")) else None}
        for f in (d.get("facts") if isinstance(d.get("facts"), list) else [])
        if isinstance(f, dict)
    ]
    s = d.get("suggestion")
    ok = isinstance(s, dict) and isinstance(s.get("landed"), bool) and isinstance(
        s.get("reason"), str
    )
    return Found(
        event_id=event.id,
        at=event.at,
        actor=event.actor,
        trigger=str(d.get("trigger", "")),
        facts=tuple(facts),
        suggestion={"landed": s["landed"], "reason": s["reason"]} if ok else None,
        error=d.get("error") if isinstance(d.get("error"), str) else None,
        suggest_error=d.get("suggest_error") if isinstance(d.get("suggest_error"), str) else None,
        omitted=int(d.get("omitted") or 0) if isinstance(d.get("omitted"), int) else 0,
    )


def _shown_link(link: object) -> bool:
    # Checked when recorded; again when shown, for a row written by other means.
    return isinstance(link, str) and link.lower().startswith(("http://", "https://"))


def latest(events: Sequence[Event]) -> Found | None:
    """The latest gathering recorded among an intent's events."""
    for e in reversed(events):
        if e.kind == EVIDENCE:
            f = found(e)
            if f is not None:
                return f
    return None


def audit_of(events: Sequence[Event], landed: bool) -> dict[str, Any]:
    """What a decision's event records of the suggestion in force when it was made: what
    was suggested, from which gathering, and whether the operator followed it."""
    f = latest(events)
    if f is None or f.suggestion is None:
        return {}
    return {
        "suggested": "landed" if f.suggestion["landed"] else "not_landed",
        "suggestion_reason": f.suggestion["reason"],
        "suggestion_event": f.event_id,
        "followed_suggestion": f.suggestion["landed"] == landed,
    }


#: Notifications that carry the intent's latest evidence when delivered.
CARRY = frozenset({"indeterminate", "indeterminate_reminder", "overdue"})


def with_evidence(store: Store, n: Notification) -> Notification:
    """The notification as delivered: with the intent's latest evidence in its payload."""
    if n.kind not in CARRY:
        return n
    f = latest(store.events(n.intent_id))
    if f is None:
        return n
    try:
        payload = json.loads(n.payload)
    except ValueError:
        return n
    if not isinstance(payload, dict):
        return n
    payload["evidence"] = f.to_json()
    return dataclasses.replace(n, payload=json.dumps(payload, sort_keys=True))
