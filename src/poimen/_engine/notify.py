"""Operator notifications: a durable outbox, delivered at least once by pluggable notifiers.

Each notification is written for the notifiers of the kernel that wrote it, by name (or, if
that kernel had none, for any notifier). A kernel delivers only to its own notifiers and
records each notifier's delivery apart, so one notifier's failure never resends another's,
and a kernel without a notifier a row was written for never marks that row delivered.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import secrets
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import httpx

from poimen._core.backoff import OUTBOX, Backoff
from poimen._core.intents import Intent, IntentState, Notification
from poimen._core.present import redact_url, redact_urls
from poimen._engine.evidence import with_evidence
from poimen.errors import PoimenError
from poimen.store._base import (
    ANY_NOTIFIER,
    NewDispatch,
    NewNotification,
    Store,
    indeterminate_notification,
)

log = logging.getLogger("poimen.notify")


class Notifier(Protocol):
    """Delivers one notification; raises to have it retried later.

    `name` identifies the recipient in the log, across processes and restarts: give one
    recipient the same name everywhere, and different recipients different names.
    """

    name: str

    def notify(self, notification: Notification) -> None:
        """Deliver one notification; raise to have it retried later."""
        ...


class LogNotifier:
    """The default: a WARNING on the ``poimen.notify`` logger."""

    name = "log"

    def notify(self, notification: Notification) -> None:
        """Log the notification as a WARNING on ``poimen.notify``."""
        log.warning("poimen %s: %s", notification.kind, notification.payload)


class CallbackNotifier:
    """Calls a Python function with each notification; named ``callback:<function>``
    unless `name` says otherwise."""

    def __init__(self, fn: Callable[[Notification], object], *, name: str | None = None) -> None:
        self._fn = fn
        self.name = name or f"callback:{getattr(fn, '__qualname__', type(fn).__qualname__)}"

    def notify(self, notification: Notification) -> None:
        """Call the function with the notification; raising has it retried later."""
        self._fn(notification)


def notifier_names(notifiers: Sequence[Notifier]) -> tuple[str, ...]:
    """The notifiers' names, refused when one is missing, reserved or given twice."""
    names: list[str] = []
    for n in notifiers:
        name = getattr(n, "name", None)
        if not isinstance(name, str) or not name or name == ANY_NOTIFIER:
            raise PoimenError(
                f"notifier {type(n).__name__} needs a name (a non-empty string, not "
                f"{ANY_NOTIFIER!r})",
                field="notifiers",
            )
        if name in names:
            raise PoimenError(
                f"two notifiers are named {name!r}: pass name= to tell them apart",
                field="notifiers",
                name=name,
            )
        names.append(name)
    return tuple(names)


def indeterminate_note(
    intent: Intent, reason: str, notifiers: Sequence[Notifier] = ()
) -> NewNotification:
    return indeterminate_notification(intent, reason, notifier_names(notifiers))


def approval_note(
    d: NewDispatch, expires_at: float | None, notifiers: Sequence[Notifier] = ()
) -> NewNotification:
    """An operator is asked to approve (or reject) a call before it is dispatched."""
    payload = {
        "intent_id": d.intent_id,
        "call_id": d.call_id,
        "tool_id": d.tool_id,
        "effect": d.effect,
        "reason": "awaiting_approval",
        "created_at": d.now,
        "expires_at": expires_at,
    }
    return NewNotification(
        delivery_id=f"{d.intent_id}:approval",
        kind="approval_requested",
        payload=json.dumps(payload, sort_keys=True),
        notifiers=notifier_names(notifiers),
    )


def deliver(
    store: Store,
    notifiers: Sequence[Notifier],
    *,
    limit: int = 100,
    backoff: Backoff = OUTBOX,
    hold: Collection[str] = (),
    escalate_to: Sequence[Notifier] = (),
) -> int:
    """Deliver what is due to these notifiers; returns how many deliveries were made.

    Each notifier's delivery is marked only after it accepted the notification, so a crash
    in between delivers it again: at least once, never zero times. A notification written
    for any notifier is delivered to all of these, and marked once all of them accepted it.
    Without notifiers nothing is delivered and nothing is marked. The notifications of the
    intents in `hold` (their evidence is being gathered) wait for a later round; each goes
    out with its intent's latest evidence. `escalate_to` deliver what was written for them
    by name (overdue calls), never what was written for any notifier.
    """
    primary = dict(zip(notifier_names(notifiers), notifiers, strict=True))
    by_name = dict(zip(notifier_names([*notifiers, *escalate_to]), [*notifiers, *escalate_to],
                       strict=True))
    if not by_name:
        return 0
    delivered = 0
    now = store.now()
    names = [*by_name, *([ANY_NOTIFIER] if primary else [])]
    for n, d in store.due_deliveries(names, now, limit):
        if n.intent_id in hold:
            continue
        targets = list(primary.values()) if d.notifier == ANY_NOTIFIER else [by_name[d.notifier]]
        n = with_evidence(store, n)
        try:
            for notifier in targets:
                notifier.notify(n)
        except Exception as exc:  # a notifier's failure is retried, never lost
            delay = backoff.delay(d.attempts + 1)
            # An error text may quote a webhook's URL, which is its credential.
            error = redact_urls(f"{type(exc).__name__}: {exc}")
            store.mark_delivery_failed(n.id, d.notifier, error, now + delay)
            log.warning(
                "notification %s to %s failed, retry in %.1fs: %s",
                n.delivery_id,
                d.notifier,
                delay,
                redact_urls(str(exc)),
            )
            continue
        store.mark_delivered(n.id, d.notifier, store.now())
        delivered += 1
    return delivered


# Webhooks, signed as Standard Webhooks (https://www.standardwebhooks.com): receivers verify
# them with that project's libraries, in any language.

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
#: The delivery id travels as the message id: the same on every retry, the receiver's dedupe key.
DELIVERY_HEADER = ID_HEADER
#: A secret in the Standard Webhooks form: this prefix, then the key in base64.
SECRET_PREFIX = "whsec_"


class WebhookDeliveryError(PoimenError):
    """The webhook receiver did not accept the notification; the outbox retries it."""


def _secret_bytes(secret: str | bytes) -> bytes:
    """The HMAC key: ``whsec_<base64>`` decoded (as Standard Webhooks libraries do), any
    other text as its UTF-8 bytes, bytes as they are."""
    if isinstance(secret, str) and secret.startswith(SECRET_PREFIX):
        try:
            raw = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
        except ValueError:
            raise PoimenError(
                f"a webhook secret starting {SECRET_PREFIX} must be base64 after it",
                field="secret",
            ) from None
    else:
        raw = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise PoimenError("a webhook needs a non-empty shared secret", field="secret")
    return raw


def new_secret() -> str:
    """A fresh random secret in the Standard Webhooks form (``whsec_`` and 32 bytes)."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode("ascii")


def sign(secret: str | bytes, msg_id: str, timestamp: str, body: bytes) -> str:
    """``v1,<base64>``: HMAC-SHA256 with the secret's key over ``id.timestamp.body``."""
    signed = msg_id.encode("utf-8") + b"." + timestamp.encode("ascii") + b"." + body
    mac = hmac.new(_secret_bytes(secret), signed, "sha256").digest()
    return "v1," + base64.b64encode(mac).decode("ascii")


def verify_signature(
    secret: str | bytes,
    msg_id: str,
    timestamp: str,
    body: bytes,
    signature: str,
    *,
    tolerance: float = 300.0,
    now: float | None = None,
) -> bool:
    """What a receiver checks: one of the space-separated ``v1,`` signatures matches and the
    timestamp is recent, in the past or the future (no replay)."""
    # Headers are attacker-controlled: anything but a few ASCII digits is simply "no" (a
    # long digit string would make int() itself refuse).
    if not (
        isinstance(timestamp, str)
        and timestamp.isascii()
        and timestamp.isdigit()
        and len(timestamp) <= 15
    ):
        return False
    if not (isinstance(msg_id, str) and isinstance(signature, str) and isinstance(body, bytes)):
        return False
    if abs((time.time() if now is None else now) - int(timestamp)) > tolerance:
        return False
    expected = sign(secret, msg_id, timestamp, body).encode()
    given = [s.encode("utf-8", "replace") for s in signature.split(" ") if s.startswith("v1,")]
    return any(hmac.compare_digest(expected, s) for s in given)


def verify(
    secret: str | bytes,
    headers: Mapping[str, str],
    body: bytes,
    *,
    tolerance: float = 300.0,
    now: float | None = None,
) -> bool:
    """`verify_signature` over a request's headers (any case) and raw body."""
    lower = {str(k).lower(): v for k, v in headers.items()}
    parts = [lower.get(h) for h in (ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER)]
    if not all(isinstance(p, str) for p in parts):
        return False
    msg_id, timestamp, signature = cast("list[str]", parts)
    return verify_signature(
        secret, msg_id, timestamp, body, signature, tolerance=tolerance, now=now
    )


class WebhookNotifier:
    """POSTs each notification as JSON to `url`, signed with the shared `secret`.

    Signed as Standard Webhooks: ``webhook-id`` (the delivery id; the same on every retry,
    so a receiver dedupes on it), ``webhook-timestamp`` (unix seconds) and
    ``webhook-signature`` (see `sign`). Anything but a 2xx answer raises, and the durable
    outbox retries with back-off: delivery is at least once.
    `console_url` (the console's base URL) adds a link to the intent's page.

    The URL is often the credential itself (a Slack-style path, a ``?token=``): poimen shows
    and stores only its scheme and host. The notifier is named ``webhook:<host>`` unless
    `name` says otherwise (two webhooks on one host need names).
    """

    def __init__(
        self,
        url: str,
        *,
        secret: str | bytes,
        console_url: str | None = None,
        timeout: float = 10.0,
        name: str | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise PoimenError(
                f"webhook url {redact_url(url)} must be http:// or https://", field="url"
            )
        self.url = url
        self.shown_url = redact_url(url)
        self.name = name or f"webhook:{urlsplit(url).netloc.rpartition('@')[2]}"
        self._secret = _secret_bytes(secret)
        self.console_url = console_url.rstrip("/") if console_url else None
        self._client = httpx.Client(timeout=timeout)

    def body(self, notification: Notification, now: float) -> dict[str, Any]:
        """The JSON body sent for `notification` at time `now`."""
        payload = json.loads(notification.payload)
        intent_id = payload.get("intent_id", notification.intent_id)
        created = payload.get("created_at")
        return {
            "delivery_id": notification.delivery_id,
            "kind": notification.kind,
            "intent": {
                "id": intent_id,
                "call_id": payload.get("call_id"),
                "tool_id": payload.get("tool_id"),
                "effect": payload.get("effect"),
                "reason": payload.get("reason"),
                "created_at": created,
                "age_s": None if created is None else round(now - float(created), 3),
                "link": f"{self.console_url}/intents/{intent_id}" if self.console_url else None,
            },
            "reminder": payload.get("reminder"),
            "audit_head": payload.get("audit_head"),  # kind audit_head: the chain's head
            "evidence": payload.get("evidence"),
            "queued_at": notification.created_at,
            "sent_at": now,
        }

    def notify(self, notification: Notification) -> None:
        """POST the notification, signed; anything but a 2xx answer raises (the outbox
        retries)."""
        now = time.time()
        body = json.dumps(self.body(notification, now), sort_keys=True).encode("utf-8")
        ts = str(int(now))
        headers = {
            "Content-Type": "application/json",
            ID_HEADER: notification.delivery_id,
            TIMESTAMP_HEADER: ts,
            SIGNATURE_HEADER: sign(self._secret, notification.delivery_id, ts, body),
        }
        try:
            r = self._client.post(self.url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            raise WebhookDeliveryError(
                f"webhook {self.shown_url} unreachable: {redact_urls(str(exc))}",
                delivery_id=notification.delivery_id,
            ) from None  # the cause's text may hold the URL
        if not 200 <= r.status_code < 300:
            raise WebhookDeliveryError(
                f"webhook {self.shown_url} answered {r.status_code}",
                delivery_id=notification.delivery_id,
                status=r.status_code,
            )

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()


# Re-notification of Indeterminate intents nobody has resolved yet.

REMINDER = "indeterminate_reminder"


def reminder_note(
    intent: Intent, number: int, now: float, notifiers: Sequence[Notifier] = ()
) -> NewNotification:
    payload = {
        "intent_id": intent.id,
        "call_id": intent.call_id,
        "tool_id": intent.tool_id,
        "effect": intent.effect,
        "reason": intent.reason,
        "created_at": intent.created_at,
        "reminder": number,
        "open_for_s": now - intent.updated_at,
    }
    return NewNotification(
        # Numbered, so two processes re-notifying at once add one row, not two.
        delivery_id=f"{intent.id}:{REMINDER}:{number}",
        kind=REMINDER,
        payload=json.dumps(payload, sort_keys=True),
        notifiers=notifier_names(notifiers),
    )


def renotify(
    store: Store, *, after: float, notifiers: Sequence[Notifier] = (), limit: int = 10_000
) -> int:
    """Queue a reminder for each INDETERMINATE intent whose latest notification is older
    than `after` seconds; returns how many were queued. Resolved intents get none."""
    if not after > 0:
        raise PoimenError(f"renotify after must be positive, not {after!r}", field="after")
    now = store.now()
    queued = 0
    for intent in store.list_intents(state=IntentState.INDETERMINATE, limit=limit):
        notes = store.notifications(intent.id)
        last = max((n.created_at for n in notes), default=intent.updated_at)
        if now - last < after:
            continue
        number = sum(1 for n in notes if n.kind == REMINDER) + 1
        note = reminder_note(intent, number, now, notifiers)
        if store.add_notification(intent.id, note, now):
            queued += 1
    return queued


class Renotifier:
    """Runs `renotify` at most every `every` seconds (default: a quarter of `after`, <= 60s)."""

    def __init__(self, after: float, *, every: float | None = None) -> None:
        if not after > 0:
            raise PoimenError(f"renotify_after must be positive, not {after!r}", field="after")
        self.after = after
        self.every = every if every is not None else min(after / 4, 60.0)
        self._next = 0.0

    def maybe_run(self, store: Store, notifiers: Sequence[Notifier] = ()) -> int:
        mono = time.monotonic()
        if mono < self._next:
            return 0
        self._next = mono + self.every
        return renotify(store, after=self.after, notifiers=notifiers)
