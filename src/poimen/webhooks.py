"""What a webhook receiver needs to check poimen's notifications (docs/resolve-indeterminate.md).

They are signed as Standard Webhooks: ``webhook-id``, ``webhook-timestamp`` and
``webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">``, so any Standard
Webhooks library verifies them; `verify` does it here.
"""

from __future__ import annotations

from poimen._engine.notify import (
    DELIVERY_HEADER,
    ID_HEADER,
    SECRET_PREFIX,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WebhookDeliveryError,
    new_secret,
    sign,
    verify,
    verify_signature,
)

__all__ = [
    "DELIVERY_HEADER",
    "ID_HEADER",
    "SECRET_PREFIX",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "WebhookDeliveryError",
    "new_secret",
    "sign",
    "verify",
    "verify_signature",
]
