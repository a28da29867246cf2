"""The operator path over any Store: status, list, search, show, resolve, abandon, audit
(docs/resolve-indeterminate.md).

The CLI and the web console both call these functions, so the two never disagree about
what an intent looks like, what is redacted, or when a resolution is refused.
"""

from __future__ import annotations

import getpass
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from poimen._core.intents import (
    TERMINAL,
    Attempt,
    Delivery,
    Denial,
    Event,
    Intent,
    IntentState,
    Notification,
    Owner,
)
from poimen._core.keys import encode_value
from poimen._core.present import (
    MAX_DEPTH,
    MAX_LIMIT,
    REDACTED,
    SECRET_NAME,
    OperatorInputError,
    _check_limit,
    _redacted_json,
    escape_lines,
    escape_text,
    fmt_age,
    fmt_time,
    is_secret_name,
    parse_duration,
    parse_limit,
    parse_result,
    parse_since,
    parse_state,
    redact,
    redact_store_url,
    redact_url,
    redact_urls,
    safe_json,
)
from poimen._engine import evidence as _evidence
from poimen.call_ids import original_of
from poimen.errors import IntentNotFoundError
from poimen.store._base import Store
from poimen.store._statements import ABANDONED

S = IntentState

__all__ = [
    "ABANDONED",
    "MAX_DEPTH",
    "MAX_LIMIT",
    "REDACTED",
    "SECRET_NAME",
    "Identity",
    "IntentDetail",
    "OperatorInputError",
    "Status",
    "abandon",
    "audit",
    "escape_lines",
    "escape_text",
    "find",
    "fmt_age",
    "fmt_time",
    "is_secret_name",
    "list_intents",
    "os_user",
    "parse_duration",
    "parse_limit",
    "parse_result",
    "parse_since",
    "parse_state",
    "redact",
    "redact_store_url",
    "redact_url",
    "redact_urls",
    "resolve",
    "safe_json",
    "same_run",
    "search",
    "show",
    "status",
]

MAX_OPERATOR = 200
MAX_REASON = 4000
@dataclass(frozen=True, slots=True)
class Status:
    """Counts by state and by tool, the oldest Indeterminate intent, the unfinished ones."""

    now: float
    by_state: dict[str, int]
    by_tool: dict[str, dict[str, int]]
    total: int
    unfinished: int
    indeterminate: int
    oldest_indeterminate: Intent | None
    undelivered_notifications: int

    def to_json(self) -> dict[str, Any]:
        """The status as JSON-ready data (what `poimen status --json` prints)."""
        oldest = self.oldest_indeterminate
        return {
            "now": self.now,
            "total": self.total,
            "by_state": self.by_state,
            "by_tool": self.by_tool,
            "unfinished": self.unfinished,
            "indeterminate": self.indeterminate,
            "oldest_indeterminate": None
            if oldest is None
            else {**intent_summary(oldest), "age_s": self.now - oldest.created_at},
            "undelivered_notifications": self.undelivered_notifications,
        }


def status(store: Store, *, notification_cap: int = 1000) -> Status:
    """How many intents are in each state, the oldest unresolved Indeterminate one, and the
    notifications not yet delivered (counted up to `notification_cap`)."""
    now = store.now()
    by_state = {s.value: 0 for s in IntentState}
    by_tool: dict[str, dict[str, int]] = {}
    # A damaged log may hold a tool id or state that is not text (poimen verify names it).
    counts = {(_as_text(t), _as_text(st)): n for (t, st), n in store.counts().items()}
    for (tool, state), n in sorted(counts.items()):
        by_state[state] = by_state.get(state, 0) + n
        by_tool.setdefault(tool, {})[state] = by_tool.get(tool, {}).get(state, 0) + n
    oldest = store.list_intents(state=S.INDETERMINATE, limit=1)
    # Due at the end of time: every undelivered row, capped so a huge backlog stays cheap.
    pending = len(store.due_notifications(float(2**62), notification_cap))
    return Status(
        now=now,
        by_state=by_state,
        by_tool=by_tool,
        total=sum(by_state.values()),
        unfinished=by_state[S.DISPATCHED],
        indeterminate=by_state[S.INDETERMINATE],
        oldest_indeterminate=oldest[0] if oldest else None,
        undelivered_notifications=pending,
    )


def _as_text(value: object) -> str:
    return value if isinstance(value, str) else repr(value)


def list_intents(
    store: Store,
    *,
    state: IntentState | None = None,
    tool_id: str | None = None,
    since: float | None = None,
    limit: int = 100,
) -> list[Intent]:
    """Intents oldest first, filtered; `limit` bounds the answer."""
    _check_limit(limit)
    found = store.list_intents(state=state, tool_id=tool_id, since=since, limit=limit)
    return [shown_intent(i) for i in found]


@dataclass(frozen=True, slots=True)
class IntentDetail:
    """One intent with its history; `args` and `result` already redacted."""

    intent: Intent
    args: Any
    result: Any
    attempts: list[Attempt]
    events: list[Event]
    notifications: list[Notification]
    deliveries: list[Delivery]
    now: float
    undoes: Intent | None = None  # for an undo's intent: the call it undoes

    @property
    def resolvable(self) -> bool:
        """Whether an operator may resolve the intent now (it is INDETERMINATE)."""
        return self.intent.state == S.INDETERMINATE

    @property
    def late_evidence(self) -> list[dict[str, Any]]:
        """What stale owners saw after losing their attempt, redacted like everything shown."""
        return [
            {
                "number": a.number,
                "late_outcome": a.late_outcome,
                "late_result": None
                if a.late_result is None
                else json.dumps(_redacted_json(a.late_result), sort_keys=True),
            }
            for a in self.attempts
            if a.late_outcome is not None
        ]

    def event_detail(self, event: Event) -> Any:
        """An event's detail as data, secrets redacted."""
        return _event_detail(event)

    def actor(self, event: Event) -> str:
        """The event's actor with how poimen knew them, if recorded: ``ann (cli, os user
        root)``, ``bob (own token)``, ``ana (typed)``."""
        detail = _event_detail(event)
        if not isinstance(detail, dict) or detail.get("identified_by") not in VIA:
            return event.actor
        how = [_VIA_SHORT[detail["identified_by"]]]
        if isinstance(detail.get("os_user"), str):
            how.append(f"os user {detail['os_user']}")
        return f"{event.actor} ({', '.join(how)})"

    @property
    def undone_by(self) -> list[dict[str, Any]]:
        """The undos that reversed this call (its "undone" events): undo intent, call id,
        tool, who asked, when."""
        out = []
        for e in self.events:
            detail = _event_detail(e)
            if e.kind == "undone" and isinstance(detail, dict):
                out.append({
                    "undo_intent_id": detail.get("undo_intent_id"),
                    "undo_call_id": detail.get("undo_call_id"),
                    "undo_tool": detail.get("undo_tool"),
                    "asked_by": e.actor,
                    "at": e.at,
                })
        return out

    def to_json(self) -> dict[str, Any]:
        """The whole detail as JSON-ready data (what `poimen show --json` prints)."""
        return {
            **intent_summary(self.intent),
            "args": self.args,
            "result": self.result,
            "age_s": self.now - self.intent.created_at,
            "undone_by": self.undone_by,
            "evidence": None if self.evidence is None else self.evidence.to_json(),
            "suggestion": self.suggestion,
            "undoes": None if self.undoes is None else intent_summary(self.undoes),
            "attempts": [attempt_json(a) for a in self.attempts],
            "events": [event_json(e) for e in self.events],
            "notifications": [
                notification_json(n, self.deliveries_of(n)) for n in self.notifications
            ],
        }

    @property
    def evidence(self) -> _evidence.Found | None:
        """The latest evidence gathered for this call (redacted), if any."""
        return _evidence.latest(self.events)

    @property
    def suggestion(self) -> dict[str, Any] | None:
        """What the tool's rule concludes from that evidence, while the call is undecided:
        ``{"decision": "landed" | "not_landed", "reason": ...}``; a person still decides."""
        found = self.evidence
        if not self.resolvable or found is None or found.suggestion is None:
            return None
        landed = found.suggestion["landed"]
        return {"decision": "landed" if landed else "not_landed", **found.suggestion}

    def deliveries_of(self, n: Notification) -> list[Delivery]:
        """The per-notifier deliveries of one of the intent's notifications."""
        return [d for d in self.deliveries if d.notification_id == n.id]


def search(store: Store, prefix: str, *, limit: int = 100) -> list[Intent]:
    """Intents whose call id starts with `prefix` (an exact call id included), newest first."""
    _check_limit(limit)
    return [shown_intent(i) for i in store.search_call_id(prefix, limit=limit)]


def run_prefix(call_id: str) -> str | None:
    """The run a call id belongs to: everything up to its last ``/`` (None without one)."""
    cut = call_id.rfind("/")
    return call_id[: cut + 1] if cut > 0 else None


def same_run(store: Store, intent: Intent, *, limit: int = 50) -> list[Intent]:
    """The other calls of `intent`'s run (same call-id prefix up to the last ``/``),
    newest first."""
    prefix = run_prefix(intent.call_id)
    if prefix is None:
        return []
    return [i for i in store.search_call_id(prefix, limit=limit + 1) if i.id != intent.id][:limit]


def find(store: Store, ident: str) -> Intent:
    """The intent with this intent id, or else with this call id."""
    intent = store.get_intent(ident) or store.get_by_call_id(ident)
    if intent is None:
        raise IntentNotFoundError(f"no intent has id or call id {ident!r}", intent_id=ident)
    return intent


def show(store: Store, intent_id: str) -> IntentDetail:
    """Everything recorded about one intent, by intent id or call id."""
    intent = find(store, intent_id)
    original = original_of(intent.call_id)
    return IntentDetail(
        intent=shown_intent(intent),
        args=_redacted_json(intent.args),
        result=_redacted_json(intent.result),
        attempts=[replace(a, error=_error_text(a.error)) for a in store.attempts(intent.id)],
        events=store.events(intent.id),
        notifications=store.notifications(intent.id),
        deliveries=store.deliveries(intent.id),
        now=store.now(),
        undoes=None if original is None else store.get_by_call_id(original),
    )


def audit(
    store: Store, *, tool_id: str | None = None, since: float | None = None, limit: int = 1000
) -> list[Denial]:
    """Capability and sandbox denials, oldest first."""
    _check_limit(limit)
    return store.denials(tool_id=tool_id, since=since, limit=limit)


# Who decides.

#: How poimen knows who an operator is, recorded with each decision as ``identified_by``.
VIA = {
    "operator-token": "logged in to the console with their own token",
    "proxy-header": "named by the trusted proxy in front of the console",
    "typed-name": "typed into the console under its shared token: not verified",
    "cli": "given to the command line; os_user is the account that ran it",
}


_VIA_SHORT = {
    "operator-token": "own token",
    "proxy-header": "named by proxy",
    "typed-name": "typed",
    "cli": "cli",
}


@dataclass(frozen=True, slots=True)
class Identity:
    """The operator behind a decision and how poimen knows it (`via`, one of `VIA`);
    `os_user` is the operating-system account of a command-line decision."""

    name: str
    via: str
    os_user: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise OperatorInputError("an identity needs the operator's name", field="operator")
        if self.via not in VIA:
            raise OperatorInputError(
                f"via {self.via!r} is not one of {', '.join(VIA)}", field="via"
            )

    def detail(self) -> dict[str, str]:
        """What goes into the decision's event besides the name."""
        out = {"identified_by": self.via}
        if self.os_user is not None:
            out["os_user"] = self.os_user
        return out


def os_user() -> str | None:
    """The account this process runs as (its real uid, not what the environment says)."""
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError, AttributeError):
        pass
    try:
        return getpass.getuser()
    except Exception:  # getpass raises OSError, or worse on odd platforms: no name to give
        return None


# The one state change an operator makes.


def resolve(
    store: Store,
    intent_id: str,
    *,
    landed: bool,
    result: Any = None,
    operator: str | Identity,
    reason: str,
    batch: Mapping[str, Any] | None = None,
) -> Intent:
    """Decide an INDETERMINATE intent: landed (with an optional result) or not landed.

    Terminal and audited: the operator (with how poimen knows them, for an `Identity`) and
    the reason go into the intent's events in the same transaction, with the suggestion of
    the call's latest evidence, if any (and whether the decision followed it), and `batch`
    (a bulk resolution's id and source). Any other state is refused
    (`NotIndeterminateError`); nothing here retries.
    """
    name, reason, context = who_and_why("resolve", operator, reason)
    if not landed and result is not None:
        raise OperatorInputError("a result makes sense only for a landed call", field="result")
    text = None if result is None else encode_value(result, "result")
    context = {
        **(context or {}),
        **(batch or {}),
        **_evidence.audit_of(store.events(intent_id), landed),
    }
    return store.resolve(
        intent_id,
        landed=landed,
        result=text,
        operator=name,
        reason=reason,
        now=store.now(),
        context=context,
    )


def abandon(
    store: Store,
    intent_id: str,
    *,
    operator: str | Identity,
    reason: str,
    notifiers: tuple[str, ...] = (),
) -> Intent:
    """Give up on a DISPATCHED intent whose worker will not come back: it becomes
    INDETERMINATE (`ABANDONED`) for an operator to resolve as usual, notified like any
    Indeterminate intent (for `notifiers` by name; none named: any kernel's).

    The fence moves on, so an outcome the old worker reports after all is kept only as late
    evidence. Audited like `resolve`; any other state is refused (`NotDispatchedError`),
    and of two operators abandoning at once exactly one wins.
    """
    name, reason, context = who_and_why("abandon", operator, reason)
    return store.abandon(
        intent_id,
        operator=name,
        reason=reason,
        now=store.now(),
        context=context,
        notifiers=notifiers,
    )


def decide_approval(
    store: Store, intent_id: str, *, approve: bool, operator: str | Identity, reason: str
) -> Intent:
    """Approve (dispatched once, by its class) or reject (FAILED, nothing sent) a call that
    awaits approval. Audited like `resolve`; any other state is refused
    (`NotAwaitingApprovalError`), and of two operators deciding at once exactly one wins."""
    name, reason, context = who_and_why("approve" if approve else "reject", operator, reason)
    return store.decide_approval(
        intent_id, approve=approve, operator=name, reason=reason, now=store.now(), context=context
    )


def who_and_why(
    what: str, operator: str | Identity, reason: Any
) -> tuple[str, str, dict[str, str] | None]:
    context = operator.detail() if isinstance(operator, Identity) else None
    if isinstance(operator, Identity):
        operator = operator.name
    if not isinstance(operator, str) or not operator.strip():
        raise OperatorInputError(f"{what} needs the operator's name", field="operator")
    if not isinstance(reason, str) or not reason.strip():
        raise OperatorInputError(f"{what} needs a reason", field="reason")
    if len(operator) > MAX_OPERATOR:
        raise OperatorInputError(
            f"operator is longer than {MAX_OPERATOR} characters", field="operator"
        )
    if len(reason) > MAX_REASON:
        raise OperatorInputError(f"reason is longer than {MAX_REASON} characters", field="reason")
    return operator.strip(), reason.strip(), context


# JSON shapes, shared by `--json` and the console.


def _owner_json(o: Owner | None) -> dict[str, Any] | None:
    if o is None:
        return None
    return {"worker_id": o.worker_id, "host": o.host, "pid": o.pid}


def _plain(obj: Any, drop: frozenset[str] = frozenset(), **override: Any) -> dict[str, Any]:
    out = {f.name: getattr(obj, f.name) for f in fields(obj) if f.name not in drop}
    out.update(override)
    return out


# Raw arguments and results never leave this module unredacted.
_INTENT_DROP = frozenset({"args", "args_hash", "result", "lease_expires_at", "next_check_at"})


def intent_summary(i: Intent) -> dict[str, Any]:
    i = shown_intent(i)
    return _plain(
        i,
        _INTENT_DROP,
        state=i.state.value,
        owner=_owner_json(i.owner),
        terminal=i.state in TERMINAL,
    )


def attempt_json(a: Attempt) -> dict[str, Any]:
    return _plain(
        a,
        frozenset({"intent_id"}),
        owner=_owner_json(a.owner),
        error=_error_text(a.error),
        result=_redacted_json(a.result),
        late_result=_redacted_json(a.late_result),
    )


def _event_detail(e: Event) -> Any:
    detail = _redacted_json(e.detail)
    if isinstance(detail, dict) and isinstance(detail.get("result"), str):
        detail = {**detail, "result": _redacted_json(detail["result"])}
    if isinstance(detail, dict):  # an error's text quotes URLs, with their credentials
        detail = {
            k: _error_text(v) if k in ("error", "reason") and isinstance(v, str) else v
            for k, v in detail.items()
        }
    return detail


def event_json(e: Event) -> dict[str, Any]:
    return _plain(e, frozenset({"intent_id"}), detail=_event_detail(e))


def notification_json(n: Notification, deliveries: list[Delivery]) -> dict[str, Any]:
    # Error texts may quote a webhook's URL, written by an older poimen before redaction.
    return _plain(
        n,
        frozenset({"id", "intent_id", "payload"}),
        last_error=_error_text(n.last_error),
        deliveries=[
            _plain(d, frozenset({"notification_id"}), last_error=_error_text(d.last_error))
            for d in deliveries
        ],
    )


def _error_text(text: str | None) -> str | None:
    return None if text is None else redact_urls(text)


def shown_intent(i: Intent) -> Intent:
    """The intent as an operator sees it: its error and reason texts (a provider's message,
    an exception's text) with the credentials of URLs in them removed, like arguments."""
    error, reason = _error_text(i.error), _error_text(i.reason)
    return i if (error, reason) == (i.error, i.reason) else replace(i, error=error, reason=reason)


def denial_json(d: Denial) -> dict[str, Any]:
    return _plain(d)
