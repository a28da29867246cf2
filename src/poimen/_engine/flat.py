"""The call protocol's happy path in straight-line code: `Engine.run_call` without a generator
and a runner between its steps (docs/design.md §4, "The flat path").

A call that nothing deviates from (no approval, no sandbox, a new call id, one run that ends
completed or FAILED for good, its outcome committed on its fence) takes the steps of
`protocol.call_steps` one after the other, with the same functions deciding: the send gate in
the tool's handles (`runners.invoke_sync` makes its context), `failure_is_final`, `Write.of`,
`late`. At the first deviation the protocol takes over at that point: the generator that
would have run next, driven by `run_sync`.

`flat_acall` is the same for `Kernel.acall` of an async tool: each await is a step of
`run_async` (`block_async`, `invoke_async_step`), so a cancelled caller is treated exactly as
the protocol treats it, and the protocol's generators that take over are driven on the loop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from poimen._core.decide import failure_is_final
from poimen._core.intents import Intent, Outcome
from poimen._core.tools import Tool
from poimen._engine import crashpoints as _crashpoints
from poimen._engine import hooks as _hooks
from poimen._engine.protocol import (
    Write,
    existing_steps,
    fenced_out,
    given,
    late,
    run_steps,
    stamp_deadline,
    taken,
    untried,
)
from poimen._engine.runners import (
    block_async,
    drive_async,
    invoke_async_step,
    invoke_sync,
    run_sync,
)
from poimen._engine.steps import Block, CallState, Invoke, Run, Steps
from poimen.store._base import NewDispatch

if TYPE_CHECKING:
    from poimen._engine.engine import Engine


def flat_call(e: Engine, t: Tool, d: NewDispatch, kwargs: dict[str, Any]) -> Outcome:
    """`call_steps(e, t, d, kwargs, CallState())`, run in this thread, for a call that awaits
    no approval."""
    c = CallState()
    e.holds.take(d.intent_id)  # a fresh id: always ours
    try:
        if _crashpoints.ACTIVE:
            _crashpoints.hit("before_dispatch_commit", d.call_id)
        store = e.store
        intent, created = store.record_dispatch(d)
        if not created:  # the call id is in the log
            return run_sync(e, existing_steps(e, t, intent, d, c))
        _hooks.dispatched(e, d, intent)
        if _crashpoints.ACTIVE:
            _crashpoints.hit("after_dispatch_commit", d.call_id)
        if t.registration.effects.has_deadline:
            started = run_sync(e, stamp_deadline(e, t, intent, d.now))
            if not isinstance(started, Intent):
                return started
            intent = started
        run = invoke_sync(e, Invoke(t, intent, kwargs))
        if run.kind == "completed" or (
            run.kind == "failed" and failure_is_final(t.registration.effects, intent)
        ):
            if _crashpoints.ACTIVE:
                _crashpoints.hit("after_effect", intent.call_id)
            w = Write.of(run, intent.id)
            ok = store.record_outcome(
                intent.id, intent.fence, w.state, result=w.result, error=w.error, now=store.now()
            )
            out = w.settled(e, intent) if ok else run_sync(e, fenced_out(e, intent, "outcome"))
        else:  # never sent, unknown, committed with its transaction: the protocol goes on
            out = resumed(e, run_steps(e, t, intent, kwargs, c), run)
        return given(store, out) if late(d, c) else out
    finally:
        e.holds.drop(d.intent_id)


def resumed(e: Engine, steps: Steps[Outcome], run: Run) -> Outcome:
    """`steps`, whose first step (an invocation) was done already and ended as `run`."""
    next(steps)
    return run_sync(e, steps, run, started=True)


async def flat_acall(e: Engine, t: Tool, d: NewDispatch, kwargs: dict[str, Any]) -> Outcome:
    """`run_async(call_steps(e, t, d, kwargs, c), c)` for an async tool's call that awaits no
    approval."""
    store, c = e.store, CallState()
    e.holds.take(d.intent_id)
    try:
        if _crashpoints.ACTIVE:
            _crashpoints.hit("before_dispatch_commit", d.call_id)
        dispatch = Block(store.record_dispatch, (d,), getattr(store, "arecord_dispatch", None))
        intent, created = await block_async(e, dispatch, c)
        if not created:  # the call id is in the log
            out = await drive_async(e, existing_steps(e, t, intent, d, c), c)
        else:
            _hooks.dispatched(e, d, intent)
            if _crashpoints.ACTIVE:
                _crashpoints.hit("after_dispatch_commit", d.call_id)
            out = await _dispatched(e, t, d, intent, kwargs, c)
    finally:
        e.holds.drop(d.intent_id)  # an async tool ends with its caller's task
    if c.cancelled:  # told once the call's steps are done, as by `run_async`
        raise asyncio.CancelledError
    return out


async def _dispatched(
    e: Engine, t: Tool, d: NewDispatch, intent: Intent, kwargs: dict[str, Any], c: CallState
) -> Outcome:
    if c.cancelled:  # cancelled during the dispatch commit: the tool never ran
        return await drive_async(e, untried(e, intent), c)
    if t.registration.effects.has_deadline:
        started = await drive_async(e, stamp_deadline(e, t, intent, d.now), c)
        if not isinstance(started, Intent):
            return started
        intent = started
    rest = _then_taken(e, d, c, run_steps(e, t, intent, kwargs, c))
    if c.cancelled:  # cancelled during the deadline's commit
        return await drive_async(e, rest, c)
    step = next(rest)  # the protocol's own first step: its invocation
    assert isinstance(step, Invoke)
    run = await invoke_async_step(e, step, c)
    if not (
        run.kind == "completed"
        or (run.kind == "failed" and failure_is_final(t.registration.effects, intent))
    ):  # never sent, unknown, committed with its transaction: the protocol goes on
        return await drive_async(e, rest, c, run, started=True)
    rest.close()
    if _crashpoints.ACTIVE:
        _crashpoints.hit("after_effect", intent.call_id)
    w = Write.of(run, intent.id)
    store = e.store
    outcome = Block(
        store.record_outcome,
        (intent.id, intent.fence, w.state),
        getattr(store, "arecord_outcome", None),
        {"result": w.result, "error": w.error, "now": store.now()},
    )
    if await block_async(e, outcome, c):
        out = w.settled(e, intent)
    else:
        out = await drive_async(e, fenced_out(e, intent, "outcome"), c)
    if late(d, c):
        out = await block_async(e, Block(given, (store, out)), c)
    return out


def _then_taken(e: Engine, d: NewDispatch, c: CallState, steps: Steps[Outcome]) -> Steps[Outcome]:
    """`steps`, then the answer taken if the caller is late: the rest of `call_steps`."""
    out = yield from steps
    return (yield from taken(e, out, late(d, c)))
