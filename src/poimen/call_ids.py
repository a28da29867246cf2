"""Call ids that survive a restart.

A call id is how poimen knows that a call it sees now is one it has seen before. It must be
the same when an agent that was killed runs again and makes the same call. Two rules:

1. **The framework persisted the model's tool call before running it** (LangGraph with a
   checkpointer, a DBOS workflow step, a Temporal activity): its id survives the restart. Use
   `framework_id(scope, id)`: the scope (thread id, workflow id) keeps ids of different runs
   apart, since frameworks number calls per run.
2. **It did not** (PydanticAI, the OpenAI Agents SDK, a plain loop): the restarted run asks
   the model again and gets new tool-call ids, so they cannot be used. Use `CallIds(scope)`:
   ``scope/tool/digest of the canonical arguments/occurrence``. The same run (the same scope:
   a conversation or session id you keep) making the same call again gets the same id, so a
   restarted agent that re-issues "send the email to bob" gets the recorded outcome instead of
   a second email; calling it twice on purpose counts occurrences 1 and 2.

What no rule can catch: a re-prompted model that changes the arguments (another wording of the
email body) makes another call, and poimen cannot know it meant the same thing. Keep arguments
that the model may reword out of what must be deduplicated (an Idempotent key over the
recipient and an order id, say) or use rule 1.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from poimen._keys import args_digest, encode_args
from poimen.errors import PoimenError

__all__ = ["CallIds", "derived", "framework_id"]


def _check_scope(scope: object) -> str:
    if not isinstance(scope, str) or not scope:
        raise PoimenError(f"a call-id scope must be a non-empty string, not {scope!r}", field="scope")
    return scope


def framework_id(scope: str, call_id: str) -> str:
    """Rule 1: the id a framework persisted before running the call, within its run."""
    if not isinstance(call_id, str) or not call_id:
        raise PoimenError(f"the framework's call id must be a non-empty string, not {call_id!r}")
    return f"{_check_scope(scope)}/{call_id}"


def derived(scope: str, tool: str, args: Mapping[str, Any], occurrence: int = 1) -> str:
    """Rule 2: ``scope/tool/digest/occurrence``; the digest is over the canonical arguments,
    so key order and spacing never matter."""
    if isinstance(occurrence, bool) or not isinstance(occurrence, int) or occurrence < 1:
        raise PoimenError(f"occurrence must be a whole number from 1, not {occurrence!r}")
    _, text = encode_args(args)
    return f"{_check_scope(scope)}/{tool}/{args_digest(text)[:16]}/{occurrence}"


class CallIds:
    """Rule 2 for one run: each (tool, arguments) gets occurrence 1, 2, ... in call order.

    Make one per run with a scope that outlives the process (a conversation or session id),
    and make it again, with the same scope, when the run restarts."""

    def __init__(self, scope: str) -> None:
        self.scope = _check_scope(scope)
        self._seen: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def next(self, tool: str, args: Mapping[str, Any]) -> str:
        _, text = encode_args(args)
        with self._lock:
            n = self._seen.get((tool, text), 0) + 1
            self._seen[(tool, text)] = n
        return derived(self.scope, tool, args, n)
