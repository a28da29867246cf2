"""The restart scan: every unfinished intent whose owner is gone is settled by its class
(docs/design.md §5). The decisions are `poimen._core.decide`'s; the steps `poimen._engine.protocol`'s.

One intent's failure (a key derivation that raises, a damaged row, a lookup that hangs) is
logged and counted; it never stops the scan of the others.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from poimen._core.intents import Intent, Outcome, Pending, RecoveryReport
from poimen._core.tools import Tool
from poimen._engine import hooks as _hooks
from poimen._engine.hooks import observed_pass, observed_recovery
from poimen._engine.protocol import orphan_steps
from poimen._engine.runners import run_sync
from poimen._engine.steps import CallState
from poimen.errors import CorruptRowError

if TYPE_CHECKING:
    from poimen._engine.engine import Engine

log = logging.getLogger("poimen.recovery")


def drive_orphan(e: Engine, tool: Tool, it: Intent) -> Outcome:
    """Settle one claimable intent; Pending("busy") if this kernel drives it already. No
    caller waits for it: its answer is owed to the first call that asks (section 4)."""
    out = run_sync(e, orphan_steps(e, tool, it, CallState(), owed=True))
    return Pending(it.id, "busy") if out is None else out


@observed_recovery
def _drive_one(e: Engine, tool: Tool, it: Intent, report: RecoveryReport) -> Outcome | None:
    try:
        return drive_orphan(e, tool, it)
    except Exception:
        log.exception("recovery of intent %s failed; it stays for the next pass", it.id)
        report.errors.append(it.id)
        return None


def _drive_all(
    e: Engine, todo: list[tuple[Tool, Intent]], workers: int, report: RecoveryReport
) -> list[Outcome | None]:
    """Resolve a page of claimable intents, `workers` at a time, outcomes in page order.

    Each intent is driven by one thread only (and every step is a CAS on its fence), so
    running them side by side changes no outcome; it lets the store commit many claims and
    outcomes in one durable commit instead of paying one commit each, one after another."""
    if workers <= 1 or len(todo) <= 1:
        return [_drive_one(e, tool, it, report) for tool, it in todo]
    # Each intent runs in the pass's context (an observer's span of the pass is its parent).
    ctxs = [contextvars.copy_context() for _ in todo]
    with ThreadPoolExecutor(
        max_workers=min(workers, len(todo)), thread_name_prefix="poimen-recover"
    ) as pool:
        return list(
            pool.map(lambda job, c: c.run(_drive_one, e, job[0], job[1], report), todo, ctxs)
        )


@observed_pass
def recover_pass(
    e: Engine,
    *,
    batch: int = 500,
    progress: Callable[[int], object] | None = None,
    workers: int = 32,
) -> RecoveryReport:
    """One restart scan: every DISPATCHED intent whose owner is gone is resolved by class.

    `progress`, if given, is called with the number of intents scanned so far; `workers`
    intents of a page are resolved side by side."""
    report = RecoveryReport()
    gone = e.store.expire_approvals(e.store.now())
    _hooks.expired(e, gone)
    report.expired = len(gone)
    after = ""
    step = batch
    while True:
        # The clock is read before the rows: an owner's lease judged against a later clock
        # than the one it was read at could have been renewed in between.
        now = e.store.now()
        try:
            rows = e.store.list_unfinished(after_id=after, limit=step)
        except CorruptRowError as exc:
            if step > 1:  # find the bad row one at a time, so no good row before it is skipped
                step = 1
                continue
            # One bad row must not stop recovery of the rest: report it and go past it.
            bad = str(exc.data.get("intent_id", ""))
            report.corrupt.append(bad)
            log.error("recovery skipped a corrupt row: %s", exc)
            if not bad or bad <= after:
                break
            after, step = bad, batch
            continue
        if not rows:
            break
        after = rows[-1].id
        todo: list[tuple[Tool, Intent]] = []
        for it in rows:
            report.scanned += 1
            tool = e.tools.get(it.tool_id)
            if tool is None:
                report.unregistered.append(it.id)
                continue
            match e.claimable(it, now):
                case "claimable":
                    todo.append((tool, it))
                case "not_due":
                    report.pending += 1
                case _:
                    report.busy += 1
        for outcome in _drive_all(e, todo, workers, report):
            if outcome is not None:
                report.count(outcome)
        if progress is not None:
            progress(report.scanned)
    if report.unregistered:
        log.warning(
            "%d unfinished intents belong to tools that are not registered; they stay "
            "DISPATCHED: %s",
            len(report.unregistered),
            ", ".join(report.unregistered[:20]),
        )
    return report
