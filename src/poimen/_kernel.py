"""The kernel: registers tools, writes the intent log, dispatches, recovers."""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
import os
import random
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, TypeVar

from poimen import _crashpoints, _guard
from poimen._capability import CallScope, Issuer, Sink, ToolContext
from poimen._effects import EffectClass, Idempotent, Queryable, Unsafe, effect_name
from poimen._intents import (
    Completed,
    Denial,
    Failed,
    Indeterminate,
    Intent,
    IntentState,
    Outcome,
    Pending,
    Resolved,
)
from poimen._keys import args_digest, canonical, encode_args, to_json_value
from poimen._liveness import current_owner, process_alive
from poimen._notify import LogNotifier, Notifier, Renotifier, deliver, notifier_names
from poimen._operator import resolve as operator_resolve
from poimen._recovery import RecoveryReport, indeterminate, recover_pass, resolve_unknown
from poimen._tools import Caps, Tool, ToolRegistration, build_tool
from poimen.errors import (
    ArgumentError,
    CallIdMismatchError,
    CapabilityDeniedError,
    DefiniteFailure,
    IntentNotFoundError,
    NondeterministicKeyError,
    PoimenError,
    RegistrationError,
    SandboxDeniedError,
    UnknownToolError,
)
from poimen.store import Store, open_store
from poimen.store._base import NewDispatch

log = logging.getLogger("poimen")
F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")
Mode = Literal["live", "shadow", "replay"]
S = IntentState


@dataclass(frozen=True, slots=True)
class _Run:
    kind: Literal["completed", "failed", "unknown", "denied_after_write"]
    value: Any = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class _Write:
    """What a definite outcome writes, and what the caller gets once it is written."""

    state: IntentState
    result: str | None
    error: str | None
    value: Any

    @classmethod
    def of(cls, run: _Run) -> _Write:
        if run.kind == "failed":
            return cls(S.FAILED, None, run.error, None)
        try:
            text = canonical(to_json_value(run.value, "<result>"))
        except PoimenError as exc:  # the call still landed: complete it, say what was lost
            return cls(S.COMPLETED, None, f"result not recorded: {exc}", run.value)
        return cls(S.COMPLETED, text, None, None)

    def outcome(self, intent_id: str) -> Outcome:
        if self.state == S.FAILED:
            return Failed(intent_id, self.error or "")
        return Completed(intent_id, self.value if self.result is None else json.loads(self.result))


class Kernel:
    """Registers tools, journals every call before and after dispatch, and recovers by class.

    `store` is a Store or a URL (``sqlite:///path``, ``postgresql://...``). Call `launch()`
    once the tools are registered: it runs the restart scan and starts background upkeep.
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
    ) -> None:
        if mode not in ("live", "shadow", "replay"):
            raise PoimenError(f"mode must be live, shadow or replay, not {mode!r}", field="mode")
        _check_settings(
            positive={
                "lease_ttl": lease_ttl,
                "lookup_backoff": lookup_backoff,
                "max_backoff": max_backoff,
                "recover_interval": recover_interval,
            },
            non_negative={"deadline_margin": deadline_margin, "wait_bound": wait_bound},
            counts={"max_attempts": max_attempts, "lookup_limit": lookup_limit},
        )
        notifier_names(notifiers or ())  # one name each: refused here, not mid-recovery
        self.store: Store = open_store(store) if isinstance(store, str) else store
        self.owner = current_owner(worker_id, host)
        self.mode: Mode = mode
        self.lease_ttl = lease_ttl
        self.notifiers: list[Notifier] = (
            list(notifiers) if notifiers is not None else [LogNotifier()]
        )
        self.max_attempts = max_attempts
        self.lookup_limit = lookup_limit
        self.lookup_backoff = lookup_backoff
        self.max_backoff = max_backoff
        self.deadline_margin = deadline_margin
        self.wait_bound = wait_bound
        self.recover_interval = recover_interval
        # Reminders for INDETERMINATE intents still open after this many seconds.
        self._renotifier = Renotifier(renotify_after) if renotify_after is not None else None
        self._tools: dict[str, Tool] = {}
        self.checks: dict[str, str] = {}  # tool id -> what an operator checks (`describe`)
        self._inflight: set[str] = set()
        self._inflight_lock = threading.Lock()
        self._stop = threading.Event()
        self._upkeep: threading.Thread | None = None
        self._background = False
        self._wake = threading.Event()  # a notification is waiting in the outbox
        self._deliver_lock = threading.Lock()
        self._on_close: list[Callable[[], object]] = []
        self._store_pool: ThreadPoolExecutor | None = None  # acall's blocking steps
        # Layer 2: write tokens, registered sinks, the shared HTTP pool of ctx.http.
        self._issuer = Issuer(self.store)
        self._on_close.append(self._issuer.close)

    @property
    def worker_id(self) -> str:
        return self.owner.worker_id

    # Registration.

    def tool(
        self, *, id: str, effects: EffectClass, caps: Caps, timeout: float
    ) -> Callable[[F], F]:
        """Register the decorated function. Every argument is required."""
        registration = ToolRegistration(id=id, effects=effects, caps=caps, timeout=timeout)

        def decorate(fn: F) -> F:
            self.register(registration, fn)
            return fn

        return decorate

    def register(self, registration: ToolRegistration, fn: Callable[..., Any]) -> Tool:
        if not isinstance(registration, ToolRegistration):
            raise RegistrationError(
                f"expected a ToolRegistration, got {type(registration).__name__}"
            )
        if registration.id in self._tools:
            raise RegistrationError(
                f"tool {registration.id!r} is already registered", tool_id=registration.id
            )
        tool = build_tool(registration, fn)
        if isinstance(registration.effects, Idempotent):
            _guard.install()
        self._tools[registration.id] = tool
        return tool

    def describe(self, tool_id: str, *, check: str) -> None:
        """What an operator should check before resolving `tool_id`'s Indeterminate calls."""
        self.checks[tool_id] = check

    def register_sink(self, name: str, sink: Sink) -> None:
        """Make `sink` available to tools as `ctx.sink(name)`; Idempotent tools also need
        `name` in their registration's `caps.sinks`."""
        self._issuer.register_sink(name, sink)

    def denials(
        self, tool_id: str | None = None, since: float | None = None, *, limit: int = 1000
    ) -> list[Denial]:
        """The audit of denied writes, oldest first, optionally for one tool or since a time."""
        return self.store.denials(tool_id=tool_id, since=since, limit=limit)

    def registered(self) -> dict[str, ToolRegistration]:
        return {k: t.registration for k, t in self._tools.items()}

    # Life cycle.

    def launch(self, *, background: bool = True) -> RecoveryReport:
        """Run the restart scan and recovery pass; with `background`, keep recovery and
        notification delivery going every `recover_interval` seconds."""
        report = self.recover()
        if background:
            self._background = True
            self._start_upkeep()
        return report

    def _start_upkeep(self) -> None:
        # Leases of held intents are renewed and notifications delivered off the caller's
        # thread even without launch(); launch(background=True) adds periodic recovery.
        with self._inflight_lock:
            if self._upkeep is not None or self._stop.is_set():
                return
            self._upkeep = threading.Thread(
                target=self._upkeep_loop, name="poimen-upkeep", daemon=True
            )
        self._upkeep.start()

    def on_close(self, fn: Callable[[], object]) -> None:
        """Run `fn` when the kernel closes (e.g. to close a tool's HTTP client)."""
        self._on_close.append(fn)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._upkeep is not None:
            self._upkeep.join(timeout=10)
            self._upkeep = None
        while self._on_close:
            self._on_close.pop()()
        self.store.close()

    def __enter__(self) -> Kernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _upkeep_loop(self) -> None:
        period = min(self.lease_ttl / 3, self.recover_interval, 1.0)
        next_recover = time.monotonic() + self.recover_interval
        while not self._stop.is_set():
            woken = self._wake.wait(period)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._renew()
                if self._background and time.monotonic() >= next_recover:
                    self.recover()
                    next_recover = time.monotonic() + self.recover_interval
                elif woken or self._background:
                    self.deliver_notifications()
            except PoimenError as exc:  # upkeep keeps going; the next round retries
                log.warning("poimen upkeep: %s", exc)

    def _hold(self, intent_id: str) -> bool:
        """Mark an intent as driven by this kernel, from before its dispatch commit until it is
        settled; False if it already is. Held intents are never claimable by this kernel's own
        recovery, and their leases are renewed."""
        with self._inflight_lock:
            if intent_id in self._inflight:
                return False
            self._inflight.add(intent_id)
        if self._upkeep is None:
            self._start_upkeep()
        return True

    def _release(self, intent_id: str) -> None:
        with self._inflight_lock:
            self._inflight.discard(intent_id)

    def drive_orphan(self, t: Tool, intent: Intent) -> Outcome | None:
        """Settle an unfinished intent found claimable; None if this kernel already drives it."""
        if not self._hold(intent.id):
            return None
        try:
            return self._drive(t, intent)
        finally:
            self._release(intent.id)

    def _renew(self) -> None:
        with self._inflight_lock:
            ids = list(self._inflight)
        if ids:
            self.store.renew_leases(self.worker_id, ids, self.store.now() + self.lease_ttl)

    # The call path.

    def call(self, tool: str, args: Mapping[str, Any], *, call_id: str) -> Outcome:
        """Journal, dispatch and settle one call. Indeterminate is returned, not raised."""
        if _guard.current() is not None:
            # Called from inside a guarded tool: the kernel's writes are not that tool's, and
            # the inner tool is guarded by its own class.
            token = _guard.suspend()
            try:
                return self.call(tool, args, call_id=call_id)
            finally:
                _guard.resume(token)
        t, d, kwargs = self._prepare(tool, args, call_id)
        self._hold(d.intent_id)
        try:
            _crashpoints.hit("before_dispatch_commit")
            intent, created = self.store.record_dispatch(d)
            if not created:
                return self._existing(t, intent, d)
            _crashpoints.hit("after_dispatch_commit")
            return self._drive(t, intent, kwargs)
        finally:
            self._release(d.intent_id)

    async def acall(self, tool: str, args: Mapping[str, Any], *, call_id: str) -> Outcome:
        if _guard.current() is not None:  # see call()
            token = _guard.suspend()
            try:
                return await self.acall(tool, args, call_id=call_id)
            finally:
                _guard.resume(token)
        t, d, kwargs = self._prepare(tool, args, call_id)
        self._hold(d.intent_id)
        try:
            _crashpoints.hit("before_dispatch_commit")
            arecord = getattr(self.store, "arecord_dispatch", None)
            if arecord is not None:  # the store commits for us without a thread per caller
                intent, created = await arecord(d)
            else:
                intent, created = await self._offload(self.store.record_dispatch, d)
            if not created:
                return await self._offload(self._existing, t, intent, d)
            _crashpoints.hit("after_dispatch_commit")
            while True:
                run = await self._invoke_async(t, intent, kwargs)
                nxt = await self._asettle(t, intent, run)
                if not isinstance(nxt, Intent):
                    return nxt
                intent = nxt
        finally:
            self._release(d.intent_id)

    def _offload(self, fn: Callable[..., R], *args: Any) -> asyncio.Future[R]:
        """Run a blocking step of acall (a commit, mostly) on the kernel's store pool, in the
        caller's context. The loop's default pool has cpu_count + 4 threads, which capped how
        many async callers' commits could meet in one group commit."""
        pool = self._store_pool
        if pool is None:
            with self._inflight_lock:
                if self._store_pool is None:
                    self._store_pool = ThreadPoolExecutor(64, thread_name_prefix="poimen-store")
                    self._on_close.append(self._shutdown_pool)
                pool = self._store_pool
        ctx = contextvars.copy_context()
        return asyncio.get_running_loop().run_in_executor(pool, partial(ctx.run, fn, *args))

    def _shutdown_pool(self) -> None:
        pool, self._store_pool = self._store_pool, None
        if pool is not None:
            pool.shutdown(wait=False)

    def _prepare(
        self, tool: str, args: Mapping[str, Any], call_id: str
    ) -> tuple[Tool, NewDispatch, dict[str, Any]]:
        t = self._tools.get(tool) if isinstance(tool, str) else None
        if t is None:
            raise UnknownToolError(f"no tool is registered as {tool!r}", tool_id=tool)
        if not isinstance(call_id, str) or not call_id:
            raise PoimenError(
                f"call_id must be a non-empty string, got {call_id!r}", field="call_id"
            )
        effects = t.registration.effects
        if self.mode != "live" and isinstance(effects, Unsafe):
            self.store.record_denial(
                tool_id=t.id,
                intent_id=None,
                attempt=None,
                action="dispatch",
                target=call_id,
                reason=f"unsafe tool in {self.mode} mode",
                now=self.store.now(),
            )
            raise SandboxDeniedError(
                f"tool {t.id!r} is Unsafe and {self.mode} mode denies it", tool_id=t.id
            )
        data, _ = encode_args(args)
        recorded, kwargs = t.validate(data)
        text = canonical(recorded)
        key = request_id = None
        if isinstance(effects, Idempotent):
            key = effects.key.derive(t.id, recorded)
            if effects.key.mode == "custom" and effects.key.derive(t.id, recorded) != key:
                raise NondeterministicKeyError(
                    f"tool {t.id!r}: its key derivation gave two keys for one set of arguments",
                    tool_id=t.id,
                )
        elif isinstance(effects, Queryable):
            request_id = _new_request_id()
        now = self.store.now()
        timeout = t.registration.timeout
        d = NewDispatch(
            intent_id=_new_id(),
            call_id=call_id,
            tool_id=t.id,
            effect=effect_name(effects),
            args=text,
            args_hash=args_digest(text),
            key=key,
            request_id=request_id,
            owner=self.owner,
            lease_expires_at=now + max(self.lease_ttl, timeout),
            timeout_s=timeout,
            deadline_at=now + timeout + self.deadline_margin,
            now=now,
        )
        return t, d, kwargs

    def _existing(self, t: Tool, intent: Intent, d: NewDispatch) -> Outcome:
        if intent.tool_id != t.id or intent.args_hash != d.args_hash:
            raise CallIdMismatchError(
                f"call id {d.call_id!r} was recorded for tool {intent.tool_id!r} with other "
                "arguments; a call id always names the same call",
                call_id=d.call_id,
                intent_id=intent.id,
            )
        if intent.state != S.DISPATCHED:
            return self._answer(intent)
        deadline = time.monotonic() + self.wait_bound
        while True:
            now = self.store.now()
            due = intent.next_check_at is None or intent.next_check_at <= now
            if due and self._claimable(intent, now):
                out = self.drive_orphan(t, intent)
                if out is not None:
                    return out
            if time.monotonic() >= deadline:
                return Pending(intent.id, "in_flight")
            time.sleep(0.05)
            current = self.store.get_intent(intent.id)
            assert current is not None
            if current.state != S.DISPATCHED:
                return self._answer(current)
            intent = current

    def _drive(self, t: Tool, intent: Intent, kwargs: dict[str, Any] | None = None) -> Outcome:
        """Run an intent we hold to an outcome: invoke, settle, retry by class."""
        if kwargs is None:
            # Recovery of an orphan: decide first, the tool runs only if its class says so.
            nxt = resolve_unknown(self, t, intent)
            if not isinstance(nxt, Intent):
                return nxt
            intent = nxt
            try:
                _, kwargs = t.validate(json.loads(intent.args))
            except ArgumentError as exc:  # the tool's signature changed since the dispatch
                log.error("intent %s: recorded arguments no longer validate: %s", intent.id, exc)
                return indeterminate(self, intent, "arguments_no_longer_valid")
        while True:
            run = self._invoke_sync(t, intent, kwargs)
            nxt = self._settle(t, intent, run)
            if not isinstance(nxt, Intent):
                return nxt
            intent = nxt

    def _context(self, t: Tool, intent: Intent) -> ToolContext:
        reg = t.registration
        key = intent.key
        # Only an Idempotent call is guarded: its handles carry a token for this attempt.
        scope = (
            self._issuer.scope(t.id, intent.id, intent.attempts, key, reg.caps)
            if key is not None and isinstance(reg.effects, Idempotent)
            else None
        )
        return ToolContext(
            tool_id=t.id,
            intent_id=intent.id,
            call_id=intent.call_id,
            attempt=intent.attempts,
            key=key,
            request_id=intent.request_id,
            issuer=self._issuer,
            scope=scope,
            timeout=reg.timeout,
        )

    def _invoke_sync(self, t: Tool, intent: Intent, kwargs: dict[str, Any]) -> _Run:
        ctx = self._context(t, intent)
        scope = ctx._scope
        try:
            if t.is_async:
                coro = t.fn(ctx, **kwargs)
                if scope is not None:
                    coro = _guard.arun(scope, coro)
                value = _run_coroutine(asyncio.wait_for(coro, t.registration.timeout))
            elif scope is not None:
                value = _guard.run(scope, t.fn, ctx, kwargs)
            else:
                # A sync tool cannot be preempted; its timeout sets the lease and deadline.
                value = t.fn(ctx, **kwargs)
        except Exception as exc:
            return _classify(exc, scope)
        finally:
            if scope is not None:
                scope.end()
        return _Run("completed", value=value)

    async def _invoke_async(self, t: Tool, intent: Intent, kwargs: dict[str, Any]) -> _Run:
        ctx = self._context(t, intent)
        scope = ctx._scope
        try:
            if t.is_async:
                coro = t.fn(ctx, **kwargs)
                if scope is not None:
                    coro = _guard.arun(scope, coro)
                value = await asyncio.wait_for(coro, t.registration.timeout)
            elif scope is not None:
                value = await asyncio.to_thread(_guard.run, scope, t.fn, ctx, kwargs)
            else:
                # As in call(): a thread cannot be preempted, and giving up on it while its
                # request may still land would let recovery re-issue it.
                value = await asyncio.to_thread(t.fn, ctx, **kwargs)
        except Exception as exc:  # timeouts included: the outcome is unknown
            return _classify(exc, scope)
        finally:
            if scope is not None:
                scope.end()
        return _Run("completed", value=value)

    def _settle(self, t: Tool, intent: Intent, run: _Run) -> Outcome | Intent:
        _crashpoints.hit("after_effect")
        now = self.store.now()
        if run.kind in ("completed", "failed"):
            w = _Write.of(run)
            if self.store.record_outcome(
                intent.id, intent.fence, w.state, result=w.result, error=w.error, now=now
            ):
                return w.outcome(intent.id)
            return self._answer_current(intent.id)
        self.store.record_unknown(intent.id, intent.fence, run.error or "unknown", now)
        if run.kind == "denied_after_write":
            return indeterminate(self, intent, "capability_denied_after_write")
        return resolve_unknown(self, t, intent)

    async def _asettle(self, t: Tool, intent: Intent, run: _Run) -> Outcome | Intent:
        """`_settle` for acall: a definite outcome is written without a thread per caller."""
        arecord = getattr(self.store, "arecord_outcome", None)
        if arecord is None or run.kind not in ("completed", "failed"):
            return await self._offload(self._settle, t, intent, run)
        _crashpoints.hit("after_effect")
        w = _Write.of(run)
        if await arecord(
            intent.id, intent.fence, w.state, result=w.result, error=w.error, now=self.store.now()
        ):
            return w.outcome(intent.id)
        return await self._offload(self._answer_current, intent.id)

    def _claim_retry(self, intent: Intent) -> Outcome | Intent:
        now = self.store.now()
        timeout = intent.timeout_s
        claimed = self.store.claim(
            intent.id,
            intent.fence,
            self.owner,
            lease_expires_at=now + max(self.lease_ttl, timeout),
            new_attempt=True,
            deadline_at=now + timeout + self.deadline_margin,
            now=now,
        )
        if claimed is None:
            return Pending(intent.id, "lost_race")
        return claimed

    def _claimable(self, intent: Intent, now: float) -> bool:
        o = intent.owner
        if o is None:
            return True
        if o == self.owner:
            with self._inflight_lock:
                return intent.id not in self._inflight
        me = self.owner
        if intent.lease_expires_at is not None and intent.lease_expires_at <= now:
            return True
        # Only on our own host can a pid say anything; elsewhere the lease decides.
        return o.host == me.host and not process_alive(o.pid, o.pid_start)

    def _answer_current(self, intent_id: str) -> Outcome:
        current = self.store.get_intent(intent_id)
        if current is None:
            raise IntentNotFoundError(f"no intent {intent_id!r}", intent_id=intent_id)
        return self._answer(current)

    def _answer(self, intent: Intent) -> Outcome:
        match intent.state:
            case S.COMPLETED:
                return Completed(
                    intent.id, None if intent.result is None else json.loads(intent.result)
                )
            case S.FAILED:
                return Failed(intent.id, intent.error or "")
            case S.INDETERMINATE:
                return Indeterminate(intent.id, intent.reason or "")
            case S.RESOLVED_LANDED | S.RESOLVED_NOT_LANDED:
                return Resolved(
                    intent.id,
                    intent.state == S.RESOLVED_LANDED,
                    None if intent.result is None else json.loads(intent.result),
                )
            case S.DISPATCHED:
                return Pending(intent.id, intent.reason or "in_flight")
        raise AssertionError(intent.state)

    # Recovery and the operator path.

    def recover(self, *, progress: Callable[[int], object] | None = None) -> RecoveryReport:
        """One recovery pass now; then deliver due notifications."""
        report = recover_pass(self, progress=progress)
        self.deliver_notifications()
        return report

    def resolve(
        self, intent_id: str, *, landed: bool, result: Any = None, operator: str, reason: str
    ) -> Intent:
        """An operator's decision on an INDETERMINATE intent; terminal and audited."""
        return operator_resolve(
            self.store, intent_id, landed=landed, result=result, operator=operator, reason=reason
        )

    def deliver_notifications(self) -> int:
        with self._deliver_lock:
            if self._renotifier is not None:
                self._renotifier.maybe_run(self.store, self.notifiers)
            return deliver(self.store, self.notifiers)

    def _notify_soon(self) -> None:
        """The outbox row is committed: have the upkeep thread deliver it, so a slow webhook
        never holds up the caller (nor other callers behind the delivery lock)."""
        _crashpoints.hit("before_notify")
        self._start_upkeep()
        self._wake.set()


def _check_settings(
    *, positive: dict[str, float], non_negative: dict[str, float], counts: dict[str, int]
) -> None:
    for name, v in {**positive, **non_negative}.items():
        if (
            isinstance(v, bool)
            or not isinstance(v, int | float)
            or not math.isfinite(v)
            or (v <= 0 if name in positive else v < 0)
        ):
            kind = "positive" if name in positive else "non-negative"
            raise PoimenError(f"{name} must be a {kind} number of seconds, not {v!r}", field=name)
    for name, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PoimenError(f"{name} must be a whole number of at least 1, not {n!r}", field=name)


def _refused(exc: BaseException, scope: CallScope | None) -> _Run:
    """A provider's refusal, or a write the kernel denied: FAILED, never retried (a retry would
    be denied the same way), unless an earlier write of this attempt went out under the key:
    then the effect may have landed, and an operator decides."""
    if isinstance(exc, CapabilityDeniedError) and scope is not None and scope.writes:
        return _Run("denied_after_write", error=_failure(exc))
    return _Run("failed", error=_failure(exc))


def _failure(exc: BaseException) -> str:
    if isinstance(exc, CapabilityDeniedError):
        return f"capability denied: {exc}"
    return str(exc) or type(exc).__name__


def _classify(exc: Exception, scope: CallScope | None) -> _Run:
    if isinstance(exc, DefiniteFailure | CapabilityDeniedError):
        return _refused(exc, scope)
    return _unknown(exc, scope)


def _unknown(exc: Exception, scope: CallScope | None) -> _Run:
    # A library that wrapped a denial (raise ... from it) hides a write that never left.
    seen: BaseException | None = exc
    for _ in range(8):
        seen = seen.__cause__ or seen.__context__ if seen is not None else None
        if isinstance(seen, CapabilityDeniedError):
            return _refused(seen, scope)
    return _Run("unknown", error=f"{type(exc).__name__}: {exc}")


# Intent ids need uniqueness, not secrecy. os.urandom per call hands the GIL back for a
# system call and, with the store's writer thread busy, waited 60 us to win it again (profile
# of 64 async callers); a generator seeded from it once per process, and again in a forked
# child, does not.
_ids = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(32)))


def _new_id() -> str:
    # Time-ordered, so recovery scans the oldest unfinished intents first.
    return f"in_{time.time_ns():016x}{_ids.getrandbits(40):010x}"


def _new_request_id() -> str:
    # Request ids go to providers, and a lookup trusts what answers under one: unpredictable.
    return "rq_" + secrets.token_hex(16)


def _run_coroutine(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise PoimenError("an async tool called with Kernel.call inside a running loop: use acall")
