"""LangGraph: the kernel's tools as LangChain tools, for `ToolNode`.

    tools = poimen_tools(kernel)
    graph = build_graph(model.bind_tools(tools), ToolNode(tools)).compile(checkpointer=saver)
    graph.invoke(inputs, {"configurable": {"thread_id": thread_id}})

With a checkpointer, LangGraph saves the model's message, tool calls and their ids included,
before the tool node runs, and a resumed thread runs the same calls with the same ids. So the
call id is rule 1 of `poimen.call_ids`: ``framework_id(thread_id, tool_call_id)``. Without a
``thread_id`` in the config (no checkpointer), nothing was saved, and the call id falls back to
rule 2 within `scope` (`CallIds(scope)`, counted in this process); `poimen_tools` needs a scope
for that, and refuses the call without one.

The thread is the call's scope: restarted with ``graph.invoke(inputs, config)``, the model is
asked again and mints new tool-call ids, and a call identical to one still unsettled in the
thread (in flight, Pending, Indeterminate, awaiting approval) gets that call's outcome instead
of a second dispatch.

A Pending call is waited for up to `pending_wait` seconds; still Pending, or awaiting an
operator's approval, it goes through LangGraph's `interrupt` (with a checkpointer): the graph
stops with ``{"poimen": {"call_id", "intent_id", "tool", "args", "outcome", "reason"}}`` (an
approval also has ``"approvals": {"needed", "given"}``) and resumes with
``Command(resume=...)``: for an approval the decision, ``{"decision": "approve" | "reject" |
"edit", "operator": ..., "reason": ..., "args": {...}}``; for a Pending call anything, once it
has settled (``kernel.wait(call_id)``). A four-eyes call stops the thread again until enough
distinct operators approved; after an edit it asks about the edited call.

The `ToolMessage`'s content is the text of `Outcome.for_model()` (for Completed, the result as
JSON); its artifact names the call: ``{"call_id", "intent_id", "outcome"}``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any

from poimen.errors import MissingExtraError

try:
    from langchain_core.messages import ToolCall, ToolMessage
    from langchain_core.runnables import RunnableConfig
    from langchain_core.tools import BaseTool
    from langgraph.types import interrupt
    from pydantic import ConfigDict
except ImportError as exc:  # the extra is missing: say which one
    raise MissingExtraError.of("poimen.integrations.langgraph", "langgraph", exc) from exc

from poimen import Failed, Kernel, Outcome, Pending, call_ids
from poimen.errors import ArgumentError, PoimenError
from poimen.integrations._outcomes import (
    PENDING_WAIT,
    followed,
    refusal,
    request,
    resumed_decision,
    settle,
    settle_sync,
)

__all__ = ["PoimenTool", "poimen_tools"]

# The call in progress: (call id, the model's tool-call id, its scope, the thread or None),
# set by invoke for _run.
_CALL: contextvars.ContextVar[tuple[str, str | None, str, str | None] | None] = (
    contextvars.ContextVar("poimen_langgraph_call", default=None)
)


def poimen_tools(
    kernel: Kernel,
    *,
    scope: str | None = None,
    tools: Sequence[str] | None = None,
    pending_wait: float = PENDING_WAIT,
) -> list[PoimenTool]:
    """LangChain tools for the kernel's tools (all, or those named in `tools`). `scope` is
    only for calls made without a ``thread_id``; `pending_wait` bounds the wait for a
    Pending call, in seconds."""
    if scope is not None:
        call_ids.derived(scope, "-", {})  # refuses a bad scope now
    wanted = None if tools is None else {kernel.tool_id(t) for t in tools}
    fallback = None if scope is None else call_ids.CallIds(scope)
    return [
        PoimenTool(
            name=s.name,
            description=s.description,
            args_schema=s.parameters,
            kernel=kernel,
            tool_id=s.id,
            fallback=fallback,
            pending_wait=pending_wait,
        )
        for s in kernel.specs()
        if wanted is None or s.id in wanted
    ]


class PoimenTool(BaseTool):
    """One kernel tool. Called by `ToolNode` with the model's tool call, it returns a
    `ToolMessage`; called with plain arguments, the text of the outcome."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    kernel: Kernel
    tool_id: str
    fallback: call_ids.CallIds | None = None
    pending_wait: float = PENDING_WAIT

    def invoke(
        self, input: str | dict[str, Any] | ToolCall, config: RunnableConfig | None = None,
        **kwargs: Any,
    ) -> Any:
        token = _CALL.set(self._identify(input, config))
        try:
            return super().invoke(input, config, **kwargs)
        finally:
            _CALL.reset(token)

    async def ainvoke(
        self, input: str | dict[str, Any] | ToolCall, config: RunnableConfig | None = None,
        **kwargs: Any,
    ) -> Any:
        token = _CALL.set(self._identify(input, config))
        try:
            return await super().ainvoke(input, config, **kwargs)
        finally:
            _CALL.reset(token)

    def _identify(
        self, input: str | dict[str, Any] | ToolCall, config: RunnableConfig | None
    ) -> tuple[str, str | None, str, str | None]:
        """The call id: rule 1 with the thread and the model's id, else rule 2 in the scope;
        the scope; the thread."""
        if not isinstance(input, dict):
            raise PoimenError(f"tool {self.name!r} takes its arguments as a mapping")
        is_call = input.get("type") == "tool_call" and isinstance(input.get("id"), str)
        tool_call_id: str | None = input["id"] if is_call else None
        args = input["args"] if is_call else input
        thread = ((config or {}).get("configurable") or {}).get("thread_id")
        if tool_call_id and thread is not None:
            thread = str(thread)
            return call_ids.framework_id(thread, tool_call_id), tool_call_id, thread, thread
        if self.fallback is None:
            raise PoimenError(
                f"tool {self.name!r} was called without a thread_id in the config: pass "
                "{'configurable': {'thread_id': ...}} with a checkpointer, or give "
                "poimen_tools a scope",
                field="thread_id",
            )
        scope = self.fallback.scope
        return self.fallback.next(self.tool_id, args), tool_call_id, scope, None

    def _run(self, **kwargs: Any) -> Any:
        call_id, tool_call_id, scope, thread = self._current()
        k = self.kernel
        try:
            outcome = k.call(self.tool_id, kwargs, call_id=call_id, scope=scope)
        except ArgumentError as e:
            return self._refused(e, tool_call_id)
        outcome = settle_sync(k, call_id, followed(k, call_id, outcome), self.pending_wait)
        refused = None
        while thread is not None and isinstance(outcome, Pending) and not outcome.terminal:
            refused = self._resumed(outcome, interrupt(self._asked(call_id, kwargs, outcome,
                                                                   refused)))
            current = k.outcome(call_id) or outcome
            outcome = settle_sync(k, call_id, current, self.pending_wait)
        return self._message(outcome, call_id, tool_call_id)

    async def _arun(self, **kwargs: Any) -> Any:
        call_id, tool_call_id, scope, thread = self._current()
        k = self.kernel
        try:
            outcome = await k.acall(self.tool_id, kwargs, call_id=call_id, scope=scope)
        except ArgumentError as e:
            return self._refused(e, tool_call_id)
        outcome = await settle(k, call_id, followed(k, call_id, outcome), self.pending_wait)
        refused = None
        while thread is not None and isinstance(outcome, Pending) and not outcome.terminal:
            refused = self._resumed(outcome, interrupt(self._asked(call_id, kwargs, outcome,
                                                                   refused)))
            current = k.outcome(call_id) or outcome
            outcome = await settle(k, call_id, current, self.pending_wait)
        return self._message(outcome, call_id, tool_call_id)

    def _asked(
        self, call_id: str, args: dict[str, Any], outcome: Outcome, refused: str | None
    ) -> dict[str, Any]:
        asked = request(self.kernel, call_id, self.tool_id, args, outcome)
        if refused is not None:
            asked["refused"] = refused
        return {"poimen": asked}

    def _resumed(self, outcome: Pending, answer: Any) -> str | None:
        """The graph resumed: an approver's decision is applied to the call asked about.
        A decision that does not count (its operator or reason missing, the same operator
        again for four eyes, or an earlier answer LangGraph replays) is asked again, and the
        next interrupt says why (``"refused"``)."""
        if outcome.reason != "awaiting_approval":
            return None
        return resumed_decision(self.kernel, outcome.intent_id, answer)

    def _refused(self, error: ArgumentError, tool_call_id: str | None) -> Any:
        text = refusal(error)
        if tool_call_id is None:
            return text
        return ToolMessage(content=text, tool_call_id=tool_call_id, name=self.name, status="error")

    def _current(self) -> tuple[str, str | None, str, str | None]:
        current = _CALL.get()
        if current is None:
            raise PoimenError(f"call tool {self.name!r} with invoke or ainvoke")
        return current

    def _message(self, outcome: Outcome, call_id: str, tool_call_id: str | None) -> Any:
        text = outcome.for_model()
        if self.fallback is not None and call_id.startswith(self.fallback.scope + "/"):
            self.fallback.answered(call_id, outcome)
        if tool_call_id is None:
            return text
        return ToolMessage(
            content=text,
            tool_call_id=tool_call_id,
            name=self.name,
            status="error" if isinstance(outcome, Failed) else "success",
            artifact={
                "call_id": call_id,
                "intent_id": outcome.intent_id,
                "outcome": type(outcome).__name__,
            },
        )
