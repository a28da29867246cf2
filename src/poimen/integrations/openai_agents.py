"""The OpenAI Agents SDK: the kernel's tools as `FunctionTool`s.

    agent = Agent(name="assistant", tools=poimen_tools(kernel, scope=session_id))

The SDK keeps no record of a tool call before it runs it: a run killed mid-call and run again
asks the model again, which mints new call ids. So the call id is rule 2 of `poimen.call_ids`:
``scope/tool/digest of the arguments/occurrence``. The occurrence counts the calls of the same
tool with the same arguments that got an output in the run's input (the session's history)
and those made earlier in the same run: a restarted process given the same history counts the
same, so a re-issued call gets the recorded outcome, and a call made again on purpose in a
later turn is a new call. An output that told the model the call is Pending or Indeterminate
is no result: the model asking again is the same call. The session is the call's scope too:
an identical call while one is unsettled gets its outcome.

The model gets the text of `Outcome.for_model()`: for Completed, the result as JSON. A Pending
call is waited for up to `pending_wait` seconds first. A call the log holds already (a
restarted run's, or an identical one unsettled in the session) that is still Pending then
ends the run with an interruption, through `needs_approval`, before the tool runs:
`resume_pending(kernel, state, scope=...)` waits for it to settle and lets it through in the
`RunState` (no approval is recorded: the resumed tool answers from the log) and returns the
interruptions that are approvals; `decide` refuses a Pending one.

A tool registered with `requires_approval` asks through the SDK's own `needs_approval`: the
call is recorded awaiting approval and the run stops with an interruption
(`result.interruptions`); `decide(kernel, state, item, ...)` records the approver's decision on
that call's intent (approve, edit, reject; audited) and approves or rejects the item in the
`RunState` that resumes the run; a four-eyes call stops the run again until enough distinct
operators approved. A stale saved state resumed after the decision answers from the log.
"""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from poimen.errors import MissingExtraError

try:
    from agents import FunctionTool, RunContextWrapper, RunState, ToolApprovalItem
    from agents.exceptions import UserError
    from agents.strict_schema import ensure_strict_json_schema
    from agents.tool_context import ToolContext
except ImportError as exc:  # the extra is missing: say which one
    raise MissingExtraError.of("poimen.integrations.openai_agents", "openai-agents", exc) from exc

from poimen import Failed, Indeterminate, Intent, Kernel, Outcome, Pending, ToolSpec, call_ids
from poimen._runtime import engine_of
from poimen.errors import ArgumentError, NotAwaitingApprovalError, PoimenError
from poimen.integrations._outcomes import (
    PENDING_WAIT,
    apply_decision,
    awaiting,
    followed,
    refusal,
    settle,
    unsettled,
    waitable,
)
from poimen.store import NewDispatch

__all__ = ["decide", "poimen_tools", "resume_pending"]


def poimen_tools(
    kernel: Kernel,
    *,
    scope: str,
    tools: Sequence[str] | None = None,
    pending_wait: float = PENDING_WAIT,
) -> list[FunctionTool]:
    """`FunctionTool`s for the kernel's tools (all, or those named in `tools`).

    `scope` names the session whose history the runs share: keep it, and that history,
    across restarts."""
    call_ids.derived(scope, "-", {})  # refuses a bad scope now, not at the first call
    wanted = None if tools is None else {kernel.tool_id(t) for t in tools}
    counter = _RunCounter(scope)
    return [
        _function_tool(kernel, spec, counter, pending_wait)
        for spec in kernel.specs()
        if wanted is None or spec.id in wanted
    ]


def _function_tool(
    kernel: Kernel, spec: ToolSpec, counter: _RunCounter, pending_wait: float
) -> FunctionTool:
    async def invoke(ctx: ToolContext[Any], raw: str) -> str:
        try:
            args = _args(raw)
            call_id = counter.call_id(ctx, ctx.tool_name, ctx.tool_call_id, spec.id, args)
            outcome = await kernel.acall(spec.id, args, call_id=call_id, scope=counter.scope)
        except (ArgumentError, json.JSONDecodeError) as e:  # nothing was recorded
            return refusal(e)
        outcome = await settle(kernel, call_id, followed(kernel, call_id, outcome), pending_wait)
        counter.answered(ctx, call_id, outcome)
        return outcome.for_model()

    rule = engine_of(kernel).approval_for(spec.id)

    async def needs_approval(
        ctx: RunContextWrapper[Any], params: dict[str, Any], sdk_call_id: str
    ) -> bool:
        """True while poimen holds the call: for an operator (recorded now if its rule asks),
        or Pending after `pending_wait` (the run ends; `resume_pending` resumes it)."""
        try:
            call_id = counter.call_id(ctx, spec.name, sdk_call_id, spec.id, params)
            _, d, _ = engine_of(kernel).prepare(spec.id, params, call_id, counter.scope)
            if rule is not None and rule.needed(spec.id, json.loads(d.args)):
                outcome = await kernel.acall(
                    spec.id, params, call_id=call_id, scope=counter.scope
                )
                if awaiting(followed(kernel, call_id, outcome)):  # edited: more approvers?
                    return True
        except ArgumentError:
            return False  # refused when the tool runs, before anything is recorded
        return await _still_pending(kernel, d, params, pending_wait)

    schema, strict = _schema(spec.parameters)
    return FunctionTool(
        name=spec.name,
        description=spec.description,
        params_json_schema=schema,
        on_invoke_tool=invoke,
        strict_json_schema=strict,
        needs_approval=needs_approval,
    )


async def _still_pending(
    kernel: Kernel, d: NewDispatch, params: dict[str, Any], wait: float
) -> bool:
    """The call is in the log already (a restarted run's, or an identical one unsettled in
    its scope) and still Pending after `wait` seconds: the run ends with an interruption
    instead of telling the model. A call the log has not seen runs, and is answered there."""
    outcome = kernel.outcome(d.call_id)
    if outcome is None and d.scope is not None:
        if kernel.store.unsettled_call(d.scope, d.tool_id, d.args_hash) is None:
            return False
        # Made an alias of the unsettled call: answered by it, now and once it has settled.
        outcome = await kernel.acall(d.tool_id, params, call_id=d.call_id, scope=d.scope)
    return outcome is not None and waitable(await settle(kernel, d.call_id, outcome, wait))


def _args(raw: str) -> dict[str, Any]:
    args = json.loads(raw) if raw else {}
    if not isinstance(args, dict):
        raise ArgumentError(f"arguments must be a JSON object, not {raw!r}")
    return args


async def decide(
    kernel: Kernel,
    state: RunState[Any],
    item: ToolApprovalItem,
    *,
    scope: str,
    decision: str,
    operator: str,
    reason: str,
    args: dict[str, Any] | None = None,
) -> None:
    """An operator's decision on an interruption of the session `scope`: recorded on the
    call's intent in the log (audited) and given to `state`, which resumes the run:
    ``"approve"``; ``"edit"`` with the edited `args` (a new call bound to them; the original
    is rejected with a link to it); ``"reject"`` (nothing is sent). A four-eyes call that
    needs another operator leaves the item undecided: the resumed run stops on it again, and
    the next operator decides (on the edited call, after an edit); the same operator again is
    `SameApproverError`. A call decided already (a stale saved state) keeps its decision,
    whatever this one: the resumed run answers from the log."""
    intent = _asked(kernel, scope, item)
    if intent is None:  # decided already (a stale state): the tool answers from the log
        state.approve(item)
        return
    now = kernel.outcome(intent.call_id)
    if now is not None and waitable(now):
        raise NotAwaitingApprovalError(
            f"the interruption for call {intent.call_id!r} is a Pending call, not an approval "
            "asked for: nobody approves it; resume_pending resumes it once it has settled"
        )
    choice = {"decision": decision, "operator": operator, "reason": reason, "args": args}
    await asyncio.to_thread(apply_decision, kernel, intent.id, choice)
    outcome = kernel.outcome(intent.call_id)
    if awaiting(outcome):
        return  # another operator must approve
    if isinstance(outcome, Failed):  # rejected: nothing was sent
        state.reject(item, rejection_message=outcome.for_model())
    else:
        state.approve(item)


async def resume_pending(
    kernel: Kernel, state: RunState[Any], *, scope: str, timeout: float | None = None
) -> list[ToolApprovalItem]:
    """Resume the interruptions of the session `scope` that stand for a Pending call:
    each is waited for (up to `timeout` seconds; None: until it settles) and let through in
    `state`, whose resumed run gets the call's outcome from the log. Nothing is recorded as
    an approval: the item is approved in the `RunState` only so that the SDK runs the tool,
    which answers from the log. A call still Pending after `timeout` is left undecided (the
    resumed run stops on it again). Returns the interruptions that ask an operator's
    approval, for `decide`. An interruption whose arguments are no JSON object (the SDK
    stops on those before asking the tools) is let through too: the tool refuses them."""
    asked: list[ToolApprovalItem] = []
    for item in state.get_interruptions():
        intent = _asked(kernel, scope, item)
        outcome = None if intent is None else kernel.outcome(intent.call_id)
        if awaiting(outcome):
            asked.append(item)
            continue
        if intent is not None and outcome is not None and waitable(outcome):
            outcome = await kernel.wait(intent.call_id, timeout=timeout)
            if waitable(outcome):
                continue
        state.approve(item)
    return asked


def _asked(kernel: Kernel, scope: str, item: ToolApprovalItem) -> Intent | None:
    """The call an interruption asks about: the unsettled call of this tool with these
    arguments in the session (awaiting approval, or Pending), or the edited call an
    approver made of it, awaiting the other approvers of a four-eyes tool. None for
    arguments that are no JSON object: the SDK stops on those before asking the tools, and
    the tool refuses them, recording nothing."""
    raw = item.raw_item
    tool_id = kernel.tool_id(str(item.tool_name or _field(raw, "name")))
    try:
        params = _args(_field(raw, "arguments") or "")
        _, d, _ = engine_of(kernel).prepare(tool_id, params, "poimen-decide", scope)
    except (ArgumentError, ValueError):
        return None
    intent = kernel.store.unsettled_call(scope, tool_id, d.args_hash)
    if intent is not None:
        return intent
    same = call_ids.derived(scope, tool_id, params).rpartition("/")[0] + "/"
    for earlier in kernel.store.search_call_id(same, limit=100):
        now = kernel.outcome(earlier.call_id)  # an edited call answers for its original
        if awaiting(now) and now is not None and now.intent_id != earlier.id:
            return kernel.store.get_intent(now.intent_id)
    return None


def _schema(parameters: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Strict mode (the SDK's recommendation) where it keeps the tool's meaning: every
    parameter required. A parameter with a default would become one the model must send."""
    required = set(parameters.get("required", ()))
    if set(parameters.get("properties", {})) != required:
        return parameters, False
    try:
        return ensure_strict_json_schema(dict(parameters)), True
    except UserError:
        return parameters, False


class _Run:
    """One run's own calls: occurrences per (tool, arguments), and those given back by a
    Pending or Indeterminate answer (the model asking again is the same call)."""

    __slots__ = ("back", "issued", "ref", "seen")

    def __init__(self, ref: weakref.ref[object]) -> None:
        self.ref = ref
        self.seen: dict[str, int] = {}
        self.back: dict[str, set[int]] = {}
        self.issued: dict[str, tuple[str, int]] = {}


class _RunCounter:
    """Occurrences per run. The SDK gives every tool call of one run the same `usage` object
    and a new one to the next run; a run's own calls are counted here, earlier runs' calls
    in the run's input."""

    def __init__(self, scope: str) -> None:
        self.scope = scope
        # id(usage) -> the run; `Usage` is not hashable.
        self._runs: dict[int, _Run] = {}
        self._sdk: dict[str, tuple[str, str]] = {}  # the SDK's call id -> (call, call id)
        self._lock = threading.Lock()

    def _run(self, ctx: RunContextWrapper[Any]) -> _Run:
        run, key = ctx.usage, id(ctx.usage)
        entry = self._runs.get(key)
        if entry is None or entry.ref() is not run:
            runs = self._runs
            # The callback takes no lock: it may run in a collection inside this block.
            entry = _Run(weakref.ref(run, lambda _: runs.pop(key, None)))
            self._runs[key] = entry
        return entry

    def call_id(
        self,
        ctx: RunContextWrapper[Any],
        name: str,
        sdk_call_id: str,
        tool_id: str,
        args: Mapping[str, Any],
    ) -> str:
        """The call id of the SDK's call `sdk_call_id`; the same when asked again for it (its
        approval check, then its run)."""
        same = call_ids.derived(self.scope, tool_id, args)
        earlier = _answered(self.scope, ctx.turn_input, name, tool_id, same)
        with self._lock:
            known = self._sdk.get(sdk_call_id)
            if known is not None and known[0] == same:
                return known[1]
            run = self._run(ctx)
            back = run.back.get(same)
            if back:
                own = min(back)
                back.discard(own)
            else:
                own = run.seen[same] = run.seen.get(same, 0) + 1
            call_id = call_ids.derived(self.scope, tool_id, args, earlier + own)
            run.issued[call_id] = (same, own)
            self._sdk[sdk_call_id] = (same, call_id)
        return call_id

    def answered(self, ctx: ToolContext[Any], call_id: str, outcome: Outcome) -> None:
        if not unsettled(outcome):
            return
        with self._lock:
            run = self._run(ctx)
            issued = run.issued.get(call_id)
            if issued is not None:
                run.back.setdefault(issued[0], set()).add(issued[1])


def _field(item: Any, name: str) -> Any:
    return item.get(name) if isinstance(item, Mapping) else getattr(item, name, None)


def _answered(scope: str, items: Sequence[Any], name: str, tool_id: str, same: str) -> int:
    """Calls of this tool with these arguments in the run's input that have an output."""
    outputs = {
        _field(i, "call_id")
        for i in items
        if _field(i, "type") == "function_call_output" and not _no_result(_field(i, "output"))
    }
    n = 0
    for i in items:
        if (
            _field(i, "type") == "function_call"
            and _field(i, "name") == name
            and _field(i, "call_id") in outputs
        ):
            try:
                args = json.loads(_field(i, "arguments") or "{}")
                if isinstance(args, dict) and call_ids.derived(scope, tool_id, args) == same:
                    n += 1
            except (ValueError, PoimenError):
                continue
    return n


# What poimen tells a model of a call that has no result yet (`Outcome.for_model()`): the SDK
# keeps only the output text, so it is recognised by its opening words.
_NO_RESULT = tuple(
    o.for_model()[:40]
    for o in (
        Pending("-", "in_flight"),
        Pending("-", "awaiting_approval"),
        Indeterminate("-", "-"),
    )
)


def _no_result(output: Any) -> bool:
    return isinstance(output, str) and output.startswith(_NO_RESULT)
