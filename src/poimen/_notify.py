"""Operator notifications: a durable outbox, delivered at least once by pluggable notifiers."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from poimen._intents import Intent, Notification
from poimen.store._base import NewNotification, Store

log = logging.getLogger("poimen.notify")


class Notifier(Protocol):
    """Delivers one notification; raises to have it retried later."""

    def notify(self, notification: Notification) -> None: ...


class LogNotifier:
    """The default: a WARNING on the ``poimen.notify`` logger."""

    def notify(self, notification: Notification) -> None:
        log.warning("poimen %s: %s", notification.kind, notification.payload)


class CallbackNotifier:
    """Calls a Python function with each notification."""

    def __init__(self, fn: Callable[[Notification], object]) -> None:
        self._fn = fn

    def notify(self, notification: Notification) -> None:
        self._fn(notification)


def indeterminate_note(intent: Intent, reason: str) -> NewNotification:
    payload = {
        "intent_id": intent.id,
        "call_id": intent.call_id,
        "tool_id": intent.tool_id,
        "effect": intent.effect,
        "reason": reason,
        "created_at": intent.created_at,
    }
    return NewNotification(
        delivery_id=f"{intent.id}:indeterminate",
        kind="indeterminate",
        payload=json.dumps(payload, sort_keys=True),
    )


def deliver(
    store: Store,
    notifiers: Sequence[Notifier],
    *,
    limit: int = 100,
    backoff: float = 1.0,
    max_backoff: float = 300.0,
) -> int:
    """Deliver due notifications; returns how many were delivered.

    A notification is marked delivered only after every notifier accepted it, so a crash
    in between delivers it again: at least once, never zero times.
    """
    delivered = 0
    now = store.now()
    for n in store.due_notifications(now, limit):
        try:
            for notifier in notifiers:
                notifier.notify(n)
        except Exception as exc:  # a notifier's failure is retried, never lost
            delay = min(max_backoff, backoff * 2 ** min(n.attempts, 16))
            store.mark_delivery_failed(n.id, f"{type(exc).__name__}: {exc}", now + delay)
            log.warning("notification %s failed, retry in %.1fs: %s", n.delivery_id, delay, exc)
            continue
        store.mark_delivered(n.id, store.now())
        delivered += 1
    return delivered
