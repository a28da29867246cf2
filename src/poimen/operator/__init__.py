"""The operator path from Python: what `poimen` (the CLI) and the console call, over any store
(`poimen.store.open_store(url)`). See docs/resolve-indeterminate.md."""

from __future__ import annotations

from poimen.operator._ops import (
    Identity,
    IntentDetail,
    OperatorInputError,
    Status,
    abandon,
    audit,
    decide_approval,
    find,
    list_intents,
    redact,
    resolve,
    search,
    show,
    status,
)
from poimen.operator._prune import MIN_AGE, PruneReport, prune, read_archive

__all__ = [
    "MIN_AGE",
    "Identity",
    "IntentDetail",
    "OperatorInputError",
    "PruneReport",
    "Status",
    "abandon",
    "audit",
    "decide_approval",
    "find",
    "list_intents",
    "prune",
    "read_archive",
    "redact",
    "resolve",
    "search",
    "show",
    "status",
]
