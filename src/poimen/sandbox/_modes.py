"""Sandbox modes: a kernel that answers calls without effects (docs/sandbox.md).

- **replay** (`recording=`): every call is answered from the recording by call id; no tool body
  runs. A call the recording does not have, or has with another tool or other arguments, is a
  divergence: refused with `DivergenceError` (``on_divergence="raise"``) or answered
  ``Pending("not_in_recording")`` (``on_divergence="record"``).
- **shadow** (`live=`, optional): ReadOnly tools run for real, through the normal protocol on
  this kernel's own log, and so do Transactional tools, whose transaction is always rolled
  back (no marker, nothing committed): their answer is what the tool would return now. Every other call is never dispatched: one that matches the live run's
  intent (call id, tool and arguments) gets the live outcome, any other is recorded as
  ``would_have_called`` and answered ``Pending("would_have_called")``.

Calls not dispatched are kept as sandbox records (`poimen.store._sandbox`), never as intents,
so no recovery can dispatch them. An Unsafe call is audited as a denial in both modes. The
recording and the live log are opened read-only and never written.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, cast

from poimen import events as ev
from poimen._core.effects import ReadOnly, Transactional, Unsafe
from poimen._core.intents import (
    Completed,
    Failed,
    Indeterminate,
    Intent,
    IntentState,
    Outcome,
    Pending,
    Resolved,
)
from poimen._core.tools import Tool
from poimen._engine import hooks as _hooks
from poimen._engine import protocol as _protocol
from poimen.errors import (
    CallIdMismatchError,
    DivergenceError,
    PoimenError,
)
from poimen.sandbox import change_text, json_changes, open_log, redact_change, rule2_slot
from poimen.store import Store
from poimen.store import _sandbox as records
from poimen.store._base import NewDispatch
from poimen.store._dialect import same_log

if TYPE_CHECKING:
    from poimen._engine.engine import Engine

OnDivergence = Literal["raise", "record"]
_OUTCOMES: dict[str, type[Any]] = {
    c.__name__: c for c in (Completed, Failed, Indeterminate, Resolved, Pending)
}
_UNSETTLED = (IntentState.DISPATCHED, IntentState.AWAITING_APPROVAL)
# What a shadow kernel runs for real: tools that change nothing, or whose every write it rolls
# back (a Transactional tool's transaction never commits in a sandbox kernel).
_SHADOW_RUNS = (ReadOnly, Transactional)


def check_options(
    mode: str,
    *,
    recording: str | Store | None,
    live: str | Store | None,
    scope: str | None,
    on_divergence: str,
) -> None:
    """Refuse a sandbox setting that does not fit the mode, before anything is opened."""
    if mode not in ("live", "shadow", "replay"):
        raise PoimenError(f"mode must be live, shadow or replay, not {mode!r}", field="mode")
    if mode == "live" and (recording, live, scope) != (None, None, None):
        raise PoimenError(
            "recording, live and scope are for mode='replay' or mode='shadow'", field="mode"
        )
    if mode == "replay" and recording is None:
        raise PoimenError("mode='replay' needs recording=<the recorded log>", field="recording")
    if mode == "replay" and live is not None:
        raise PoimenError("live= is for mode='shadow'; replay reads recording=", field="live")
    if mode == "shadow" and recording is not None:
        raise PoimenError("recording= is for mode='replay'; shadow reads live=", field="recording")
    for name, value in (("recording", recording), ("live", live)):
        if value is not None and not (
            isinstance(value, str) or callable(getattr(value, "get_by_call_id", None))
        ):
            raise PoimenError(f"{name} must be a log URL or a Store, not {value!r}", field=name)
    if scope is not None and (not isinstance(scope, str) or not scope):
        raise PoimenError(f"scope must be a non-empty call-id prefix, not {scope!r}", field="scope")
    if on_divergence not in ("raise", "record"):
        raise PoimenError(
            f"on_divergence must be 'raise' or 'record', not {on_divergence!r}",
            field="on_divergence",
        )
    if on_divergence != "raise" and mode != "replay":
        raise PoimenError("on_divergence is for mode='replay'", field="on_divergence")


def attach(
    engine: Engine,
    store: Store,
    mode: str,
    *,
    recording: str | Store | None,
    live: str | Store | None,
    scope: str | None,
    on_divergence: OnDivergence,
    on_close: list[Callable[[], object]],
) -> Sandbox | None:
    """A shadow or replay kernel's sandbox, put in front of its engine (closed with it:
    `on_close`); None for a live kernel. `store`: the kernel's log as opened, not the engine's
    observed one."""
    if mode == "live":
        return None
    sandbox = Sandbox(
        engine,
        store,
        cast("Literal['shadow', 'replay']", mode),
        source=recording if mode == "replay" else live,
        scope=scope,
        on_divergence=on_divergence,
    )
    on_close.append(sandbox.close)
    engine.sandbox = sandbox
    return sandbox


@dataclasses.dataclass(frozen=True, slots=True)
class _Divergence:
    kind: Literal["not_in_recording", "arguments_changed", "tool_changed"]
    recorded_call_id: str | None
    recorded_tool: str | None
    changes: tuple[dict[str, Any], ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "kind": self.kind,
                "recorded_call_id": self.recorded_call_id,
                "recorded_tool": self.recorded_tool,
                "changes": list(self.changes),
            },
            sort_keys=True,
            ensure_ascii=False,
        )


class Sandbox:
    """A kernel's shadow or replay mode: what its calls are answered (the engine's call entry
    asks `runs` and `answer`), its outcomes and its recovery. `store` is the kernel's own log
    as opened (sandbox records and denials are not transitions its observers report)."""

    def __init__(
        self,
        engine: Engine,
        store: Store,
        mode: Literal["shadow", "replay"],
        *,
        source: str | Store | None,
        scope: str | None,
        on_divergence: OnDivergence,
    ) -> None:
        self.engine = engine
        self.store = store
        self.mode = mode
        self.scope = scope
        self.on_divergence = on_divergence
        records.sql_store(store)  # sandbox records need a SQL store
        given = source if isinstance(source, str) else getattr(source, "url", None)
        if isinstance(given, str) and same_log(given, store.url):
            what = "recording" if mode == "replay" else "live"
            raise PoimenError(
                f"the {mode} kernel's own log is its {what} log: give it a log of its own "
                "(the recording is only ever read)",
                field=what,
            )
        self.source: Store | None = None
        self._owned = False
        if source is not None:
            self.source, self._owned = open_log(source)

    def close(self) -> None:
        if self._owned and self.source is not None:
            self.source.close()

    # The call entry.

    def runs(self, t: Tool, d: NewDispatch) -> bool:
        """Whether this call runs for real: a ReadOnly or Transactional tool in shadow mode
        that needs no operator's approval (a call that would wait for one is not run)."""
        return (
            self.mode == "shadow"
            and isinstance(t.registration.effects, _SHADOW_RUNS)
            and self.engine.approval(t, d) is None
        )

    def answer(self, t: Tool, d: NewDispatch) -> Outcome:
        """What a call this mode does not run is answered (and recorded as)."""
        store = self.store
        if isinstance(t.registration.effects, Unsafe):
            data: dict[str, Any] = {
                "tool_id": t.id,
                "intent_id": None,
                "attempt": None,
                "action": "dispatch",
                "target": d.call_id,
                "reason": f"unsafe tool in {self.mode} mode",
            }
            store.record_denial(now=store.now(), **data)
            _hooks.point(self.engine, lambda base: ev.DenialEvent(**base, **data))
        seen = records.get(store, d.call_id)
        if seen is not None:
            return self._again(seen, t, d)
        found = self._find(d.call_id)
        div = self._divergence(t, d, found)
        source = None if found is None else found.id
        if div is None:
            assert found is not None
            if self.mode == "shadow":
                found = self._settled(found)
            answer: records.SandboxAnswer = "recorded" if self.mode == "replay" else "live"
            out = self._keep(d, answer, source, _protocol.answer(found), None)
        elif self.mode == "shadow":
            out = self._keep(d, "would_have_called", source, None, div)
        elif self.on_divergence == "record":
            out = self._keep(d, "not_in_recording", source, None, div)
        else:
            out = self._keep(d, "refused", source, None, div)
            if out is None:
                raise _divergence_error(d, div)
        assert out is not None
        return out

    def _keep(
        self,
        d: NewDispatch,
        answer: records.SandboxAnswer,
        source: str | None,
        outcome: Outcome | None,
        div: _Divergence | None,
    ) -> Outcome | None:
        """Record what this call was answered, and give that answer (None: refused)."""
        rid = "sb_" + d.intent_id.removeprefix("in_")
        if outcome is None and answer != "refused":
            outcome = Pending(rid, answer)
        rec = records.SandboxCall(
            id=rid,
            call_id=d.call_id,
            mode=self.mode,
            tool_id=d.tool_id,
            effect=d.effect,
            args=d.args,
            args_hash=d.args_hash,
            answer=answer,
            source=source,
            outcome=None if outcome is None else _outcome_json(outcome),
            divergence=None if div is None else div.to_json(),
            created_at=d.now,
        )
        kept, created = records.record(self.store, rec)
        if not created:  # the same call id, recorded by another caller meanwhile
            return self._again(kept, self.engine.tools[d.tool_id], d)
        return outcome

    def _again(self, seen: records.SandboxCall, t: Tool, d: NewDispatch) -> Outcome:
        """A call id this sandbox log has answered before: the same answer."""
        if seen.tool_id != t.id or seen.args_hash != d.args_hash:
            raise CallIdMismatchError(
                f"call id {d.call_id!r} was recorded for tool {seen.tool_id!r} with other "
                "arguments; a call id always names the same call",
                call_id=d.call_id,
                intent_id=seen.id,
            )
        if seen.answer == "refused" or seen.outcome is None:
            raise _divergence_error(d, _divergence_of(seen.divergence))
        return _outcome_of_json(seen.outcome)

    # The recording or live run.

    def _find(self, call_id: str) -> Intent | None:
        if self.source is None or (self.scope is not None and not call_id.startswith(self.scope)):
            return None
        return self.source.get_by_call_id(call_id)

    def _divergence(self, t: Tool, d: NewDispatch, found: Intent | None) -> _Divergence | None:
        if found is not None:
            if found.tool_id == t.id and found.args_hash == d.args_hash:
                return None
            changes = _changes(found.args, d.args)
            if found.tool_id != t.id:
                return _Divergence("tool_changed", found.call_id, found.tool_id, changes)
            return _Divergence("arguments_changed", found.call_id, None, changes)
        near = self._nearest(t, d)
        if near is None:
            return _Divergence("not_in_recording", None, None, ())
        return _Divergence("not_in_recording", near.call_id, None, _changes(near.args, d.args))

    def _nearest(self, t: Tool, d: NewDispatch) -> Intent | None:
        """For a rule-2 call id (scope/tool/digest/n) that the recording lacks: the
        recording's call of the same tool in the same scope, the same occurrence first."""
        slot = rule2_slot(d.call_id, t.id)
        if self.source is None or slot is None or not self._in_scope(slot[0]):
            return None
        stem, n = slot
        near = [
            i
            for i in self.source.search_call_id(stem, limit=200)
            if rule2_slot(i.call_id, t.id) is not None
        ]
        near.sort(key=lambda i: (rule2_slot(i.call_id, t.id) != (stem, n), i.id))
        return near[0] if near else None

    def _in_scope(self, call_id: str) -> bool:
        return self.scope is None or call_id.startswith(self.scope)

    def _settled(self, found: Intent) -> Intent:
        """The live call, once settled (waited for up to the kernel's `wait_bound`)."""
        assert self.source is not None
        end = time.monotonic() + self.engine.wait_bound
        delay = 0.02
        while found.state in _UNSETTLED and time.monotonic() < end:
            time.sleep(min(delay, max(0.0, end - time.monotonic())))
            delay = min(delay * 2, 0.5)
            found = self.source.get_intent(found.id) or found
        return found

    # What the rest of the kernel asks.

    def outcome(self, call_id: str) -> Outcome | None:
        """What this sandbox log says of a call id: its answer, or its intent (a ReadOnly
        call run in shadow mode); None if never called or refused."""
        seen = records.get(self.store, call_id)
        if seen is not None:
            return None if seen.outcome is None else _outcome_of_json(seen.outcome)
        intent = self.store.get_by_call_id(call_id)
        return None if intent is None else _protocol.answer(intent)

    def recovery_engine(self) -> Engine:
        """The kernel's engine as recovery may use it: with only the tools this mode may
        run without asking (shadow: ReadOnly; replay: none). An intent of any other tool in
        this log stays
        as it is, reported as unregistered, and is never dispatched."""
        e = copy.copy(self.engine)
        e.tools = {
            tid: t
            for tid, t in self.engine.tools.items()
            if self.mode == "shadow" and isinstance(t.registration.effects, ReadOnly)
        }
        return e


def _changes(recorded: str, given: str) -> tuple[dict[str, Any], ...]:
    return tuple(redact_change(c) for c in json_changes(json.loads(recorded), json.loads(given)))


def _divergence_of(text: str | None) -> _Divergence:
    data = json.loads(text) if text else {}
    return _Divergence(
        data.get("kind", "not_in_recording"),
        data.get("recorded_call_id"),
        data.get("recorded_tool"),
        tuple(data.get("changes", ())),
    )


def _divergence_error(d: NewDispatch, div: _Divergence) -> DivergenceError:
    changes = "; ".join(change_text(c) for c in div.changes[:5])
    more = f" (+{len(div.changes) - 5} more)" if len(div.changes) > 5 else ""
    if div.kind == "not_in_recording":
        what = f"the recording has no call {d.call_id!r}"
        if div.recorded_call_id is not None:
            what += f"; its call {div.recorded_call_id!r} of this tool had other arguments"
    elif div.kind == "tool_changed":
        what = f"the recording has call {d.call_id!r} for tool {div.recorded_tool!r}"
    else:
        what = f"the recording has call {d.call_id!r} with other arguments"
    if changes:
        what += f": {changes}{more}"
    return DivergenceError(
        f"replay of tool {d.tool_id!r} diverged: {what}; nothing was run",
        call_id=d.call_id,
        tool_id=d.tool_id,
        kind=div.kind,
        recorded_call_id=div.recorded_call_id,
        recorded_tool=div.recorded_tool,
        difference=[dict(c) for c in div.changes],
    )


def _outcome_json(o: Outcome) -> str:
    return json.dumps(
        {"type": type(o).__name__, **dataclasses.asdict(o)}, sort_keys=True, ensure_ascii=False
    )


def _outcome_of_json(text: str) -> Outcome:
    data = json.loads(text)
    cls = _OUTCOMES[data.pop("type")]
    out: Outcome = cls(**data)
    return out
