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
(a step too) returns the decision: see docs/integrations/dbos.md.
"""

from __future__ import annotations

from typing import Any

from poimen.errors import MissingExtraError

try:
    from dbos import DBOS
except ImportError as exc:  # the extra is missing: say which one
    raise MissingExtraError.of("poimen.integrations.dbos", "dbos", exc) from exc

from poimen import Kernel, call_ids
from poimen.errors import PoimenError
from poimen.integrations._outcomes import value_or_raise

__all__ = ["DbosStep", "dbos_step", "step_call_id"]


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

        self._call = DBOS.step(name=self.name)(call)
        self._wait = DBOS.step(name=f"{self.name}:resume")(wait)

    def __call__(self, **args: Any) -> Any:
        return self._call(**args)

    def resume(self, call_id: str, timeout: float | None = None) -> Any:
        """Wait (as a DBOS step) until the call is settled, an operator's decision included;
        then its result, or the same errors as a call. `timeout` in seconds; None waits on."""
        return self._wait(call_id, timeout)


def dbos_step(kernel: Kernel, tool: str, *, name: str | None = None) -> DbosStep:
    """The tool `tool` (an id or a spec name) of `kernel` as a DBOS step named `name`
    (default ``poimen:<tool id>``). Make it before ``DBOS.launch()``."""
    return DbosStep(kernel, tool, name=name)
