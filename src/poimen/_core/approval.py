"""When a tool's call waits for an operator's approval (docs/approvals.md): always, or when a
predicate on the recorded arguments says so; and for how long. Pure rules: the store records the
wait, `poimen._approval` applies an edited approval."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from poimen._core.intents import Intent, IntentState
from poimen.errors import ArgumentError, RegistrationError


class ApprovalRule:
    """When a tool's call waits for an operator: always, or when a predicate on the recorded
    arguments says so."""

    __slots__ = ("approvers", "predicate", "ttl")

    def __init__(
        self,
        predicate: Callable[[Mapping[str, Any]], bool] | None,
        ttl: float | None,
        approvers: int = 1,
    ):
        self.predicate = predicate
        self.ttl = ttl
        self.approvers = approvers

    def needed(self, tool_id: str, recorded: Mapping[str, Any]) -> bool:
        if self.predicate is None:
            return True
        try:
            return bool(self.predicate(recorded))
        except Exception as exc:  # nothing is recorded: the caller learns why
            raise ArgumentError(
                f"tool {tool_id!r}: its approval rule raised {type(exc).__name__}: {exc}",
                tool_id=tool_id,
                argument="<requires_approval>",
            ) from exc


def approval_rule(
    tool_id: str, requires: object, ttl: float | None, approvers: object = 1
) -> ApprovalRule | None:
    if ttl is not None and (
        isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0
    ):
        raise RegistrationError(
            f"tool {tool_id!r}: approval_ttl must be a positive number of seconds or None, "
            f"not {ttl!r}",
            tool_id=tool_id,
        )
    if isinstance(approvers, bool) or not isinstance(approvers, int) or approvers < 1:
        raise RegistrationError(
            f"tool {tool_id!r}: approvers must be a whole number from 1, not {approvers!r}",
            tool_id=tool_id,
        )
    if requires is False:
        if approvers > 1:
            raise RegistrationError(
                f"tool {tool_id!r}: approvers needs requires_approval", tool_id=tool_id
            )
        if ttl is not None:
            raise RegistrationError(
                f"tool {tool_id!r}: approval_ttl needs requires_approval", tool_id=tool_id
            )
        return None
    if requires is True:
        return ApprovalRule(None, ttl, approvers)
    if callable(requires):
        return ApprovalRule(requires, ttl, approvers)
    raise RegistrationError(
        f"tool {tool_id!r}: requires_approval must be True, False or a predicate on the "
        f"arguments, not {requires!r}",
        tool_id=tool_id,
    )


def approval_due(intent: Intent, now: float) -> bool:
    """Whether a call awaiting approval is past its window at `now` (it must expire, and no
    decision may dispatch it any more)."""
    return (
        intent.state == IntentState.AWAITING_APPROVAL
        and intent.next_check_at is not None
        and intent.next_check_at <= now
    )
