"""poimen: crash-safe tool calls for AI agents."""

from poimen._capability.context import Sink, ToolContext
from poimen._capability.handles import AsyncHttpHandle, HttpHandle, SinkHandle
from poimen._capability.tx import Tx, TxCursor
from poimen._core.effects import (
    EffectClass,
    Idempotent,
    KeyDerivation,
    Landed,
    LookupAnswer,
    NotLanded,
    Queryable,
    ReadOnly,
    RequestIdLookup,
    Transactional,
    Unknown,
    Unsafe,
)
from poimen._core.intents import (
    Attempt,
    Completed,
    Denial,
    Event,
    Failed,
    Indeterminate,
    Intent,
    IntentState,
    Notification,
    Outcome,
    Pending,
    RecoveryReport,
    Resolved,
)
from poimen._core.keys import MAX_ARGS_BYTES, MAX_CALL_ID_BYTES, MAX_NESTING, MAX_TOOL_ID_BYTES
from poimen._core.retry import Retry
from poimen._core.spec import ToolSpec
from poimen._core.tools import Caps, ToolRegistration
from poimen._engine.evidence import Evidence, Fact, RecordedCall, Suggestion
from poimen._engine.notify import CallbackNotifier, LogNotifier, Notifier, WebhookNotifier
from poimen._kernel import Kernel
from poimen._tool_handle import ToolHandle
from poimen._undo import UndoReport, UndoStep
from poimen.errors import DefiniteFailure, NotSent

__all__ = [
    "MAX_ARGS_BYTES",
    "MAX_CALL_ID_BYTES",
    "MAX_NESTING",
    "MAX_TOOL_ID_BYTES",
    "AsyncHttpHandle",
    "Attempt",
    "CallbackNotifier",
    "Caps",
    "Completed",
    "DefiniteFailure",
    "Denial",
    "EffectClass",
    "Event",
    "Evidence",
    "Fact",
    "Failed",
    "HttpHandle",
    "Idempotent",
    "Indeterminate",
    "Intent",
    "IntentState",
    "Kernel",
    "KeyDerivation",
    "Landed",
    "LogNotifier",
    "LookupAnswer",
    "NotLanded",
    "NotSent",
    "Notification",
    "Notifier",
    "Outcome",
    "Pending",
    "Queryable",
    "ReadOnly",
    "RecordedCall",
    "RecoveryReport",
    "RequestIdLookup",
    "Resolved",
    "Retry",
    "Sink",
    "SinkHandle",
    "Suggestion",
    "ToolContext",
    "ToolHandle",
    "ToolRegistration",
    "ToolSpec",
    "Transactional",
    "Tx",
    "TxCursor",
    "UndoReport",
    "UndoStep",
    "Unknown",
    "Unsafe",
    "WebhookNotifier",
]
