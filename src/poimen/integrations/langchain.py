"""LangChain agents: approvals of the kernel's tools through LangChain's human-in-the-loop
protocol (the `HumanInTheLoopMiddleware` requests and decisions), bound to poimen's intents.
Needs ``pip install 'poimen[langchain]'``.

    agent = create_agent(model, tools=poimen_tools(kernel),
                         middleware=[PoimenHumanInTheLoop(kernel)], checkpointer=saver)

A kernel tool registered with `requires_approval` is recorded awaiting approval before the
agent asks anyone, under the call id its `PoimenTool` uses (``framework_id(thread_id,
tool_call_id)``); the thread then stops with LangChain's `HITLRequest` (one action request;
``interrupt_mode="per_call"``: a ``tool_approval`` request), with the call's poimen details
under ``"poimen"``. Resume it with LangChain's decision, plus who decides:
``Command(resume={"decisions": [{"type": "approve", "operator": "ann", "reason": ...}]})``
(per_call: the decision alone). ``"edit"`` with ``"edited_action": {"name", "args"}`` runs the
edited call (a new intent bound to the edited arguments; the original is rejected with a link
to it); ``"reject"`` with its ``"message"`` sends nothing. A four-eyes tool stops the thread
again until enough distinct operators approved. The decision is recorded on the intent asked
about, audited; one that does not count (no operator, no reason, the same operator twice) is
asked again, the request saying why (``"refused"``). A stale checkpoint resumed after the
call was decided answers from the log.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

from poimen.errors import MissingExtraError

try:
    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.messages import ToolMessage
    from langgraph.prebuilt.tool_node import ToolCallRequest
    from langgraph.types import Command, interrupt
except ImportError as exc:  # the extra is missing: say which one
    raise MissingExtraError.of("poimen.integrations.langchain", "langchain", exc) from exc

from poimen import Kernel
from poimen._runtime import engine_of
from poimen.errors import PoimenError
from poimen.integrations._outcomes import awaiting, followed, request, resumed_decision
from poimen.integrations.langgraph import PoimenTool
from poimen.operator._ops import OperatorInputError

__all__ = ["PoimenHumanInTheLoop"]

_ALLOWED = ["approve", "edit", "reject"]


class PoimenHumanInTheLoop(AgentMiddleware[Any, Any, Any]):
    """Asks for the approval of the kernel's tools that need one, in LangChain's
    human-in-the-loop protocol, and records each decision on the call's intent."""

    def __init__(
        self,
        kernel: Kernel,
        *,
        interrupt_mode: Literal["batched", "per_call"] = "batched",
        description: str = "Tool execution requires approval",
    ) -> None:
        super().__init__()
        if interrupt_mode not in ("batched", "per_call"):
            raise PoimenError(
                f"interrupt_mode must be 'batched' or 'per_call', not {interrupt_mode!r}",
                field="interrupt_mode",
            )
        self.kernel = kernel
        self.interrupt_mode = interrupt_mode
        self.description = description

    def wrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], ToolMessage | Command[Any]],
    ) -> ToolMessage | Command[Any]:
        edited = self._approved(request)
        return self._noted(handler(request), edited)

    async def awrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]],
    ) -> ToolMessage | Command[Any]:
        edited = self._approved(request)  # the log's reads and the interrupt are short
        return self._noted(await handler(request), edited)

    def _approved(self, req: ToolCallRequest) -> dict[str, Any] | None:
        """Record a call of a tool that needs approval and ask until it is decided; the tool
        then answers from the log. Returns the edited arguments, if an approver edited it."""
        tool = req.tool
        k = self.kernel
        if not isinstance(tool, PoimenTool) or engine_of(k).approval_for(tool.tool_id) is None:
            return None
        call = req.tool_call
        config = getattr(req.runtime, "config", None)
        call_id, _, scope, thread = tool._identify(
            {"type": "tool_call", "id": call.get("id"), "name": call["name"],
             "args": call["args"]}, config)
        if thread is None:
            raise PoimenError(
                f"tool {call['name']!r} needs an approval, asked through a LangGraph "
                "interrupt: run the agent with a checkpointer and a thread_id",
                field="thread_id",
            )
        outcome = followed(k, call_id, k.call(tool.tool_id, call["args"], call_id=call_id,
                                              scope=scope))
        refused: str | None = None
        while awaiting(outcome):
            asked = request(k, call_id, tool.tool_id, call["args"], outcome)
            if refused is not None:
                asked["refused"] = refused
            answer = interrupt(self._value(call, asked))
            try:
                decision = _decision(call["name"], answer)
            except OperatorInputError as exc:  # asked again: see `resumed_decision`
                refused = str(exc)
            else:
                refused = resumed_decision(k, outcome.intent_id, decision)
            outcome = k.outcome(call_id) or outcome
        original = k.store.get_by_call_id(call_id)
        if original is None or outcome.intent_id == original.id:
            return None
        edited = k.store.get_intent(outcome.intent_id)  # the call an approver edited
        return None if edited is None else dict(json.loads(edited.args))

    def _value(self, call: Mapping[str, Any], asked: dict[str, Any]) -> dict[str, Any]:
        """LangChain's request for the call (its arguments those asked about: an edited
        call's, after an edit), with poimen's details."""
        description = f"{self.description}: intent {asked['intent_id']}"
        approvals = asked["approvals"]
        if approvals["needed"] > 1:
            description += (
                f"; {approvals['needed']} distinct operators must approve, approved so far "
                f"by {', '.join(approvals['given']) or 'no one'}"
            )
        if "refused" in asked:
            description += f". The last decision did not count: {asked['refused']}"
        if self.interrupt_mode == "per_call":
            return {"type": "tool_approval", "tool_call_id": call.get("id"),
                    "name": call["name"], "args": asked["args"], "description": description,
                    "poimen": asked}
        return {
            "action_requests": [
                {"name": call["name"], "args": asked["args"], "description": description}
            ],
            "review_configs": [{"action_name": call["name"], "allowed_decisions": _ALLOWED}],
            "poimen": asked,
        }

    @staticmethod
    def _noted(
        result: ToolMessage | Command[Any], edited: dict[str, Any] | None
    ) -> ToolMessage | Command[Any]:
        """Tell the model that an approver replaced its call's arguments, and with what."""
        if edited is None or not isinstance(result, ToolMessage):
            return result
        note = (
            "An approver edited this call before it ran: it ran with the arguments "
            f"{json.dumps(edited, sort_keys=True)}, not yours. Do not make your call again."
        )
        return result.model_copy(update={"content": f"{note}\n\n{result.content}"})



def _decision(name: str, answer: Any) -> dict[str, Any]:
    """LangChain's decision (alone, or the one of ``{"decisions": [...]}``) as poimen's."""
    if isinstance(answer, Mapping) and "decisions" in answer:
        decisions = answer["decisions"]
        if not isinstance(decisions, list) or len(decisions) != 1:
            raise OperatorInputError(
                f"the approval of {name!r} takes one decision, not {decisions!r}",
                field="decisions",
            )
        answer = decisions[0]
    if not isinstance(answer, Mapping):
        raise OperatorInputError(
            f"a decision is a mapping with 'type' and 'operator', not {answer!r}", field="type"
        )
    kind = answer.get("type")
    who = {"operator": answer.get("operator"), "reason": answer.get("reason")}
    if kind == "approve":
        return {"decision": "approve", **who}
    if kind == "reject":
        return {"decision": "reject", "operator": who["operator"],
                "reason": answer.get("message") or who["reason"]}
    if kind == "edit":
        action = answer.get("edited_action")
        if not isinstance(action, Mapping) or action.get("name", name) != name:
            raise OperatorInputError(
                f"an edit of {name!r} gives 'edited_action' with the same tool's 'name' and "
                f"the edited 'args', not {action!r}",
                field="edited_action",
            )
        return {"decision": "edit", **who, "args": action.get("args")}
    raise OperatorInputError(
        f"a poimen tool's call is approved, edited or rejected: decision type must be "
        f"{', '.join(map(repr, _ALLOWED))}, not {kind!r}",
        field="type",
    )
