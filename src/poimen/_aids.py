"""What a kernel does to help an operator decide: its tools' evidence (`poimen._engine.evidence`),
their ageing thresholds and the escalation line (`poimen.operator._ageing`), wired to the kernel's
delivery of notifications. None of it runs on a caller's thread or in recovery."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from poimen._capability import guard as _guard
from poimen._engine import evidence as _evidence
from poimen._engine.notify import Notifier, Renotifier, deliver, notifier_names
from poimen.operator import _ageing
from poimen.operator._ops import Identity, find

if TYPE_CHECKING:
    from poimen._capability.context import Issuer
    from poimen._core.tools import Tool
    from poimen._engine.upkeep import Duty, Upkeep
    from poimen.store._base import Store


class Aids:
    """One kernel's evidence gatherer, ageing scan, escalation notifiers and reminders."""

    def __init__(
        self,
        store: Store,
        issuer: Issuer,
        tools: Mapping[str, Tool],
        escalate_to: Sequence[Notifier],
        renotify_after: float | None,
    ) -> None:
        self.store = store
        self.escalate_to = list(escalate_to)
        self.gatherer = _evidence.Gatherer(store, issuer, tools)
        self.ageing = _ageing.Ageing()
        # Reminders for INDETERMINATE intents still open after this many seconds.
        self.renotifier = Renotifier(renotify_after) if renotify_after is not None else None
        self.lock = threading.Lock()  # one delivery at a time

    def after_fork(self) -> None:
        self.lock = threading.Lock()
        self.gatherer.after_fork()

    def register(
        self, tool_id: str, evidence: object, escalate_after: object
    ) -> Callable[[], None]:
        """Check a registration's `evidence` and `escalate_after`; returns what records them
        once the rest of the registration is checked too."""
        rule = _evidence.rule_of(tool_id, evidence)
        after = _ageing.threshold(tool_id, escalate_after)

        def commit() -> None:
            if rule is not None:
                _guard.install()  # its reads run under the ReadOnly scope
                self.gatherer.rules[tool_id] = rule
            if after is not None:
                self.ageing.thresholds[tool_id] = after

        return commit

    def deliver_due(self, notifiers: Sequence[Notifier], upkeep: Upkeep) -> int:
        """`Kernel.deliver_notifications`: remind, escalate, deliver, one at a time."""
        with self.lock:
            if self.renotifier is not None:
                self.renotifier.maybe_run(self.store, notifiers)
            return self.deliver(notifiers, upkeep.delivery, upkeep.notify_soon)

    def deliver(self, notifiers: Sequence[Notifier], duty: Duty, wake: Callable[[], None]) -> int:
        """Escalate what is overdue, then deliver; notifications of calls whose evidence is
        still to be gathered wait for the delivery duty to gather it."""
        self.ageing.maybe_run(self.store, notifier_names([*notifiers, *self.escalate_to]))
        hold = self.gatherer.scan() if self.gatherer.rules else set()
        done = deliver(self.store, notifiers, hold=hold, escalate_to=self.escalate_to)
        if hold and not duty.is_current():
            wake()
        return done

    def round(
        self, deliver_now: Callable[[], object], closed: Callable[[], bool], *, finish: bool
    ) -> None:
        """The delivery duty's round: deliver, gather the evidence notifications wait for (a
        few at a time, each within its timeout), deliver what it let go. With `finish`
        (a process about to exit), also wait for gatherings another thread has in flight."""
        deliver_now()
        while not closed():
            if not self.gatherer.gather_pending() and not (finish and self.gatherer.wait_idle()):
                return
            deliver_now()

    def evidence(self, intent_id: str, operator: str | Identity | None) -> _evidence.Found | None:
        intent = find(self.store, intent_id)
        context = operator.detail() if isinstance(operator, Identity) else None
        name = operator.name if isinstance(operator, Identity) else operator
        who = name.strip() if isinstance(name, str) and name.strip() else "poimen"
        event = self.gatherer.gather_now(intent, actor=who, context=context)
        return None if event is None else _evidence.found(event)
