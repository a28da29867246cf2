"""The public exception tree. Every poimen error derives from `PoimenError`."""

from __future__ import annotations

from typing import Any


class PoimenError(Exception):
    """A poimen error."""

    def __init__(self, message: str | None = None, **data: Any) -> None:
        self.data = data
        for name, value in data.items():
            setattr(self, name, value)
        super().__init__(message or (self.__doc__ or type(self).__name__).strip())


class RegistrationError(PoimenError):
    """The tool registration was refused."""


class UnknownToolError(PoimenError):
    """No tool is registered under this id."""


class ArgumentError(PoimenError):
    """The call's arguments were refused before anything was recorded."""


class ArgumentEncodingError(ArgumentError):
    """An argument cannot be encoded canonically."""


class ArgumentTooLargeError(ArgumentError):
    """The encoded arguments exceed the size limit."""


class KeyDerivationError(ArgumentError):
    """The tool's key derivation failed on these arguments."""


class CallIdMismatchError(PoimenError):
    """This call id was recorded with different arguments or another tool."""


class NondeterministicKeyError(RegistrationError):
    """The key derivation is not a pure function of the recorded arguments."""


class StoreError(PoimenError):
    """The intent log could not be read or written."""


class StoreUnavailableError(StoreError):
    """The database cannot be reached."""


class SchemaTooNewError(StoreError):
    """The database schema is newer than this version of poimen knows."""


class NetworkFilesystemError(StoreError):
    """A SQLite log on a network or FUSE filesystem, where locks and fsync cannot be trusted:
    use PostgreSQL to share a log between machines."""


class CorruptRowError(StoreError):
    """A row in the intent log does not decode."""


class IllegalTransitionError(PoimenError):
    """This state change is not allowed by the intent state machine."""


class IntentNotFoundError(PoimenError):
    """No intent has this id."""


class NotIndeterminateError(PoimenError):
    """Only an INDETERMINATE intent can be resolved by an operator."""


class NotDispatchedError(PoimenError):
    """Only a DISPATCHED intent can be abandoned by an operator."""


class ReadOnlyStoreError(StoreError):
    """The intent log was opened read-only: nothing can be written through it."""


class CapabilityDeniedError(PoimenError):
    """The write was denied: it did not carry the kernel's key for this call."""


class SandboxDeniedError(PoimenError):
    """A sandbox kernel (shadow or replay mode) refused this call."""


class DivergenceError(SandboxDeniedError):
    """A replayed call differs from the recording: the recording has no call with this call
    id (`kind="not_in_recording"`), or has it with another tool or other arguments
    (`kind="arguments_changed"`). `call_id`, `tool_id`, `kind` and `difference` (changes of
    the arguments, recording to run, each with its JSON path) say what; nothing was run."""


class DefiniteFailure(Exception):
    """Raised by a tool when the provider definitely refused the effect.

    The call becomes FAILED and is never retried. Any other exception leaves
    the outcome unknown and hands the intent to recovery by its effect class.
    """

    def __init__(self, message: str, *, detail: Any = None) -> None:
        self.detail = detail
        super().__init__(message)


class NotSent(DefiniteFailure):
    """The request never left this process (the connection was refused, the name did not
    resolve): no effect can have happened.

    `ctx.http` raises it when a connection fails before any write of the attempt went out; a
    tool may raise it itself for its own clients. The call is retried in place within its
    `Retry` budget, whatever its class, and becomes FAILED when the budget is spent.
    """


class TransactionControlError(PoimenError):
    """A Transactional tool tried to end its own transaction (commit, rollback, close), or
    used `ctx.tx` after its call ended: poimen commits the transaction, with the call's
    marker, once the tool has returned. `tool_id`, `intent_id`, `action`."""


class TransactionalDatabaseError(PoimenError):
    """A Transactional tool's database cannot be opened, or is not one poimen can use (a
    sqlite3 or psycopg 3 connection). `database` names it, its password masked."""


class WrongRunnerError(PoimenError):
    """This call cannot run here (an async tool through `Kernel.call` inside a running event
    loop: use `await Kernel.acall`)."""


class DuplicateWorkerError(PoimenError):
    """Another live kernel in this process has this worker id; two kernels with one identity
    would take over each other's calls."""


class NotAwaitingApprovalError(PoimenError):
    """Only a call awaiting approval can be approved or rejected."""


class ApprovalExpiredError(NotAwaitingApprovalError):
    """The call's approval window (`approval_ttl`) ended before this decision: it failed
    (`approval_expired`) and nothing was sent."""


class SameApproverError(NotAwaitingApprovalError):
    """The call needs the approval of more than one operator (four eyes) and this operator
    has approved it already: another operator must. `intent_id`, `operator`."""


class ToolCallFailedError(PoimenError):
    """A tool call failed and had no effect (or an operator decided it did not land).

    Raised where a framework expects an exception rather than an outcome (a DBOS step, a
    Temporal activity); `call_id`, `intent_id` and `error` say which call and why."""


class OutcomeUnknownError(PoimenError):
    """A tool call's effect may or may not have happened (Indeterminate), or it is not settled
    yet (Pending). Do not call it again: an operator decides, then `Kernel.wait(call_id)`
    returns the decision. `call_id`, `intent_id`, `outcome` and `reason` say which call."""


class OperatorsFileError(PoimenError):
    """The console's operators file cannot be read, or a line of it is not ``name:hash``."""


class DuplicateOperatorError(OperatorsFileError):
    """The operators file already has an operator of this name."""


class UnknownOperatorError(OperatorsFileError):
    """The operators file has no operator of this name."""


class MissingExtraError(PoimenError, ImportError):
    """A poimen module needs an optional extra that is not installed."""

    @classmethod
    def of(cls, module: str, extra: str, cause: ImportError) -> MissingExtraError:
        """The error for `module`, which needs ``poimen[extra]``; `cause` says what failed."""
        return cls(
            f"{module} needs the extra {extra}: pip install 'poimen[{extra}]' ({cause})",
            module=module,
            extra=extra,
        )


class ConsoleConfigError(PoimenError):
    """The console cannot start with these options."""


class NondeterministicUndoError(RegistrationError):
    """An undo's argument derivation is not a pure function of the original call's recorded
    arguments and result."""


class UndoError(PoimenError):
    """`Kernel.undo` was refused before anything was undone (a bad scope, an undo tool that is
    not registered)."""


class AlreadyUndoneError(PoimenError):
    """The call was undone already (it has an 'undone' event): no new undo of it is asked
    for. `intent_id` is the call's intent, `undo_intent_id` the undo that reversed it."""

    undo_intent_id: str | None


class ReservedCallIdError(ArgumentError):
    """The call id starts with ``undo/`` or ``undo#<n>/``: those call ids are poimen's own,
    for the undo calls `Kernel.undo` makes."""
