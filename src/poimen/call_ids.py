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

**Undo calls** (`Kernel.undo`, docs/undo.md) have call ids of their own, derived from the
original's: the first undo of call id C is ``undo/C``, a later one (after an undo that had no
effect) ``undo#2/C``, ``undo#3/C``; a C too long to carry is replaced by
``sha256:<hex of C>``. **Edited calls** (an approver changed the arguments, docs/approvals.md)
are ``edit/C``. Call ids starting with ``undo/``, ``undo#<n>/`` or ``edit/`` are poimen's: an
application's own call ids must not.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Mapping
from typing import Any

from poimen._core.keys import MAX_CALL_ID_BYTES, args_digest, encode_args
from poimen.errors import ArgumentError, PoimenError

__all__ = [
    "CallIds",
    "derived",
    "edit_of",
    "framework_id",
    "is_edit",
    "is_undo",
    "original_of",
    "scope_for",
    "scope_of",
    "undo_of",
]


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


def scope_for(
    call_id: str, tool: str, args: Mapping[str, Any], given: object, coalesce: bool
) -> str | None:
    """The scope in which an identical unsettled call answers this one (`Kernel.call`):
    `given`, else the scope of a rule-2 call id of this call; None for a tool registered
    with ``coalesce=False`` and for poimen's own undo and edited calls."""
    if given is not None and (not isinstance(given, str) or not given):
        raise ArgumentError(
            f"scope must be a non-empty string or None, not {given!r}", argument="scope"
        )
    reserved = call_id.startswith(("undo", "edit/")) and (is_undo(call_id) or is_edit(call_id))
    if not coalesce or reserved:
        return None
    if isinstance(given, str):
        return given
    # Only a call id naming this tool can be a rule-2 id of the call: any other is spared
    # scope_of's second encoding and hash of the arguments (40k instructions a call).
    return scope_of(call_id, tool, args) if f"/{tool}/" in call_id else None


def scope_of(call_id: str, tool: str, args: Mapping[str, Any]) -> str | None:
    """The scope of `call_id` if it is a rule-2 id of this very call (this tool, these
    arguments), else None: how `Kernel.call` finds the scope of a call made with `derived`
    or `CallIds` (docs/design.md section 4)."""
    _, text = encode_args(args)
    tail = f"/{tool}/{args_digest(text)[:16]}/"
    head, sep, occurrence = call_id.rpartition(tail)
    if not sep or not head or not (occurrence.isascii() and occurrence.isdigit()) or occurrence.startswith("0"):
        return None
    return head


class CallIds:
    """Rule 2 for one run: each (tool, arguments) gets occurrence 1, 2, ... in call order.

    Make one per run with a scope that outlives the process (a conversation or session id),
    and make it again, with the same scope, when the run restarts. Tell it what each call
    was answered (`answered`): a Pending or Indeterminate answer is not a result, so the
    next identical call is the same call again, never a new one."""

    def __init__(self, scope: str) -> None:
        self.scope = _check_scope(scope)
        self._seen: dict[tuple[str, str], int] = {}
        self._back: dict[tuple[str, str], set[int]] = {}  # occurrences that got no result
        self._issued: dict[str, tuple[tuple[str, str], int]] = {}
        self._lock = threading.Lock()

    def next(self, tool: str, args: Mapping[str, Any]) -> str:
        """The call id of the next call of `tool` with these arguments in this run."""
        _, text = encode_args(args)
        key = (tool, text)
        with self._lock:
            back = self._back.get(key)
            if back:
                n = min(back)
                back.discard(n)
            else:
                n = self._seen.get(key, 0) + 1
                self._seen[key] = n
            call_id = derived(self.scope, tool, args, n)
            self._issued[call_id] = (key, n)
        return call_id

    def answered(self, call_id: str, outcome: Any) -> None:
        """What the call `call_id` (from `next`) was answered. Pending or Indeterminate: no
        result, so the next identical call gets this call id again."""
        if getattr(outcome, "terminal", True):
            return
        with self._lock:
            issued = self._issued.get(call_id)
            if issued is not None:
                self._back.setdefault(issued[0], set()).add(issued[1])


_UNDO = re.compile(r"undo(?:#[1-9][0-9]*)?/")


def undo_of(call_id: str, attempt: int = 1) -> str:
    """The call id of the `attempt`-th undo of the call `call_id`."""
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise PoimenError(f"attempt must be a whole number from 1, not {attempt!r}")
    return _under("undo/" if attempt == 1 else f"undo#{attempt}/", call_id)


def edit_of(call_id: str) -> str:
    """The call id of the call an approver made of `call_id` by editing its arguments
    (docs/approvals.md): ``edit/<call id>``, shortened like an undo's."""
    return _under("edit/", call_id)


def is_edit(call_id: str) -> bool:
    """Whether `call_id` is an edited call's (``edit/...``)."""
    return call_id.startswith("edit/")


def _under(head: str, call_id: str) -> str:
    out = head + call_id
    if len(out.encode("utf-8", "surrogatepass")) > MAX_CALL_ID_BYTES:
        digest = hashlib.sha256(call_id.encode("utf-8", "surrogatepass")).hexdigest()
        out = f"{head}sha256:{digest}"
    return out


def is_undo(call_id: str) -> bool:
    """Whether `call_id` is an undo's (``undo/...``, ``undo#<n>/...``)."""
    return _UNDO.match(call_id) is not None


def original_of(call_id: str) -> str | None:
    """The call id an undo call id undoes, or None (not an undo's, or shortened to a hash)."""
    m = _UNDO.match(call_id)
    if m is None:
        return None
    rest = call_id[m.end() :]
    return None if rest.startswith("sha256:") and len(rest) == 71 else rest
