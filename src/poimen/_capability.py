"""The context the kernel hands every tool: the kernel-derived key or request id."""

from __future__ import annotations


class ToolContext:
    """What a tool receives as its first argument. Read-only: a tool cannot set its own key."""

    __slots__ = ("_attempt", "_call_id", "_intent_id", "_key", "_request_id", "_tool_id")

    def __init__(
        self,
        *,
        tool_id: str,
        intent_id: str,
        call_id: str,
        attempt: int,
        key: str | None,
        request_id: str | None,
    ) -> None:
        self._tool_id = tool_id
        self._intent_id = intent_id
        self._call_id = call_id
        self._attempt = attempt
        self._key = key
        self._request_id = request_id

    @property
    def tool_id(self) -> str:
        return self._tool_id

    @property
    def intent_id(self) -> str:
        return self._intent_id

    @property
    def call_id(self) -> str:
        return self._call_id

    @property
    def attempt(self) -> int:
        return self._attempt

    @property
    def key(self) -> str | None:
        """The kernel-derived idempotency key (Idempotent tools only)."""
        return self._key

    @property
    def request_id(self) -> str | None:
        """The kernel-minted request id (Queryable tools only)."""
        return self._request_id

    def __repr__(self) -> str:
        return (
            f"ToolContext(tool_id={self._tool_id!r}, intent_id={self._intent_id!r}, "
            f"attempt={self._attempt}, key={self._key!r}, request_id={self._request_id!r})"
        )
