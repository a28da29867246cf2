"""What a webhook receiver needs to check poimen's notifications (docs/resolve-indeterminate.md):
the headers, and the signature over timestamp and body."""

from __future__ import annotations

from poimen._notify import (
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WebhookDeliveryError,
    sign,
    verify_signature,
)

__all__ = [
    "DELIVERY_HEADER",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "WebhookDeliveryError",
    "sign",
    "verify_signature",
]
