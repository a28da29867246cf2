"""poimen tools as DBOS steps. Needs ``pip install 'poimen[dbos]'``.

::

    send = dbos_step(kernel, "send_email")      # before DBOS.launch()

    @DBOS.workflow()
    def notify(to: str) -> dict:
        return send(to=to, subject="Your invoice")

A DBOS step records its output only after it returns, so DBOS runs a step again when its
process died inside it: an email step killed after sending sends a second email on recovery.
Here the step's call id is the workflow id and the step id (``dbos/<workflow id>/<step id>``),
which DBOS gives the step again when it re-runs it; the re-run finds the call in the log and
answers from it (an Unsafe call whose process died becomes Indeterminate, never a second
send).

The step returns the tool's result. It raises `poimen.errors.ToolCallFailedError` when the call
failed and had no effect, and `poimen.errors.OutcomeUnknownError` when its effect is unknown;
DBOS does not retry either (retries are off). After an operator decides, ``send.resume(call_id)``
(a step too) returns the decision. A call awaiting approval raises `OutcomeUnknownError` with
``reason="awaiting_approval"``; ``send.approval(call_id)`` receives the approvers' decisions
as DBOS messages (`send_decision`), applies them and returns the call's result: see
docs/integrations/dbos.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from poimen.errors import MissingExtraError

try:
    from dbos import DBOS, DBOSClient
except ImportError as exc:  # the extra is missing: say which one
    raise MissingExtraError.of("poimen.integrations.dbos", "dbos", exc) from exc

from poimen import Kernel, call_ids
from poimen.errors import OutcomeUnknownError, PoimenError
from poimen.integrations._outcomes import (
    PENDING_WAIT,
    awaiting,
    request,
    resumed_decision,
    settle_sync,
    value_or_raise,
)

__all__ = ["DbosStep", "dbos_step", "send_decision", "step_call_id"]


def step_call_id() -> str:
    """The call id of the DBOS step running now: ``dbos/<workflow id>/<step id>``."""
    workflow, step = DBOS.workflow_id, DBOS.step_id
    if workflow is None or step is None:
        raise PoimenError(
            "a poimen DBOS step has a call id only inside a DBOS workflow: call it from a "
            "@DBOS.workflow() function; nothing was recorded"
        )
    return call_ids.framework_id(f"dbos/{workflow}", str(step))


class DbosStep:
    """A registered poimen tool as a DBOS step (retries off). Call it with the tool's
    arguments by name; `resume(call_id)` waits for an operator's decision on a call whose
    outcome was unknown."""

    def __init__(self, kernel: Kernel, tool: str, *, name: str | None = None) -> None:
        self.tool_id = kernel.tool_id(tool)
        self.name = name or f"poimen:{self.tool_id}"
        tool_id = self.tool_id

        def call(**args: Any) -> Any:
            call_id = step_call_id()
            scope = f"dbos/{DBOS.workflow_id}"  # an identical unsettled call answers this one
            return value_or_raise(
                kernel.call(tool_id, args, call_id=call_id, scope=scope), call_id
            )

        def wait(call_id: str, timeout: float | None = None) -> Any:
            return value_or_raise(kernel.wait_sync(call_id, timeout=timeout), call_id)

        def decide(call_id: str, decision: Any) -> dict[str, Any]:
            """Apply an approver's decision to the call, if it awaits approval; what is asked
            now: nothing once decided, else the call, its arguments and its approvals (four
            eyes, or after an edit), and why the decision did not count (``refused``)."""
            outcome = kernel.outcome(call_id)
            if outcome is None:
                raise PoimenError(f"no call has the call id {call_id!r}", call_id=call_id)
            refused = None
            if awaiting(outcome):
                refused = resumed_decision(kernel, outcome.intent_id, decision)
                outcome = kernel.outcome(call_id) or outcome
            if not awaiting(outcome):
                return {}
            asked = request(kernel, call_id, tool_id, {}, outcome)
            return asked if refused is None else {**asked, "refused": refused}

        def run(call_id: str) -> Any:
            """The decided call run (by this step, when no other process runs it) and its
            outcome: the result, or the same errors as a call."""
            outcome = kernel.wait_sync(call_id, timeout=0)
            return value_or_raise(settle_sync(kernel, call_id, outcome, PENDING_WAIT), call_id)

        self._call = DBOS.step(name=self.name)(call)
        self._wait = DBOS.step(name=f"{self.name}:resume")(wait)
        self._decide = DBOS.step(name=f"{self.name}:decide")(decide)
        self._run = DBOS.step(name=f"{self.name}:run")(run)

    def __call__(self, **args: Any) -> Any:
        return self._call(**args)

    def resume(self, call_id: str, timeout: float | None = None) -> Any:
        """Wait (as a DBOS step) until the call is settled, an operator's decision included;
        then its result, or the same errors as a call. `timeout` in seconds; None waits on."""
        return self._wait(call_id, timeout)

    def approval(self, call_id: str, *, timeout: float = 86_400.0) -> Any:
        """In the workflow whose call raised `OutcomeUnknownError` with ``reason ==
        "awaiting_approval"``: receive the approvers' decisions (`send_decision`: a DBOS
        message to this workflow, its topic the call id), apply each to the call (a step;
        audited) until it is decided, then run it: its result, or the same errors as a
        call. A four-eyes call waits for a second operator; after an edit the edited call
        runs. `timeout`: seconds to wait for each decision; after it, `OutcomeUnknownError`
        (the call still awaits approval)."""
        while True:
            decision = DBOS.recv(call_id, timeout_seconds=timeout)
            if decision is None:
                raise OutcomeUnknownError(
                    f"call {call_id!r}: no decision came within {timeout} s; it still awaits "
                    "an operator's approval",
                    call_id=call_id, outcome="pending", reason="awaiting_approval",
                )
            if not self._decide(call_id, decision):
                return self._run(call_id)


def send_decision(
    call_id: str, decision: Mapping[str, Any], *, client: DBOSClient | None = None
) -> None:
    """Send an approver's decision on a step's call awaiting approval to its workflow, where
    `DbosStep.approval` applies it: ``{"decision": "approve" | "edit" | "reject", "operator":
    ..., "reason": ..., "args": {...} (edit)}``. From the DBOS application's own process, or
    from another with a `DBOSClient` on its system database (`client`)."""
    workflow, sep, _ = call_id.removeprefix("dbos/").rpartition("/")
    if not call_id.startswith("dbos/") or not sep or not workflow:
        raise PoimenError(f"{call_id!r} is not the call id of a DBOS step", call_id=call_id)
    if client is not None:
        client.send(workflow, dict(decision), topic=call_id)
    else:
        DBOS.send(workflow, dict(decision), topic=call_id)


def dbos_step(kernel: Kernel, tool: str, *, name: str | None = None) -> DbosStep:
    """The tool `tool` (an id or a spec name) of `kernel` as a DBOS step named `name`
    (default ``poimen:<tool id>``). Make it before ``DBOS.launch()``."""
    return DbosStep(kernel, tool, name=name)
