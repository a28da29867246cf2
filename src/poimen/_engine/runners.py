"""The runners of the call protocol: how each step of `poimen._engine.protocol` is carried out,
blocking (`run_sync`: `Kernel.call`, recovery) or on an event loop (`run_async`: `Kernel.acall`),
and how a tool is invoked and its exception classified (docs/design.md §4, §6).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from poimen._capability import guard as _guard
from poimen._capability.context import AttemptRecord, ToolContext
from poimen._core.decide import Fail, MarkIndeterminate
from poimen._core.effects import (
    Landed,
    LookupAnswer,
    NotLanded,
    Queryable,
    ReadOnly,
    Transactional,
    Unknown,
)
from poimen._core.intents import Intent
from poimen._core.tools import Tool
from poimen._engine.hooks import observed_ainvoke, observed_invoke, observed_lookup
from poimen._engine.protocol import printable
from poimen._engine.steps import Block, CallState, Invoke, Lookup, Run, Sleep, Steps
from poimen._engine.transactional import AttemptTx
from poimen.errors import (
    CapabilityDeniedError,
    DefiniteFailure,
    NotSent,
    TransactionalDatabaseError,
    TransactionControlError,
)
from poimen.store._base import Answer

if TYPE_CHECKING:
    from poimen._engine.engine import Engine

log = logging.getLogger("poimen")
T = TypeVar("T")


# Invoking a tool.


def context(e: Engine, t: Tool, intent: Intent, tx: AttemptTx | None = None) -> ToolContext:
    reg = t.registration
    tool_id = reg.id  # `t.id` is a property
    key = intent.key
    # A guarded call's handles carry a token for this attempt (and a keyed one's, its key).
    scope = None
    effects = reg.effects
    if effects.guarded and (key is not None or not effects.keyed):
        scope = e.issuer.scope(
            tool_id, intent.id, intent.attempts, key if effects.keyed and key else "", reg.caps,
            read_only=isinstance(effects, ReadOnly),
            transactional=isinstance(effects, Transactional),
        )
    record = AttemptRecord(e.issuer, tool_id, intent, reg.effects, reg.timeout)
    if tx is not None:
        # A denied write ends the attempt: its transaction is rolled back before the denial
        # is recorded (on the log's own SQLite file, it holds the lock that commit needs).
        assert scope is not None
        record.abort = scope.abort = functools.partial(tx._abort, "a write of the tool was denied")
    return ToolContext(
        tool_id=tool_id,
        intent_id=intent.id,
        call_id=intent.call_id,
        attempt=intent.attempts,
        key=key,
        request_id=intent.request_id,
        issuer=e.issuer,
        scope=scope,
        timeout=reg.timeout,
        record=record,
        tx=tx,
    )


def _begin(e: Engine, step: Invoke) -> AttemptTx | Run | None:
    """A Transactional attempt's transaction (None for the other classes), or how the
    attempt ends if it cannot begin: nothing of it happened."""
    db = e.databases.get(step.tool.id)
    if db is None:
        return None
    try:
        return db.begin(step.intent, step.tool.registration.timeout, live=e.issuer.live)
    except NotSent as exc:
        return Run("not_sent", error=printable(str(exc)))
    except TransactionalDatabaseError as exc:
        return Run("failed", error=printable(str(exc)))


def _end(e: Engine, tx: AttemptTx | None, run: Run) -> Run:
    return run if tx is None else tx._finish(run, e.store)


@observed_invoke
def invoke_sync(e: Engine, step: Invoke) -> Run:
    t = step.tool
    tx = _begin(e, step)
    if isinstance(tx, Run):
        return tx
    ctx = context(e, t, step.intent, tx)
    scope = ctx._scope
    try:
        if t.is_async:
            value = asyncio.run(_tool_coroutine(t, ctx, step.kwargs))
        elif scope is not None:
            value = _guard.run(scope, t.fn, ctx, step.kwargs)
        else:
            # A sync tool cannot be preempted; its timeout sets the lease and deadline.
            value = t.fn(ctx, **step.kwargs)
    except Exception as exc:  # timeouts included: the outcome is unknown
        return _end(e, tx, classify(exc, ctx))
    except BaseException:  # an interrupt: the transaction never commits, nor holds its locks
        if tx is not None:
            tx._abort("the call was interrupted")
        raise
    finally:
        if scope is not None:
            scope.end()
    return _end(e, tx, completed(value, ctx))


async def _tool_coroutine(t: Tool, ctx: ToolContext, kwargs: dict[str, Any]) -> Any:
    coro = t.fn(ctx, **kwargs)
    scope = ctx._scope
    if scope is not None:
        coro = _guard.arun(scope, coro)
    try:
        # In the caller's task, as `wait_for` awaits a coroutine from Python 3.12 on: no task
        # of its own (its creation and two more turns of the loop a call).
        async with asyncio.timeout(t.registration.timeout):
            return await coro
    finally:
        # A request of ctx.ahttp runs in a thread that a timeout or cancellation cannot stop:
        # the attempt is not over until it returns.
        assert ctx._record is not None
        await ctx._record.drain()


@observed_ainvoke
async def invoke_async(e: Engine, step: Invoke) -> Run:
    """An async tool, awaited in the caller's task (so a cancelled caller cancels it)."""
    t = step.tool
    tx = _begin(e, step)
    if isinstance(tx, Run):
        return tx
    ctx = context(e, t, step.intent, tx)
    scope = ctx._scope
    try:
        value = await _tool_coroutine(t, ctx, step.kwargs)
    except Exception as exc:
        return _end(e, tx, classify(exc, ctx))
    except BaseException:  # cancelled with its caller: the transaction never commits
        if tx is not None:
            tx._abort("the call was cancelled")
        raise
    finally:
        if scope is not None:
            scope.end()
    return _end(e, tx, completed(value, ctx))


def completed(value: Any, ctx: ToolContext) -> Run:
    """The tool returned: completed, unless the send gate refused one of its requests (a
    tool that swallowed the refusal does not make the attempt safe)."""
    record = ctx._record
    refused = None if record is None else record.outcome()
    if refused is not None:
        return _after_refusal(refused)
    return Run("completed", value=value)


def classify(exc: BaseException, ctx: ToolContext) -> Run:
    """How a tool's exception leaves its call: refused by the gate, never sent, refused by the
    provider or the capability layer, or unknown. Only the exception the tool raised, and what
    it names as its cause (`raise ... from`), count: an exception it caught and went on from
    (its `__context__`) says nothing of what it did next."""
    scope = ctx._scope
    record = ctx._record
    writes = 0 if record is None else record.writes
    refused = None if record is None else record.outcome()
    if refused is not None:
        return _after_refusal(refused)
    chain = _causes(exc)
    if any(isinstance(x, NotSent) for x in chain) and writes == 0:
        return Run("not_sent", error=_failure(exc))
    if isinstance(exc, DefiniteFailure | CapabilityDeniedError | TransactionControlError) and (
        not isinstance(exc, NotSent)
    ):
        return _refused(exc, writes)  # a tool ending its own transaction would do so again
    # A library that wrapped a denial (raise ... from it) hides a write that never left.
    for seen in chain[1:]:
        if isinstance(seen, CapabilityDeniedError):
            return _refused(seen, writes)
    if scope is not None and scope.unseen is not None:  # a denial SQLite turned into its own
        return _refused(scope.unseen, writes)
    return Run("unknown", error=printable(f"{type(exc).__name__}: {exc}"))


def _causes(exc: BaseException) -> list[BaseException]:
    """The exception and its explicit causes (`raise ... from`), never its `__context__`."""
    out: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(out) < 9 and seen not in out:
        out.append(seen)
        seen = seen.__cause__
    return out


def _after_refusal(decided: Fail | MarkIndeterminate) -> Run:
    if isinstance(decided, MarkIndeterminate):
        return Run("indeterminate", reason=decided.reason, error=f"send refused: {decided.reason}")
    return Run("failed", error=decided.reason)


def _refused(exc: BaseException, writes: int) -> Run:
    """A provider's refusal, or a write the kernel denied: FAILED, never retried (a retry would
    be denied the same way), unless an earlier write of this attempt went out: then the
    effect may have landed, and an operator decides."""
    if isinstance(exc, CapabilityDeniedError) and writes:
        return Run(
            "indeterminate", reason="capability_denied_after_write", error=_failure(exc)
        )
    return Run("failed", error=_failure(exc))


def _failure(exc: BaseException) -> str:
    if isinstance(exc, CapabilityDeniedError):
        return printable(f"capability denied: {exc}")
    return printable(str(exc) or type(exc).__name__)


@observed_lookup
def lookup_sync(e: Engine, step: Lookup) -> LookupAnswer:
    """Ask the provider, bounded by the tool's timeout: a lookup that hangs must not hang
    recovery (its thread is left to finish on its own)."""
    effects = step.tool.registration.effects
    timeout = step.tool.registration.timeout
    ctx = contextvars.copy_context()
    if isinstance(effects, Transactional):
        db, it = e.databases[step.tool.id], step.intent
        assert it is not None
        fut = e.pool("lookup", 32).submit(
            ctx.run, db.lookup, it, e.store, timeout, live=e.issuer.live
        )
    else:
        assert isinstance(effects, Queryable)
        fut = e.pool("lookup", 32).submit(ctx.run, _ask, effects.lookup, step.request_id)
    try:
        got = fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        return Unknown(f"lookup gave no answer within {timeout:g}s")
    except Exception as exc:  # a provider error is an Unknown answer
        return Unknown(printable(f"{type(exc).__name__}: {exc}")[:300])
    if not isinstance(got, Landed | NotLanded | Unknown):
        return Unknown(f"lookup answered {type(got).__name__}, not Landed, NotLanded or Unknown")
    return got


def _ask(lookup: Callable[[str], Any], request_id: str) -> Any:
    """Run a lookup, sync or async (in a loop of this thread's own)."""
    got = lookup(request_id)
    if inspect.isawaitable(got):
        return asyncio.run(_awaited(got))
    return got


async def _awaited(aw: Awaitable[Any]) -> Any:
    return await aw


# The runners.


def run_sync(e: Engine, gen: Steps[T], first: Any = None, *, started: bool = False) -> T:
    """Execute a protocol's steps in this thread. `started`: the generator waits at a step
    whose result is `first` (a continuation of an async run)."""
    value: Any = first
    exc: BaseException | None = None
    if not started:
        value = None
    while True:
        try:
            step = gen.send(value) if exc is None else gen.throw(exc)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        value, exc = None, None
        try:
            if isinstance(step, Block):
                value = step.fn(*step.args, **step.kw)
            elif isinstance(step, Invoke):
                value = invoke_sync(e, step)
            elif isinstance(step, Lookup):
                value = lookup_sync(e, step)
            else:
                time.sleep(step.seconds)
        except BaseException as err:
            exc = err


async def run_async(e: Engine, gen: Steps[T], c: CallState) -> T:
    """Execute a protocol's steps on the running loop: commits without a thread where the
    store can, blocking steps on the kernel's pools, async tools in the caller's task. A
    cancelled caller is told once the steps are done."""
    out = await drive_async(e, gen, c)
    if c.cancelled:
        raise asyncio.CancelledError from None
    return out


async def drive_async(
    e: Engine, gen: Steps[T], c: CallState, first: Any = None, *, started: bool = False
) -> T:
    """`run_async` without telling a cancelled caller: for a part of a call's steps.
    `started`: the generator waits at a step whose result is `first`."""
    value: Any = first if started else None
    exc: BaseException | None = None
    while True:
        try:
            step = gen.send(value) if exc is None else gen.throw(exc)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        value, exc = None, None
        try:
            if isinstance(step, Invoke) and step.tool.is_async:
                value = await invoke_async_step(e, step, c)
            elif isinstance(step, Invoke):
                cf = e.pool("tool", 256).submit(
                    contextvars.copy_context().run, invoke_sync, e, step
                )
                try:
                    value = await asyncio.shield(asyncio.wrap_future(cf))
                except asyncio.CancelledError:
                    # The tool's thread goes on: follow it from a thread of our own, settle
                    # when it returns, and let the caller go now.
                    c.cancelled = True
                    _continue_in_thread(e, gen, cf)
                    raise
            elif isinstance(step, Sleep):
                try:
                    await asyncio.sleep(step.seconds)
                except asyncio.CancelledError:
                    c.cancelled = True
            elif isinstance(step, Lookup):
                lf = e.pool("store", 64).submit(
                    contextvars.copy_context().run, lookup_sync, e, step
                )
                try:
                    value = await asyncio.shield(asyncio.wrap_future(lf))
                except asyncio.CancelledError:
                    c.cancelled = True  # the answer is only evidence: not needed any more
                    value = Unknown("cancelled")
            else:
                value = await block_async(e, step, c)
        except asyncio.CancelledError:
            raise
        except BaseException as err:
            exc = err


async def invoke_async_step(e: Engine, step: Invoke, c: CallState) -> Run:
    try:
        return await invoke_async(e, step)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or not task.cancelling():
            return Run("unknown", error="CancelledError: the tool was cancelled")
        c.cancelled = True
        return Run("unknown", error="CancelledError: the caller was cancelled")


async def block_async(e: Engine, step: Block, c: CallState) -> Any:
    if step.afn is not None:
        fut: asyncio.Future[Any] = asyncio.ensure_future(step.afn(*step.args, **step.kw))
        if isinstance(fut, Answer):
            # It refuses to be cancelled: a cancelled caller is told once the answer is in.
            try:
                return await fut
            except asyncio.CancelledError:
                c.cancelled = True
                if fut.done():
                    return fut.result()
    else:
        ctx = contextvars.copy_context()
        call = functools.partial(step.fn, *step.args, **step.kw)
        fut = asyncio.wrap_future(e.pool("store", 64).submit(ctx.run, call))
    while True:
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if fut.cancelled():
                raise
            # A commit in flight is quick and its answer decides what comes next: wait.
            c.cancelled = True


def _continue_in_thread(e: Engine, gen: Steps[Any], cf: concurrent.futures.Future[Any]) -> None:
    def follow() -> None:
        try:
            run = cf.result()
            run_sync(e, gen, run, started=True)
        except BaseException:
            log.exception("poimen: settling a cancelled call failed; recovery will settle it")
        finally:
            e.continuations.discard(threading.current_thread())

    th = threading.Thread(target=follow, name="poimen-settle", daemon=True)
    e.continuations.add(th)
    th.start()


def wait_continuations(e: Engine, within: float) -> None:
    end = time.monotonic() + within
    for th in list(e.continuations):
        th.join(max(0.0, end - time.monotonic()))
        if th.is_alive():
            log.warning("poimen: a cancelled call's tool is still running at close")
