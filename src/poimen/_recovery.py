"""The restart scan and the per-class resolution of intents whose outcome is unknown (DESIGN §4)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, assert_never

from poimen._effects import Idempotent, Landed, LookupAnswer, NotLanded, Queryable, Unknown, Unsafe
from poimen._intents import (
    Completed,
    Failed,
    Indeterminate,
    Intent,
    Outcome,
    Pending,
    Resolved,
)
from poimen._keys import canonical, to_json_value
from poimen._notify import indeterminate_note
from poimen._tools import Tool
from poimen.errors import CorruptRowError, PoimenError

if TYPE_CHECKING:
    from poimen._kernel import Kernel

log = logging.getLogger("poimen.recovery")


@dataclass(slots=True)
class RecoveryReport:
    """What one recovery pass saw and did."""

    scanned: int = 0
    completed: int = 0
    failed: int = 0
    indeterminate: int = 0
    pending: int = 0
    busy: int = 0
    lost_race: int = 0
    unregistered: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)

    def count(self, outcome: Outcome) -> None:
        match outcome:
            case Completed() | Resolved():
                self.completed += 1
            case Failed():
                self.failed += 1
            case Indeterminate():
                self.indeterminate += 1
            case Pending():
                self.pending += 1
            case _:
                assert_never(outcome)


def indeterminate(k: Kernel, intent: Intent, reason: str) -> Outcome:
    if k.store.mark_indeterminate(
        intent.id,
        intent.fence,
        reason,
        indeterminate_note(intent, reason, k.notifiers),
        k.store.now(),
    ):
        k._notify_soon()
        return Indeterminate(intent.id, reason)
    return k._answer_current(intent.id)


def resolve_unknown(k: Kernel, tool: Tool, intent: Intent) -> Outcome | Intent:
    """Decide an unfinished intent by its tool's class; every action is a CAS on its fence.

    Returns an Outcome, or the claimed Intent of a new attempt the caller must run.
    """
    effects = tool.registration.effects
    match effects:
        case Idempotent(key=derivation):
            try:
                key = derivation.derive(tool.id, json.loads(intent.args))
            except (PoimenError, ValueError, TypeError) as exc:
                log.warning("intent %s: key derivation failed: %s", intent.id, exc)
                return indeterminate(k, intent, "key_derivation_failed")
            if key != intent.key:
                return indeterminate(k, intent, "key_drift")
            if intent.attempts >= k.max_attempts:
                return indeterminate(k, intent, "retries_exhausted")
            return k._claim_retry(intent)
        case Queryable(lookup=lookup):
            assert intent.request_id is not None
            now = k.store.now()
            answer: LookupAnswer
            try:
                answer = lookup(intent.request_id)
            except Exception as exc:  # a provider error is an Unknown answer
                answer = Unknown(f"{type(exc).__name__}: {exc}")
            match answer:
                case Landed(result=result):
                    # The provider says it landed: that decides, even if its answer does
                    # not encode (then, as in the call path, no result is recorded).
                    try:
                        text: str | None = canonical(to_json_value(result, "<lookup result>"))
                    except PoimenError as exc:
                        log.warning("intent %s: landed result not recorded: %s", intent.id, exc)
                        text = None
                    if k.store.complete_landed(intent.id, intent.fence, text, now):
                        return Completed(intent.id, None if text is None else json.loads(text))
                    return k._answer_current(intent.id)
                case NotLanded():
                    # Not trusted before the deadline: a request in flight could still land.
                    if intent.deadline_at is not None and now < intent.deadline_at:
                        return _defer(
                            k, intent, intent.deadline_at, intent.unknown_count, "awaiting_deadline"
                        )
                    if intent.attempts >= k.max_attempts:
                        return indeterminate(k, intent, "retries_exhausted")
                    return k._claim_retry(intent)
                case Unknown(reason=why):
                    n = intent.unknown_count + 1
                    if n >= k.lookup_limit:
                        return indeterminate(k, intent, "lookup_unknown_limit")
                    delay = min(k.max_backoff, k.lookup_backoff * 2 ** (n - 1))
                    return _defer(k, intent, now + delay, n, f"lookup_unknown: {why}"[:500])
                case _:
                    assert_never(answer)
        case Unsafe():
            return indeterminate(k, intent, "unsafe_unknown_outcome")
        case _:
            assert_never(effects)


def _defer(k: Kernel, intent: Intent, at: float, unknown_count: int, reason: str) -> Outcome:
    if k.store.defer(
        intent.id,
        intent.fence,
        next_check_at=at,
        unknown_count=unknown_count,
        reason=reason,
        now=k.store.now(),
    ):
        return Pending(intent.id, reason)
    return k._answer_current(intent.id)


def _drive_one(k: Kernel, tool: Tool, it: Intent) -> Outcome:
    out = k.drive_orphan(tool, it)
    # None: a thread of this kernel is driving it already (a caller or another pass).
    return Pending(it.id, "busy") if out is None else out


def _drive_all(k: Kernel, todo: list[tuple[Tool, Intent]], workers: int) -> list[Outcome]:
    """Resolve a page of claimable intents, `workers` at a time, outcomes in page order.

    Each intent is driven by one thread only (and every step is a CAS on its fence), so
    running them side by side changes no outcome; it lets the store commit many claims and
    outcomes in one durable commit instead of paying one commit each, one after another."""
    if workers <= 1 or len(todo) <= 1:
        return [_drive_one(k, tool, it) for tool, it in todo]
    with ThreadPoolExecutor(
        max_workers=min(workers, len(todo)), thread_name_prefix="poimen-recover"
    ) as pool:
        return list(pool.map(lambda job: _drive_one(k, *job), todo))


def recover_pass(
    k: Kernel,
    *,
    batch: int = 500,
    progress: Callable[[int], object] | None = None,
    workers: int = 32,
) -> RecoveryReport:
    """One restart scan: every DISPATCHED intent whose owner is gone is resolved by class.

    `progress`, if given, is called with the number of intents scanned so far; `workers`
    intents of a page are resolved side by side."""
    report = RecoveryReport()
    after = ""
    step = batch
    while True:
        try:
            rows = k.store.list_unfinished(after_id=after, limit=step)
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
        now = k.store.now()
        todo: list[tuple[Tool, Intent]] = []
        for it in rows:
            report.scanned += 1
            tool = k._tools.get(it.tool_id)
            if tool is None:
                report.unregistered.append(it.id)
                continue
            if it.next_check_at is not None and it.next_check_at > now:
                report.pending += 1
                continue
            if not k._claimable(it, now):
                report.busy += 1
                continue
            todo.append((tool, it))
        for outcome in _drive_all(k, todo, workers):
            if isinstance(outcome, Pending) and outcome.reason == "lost_race":
                report.lost_race += 1
            elif isinstance(outcome, Pending) and outcome.reason == "busy":
                report.busy += 1
            else:
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
