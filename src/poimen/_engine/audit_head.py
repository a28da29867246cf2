"""Publishing the audit chain's head (docs/audit.md): what someone with write access to the
database cannot take back. The chain shows a row changed after the rows that follow it; a
rewrite of the whole chain, hashes included, shows only against a head kept elsewhere
(`poimen audit verify --head`). A kernel with ``audit_head_every`` publishes the head on a
duty of its own, each time it moved: as a log line (logger ``poimen.audit``), to its
notifiers (a webhook's body carries ``audit_head``), and to its observers
(`poimen.events.AuditHeadEvent`; the OpenTelemetry observer makes it a span event).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from poimen._core.audit import Head
from poimen._core.intents import Notification
from poimen._engine.notify import LogNotifier
from poimen.errors import PoimenError
from poimen.events import AuditHeadEvent

log = logging.getLogger("poimen.audit")
#: The notification kind a published head goes out as.
KIND = "audit_head"


def check_every(every: float | None) -> None:
    """``audit_head_every``: None, or a positive number of seconds."""
    if every is None:
        return
    if isinstance(every, bool) or not isinstance(every, int | float) or not (
        math.isfinite(every) and every > 0
    ):
        raise PoimenError(
            f"audit_head_every must be a positive number of seconds, not {every!r}",
            field="audit_head_every",
        )


def head_note(head: Head, now: float) -> Notification:
    """The notification of a published head (sent directly, never queued in the outbox: a
    later head supersedes it)."""
    payload = {"audit_head": {"log_id": head.log_id, "seq": head.seq, "hash": head.hash,
                              "at": now}}
    return Notification(
        id=0,
        delivery_id=f"{KIND}:{head.log_id}:{head.seq}",
        intent_id="",
        kind=KIND,
        payload=json.dumps(payload, sort_keys=True),
        created_at=now,
        delivered_at=None,
        attempts=0,
        next_attempt_at=now,
        last_error=None,
    )


class HeadPublisher:
    """Publishes a log's head when it moved since the last time."""

    def __init__(
        self,
        store: Any,
        notifiers: Callable[[], Sequence[Any]],
        emit: Callable[[AuditHeadEvent], None],
        worker_id: Callable[[], str],
    ) -> None:
        self._store = store
        self._notifiers = notifiers
        self._emit = emit
        self._worker_id = worker_id
        self._last: Head | None = None
        self._lock = threading.Lock()

    def publish(self, *, force: bool = False) -> Head | None:
        """Publish the head if it moved (or `force`); the head published, or None."""
        with self._lock:
            head: Head | None = self._store.audit_head()
            if head is None or (head == self._last and not force):
                return None
            self._last = head
        now = self._store.now()
        log.info("poimen audit chain head: log %s position %d hash %s (%s)", head.log_id,
                 head.seq, head.hash, head.token(),
                 extra={"poimen": {"log_id": head.log_id, "seq": head.seq, "hash": head.hash}})
        note = head_note(head, now)
        for n in self._notifiers():
            if isinstance(n, LogNotifier):  # the log line above is its publication
                continue
            try:
                n.notify(note)
            except Exception as exc:  # the next round publishes again
                log.warning("poimen audit head not delivered to %s: %s",
                            getattr(n, "name", type(n).__name__), exc)
        self._emit(AuditHeadEvent(at=time.time(), worker_id=self._worker_id(),
                                  log_id=head.log_id, seq=head.seq, hash=head.hash))
        return head
