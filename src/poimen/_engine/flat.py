"""The call protocol's happy path in straight-line code: `Engine.run_call` without a generator
and a runner between its steps (docs/design.md §4, "The flat path").

A call that nothing deviates from (no approval, no sandbox, a new call id, one run that ends
completed or FAILED for good, its outcome committed on its fence) takes the steps of
`protocol.call_steps` one after the other, with the same functions deciding: the send gate in
the tool's handles (`runners.invoke_sync` makes its context), `failure_is_final`, `Write.of`,
`late`. At the first deviation the protocol takes over at that point: the generator that
would have run next, driven by `run_sync`.
"""

from __future__ import annotations

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
)
from poimen._engine.runners import invoke_sync, run_sync
from poimen._engine.steps import CallState, Invoke, Run, Steps
from poimen.store._base import NewDispatch

if TYPE_CHECKING:
    from poimen._engine.engine import Engine


def flat_call(e: Engine, t: Tool, d: NewDispatch, kwargs: dict[str, Any]) -> Outcome:
    """`call_steps(e, t, d, kwargs, CallState())`, run in this thread, for a call that awaits
    no approval."""
    c = CallState()
    e.holds.take(d.intent_id)  # a fresh id: always ours
    try:
        _crashpoints.hit("before_dispatch_commit", d.call_id)
        store = e.store
        intent, created = store.record_dispatch(d)
        if not created:  # the call id is in the log
            return run_sync(e, existing_steps(e, t, intent, d, c))
        _hooks.dispatched(e, d, intent)
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
