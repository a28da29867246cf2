"""What the call protocol (`poimen._engine.protocol`) yields and keeps beside the log: the steps its
generators ask the runners to do, how one invocation ended, a run's own state, and the set of
intents a kernel holds."""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from poimen._core.intents import Intent
from poimen._core.slots import slot_init

if TYPE_CHECKING:
    from poimen._core.tools import Tool

T = TypeVar("T")

# Steps a protocol yields.


@dataclass(frozen=True, slots=True)
class Block:
    """A blocking store call; `afn` is the store's own async form of it, if it has one."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    afn: Callable[..., Awaitable[Any]] | None = None
    kw: dict[str, Any] = field(default_factory=dict)


@slot_init
@dataclass(frozen=True, slots=True)
class Invoke:
    tool: Tool
    intent: Intent
    kwargs: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Lookup:
    """Ask whether a request landed: a Queryable tool's provider about `request_id`, or a
    Transactional tool's marker table about `intent`."""

    tool: Tool
    request_id: str
    intent: Intent | None = None


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


Step = Block | Invoke | Lookup | Sleep
Steps = Generator[Step, Any, T]


@slot_init
@dataclass(frozen=True, slots=True)
class Run:
    """How one invocation of a tool ended; `reason` says why one ended "indeterminate" (an
    operator decides at once: a denial or refused send after a write, a refusal after an
    attempt whose outcome is unknown). "committed": completed, its outcome already committed
    with the tool's own transaction (a Transactional tool on the log's database)."""

    kind: Literal["completed", "committed", "failed", "unknown", "not_sent", "indeterminate"]
    value: Any = None
    error: str | None = None
    reason: str | None = None


@dataclass(slots=True)
class CallState:
    """What one protocol run knows beyond the log: when it began, and whether its caller
    was cancelled (then it only settles what already ran)."""

    began: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    runs: int = 0  # invocations so far: back-off applies between this run's own attempts


class Holds:
    """The intents this kernel drives, from before their dispatch commit until nothing of
    them runs any more. A held intent is never claimable by this kernel, and its lease is
    renewed."""

    __slots__ = ("_ids", "_lock")

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def take(self, intent_id: str) -> bool:
        with self._lock:
            if intent_id in self._ids:
                return False
            self._ids.add(intent_id)
            return True

    def drop(self, intent_id: str) -> None:
        with self._lock:
            self._ids.discard(intent_id)

    def __contains__(self, intent_id: object) -> bool:
        return intent_id in self._ids

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._ids)

    def reset(self) -> None:
        """In a forked child: the parent's calls are not ours, and its lock may be held."""
        self._ids = set()
        self._lock = threading.Lock()
