"""The kernel: the public API over one `Engine` (`poimen._engine.engine`).

`Kernel` is a facade: its arguments and their documentation, registration, and the public
methods, each a few lines that hand the work to the modules of docs/design.md's module map.
Building, closing and forking its parts (settings, store, identity, engine, observers,
sandbox) are `poimen._runtime`'s. The engine owns what runs: the tools, the call entry
(`Engine.run_call`), the protocol, recovery; the decisions are `poimen._core.decide`'s; the
background duties `poimen._engine.upkeep`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar, overload

from poimen import _approval, _observe, _undo
from poimen._capability.context import Sink, ToolContext
from poimen._core.audit import Head
from poimen._core.effects import EffectClass
from poimen._core.intents import Denial, Intent, Outcome, RecoveryReport
from poimen._core.retry import Retry
from poimen._core.spec import ToolSpec
from poimen._core.tools import Caps, Tool, ToolRegistration
from poimen._core.undo import UndoArgs
from poimen._engine.engine import Settings
from poimen._engine.evidence import Evidence, Found, Gather
from poimen._engine.notify import Notifier
from poimen._engine.recovery import recover_pass
from poimen._runtime import Mode, Runtime
from poimen._tool_handle import ToolHandle
from poimen._undo import UndoReport
from poimen.events import KernelEvent, Observer
from poimen.operator import _decisions
from poimen.operator._ops import Identity
from poimen.store import Store

P = ParamSpec("P")
R = TypeVar("R")
E = TypeVar("E", bound=KernelEvent)


class Kernel(Runtime):
    """Registers tools, journals every call before and after dispatch, and recovers by class.

    Call `launch()` once the tools are registered: it runs the restart scan and starts the
    background duties (lease renewal, recovery, delivery of notifications). Every duration is
    in seconds; a setting out of range is refused here with a `PoimenError` naming it.

    Args:
        store: The intent log: a `Store`, or its URL, ``sqlite:///path`` (a file on a local
            disk) or ``postgresql://...`` (needs ``poimen[postgres]``). Opened, and migrated
            if older, here.
        worker_id: This kernel's name in the log, recorded as the owner of its calls. Default:
            a new random ``w-...`` per kernel. Two live kernels of one process may not share
            one (`DuplicateWorkerError`); a forked child takes a new one.
        host: This machine's name in the log. An unfinished call whose owner ran on this host
            is taken over as soon as its process is gone; from another host, only once its
            lease has run out. Default: the hostname, boot id and pid namespace; give hosts
            that may share a hostname distinct names (docs/postgres.md).
        mode: ``"live"`` runs tools; ``"replay"`` answers every call from `recording` and runs
            none; ``"shadow"`` runs only ReadOnly tools, and Transactional ones whose
            transaction it rolls back, and answers the others from `live`, or as "would have
            called" (docs/sandbox.md).
        lease_ttl: How long a dispatched call's lease lasts (at least its tool's timeout). The
            kernel renews the leases of the calls it runs; another kernel may take over a call
            only after its lease ran out (or its owner is seen gone on this host).
        notifiers: Where operators hear of Indeterminate calls and approvals to decide, each
            notification written in the same transaction and delivered at least once. Default:
            one `LogNotifier`; ``[]``: none.
        max_attempts: Attempts per call, the first included, for a tool registered without
            its own `Retry(attempts=...)`. Once they are spent, an Idempotent or Queryable call
            becomes Indeterminate (``retries_exhausted``) and a ReadOnly one Failed.
        lookup_limit: How many "unknown" answers a Queryable call's lookup may give before the
            call becomes Indeterminate (``lookup_unknown_limit``).
        lookup_backoff: The wait before asking again after the first "unknown" answer; it
            doubles with each further one.
        max_backoff: The longest wait between two lookups.
        deadline_margin: Added to a Queryable call's timeout to make its deadline: a "not
            landed" answer is trusted only after it, when nothing sent can still land.
        wait_bound: How long a call waits for another live owner of the same call id (or, in
            shadow mode, for the live run's call) to settle before it answers `Pending`.
        recover_interval: How often the background recovery pass runs after `launch()`, and
            the delivery of due notifications.
        renotify_after: Remind the notifiers of an Indeterminate call that is still open this
            long after its latest notification; None (default): no reminders.
        escalate_to: Notifiers that hear only of overdue calls (older than their tool's
            ``escalate_after``), besides `notifiers`: a second line, such as a pager.
        recording: In replay mode, the recorded log (a URL or a `Store`), opened read-only.
        live: In shadow mode, the live run's log (a URL or a `Store`), opened read-only;
            without it, every call but a read is "would have called".
        scope: In replay or shadow mode, the call-id prefix of the run to compare with; None:
            the whole log.
        on_divergence: In replay mode, what a call that is not in the recording (or has other
            arguments) does: ``"raise"`` `DivergenceError`, or ``"record"`` it and answer
            `Pending("not_in_recording")`.
        observers: Objects that see every event (`poimen.events.Observer`), e.g.
            `poimen.otel.OpenTelemetry()`.
        log_events: Log each transition on the ``poimen`` loggers: True, False, or None
            (default) to follow the logging configuration (docs/observability.md).
        audit_head_every: Publish the head of the log's audit chain every this many seconds
            after `launch()`, when it moved: a log line, the notifiers, the observers
            (docs/audit.md). None (default): not published.
    """

    def __init__(
        self,
        store: Store | str,
        *,
        worker_id: str | None = None,
        host: str | None = None,
        mode: Mode = "live",
        lease_ttl: float = 30.0,
        notifiers: Sequence[Notifier] | None = None,
        max_attempts: int = 5,
        lookup_limit: int = 8,
        lookup_backoff: float = 1.0,
        max_backoff: float = 300.0,
        deadline_margin: float = 1.0,
        wait_bound: float = 5.0,
        recover_interval: float = 5.0,
        renotify_after: float | None = None,
        escalate_to: Sequence[Notifier] = (),
        recording: str | Store | None = None,
        live: str | Store | None = None,
        scope: str | None = None,
        on_divergence: Literal["raise", "record"] = "raise",
        observers: Sequence[Observer] | None = None,
        log_events: bool | None = None,
        audit_head_every: float | None = None,
    ) -> None:
        self._build(
            store, worker_id=worker_id, host=host, mode=mode, notifiers=notifiers,
            escalate_to=escalate_to, renotify_after=renotify_after, recording=recording,
            live=live, scope=scope, on_divergence=on_divergence, observers=observers,
            log_events=log_events, audit_head_every=audit_head_every,
            recover=self.recover, deliver=self.deliver_notifications,
            # Made once the arguments before it are checked: the order refusals always had.
            settings=lambda: Settings(
                lease_ttl=lease_ttl, max_attempts=max_attempts, lookup_limit=lookup_limit,
                lookup_backoff=lookup_backoff, max_backoff=max_backoff,
                deadline_margin=deadline_margin, wait_bound=wait_bound,
                recover_interval=recover_interval,
            ),
        )  # fmt: skip

    @property
    def owner(self) -> Any:
        """Who this kernel is in the log: worker id, host, pid (new after a fork)."""
        return self._engine.owner

    @property
    def worker_id(self) -> str:
        """This kernel's worker id in the log (new after a fork)."""
        return str(self._engine.owner.worker_id)

    @property
    def settings(self) -> Settings:
        """The settings this kernel was made with (frozen, validated once)."""
        return self._engine.settings

    lease_ttl = property(lambda self: self.settings.lease_ttl, doc="`Settings.lease_ttl`")
    max_attempts = property(lambda self: self.settings.max_attempts, doc="`Settings.max_attempts`")
    lookup_limit = property(lambda self: self.settings.lookup_limit, doc="`Settings.lookup_limit`")
    lookup_backoff = property(lambda self: self.settings.lookup_backoff, doc="`Settings.lookup_backoff`")
    max_backoff = property(lambda self: self.settings.max_backoff, doc="`Settings.max_backoff`")
    deadline_margin = property(lambda self: self.settings.deadline_margin, doc="`Settings.deadline_margin`")
    wait_bound = property(lambda self: self.settings.wait_bound, doc="`Settings.wait_bound`")
    recover_interval = property(lambda self: self.settings.recover_interval, doc="`Settings.recover_interval`")

    # Registration.

    def tool(
        self,
        *,
        id: str,
        effects: EffectClass,
        caps: Caps,
        timeout: float,
        retry: Retry | None = None,
        description: str | None = None,
        requires_approval: bool | Callable[[Mapping[str, Any]], bool] = False,
        approval_ttl: float | None = None,
        approvers: int = 1,
        undo: str | None = None,
        undo_args: UndoArgs | None = None,
        coalesce: bool = True,
        evidence: Evidence | Gather | None = None,
        escalate_after: float | None = None,
    ) -> Callable[[Callable[Concatenate[ToolContext, P], R]], ToolHandle[P, R]]:
        """Register the decorated function; returns a `ToolHandle` (the function, callable as
        before, with typed `call`/`acall`). Every argument but `retry` and `description` is
        required; `retry` spaces the call path's own retries (default:
        `Retry(attempts=max_attempts)`); `description` is what models read (default: the
        function's docstring). `requires_approval` (True, or a predicate on the recorded
        arguments) records such a call AWAITING_APPROVAL and dispatches it only once an
        operator approves (`approvers` distinct operators: four eyes); `approval_ttl` seconds
        without a decision fail it. `undo` names the
        tool that reverses a call (`Kernel.undo`), `undo_args` derives its arguments from the
        call's recorded arguments and result (a pure function; default: the same arguments);
        `@handle.undo(...)` registers an undo function directly. `coalesce=False`: an identical
        call made while one is unsettled is a new call (docs/design.md section 4). `evidence`
        gathers facts for the operator when a call becomes Indeterminate (`Evidence`);
        `escalate_after` seconds after it was made, a call still Indeterminate or awaiting
        approval is notified again, to `escalate_to` as well."""
        registration = ToolRegistration(id=id, effects=effects, caps=caps, timeout=timeout)

        def decorate(fn: Callable[Concatenate[ToolContext, P], R]) -> ToolHandle[P, R]:
            self.register(
                registration,
                fn,
                retry=retry,
                description=description,
                requires_approval=requires_approval,
                approval_ttl=approval_ttl,
                approvers=approvers,
                undo=undo,
                undo_args=undo_args,
                coalesce=coalesce,
                evidence=evidence,
                escalate_after=escalate_after,
            )
            return ToolHandle(self, registration.id, fn)

        return decorate

    def register(
        self,
        registration: ToolRegistration,
        fn: Callable[..., Any],
        *,
        retry: Retry | None = None,
        description: str | None = None,
        requires_approval: bool | Callable[[Mapping[str, Any]], bool] = False,
        approval_ttl: float | None = None,
        approvers: int = 1,
        undo: str | None = None,
        undo_args: UndoArgs | None = None,
        coalesce: bool = True,
        evidence: Evidence | Gather | None = None,
        escalate_after: float | None = None,
    ) -> Tool:
        """Register `fn` under `registration` (what `tool` does); returns the built tool.
        Everything that can refuse runs before anything is kept: all or nothing."""
        if isinstance(fn, ToolHandle):  # one function registered under another id as well
            fn = fn.__wrapped__
        record = self._engine.record(
            registration,
            fn,
            retry=retry,
            description=description,
            requires_approval=requires_approval,
            approval_ttl=approval_ttl,
            approvers=approvers,
            undo=undo,
            undo_args=undo_args,
            coalesce=coalesce,
        )
        aids = self._aids.register(registration.id, evidence, escalate_after)
        self._engine.add(record)
        aids()
        return record.tool

    def describe(self, tool_id: str, *, check: str) -> None:
        """What an operator should check before resolving `tool_id`'s Indeterminate calls."""
        self.checks[tool_id] = check

    def register_sink(self, name: str, sink: Sink) -> None:
        """Make `sink` available to tools as `ctx.sink(name)`; Idempotent tools also need
        `name` in their registration's `caps.sinks`."""
        self._issuer.register_sink(name, sink)

    @overload
    def on(self, kind: type[E], fn: Callable[[E], object]) -> Callable[[E], object]: ...
    @overload
    def on(
        self, kind: type[E], fn: None = None
    ) -> Callable[[Callable[[E], object]], Callable[[E], object]]: ...
    def on(self, kind: type[E], fn: Callable[[E], object] | None = None) -> Any:
        """Call `fn(event)` for every event of type `kind` (a class of `poimen.events`; a
        base class takes its subclasses), on a thread of the kernel's own, never the
        caller's: in order, one at a time. Usable as a decorator. In memory only: for a
        durable signal of an Indeterminate call use a notifier."""
        if fn is None:
            _observe.check_kind(kind)
            return lambda f: self.on(kind, f)
        return _observe.subscribe(self._engine, kind, fn)

    def off(self, kind: type[E], fn: Callable[[E], object]) -> None:
        """Stop calling `fn` for `kind` (as registered with `on`)."""
        _observe.unsubscribe(self._engine, kind, fn)

    def denials(
        self, tool_id: str | None = None, since: float | None = None, *, limit: int = 1000
    ) -> list[Denial]:
        """The audit of denied writes, oldest first, optionally for one tool or since a time."""
        return self.store.denials(tool_id=tool_id, since=since, limit=limit)

    def registered(self) -> dict[str, ToolRegistration]:
        """Every registered tool's declaration, by id."""
        return {k: t.registration for k, t in self._engine.tools.items()}

    def spec(self, tool: str) -> ToolSpec:
        """A tool as a model sees it (by id or by its provider-safe name)."""
        return self._engine.spec(tool)

    def specs(self) -> list[ToolSpec]:
        """Every registered tool's spec, in registration order."""
        return [r.spec for r in self._engine.records.values()]

    def tool_id(self, name: str) -> str:
        """The tool id a spec's name stands for (a name a model sent; an id works too, and
        is looked up first)."""
        return self._engine.tool_id(name)

    # Outcomes of calls made earlier, for a caller that resumes.

    def outcome(self, call_id: str) -> Outcome | None:
        """What the log says of this call id now, or None if it was never called. A settled
        outcome read here is given to the call's caller: an answer owed since recovery settled
        it is taken (docs/design.md section 4)."""
        return self._engine.outcome(call_id)

    async def wait(self, call_id: str, *, timeout: float | None = None) -> Outcome:
        """Wait until this call's outcome is final (Completed, Failed, or an operator's
        Resolved); after `timeout` seconds, the outcome as it is then (Pending,
        Indeterminate). None waits for ever. The outcome is given, as by `outcome`."""
        return await self._engine.wait(call_id, timeout)

    def wait_sync(self, call_id: str, *, timeout: float | None = None) -> Outcome:
        """`wait` for a caller without an event loop."""
        return self._engine.wait_sync(call_id, timeout)

    # Life cycle.

    def launch(self, *, background: bool = True) -> RecoveryReport:
        """Run the restart scan and recovery pass; with `background`, keep recovery and
        notification delivery going every `recover_interval` seconds."""
        report = self.recover()
        self._upkeep.start(background=background)
        return report

    def on_close(self, fn: Callable[[], object]) -> None:
        """Run `fn` when the kernel closes (e.g. to close a tool's HTTP client)."""
        self._on_close.append(fn)

    def close(self) -> None:
        """Stop the background duties, wait for cancelled calls still settling, close the
        store. Idempotent."""
        self._shut()

    def __enter__(self) -> Kernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # The call path.

    def call(
        self, tool: str, args: Mapping[str, Any], *, call_id: str, scope: str | None = None
    ) -> Outcome:
        """Journal, dispatch and settle one call. Indeterminate is returned, not raised.
        `scope` (a conversation, a thread, a run): an identical call in it that is not settled
        answers this call instead of a dispatch (default: the scope of a call id made by
        `poimen.call_ids.derived` for this call; docs/design.md section 4)."""
        return self._engine.run_call(tool, args, call_id=call_id, scope=scope)

    async def acall(
        self, tool: str, args: Mapping[str, Any], *, call_id: str, scope: str | None = None
    ) -> Outcome:
        """`call` for async callers. A cancelled caller gets `CancelledError` at once; the
        call itself is settled with its real outcome (a sync tool's thread is followed until
        it returns), and nothing new (retry, lookup) starts for it."""
        return await self._engine.arun_call(tool, args, call_id=call_id, scope=scope)

    # Recovery and the operator path.

    def recover(self, *, progress: Callable[[int], object] | None = None) -> RecoveryReport:
        """One recovery pass now; then deliver due notifications."""
        self._watch_logging()
        e = self._engine if self._sandbox is None else self._sandbox.recovery_engine()
        report = recover_pass(e, progress=progress)
        self.deliver_notifications()
        return report

    def resolve(
        self, intent_id: str, *, landed: bool, result: Any = None, operator: str, reason: str
    ) -> Intent:
        """An operator's decision on an INDETERMINATE intent; terminal and audited."""
        return _decisions.resolve(
            self._engine, intent_id, landed=landed, result=result, operator=operator, reason=reason
        )

    def abandon(self, intent_id: str, *, operator: str, reason: str) -> Intent:
        """An operator gives up on a DISPATCHED intent whose worker will not come back: it
        becomes INDETERMINATE (`abandoned_by_operator`), notified to this kernel's notifiers,
        for an operator to resolve."""
        return _decisions.abandon(self._engine, intent_id, operator=operator, reason=reason)

    def approve(
        self, intent_id: str, *, operator: str, reason: str, args: Mapping[str, Any] | None = None
    ) -> Intent:
        """An operator approves a call awaiting approval: it is dispatched once, by its class
        (by the caller resuming with `wait`, or by any kernel's recovery). A four-eyes call
        stays awaiting until enough distinct operators approved. `args`: approved with these
        arguments instead; returns the edited call (docs/approvals.md)."""
        if args is not None:
            return _approval.approve_edited(
                self._engine, intent_id, operator=operator, reason=reason, args=args
            )
        return _decisions.decide_approval(
            self._engine, intent_id, approve=True, operator=operator, reason=reason
        )

    def reject(self, intent_id: str, *, operator: str, reason: str) -> Intent:
        """An operator rejects a call awaiting approval: FAILED, nothing is sent."""
        return _decisions.decide_approval(
            self._engine, intent_id, approve=False, operator=operator, reason=reason
        )

    def undo(
        self,
        scope: str,
        *,
        operator: str | Identity | None = None,
        reason: str | None = None,
        dry_run: bool = False,
    ) -> UndoReport:
        """Reverse the landed calls (COMPLETED, RESOLVED_LANDED) whose call id starts with
        `scope`, newest first, each by its tool's undo, an ordinary call under the call id
        ``undo/<call id>``. Run again after a crash, it resumes and undoes nothing twice.
        Calls without an undo are listed; an Indeterminate call waits for an operator unless
        its undo is Idempotent; an undo that fails, or whose outcome is unknown, stops the
        sequence there. `operator` (who asks; an `Identity` also records how they were known) and
        `reason` go into the audit; `dry_run` only reports what would be done (docs/undo.md)."""
        return _undo.undo(self._engine, scope, operator=operator, reason=reason, dry_run=dry_run)

    async def aundo(
        self,
        scope: str,
        *,
        operator: str | Identity | None = None,
        reason: str | None = None,
        dry_run: bool = False,
    ) -> UndoReport:
        """`undo` for async applications (run off the event loop)."""
        return await asyncio.to_thread(
            self.undo, scope, operator=operator, reason=reason, dry_run=dry_run
        )

    async def alaunch(self, *, background: bool = True) -> RecoveryReport:
        """`launch` for async applications (the pass runs off the event loop)."""
        return await asyncio.to_thread(self.launch, background=background)

    async def arecover(self) -> RecoveryReport:
        """`recover` for async applications."""
        return await asyncio.to_thread(self.recover)

    async def aresolve(
        self, intent_id: str, *, landed: bool, result: Any = None, operator: str, reason: str
    ) -> Intent:
        """`resolve` for async applications."""
        return await asyncio.to_thread(
            self.resolve, intent_id, landed=landed, result=result, operator=operator, reason=reason
        )

    def deliver_notifications(self, *, gather: bool = False) -> int:
        """Deliver the notifications due to this kernel's notifiers now; returns how many
        deliveries were made. Those of calls whose evidence is still to be gathered wait
        for it: the delivery duty gathers it (each within its `Evidence.timeout`), or, with
        `gather`, this call does first (for a process that exits next)."""
        if gather:
            self._aids.round(self.deliver_notifications, lambda: self._closed, finish=True)
        return self._aids.deliver_due(self.notifiers, self._upkeep)

    @property
    def evidence_tools(self) -> frozenset[str]:
        """The tools that declare `evidence=`."""
        return frozenset(self._aids.gatherer.rules)

    @property
    def escalations(self) -> dict[str, float]:
        """Each tool's ``escalate_after``, in seconds."""
        return dict(self._aids.ageing.thresholds)

    def evidence(self, intent_id: str, *, operator: str | Identity | None = None) -> Found | None:
        """Gather the evidence of one call now (by intent id or call id) with its tool's
        `Evidence`, within its timeout; recorded as an ``evidence`` event naming who asked
        (`operator`), and returned as recorded (`poimen evidence`, the console). Facts
        only: it never decides, and a failure is recorded, not raised."""
        return self._aids.evidence(intent_id, operator)

    def publish_audit_head(self) -> Head | None:
        """Publish the head of the log's audit chain now, as ``audit_head_every`` does (a log
        line, the notifiers, the observers); returns it, or None for a log without a chain."""
        return self._heads.publish(force=True)
