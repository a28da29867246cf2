"""Undo: a scope's effects reversed newest first, itself crash-safe (docs/undo.md).

A tool may name its undo: another registered tool, with its own effect class, called with
arguments derived from the original call's recorded arguments and result by a pure function.
`undo` walks a scope's intents newest first and makes each undo an ordinary call whose call id
is derived from the original's (`call_ids.undo_of`). Run again after a crash, it finds the
undos already made by those ids: a settled one answers from the log, an unfinished one is
recovered by its own class, and no effect is undone twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

from poimen._core.effects import Idempotent
from poimen._core.intents import (
    Completed,
    Failed,
    Indeterminate,
    Intent,
    IntentState,
    Pending,
    Resolved,
)
from poimen._core.keys import args_digest, canonical, check_call_id
from poimen._core.undo import UndoRule
from poimen._engine import crashpoints as _crashpoints
from poimen._engine.engine import MAKING
from poimen.call_ids import is_undo, undo_of
from poimen.errors import (
    AlreadyUndoneError,
    ArgumentError,
    CallIdMismatchError,
    PoimenError,
    RegistrationError,
    UndoError,
    UnknownToolError,
)
from poimen.operator import _ops as op

if TYPE_CHECKING:
    from poimen._core.tools import Tool
    from poimen._engine.engine import Engine
    from poimen.store import Store

S = IntentState

#: The most intents one `undo` looks at; a larger scope is refused, not cut short.
MAX_SCOPE = 10_000

UndoStatus = Literal[
    "undone",  # its undo landed in this run
    "already_undone",  # its undo had landed before
    "to_undo",  # a dry run: it would be undone now
    "no_undo",  # its tool declares no undo: listed, never reversed
    "no_effect",  # nothing happened (FAILED, resolved not landed, read-only)
    "waiting",  # not settled, or Indeterminate with an undo that is not safe blind
    "stopped",  # its undo failed, is unknown or pending: the sequence stopped here
    "not_reached",  # older than where the sequence stopped
]


def _rule(engine: Engine, tool_id: str) -> UndoRule | None:
    r = engine.records.get(tool_id)
    return None if r is None else r.undo


def check_free(engine: Engine, tool_id: str) -> None:
    """A tool has one undo: refused if `tool_id` names one already."""
    if (r := _rule(engine, tool_id)) is not None:
        raise RegistrationError(
            f"tool {tool_id!r} already has an undo ({r.tool!r})", tool_id=tool_id
        )


def link(engine: Engine, tool_id: str, undo_rule: UndoRule) -> None:
    """Name `undo_rule` as `tool_id`'s undo."""
    check_free(engine, tool_id)
    engine.records[tool_id].undo = undo_rule


# The report.


@dataclass(frozen=True, slots=True)
class UndoStep:
    """What `undo` did, or found, for one intent of the scope."""

    intent_id: str
    call_id: str
    tool_id: str
    state: str  # the intent's state when looked at
    status: UndoStatus
    undo_tool: str | None = None
    undo_call_id: str | None = None
    undo_intent_id: str | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class UndoReport:
    """Every intent of the scope, newest first, with what became of its undo."""

    scope: str
    steps: tuple[UndoStep, ...]
    dry_run: bool = False

    def _with(self, *statuses: str) -> tuple[UndoStep, ...]:
        return tuple(s for s in self.steps if s.status in statuses)

    @property
    def undone(self) -> tuple[UndoStep, ...]:
        """Reversed: in this run or before."""
        return self._with("undone", "already_undone")

    @property
    def without_undo(self) -> tuple[UndoStep, ...]:
        """Effects that stay: their tools declare no undo."""
        return self._with("no_undo")

    @property
    def waiting(self) -> tuple[UndoStep, ...]:
        """Passed over until they settle or an operator resolves them; undo again then."""
        return self._with("waiting")

    @property
    def stopped_at(self) -> UndoStep | None:
        """Where the sequence stopped (an undo failed, is unknown or pending), or None."""
        stops = self._with("stopped")
        return stops[0] if stops else None

    @property
    def complete(self) -> bool:
        """Every effect of the scope that has an undo is reversed."""
        return not self._with("to_undo", "waiting", "stopped", "not_reached")

    def summary(self) -> str:
        """One line per step, for people."""
        n = {s: len(self._with(s)) for s in get_args(UndoStatus)}
        parts = [
            f"{len(self.undone)} undone" + (f" ({n['undone']} now)" if n["undone"] else ""),
            f"{n['no_undo']} without an undo",
            f"{n['no_effect']} without effect",
            f"{n['waiting']} waiting",
        ]
        if self.dry_run:
            parts.insert(0, f"{n['to_undo']} to undo")
        head = f"{'dry run: ' if self.dry_run else ''}scope {self.scope!r}: {', '.join(parts)}"
        stop = self.stopped_at
        if stop is not None:
            head += (
                f"; STOPPED at {stop.call_id} ({stop.intent_id}): {stop.reason}; "
                f"{n['not_reached']} older not reached"
            )
        return head

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data (what `poimen undo --json` prints)."""
        stop = self.stopped_at
        return {
            "scope": self.scope,
            "dry_run": self.dry_run,
            "complete": self.complete,
            "stopped_at": None if stop is None else asdict(stop),
            "steps": [asdict(s) for s in self.steps],
        }


class Undoer(Protocol):
    """`Kernel.undo`, as the console is given it."""

    def __call__(
        self,
        scope: str,
        *,
        operator: str | op.Identity | None = None,
        reason: str | None = None,
        dry_run: bool = False,
    ) -> UndoReport: ...


# Undoing.


@dataclass(frozen=True, slots=True)
class _Who:
    actor: str
    operator: str | None
    reason: str | None
    how: dict[str, str] | None = None  # identified_by, os_user: how the operator was known


def undo(
    engine: Engine,
    scope: str,
    *,
    operator: str | op.Identity | None = None,
    reason: str | None = None,
    dry_run: bool = False,
) -> UndoReport:
    """Reverse every landed effect of the calls whose call id starts with `scope`, newest
    first (see `Kernel.undo`)."""
    _check_scope(scope)
    who = _who(engine, operator, reason)
    if engine.closed:
        raise PoimenError("the kernel is closed")
    store = engine.store
    found = store.search_call_id(scope, limit=MAX_SCOPE + 1)
    if len(found) > MAX_SCOPE:
        raise UndoError(
            f"scope {scope!r} holds more than {MAX_SCOPE} calls: undo a narrower scope",
            scope=scope,
            limit=MAX_SCOPE,
        )
    originals = [i for i in found if not is_undo(i.call_id)]
    for it in originals:
        r = _rule(engine, it.tool_id)
        if r is not None and r.tool not in engine.tools:
            raise UnknownToolError(
                f"tool {it.tool_id!r} names {r.tool!r} as its undo, and no tool is registered "
                f"as {r.tool!r}; nothing was undone",
                tool_id=r.tool,
            )
    steps: list[UndoStep] = []
    stopped = False
    for it in originals:
        if stopped:
            steps.append(_step(it, "not_reached"))
            continue
        step = _undo_one(engine, it, who, dry_run)
        steps.append(step)
        stopped = step.status == "stopped"
        if step.status == "undone":
            _crashpoints.hit("between_undos")
    return UndoReport(scope, tuple(steps), dry_run)


def _check_scope(scope: object) -> None:
    if not isinstance(scope, str) or not scope:
        raise UndoError(f"scope must be a non-empty call-id prefix, not {scope!r}", field="scope")
    check_call_id(scope)
    if is_undo(scope):
        raise UndoError(
            f"scope {scope!r} names undo calls; an undo is never undone by undo()",
            field="scope",
        )


def _who(engine: Engine, operator: object, reason: object) -> _Who:
    how = None
    if isinstance(operator, op.Identity):  # recorded with how poimen knows the operator
        how, operator = operator.detail(), operator.name
    for name, value, limit in (
        ("operator", operator, op.MAX_OPERATOR),
        ("reason", reason, op.MAX_REASON),
    ):
        if value is None:
            continue
        if not isinstance(value, str) or not value.strip():
            raise op.OperatorInputError(f"undo: {name} must be non-empty text", field=name)
        if len(value) > limit:
            raise op.OperatorInputError(
                f"undo: {name} is longer than {limit} characters", field=name
            )
    o = operator.strip() if isinstance(operator, str) else None
    r = reason.strip() if isinstance(reason, str) else None
    return _Who(o or str(engine.owner.worker_id), o, r, how)


def _step(it: Intent, status: UndoStatus, **kw: Any) -> UndoStep:
    return UndoStep(it.id, it.call_id, it.tool_id, it.state.value, status, **kw)


def _latest(store: Store, call_id: str) -> tuple[int, Intent | None]:
    """How many undos of `call_id` were made, and the last one."""
    n, latest = 0, None
    while (got := store.get_by_call_id(undo_of(call_id, n + 1))) is not None:
        n, latest = n + 1, got
    return n, latest


def _undo_one(engine: Engine, it: Intent, who: _Who, dry_run: bool) -> UndoStep:
    store = engine.store
    done = _undone_by(store, it)
    if done is not None:  # undone for good, whatever retention removed since
        return _already(it, done)
    if it.state in (S.FAILED, S.RESOLVED_NOT_LANDED) or it.effect == "readonly":
        return _step(it, "no_effect")
    if it.state == S.DISPATCHED:
        return _step(it, "waiting", reason="in flight: its outcome is not known yet")
    if it.state == S.AWAITING_APPROVAL:
        return _step(it, "waiting", reason="awaits an operator's approval")
    if it.tool_id not in engine.tools:
        return _step(it, "no_undo", reason=f"tool {it.tool_id!r} is not registered here")
    r = _rule(engine, it.tool_id)
    if r is None:
        return _step(it, "no_undo", reason=f"tool {it.tool_id!r} declares no undo")
    undo_tool = engine.tools[r.tool]
    n, latest = _latest(store, it.call_id)
    if latest is not None:
        found = {"undo_tool": latest.tool_id, "undo_call_id": latest.call_id,
                 "undo_intent_id": latest.id}
        foreign = _not_its_undo(latest, it, r, undo_tool)
        if foreign is not None:
            return _step(it, "stopped", **found, reason=foreign)
        if latest.state in (S.COMPLETED, S.RESOLVED_LANDED):
            if not dry_run:
                _mark_undone(store, it, latest, who)
            return _step(it, "already_undone", **found)
        if latest.state == S.INDETERMINATE:  # a second undo would reverse twice if it landed
            return _step(it, "stopped", **found, reason=_unknown(latest.id, latest.reason))
    resume = latest is not None and latest.state in (S.DISPATCHED, S.AWAITING_APPROVAL)
    if not resume and it.state == S.INDETERMINATE and not isinstance(
        undo_tool.registration.effects, Idempotent
    ):
        return _step(
            it, "waiting", undo_tool=r.tool,
            reason=f"its outcome is unknown and its undo {r.tool!r} is not Idempotent: "
            "undo again once an operator has resolved it",
        )
    # Resumed: the undo made before; else the first, or one after an undo without effect.
    uid = latest.call_id if resume and latest is not None else undo_of(it.call_id, n + 1)
    named = {"undo_tool": r.tool, "undo_call_id": uid}
    if dry_run:
        return _step(it, "to_undo", **named, undo_intent_id=latest.id if resume and latest else None)
    try:
        args = r.derive(it)
        undo_tool.validate(args)  # refused here, before anything is recorded for it
    except ArgumentError as exc:
        if it.state == S.INDETERMINATE:  # e.g. the derivation needs the result it lacks
            return _step(it, "waiting", undo_tool=r.tool, reason=f"its outcome is unknown: {exc}")
        return _step(it, "stopped", **named, reason=str(exc))
    if not resume:
        detail = {"undo_call_id": uid, "undo_tool": r.tool, "operator": who.operator,
                  "reason": who.reason, **(who.how or {})}
        try:
            store.record_event(it.id, "undo_requested", actor=who.actor, detail=detail,
                               now=store.now())
        except AlreadyUndoneError as exc:  # another run's undo landed since we looked
            return _already(it, _undone_by(store, it) or {"undo_intent_id": exc.undo_intent_id})
    making = MAKING.set(uid)
    try:
        out = engine.run_call(r.tool, args, call_id=uid)
    except (ArgumentError, CallIdMismatchError) as exc:
        return _step(it, "stopped", **named, reason=str(exc))
    finally:
        MAKING.reset(making)
    named["undo_intent_id"] = out.intent_id
    match out:
        case Completed() | Resolved(landed=True):
            _crashpoints.hit("undo_landed")
            undone = store.get_intent(out.intent_id)
            assert undone is not None
            _mark_undone(store, it, undone, who)
            return _step(it, "undone", **named)
        case Failed(error=error):
            reason = f"the undo failed, nothing was reversed: {error}"
        case Resolved():
            reason = "an operator resolved the undo as not landed"
        case Indeterminate(reason=why):
            reason = _unknown(out.intent_id, why)
        case Pending(reason=why):
            reason = f"the undo is pending ({why}): undo again later"
    return _step(it, "stopped", **named, reason=reason)


def _not_its_undo(found: Intent, it: Intent, r: UndoRule, undo_tool: Tool) -> str | None:
    """Why the intent under an undo call id of `it` is not `it`'s undo (the undo tool, with
    the arguments derived from `it`, made after it), or None when it is."""
    why = None
    if found.tool_id != r.tool:
        why = f"a call of {found.tool_id!r}, not of the undo tool {r.tool!r}"
    elif found.created_at < it.created_at:
        why = "made before the call itself"
    else:
        try:
            recorded, _ = undo_tool.validate(r.derive(it))
        except ArgumentError as exc:
            why = f"its arguments cannot be derived again to compare: {exc}"
        else:
            if args_digest(canonical(recorded)) != found.args_hash:
                why = "other arguments than the ones derived from this call"
    if why is None:
        return None
    return (
        f"call id {found.call_id!r} holds intent {found.id} ({why}): not this call's undo, "
        "so undo neither takes it as the reversal nor makes another; an operator decides"
    )


def _undone_by(store: Store, it: Intent) -> dict[str, Any] | None:
    """The detail of the original's first 'undone' event, or None."""
    for e in store.events(it.id):
        if e.kind == "undone":
            return _detail(e.detail)
    return None


def _already(it: Intent, done: Mapping[str, Any]) -> UndoStep:
    return _step(
        it, "already_undone", undo_tool=done.get("undo_tool"),
        undo_call_id=done.get("undo_call_id"), undo_intent_id=done.get("undo_intent_id"),
    )


def _unknown(intent_id: str, why: str | None) -> str:
    return (
        f"the undo's outcome is unknown ({why}): an operator resolves undo intent "
        f"{intent_id}, then undo again"
    )


def _mark_undone(store: Store, it: Intent, undo_intent: Intent, who: _Who) -> None:
    """The 'undone' event on the original; the store writes it once per undo intent."""
    detail = {
        "undo_intent_id": undo_intent.id,
        "undo_call_id": undo_intent.call_id,
        "undo_tool": undo_intent.tool_id,
        "operator": who.operator,
        **(who.how or {}),
    }
    # An operator's decision owes no answer (as `resolve`): a call the model makes after it
    # is new. Before the event, so a run after a crash between the two clears it still.
    store.take_answer(it.id)
    store.record_event(it.id, "undone", actor=who.actor, detail=detail, now=store.now())


def _detail(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
