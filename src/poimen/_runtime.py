"""A kernel's running parts and their wiring: built once, closed once, renewed after a fork.

`Kernel` (`poimen._kernel`) is the public face and subclasses `Runtime`: its constructor hands
its arguments to `_build`, `close` runs `_shut`, and a forked child runs `_after_fork_in_child`
(`poimen._engine.workers`); `engine_of` is how poimen's own modules that are handed a kernel
reach its engine. What each part does is its own module's: the engine
(`poimen._engine.engine`) runs the calls, `Upkeep` the background duties, `Aids` evidence and
escalation, `poimen._observe` the observers, `poimen.sandbox._modes` shadow and replay.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Literal

from poimen import _observe
from poimen._aids import Aids
from poimen._capability.context import Issuer
from poimen._engine import crashpoints as _crashpoints
from poimen._engine import hooks as _hooks
from poimen._engine import runners as _runners
from poimen._engine.audit_head import HeadPublisher, check_every
from poimen._engine.engine import Engine, Settings
from poimen._engine.liveness import current_owner
from poimen._engine.notify import LogNotifier, Notifier, notifier_names
from poimen._engine.upkeep import Upkeep
from poimen._engine.workers import (
    LIVE,
    Live,
    claim_worker_id,
    forget_worker_id,
    release_worker_id,
)
from poimen.errors import PoimenError
from poimen.events import KernelEvent, Observer
from poimen.sandbox import _modes as _sandbox
from poimen.store import Store, open_store

log = logging.getLogger("poimen")
Mode = Literal["live", "shadow", "replay"]


class Runtime:
    """The parts of one running kernel, and the sequences that build, close and fork them."""

    store: Store
    mode: Mode
    notifiers: list[Notifier]
    checks: dict[str, str]  # tool id -> what an operator checks (`describe`)
    _engine: Engine
    _issuer: Issuer
    _aids: Aids
    _heads: HeadPublisher
    _upkeep: Upkeep
    _sandbox: _sandbox.Sandbox | None
    _on_close: list[Callable[[], object]]
    _live: Live  # this kernel in the process's registry (poimen._engine.workers)
    _log_watch: bool
    _given_worker_id: str | None
    _given_host: str | None

    def _build(
        self,
        store: Store | str,
        *,
        worker_id: str | None,
        host: str | None,
        mode: Mode,
        settings: Callable[[], Settings],
        notifiers: Sequence[Notifier] | None,
        escalate_to: Sequence[Notifier],
        renotify_after: float | None,
        recording: str | Store | None,
        live: str | Store | None,
        scope: str | None,
        on_divergence: Literal["raise", "record"],
        observers: Sequence[Observer] | None,
        log_events: bool | None,
        audit_head_every: float | None,
        recover: Callable[[], object],
        deliver: Callable[[], int],
    ) -> None:
        """Check the arguments (each refusal a `PoimenError` naming its field, in this order),
        then open and wire the parts; a failure part-way closes what was opened."""
        if not isinstance(store, str) and not callable(getattr(store, "record_dispatch", None)):
            raise PoimenError(
                f"store must be a URL string or a Store, not {store!r}", field="store"
            )
        _sandbox.check_options(
            mode, recording=recording, live=live, scope=scope, on_divergence=on_divergence
        )
        if worker_id is not None and (not isinstance(worker_id, str) or not worker_id.strip()):
            raise PoimenError(
                f"worker_id must be a non-empty string, not {worker_id!r}", field="worker_id"
            )
        valid = settings()
        check_every(audit_head_every)
        # One name each (escalation notifiers too): refused here, not mid-recovery.
        notifier_names([*(notifiers or ()), *escalate_to])
        self._given_worker_id = worker_id
        self._given_host = host
        owner = current_owner(worker_id, host)
        self._live = Live(self._after_fork_in_child)
        claim_worker_id(owner.worker_id, self._live)
        try:
            self.store = open_store(store) if isinstance(store, str) else store
        except BaseException:
            release_worker_id(owner.worker_id, self._live)
            raise
        self.mode = mode
        self.notifiers = list(notifiers) if notifiers is not None else [LogNotifier()]
        self._on_close = []
        # Layer 2: write tokens, registered sinks, the shared HTTP pool of ctx.http.
        self._issuer = Issuer(self.store, live=mode == "live")
        self._on_close.append(self._issuer.close)
        self._engine = Engine(
            self.store,
            owner,
            self._issuer,
            valid,
            notify=self._notify_soon,
            notifiers=self.notifiers,
            on_call=self._before_call,
        )
        # Evidence, ageing, escalation: gathered and sent by the delivery duty (poimen._aids).
        self._aids = Aids(self.store, self._issuer, self._engine.tools, escalate_to, renotify_after)
        self._heads = HeadPublisher(
            self.store,
            lambda: self.notifiers,
            self._emit,
            lambda: str(self._engine.owner.worker_id),
        )
        self._upkeep = Upkeep(
            renew=self._renew,
            recover=recover,
            deliver=lambda: self._aids.round(deliver, lambda: self._closed, finish=False),
            lease_ttl=valid.lease_ttl,
            recover_interval=valid.recover_interval,
            publish=None if audit_head_every is None else self._heads.publish,
            publish_every=audit_head_every or 3600.0,
        )
        self.checks = {}
        _observe.setup(self._engine, self, observers, log_events)
        # Logging configured later is looked for at each call and pass (_observe.relog).
        self._log_watch = _observe.watching(self._engine, log_events)
        LIVE.add(self._live)
        # Shadow and replay answer calls without effects: poimen.sandbox._modes, docs/sandbox.md.
        try:
            self._sandbox = _sandbox.attach(
                self._engine, self.store, mode, recording=recording, live=live, scope=scope,
                on_divergence=on_divergence, on_close=self._on_close,
            )  # fmt: skip
        except BaseException:
            self._shut()
            raise

    @property
    def _closed(self) -> bool:
        return self._engine.closed

    def _shut(self) -> None:
        """`Kernel.close`: the duties stop, cancelled calls finish settling, then the close
        hooks, pools, observers and the store close, in that order. Idempotent."""
        if self._closed:
            return
        self._engine.closed = self._live.closed = True
        self._aids.gatherer.close()
        self._upkeep.stop(within=10.0)
        _runners.wait_continuations(self._engine, within=30.0)
        while self._on_close:
            try:
                self._on_close.pop()()
            except Exception:
                log.exception("poimen: a close hook failed")
        self._engine.shutdown_pools()
        if self._engine.observer is not None:
            self._engine.observer.close()
        self.store.close()
        release_worker_id(str(self._engine.owner.worker_id), self._live)
        LIVE.discard(self._live)

    def _after_fork_in_child(self) -> None:
        """A forked child is another process: a new identity, no calls of the parent's, its
        own connections and threads (the parent's do not exist here)."""
        old, given = str(self._engine.owner.worker_id), self._given_worker_id
        owner = current_owner(f"{given}.{os.getpid()}" if given else None, self._given_host)
        self._engine.after_fork(owner)
        forget_worker_id(old)
        claim_worker_id(owner.worker_id, self._live)
        _observe.after_fork(self._engine)
        self._issuer.after_fork()
        self._aids.after_fork()
        after_fork = getattr(self.store, "after_fork", None)
        if after_fork is not None:
            after_fork()
        background = self._upkeep.background
        self._upkeep.after_fork()
        if background and not self._closed:
            self._upkeep.start(background=True)

    def _renew(self) -> None:
        self._engine.renew()

    def _before_call(self) -> None:
        if self._log_watch and _observe.logging_wanted():  # _watch_logging's test, inline
            self._watch_logging()
        self._upkeep.held()

    def _watch_logging(self) -> None:
        """Install poimen's logging once it was configured after the kernel was made."""
        if self._log_watch and _observe.logging_wanted():
            self._log_watch = False
            _observe.relog(self._engine, self)

    def _emit(self, event: KernelEvent) -> None:
        _hooks.point(self._engine, lambda base: event)

    def _notify_soon(self) -> None:
        """The outbox row is committed: have the delivery duty deliver it, so a slow webhook
        never holds up the caller (nor other callers behind the delivery lock)."""
        _crashpoints.hit("before_notify")
        self._upkeep.notify_soon()


def engine_of(kernel: Runtime) -> Engine:
    """The engine a kernel runs on, for poimen's own modules that are handed a `Kernel` (an
    observer's `bind`, the integrations, the soak); not public API. The kernel's own parts are
    handed the engine when they are made or called."""
    return kernel._engine
