"""The tamper-evident audit from Python: what `poimen audit` runs (docs/audit.md).

`verify` walks a log's hash chain and names the first row edited, deleted, inserted or
reordered; `export` writes the chain signed with an Ed25519 key, and `verify_export` checks
that file offline with the public key. Signing needs ``pip install 'poimen[audit]'``.
"""

from __future__ import annotations

from poimen._core.audit import Finding, Head, Report
from poimen.operator._audit import archive_links, verify
from poimen.operator._audit_export import (
    Exported,
    export,
    keygen,
    load_private,
    load_public,
    verify_export,
)

__all__ = [
    "Exported",
    "Finding",
    "Head",
    "Report",
    "archive_links",
    "export",
    "keygen",
    "load_private",
    "load_public",
    "verify",
    "verify_export",
]
