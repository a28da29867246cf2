"""What every integration tells its framework of a call: the text for a model when the
arguments were refused, and an outcome as a framework that runs steps expects it (a value, or
an exception)."""

from __future__ import annotations

from typing import Any

from poimen import Completed, Failed, Indeterminate, Outcome, Pending, Resolved
from poimen.errors import OutcomeUnknownError, ToolCallFailedError


def refusal(error: Exception) -> str:
    """Arguments refused before anything was recorded: the model may correct them."""
    return f"The call was refused and had no effect: {error}. Correct the input and call it again."


def value_or_raise(outcome: Outcome, call_id: str) -> Any:
    """Completed (or resolved as landed): the result. Failed (or resolved as not landed):
    `ToolCallFailedError`. Indeterminate or Pending: `OutcomeUnknownError`, never to be
    retried by the framework."""
    match outcome:
        case Completed(result=result) | Resolved(landed=True, result=result):
            return result
        case Failed(intent_id=intent_id, error=error):
            raise ToolCallFailedError(
                f"call {call_id!r} failed and had no effect: {error}",
                call_id=call_id, intent_id=intent_id, error=error,
            )
        case Resolved(intent_id=intent_id):
            error = "an operator decided that it did not take effect"
            raise ToolCallFailedError(
                f"call {call_id!r}: {error}", call_id=call_id, intent_id=intent_id, error=error
            )
        case Indeterminate(intent_id=intent_id, reason=reason) | Pending(
            intent_id=intent_id, reason=reason
        ):
            kind = type(outcome).__name__.lower()
            raise OutcomeUnknownError(
                f"call {call_id!r} (intent {intent_id}) is {kind} ({reason}): its effect may "
                f"have happened. Do not retry it; an operator decides, then "
                f"kernel.wait({call_id!r}) returns the decision",
                call_id=call_id, intent_id=intent_id, outcome=kind, reason=reason,
            )
    raise TypeError(f"not an outcome: {outcome!r}")
