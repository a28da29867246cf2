"""PydanticAI: the kernel's tools as a toolset.

    agent = Agent(model, toolsets=[PoimenToolset(kernel, scope=conversation_id)])

PydanticAI keeps no record of a tool call before it runs it: a run killed mid-call and run
again asks the model again, which mints new tool-call ids. So the call id is rule 2 of
`poimen.call_ids`: ``scope/tool/digest of the arguments/occurrence``. The occurrence is counted
in the run's message history (calls of the same tool with the same arguments that got a result,
and those earlier in the same model response), not in this process: a restarted process given
the same history counts the same, so a re-issued call gets the recorded outcome, and a call
made again on purpose in a later turn is a new call. A Pending or Indeterminate answer is no
result (its return part says so in its metadata): the model asking again is the same call. The
scope is the call's scope too: an identical call while one is unsettled gets its outcome.

Completed gives the model the tool's result; Failed a failed tool result; every other outcome
the text of `Outcome.for_model()`. A Pending call is waited for up to `pending_wait` seconds
first. With ``defer=True``, Indeterminate and Pending end the run with PydanticAI's
`DeferredToolRequests` instead; `deferred_results` turns the outcomes, once settled, into the
`DeferredToolResults` that resume it. A call awaiting an operator's approval always ends the
run as an approval request (`ApprovalRequired`); `decide` records the operator's decision
(approve, edit, reject) and adds it to the results that resume the run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

from poimen.errors import MissingExtraError

try:
    from pydantic_ai import (
        ApprovalRequired,
        CallDeferred,
        DeferredToolRequests,
        DeferredToolResults,
        ModelRetry,
        RunContext,
        ToolApproved,
        ToolDefinition,
        ToolDenied,
        ToolFailed,
        ToolReturn,
    )
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        ToolCallPart,
        ToolReturnPart,
    )
    from pydantic_ai.toolsets import AbstractToolset, ToolsetTool
    from pydantic_core import SchemaValidator, core_schema
except ImportError as exc:  # the extra is missing: say which one
    raise MissingExtraError.of("poimen.integrations.pydantic_ai", "pydantic-ai", exc) from exc

from poimen import Completed, Failed, Indeterminate, Kernel, Outcome, Pending, call_ids
from poimen.errors import ArgumentError, PoimenError
from poimen.integrations._outcomes import (
    PENDING_WAIT,
    apply_decision,
    awaiting,
    refusal,
    request,
    settle,
    unsettled,
)

__all__ = ["METADATA_KEY", "PoimenToolset", "decide", "deferred_results"]

METADATA_KEY = "poimen"
"""Where a deferred call's poimen details are, in `DeferredToolRequests.metadata[tool_call_id]`."""

# poimen validates arguments against the tool's signature itself, and names the field.
_ANY_ARGS = SchemaValidator(
    core_schema.dict_schema(core_schema.str_schema(), core_schema.any_schema())
)


class PoimenToolset(AbstractToolset[Any]):
    """The kernel's tools (all, or those named in `tools`) for a PydanticAI agent.

    `scope` names the conversation whose message history the runs share: keep it, and that
    history, across restarts. `defer` ends the run with `DeferredToolRequests` for calls an
    operator must decide (the agent's `output_type` must then include `DeferredToolRequests`).
    """

    def __init__(
        self,
        kernel: Kernel,
        *,
        scope: str,
        tools: Sequence[str] | None = None,
        defer: bool = False,
        id: str | None = None,
        max_retries: int = 1,
        pending_wait: float = PENDING_WAIT,
    ) -> None:
        call_ids.derived(scope, "-", {})  # refuses a bad scope now, not at the first call
        self.kernel = kernel
        self.scope = scope
        self.defer = defer
        self.pending_wait = pending_wait
        self.max_retries = max_retries
        self._tools = None if tools is None else [kernel.tool_id(t) for t in tools]
        self._id = id

    @property
    def id(self) -> str | None:
        return self._id

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        specs = self.kernel.specs()
        if self._tools is not None:
            specs = [s for s in specs if s.id in self._tools]
        return {
            s.name: ToolsetTool(
                toolset=self,
                tool_def=ToolDefinition(
                    name=s.name, description=s.description, parameters_json_schema=s.parameters
                ),
                max_retries=self.max_retries,
                args_validator=_ANY_ARGS,
            )
            for s in specs
        }

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        tool_id = self.kernel.tool_id(name)
        given = _given(ctx)
        try:
            if given is not None:  # resumed after an approval: the call asked about
                call_id = given["call_id"]
                outcome = await self.kernel.wait(call_id, timeout=0)
            else:
                n = _occurrence(
                    self.scope, ctx.messages, ctx.tool_call_id, name, tool_id, tool_args
                )
                call_id = call_ids.derived(self.scope, tool_id, tool_args, n)
                outcome = await self.kernel.acall(
                    tool_id, tool_args, call_id=call_id, scope=self.scope
                )
        except ArgumentError as e:  # refused before anything was recorded: the model may fix it
            raise ModelRetry(refusal(e)) from e
        outcome = await settle(self.kernel, call_id, outcome, self.pending_wait)
        if awaiting(outcome):
            raise ApprovalRequired(
                metadata={METADATA_KEY: request(self.kernel, call_id, tool_id, tool_args, outcome)}
            )
        if self.defer and isinstance(outcome, Indeterminate | Pending) and not outcome.terminal:
            raise CallDeferred(metadata={METADATA_KEY: _details(call_id, outcome)})
        return _for_model(outcome)


def _given(ctx: RunContext[Any]) -> dict[str, Any] | None:
    """The poimen details of an approved call the run resumes with (from `decide`)."""
    if not ctx.tool_call_approved or not isinstance(ctx.tool_call_metadata, dict):
        return None
    details = ctx.tool_call_metadata.get(METADATA_KEY)
    return details if isinstance(details, dict) and "call_id" in details else None


def _details(call_id: str, outcome: Indeterminate | Pending) -> dict[str, str]:
    return {
        "call_id": call_id,
        "intent_id": outcome.intent_id,
        "outcome": type(outcome).__name__,
        "reason": outcome.reason,
    }


def _for_model(outcome: Outcome) -> Any:
    if isinstance(outcome, Completed):
        return outcome.result
    if isinstance(outcome, Failed):
        raise ToolFailed(outcome.for_model())
    if unsettled(outcome):  # marked: no result, so not counted when the model asks again
        meta = {METADATA_KEY: {"outcome": type(outcome).__name__}}
        return ToolReturn(return_value=outcome.for_model(), metadata=meta)
    return outcome.for_model()


# Results of calls that reached the log; a retried (refused) or denied call did not, and an
# interrupted one may have: counting it could send again what may have gone out.
_RECORDED = ("success", "failed")


def _no_result(part: ToolReturnPart) -> bool:
    """A return part that told the model the call is Pending or Indeterminate."""
    meta = part.metadata.get(METADATA_KEY) if isinstance(part.metadata, dict) else None
    return isinstance(meta, dict) and meta.get("outcome") in ("Pending", "Indeterminate")


def _occurrence(
    scope: str,
    messages: Iterable[ModelMessage],
    tool_call_id: str | None,
    name: str,
    tool_id: str,
    args: dict[str, Any],
) -> int:
    """1 + the calls of this tool with these arguments before this one in the history that
    got a result from poimen, or are in this call's own model response. A call of a run that died before
    its result was saved does not count, so the restarted run's call gets its id."""
    messages = list(messages)
    answered = {
        p.tool_call_id
        for m in messages
        if isinstance(m, ModelRequest)
        for p in m.parts
        if isinstance(p, ToolReturnPart) and p.outcome in _RECORDED and not _no_result(p)
    }
    same = call_ids.derived(scope, tool_id, args)
    n = 1
    for m in messages:
        if not isinstance(m, ModelResponse):
            continue
        calls = [p for p in m.parts if isinstance(p, ToolCallPart)]
        own_response = any(p.tool_call_id == tool_call_id for p in calls)
        for p in calls:
            if p.tool_call_id == tool_call_id:
                return n
            if (
                p.tool_name == name
                and (own_response or p.tool_call_id in answered)
                and _same_args(scope, tool_id, p, same)
            ):
                n += 1
    return n


def _same_args(scope: str, tool_id: str, part: ToolCallPart, same: str) -> bool:
    try:
        return call_ids.derived(scope, tool_id, part.args_as_dict()) == same
    except PoimenError:
        return False


async def deferred_results(
    kernel: Kernel, requests: DeferredToolRequests, *, timeout: float | None = None
) -> DeferredToolResults:
    """Results for the calls of `requests` that poimen deferred and that are now final
    (completed, failed, or decided by an operator), waiting up to `timeout` seconds for each
    (None: until decided). Calls still undecided are left out: `requests.remaining(results)`
    lists them. Pass the results to the next run with the first run's messages:

        results = await deferred_results(kernel, result.output, timeout=0)
        await agent.run(message_history=result.all_messages(), deferred_tool_results=results)
    """
    results = DeferredToolResults()
    for call in requests.calls:
        details = requests.metadata.get(call.tool_call_id, {}).get(METADATA_KEY)
        if not isinstance(details, dict):
            continue  # another toolset's deferred call
        outcome = await kernel.wait(details["call_id"], timeout=timeout)
        if not outcome.terminal:
            continue
        try:
            results.calls[call.tool_call_id] = _for_model(outcome)
        except ToolFailed as failed:
            results.calls[call.tool_call_id] = failed
    return results


async def decide(
    kernel: Kernel,
    results: DeferredToolResults,
    requests: DeferredToolRequests,
    tool_call_id: str,
    *,
    decision: str,
    operator: str,
    reason: str,
    args: dict[str, Any] | None = None,
) -> None:
    """An operator's decision on a call that ended the run awaiting approval, recorded in the
    log (audited, bound to that call's intent) and added to `results`, which resume the run:
    ``"approve"``; ``"edit"`` with the edited `args` (a new call bound to them; the original
    is rejected with a link to it); ``"reject"`` (nothing is sent). A call decided already
    (a stale saved run) keeps its decision, whatever this one: the resumed run answers from
    the log."""
    details = requests.metadata.get(tool_call_id, {}).get(METADATA_KEY)
    if not isinstance(details, dict) or "intent_id" not in details:
        raise PoimenError(f"tool call {tool_call_id!r} is not a poimen approval request")
    choice = {"decision": decision, "operator": operator, "reason": reason, "args": args}
    await asyncio.to_thread(apply_decision, kernel, details["intent_id"], choice)
    outcome = kernel.outcome(details["call_id"])
    if isinstance(outcome, Failed):  # rejected (now, or before): nothing was sent
        results.approvals[tool_call_id] = ToolDenied(outcome.for_model())
        return
    # Approved, awaiting another operator, or decided before: the call answers from the log.
    results.approvals[tool_call_id] = ToolApproved()
    results.metadata[tool_call_id] = {METADATA_KEY: details}
