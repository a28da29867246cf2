"""The one runtime object of a kernel: its settings (validated once), its store and identity,
its tools, its pools, and the call entry every caller takes (`Engine.run_call`/`arun_call`:
`Kernel.call`/`acall`, a shadow or replay kernel's calls), so no path skips a check, the
observer or the sandbox. `poimen.Kernel` is the facade that builds one and forwards to it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import os
import random
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

from poimen import call_ids
from poimen._capability import guard as _guard
from poimen._capability.context import Issuer
from poimen._core.approval import ApprovalRule, approval_due, approval_rule
from poimen._core.backoff import seconds
from poimen._core.decide import Policy, claimability
from poimen._core.effects import Idempotent, Transactional, effect_name
from poimen._core.intents import Intent, IntentState, Outcome, Owner
from poimen._core.keys import (
    MAX_CALL_ID_BYTES,
    canonical,
    check_call_id,
    checked_text,
    encode_args,
    key_hasher,
    key_of_text,
)
from poimen._core.retry import Retry as RetryPolicy
from poimen._core.spec import ToolSpec, safe_name, spec_of
from poimen._core.tools import Tool, ToolRegistration, build_tool
from poimen._core.undo import UndoArgs, UndoRule, undo_rule
from poimen._engine import hooks as _hooks
from poimen._engine.flat import flat_acall, flat_call
from poimen._engine.hooks import CALLS
from poimen._engine.liveness import owner_alive
from poimen._engine.notify import Notifier
from poimen._engine.protocol import Approval, answer, call_steps, given, orphan_steps
from poimen._engine.runners import run_async, run_sync
from poimen._engine.steps import CallState, Holds
from poimen._engine.transactional import Database
from poimen.call_ids import is_edit, is_undo
from poimen.errors import (
    IntentNotFoundError,
    NondeterministicKeyError,
    PoimenError,
    RegistrationError,
    ReservedCallIdError,
    UnknownToolError,
    WrongRunnerError,
)
from poimen.events import LeasesRenewedEvent
from poimen.store import Store
from poimen.store._base import NewDispatch

if TYPE_CHECKING:
    from poimen._engine.hooks import Observers


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """A kernel's settings, in seconds and counts; refused here, once, with a `PoimenError`
    naming the one out of range (`poimen.Kernel` documents each)."""

    lease_ttl: float = 30.0
    """How long a dispatched call's lease lasts (at least its tool's timeout)."""
    max_attempts: int = 5
    """Attempts per call, the first included, for a tool without its own `Retry`."""
    lookup_limit: int = 8
    """"Unknown" answers a Queryable call's lookup may give before it is Indeterminate."""
    lookup_backoff: float = 1.0
    """The wait before asking again after the first "unknown" answer."""
    max_backoff: float = 300.0
    """The longest wait between two lookups."""
    deadline_margin: float = 1.0
    """Added to a call's timeout to make its deadline."""
    wait_bound: float = 5.0
    """How long a call waits for another owner of its call id before it answers Pending."""
    recover_interval: float = 5.0
    """How often the background recovery pass and the delivery of notifications run."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "int":
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise PoimenError(
                        f"{f.name} must be a whole number of at least 1, not {v!r}", field=f.name
                    )
                continue
            positive = f.name not in ("deadline_margin", "wait_bound")
            if not seconds(v, positive=positive):
                kind = "positive" if positive else "non-negative"
                raise PoimenError(
                    f"{f.name} must be a {kind} number of seconds, not {v!r}", field=f.name
                )


@dataclass(slots=True, kw_only=True)
class ToolRecord:
    """Everything registered for one tool, kept together (`Engine.add`)."""

    tool: Tool
    """Its registration, function and argument schema."""
    spec: ToolSpec
    """What models see of it, under `spec.name`."""
    retry: RetryPolicy | None = None
    """Its call path's retries; None: ``Retry(attempts=max_attempts)``."""
    approval: ApprovalRule | None = None
    """When its calls wait for an operator's approval."""
    undo: UndoRule | None = None
    """The tool that reverses its calls (set later by ``@handle.undo``)."""
    coalesce: bool = True
    """False: an identical call made while one is unsettled is a new call."""
    database: Database | None = None
    """A Transactional tool's database, where its writes and its outcome's marker commit."""


@dataclass(frozen=True, slots=True)
class CallPlan:
    """What every call of one tool needs that its registration fixes, made once (`Engine.add`),
    so that a call looks it up instead of working it out again."""

    tool: Tool
    effect: str
    """The effect class's recorded name."""
    key: Callable[[Mapping[str, Any]], str] | None
    """Idempotent: the key of the recorded arguments; None for the other classes."""
    key_twice: bool
    """A custom derivation, run twice: two keys for one set of arguments refuse the call."""
    asks_provider: bool
    """Each call gets a new request id (the effect's trait)."""
    coalesce: bool
    plain: tuple[tuple[str, type], ...] | None
    """Each argument's name and type where every one is a plain `str`, `int` or `bool`
    without constraints: arguments given as exactly these are their own recorded form."""
    key_of_text: Callable[[bytes], str] | None
    """Idempotent on fields that are all the arguments: the key of the arguments' own text."""
    needle: str
    """``/<tool id>/``: only a call id holding it can be a rule-2 id of this tool's calls."""


_PLAIN: tuple[type, ...] = (str, int, bool)


# Field options that change neither what pydantic accepts nor what it records.
_SCHEMA_ONLY = frozenset(
    {"annotation", "default", "description", "title", "examples", "json_schema_extra", "repr",
     "deprecated"}
)


def _as_declared(t: Tool) -> bool:
    """Each parameter is validated by its own name and recorded under it: no field option
    beyond its type, default and schema text (an alias, a field left out of the record), no
    serializer. Unknown to pydantic's field (a future version): treated as not."""
    found = t.model.__pydantic_decorators__
    if found.field_serializers or found.model_serializers or found.computed_fields:
        return False
    return all(
        _SCHEMA_ONLY.issuperset(getattr(f, "_attributes_set", ("?",)))
        for f in t.model.model_fields.values()
    )


def _plain(t: Tool) -> tuple[tuple[str, type], ...] | None:
    """`CallPlan.plain`: pydantic, in the model `build_tool` makes (``extra="forbid"``, no
    validators), gives such a value back as it is, in Python and JSON form alike."""
    if set(t.model.model_config) != {"extra"} or t.model.__pydantic_decorators__.validators:
        return None
    if not _as_declared(t):
        return None
    out: list[tuple[str, type]] = []
    for name, f in t.model.model_fields.items():
        ann: Any = f.annotation
        if not any(ann is k for k in _PLAIN) or f.metadata:
            return None
        out.append((name, ann))
    return tuple(out)


def call_plan(record: ToolRecord) -> CallPlan:
    t = record.tool
    effects = t.registration.effects
    key: Callable[[Mapping[str, Any]], str] | None = None
    of_text = None
    if isinstance(effects, Idempotent):
        d = effects.key
        if d.mode == "fields" and not any("." in p for p in d.paths):
            key = _top_level_key(t.id, d.paths, key_hasher(t.id, d.version), d.derive)
            # The recorded arguments hold every parameter (defaults filled, extras refused,
            # none left out of the record): a key of them all selects the recorded arguments.
            if set(d.paths) == set(t.params) and _as_declared(t):
                of_text = key_of_text(t.id, d.version)
        else:
            key = functools.partial(d.derive, t.id)
    return CallPlan(
        tool=t,
        effect=effect_name(effects),
        key=key,
        key_twice=isinstance(effects, Idempotent) and effects.key.mode == "custom",
        asks_provider=effects.asks_provider,
        coalesce=record.coalesce,
        plain=_plain(t),
        key_of_text=of_text,
        needle=f"/{t.id}/",
    )


def _top_level_key(
    tool_id: str,
    paths: tuple[str, ...],
    hasher: Callable[[Any], str],
    derive: Callable[[str, Mapping[str, Any]], str],
) -> Callable[[Mapping[str, Any]], str]:
    """`KeyDerivation.fields` of top-level names: the values picked, the prefix hashed once."""

    def key(args: Mapping[str, Any]) -> str:
        try:
            selected = {p: args[p] for p in paths}
        except KeyError:  # the derivation itself names the missing field
            return derive(tool_id, args)
        return hasher(selected)

    return key


class Sandboxed(Protocol):
    """What the call entry asks of a shadow or replay mode (`poimen.sandbox._modes`)."""

    def runs(self, t: Tool, d: NewDispatch) -> bool:
        """Whether this call runs for real (else the mode answers it)."""
        ...

    def answer(self, t: Tool, d: NewDispatch) -> Outcome:
        """The mode's answer to a call it does not run."""
        ...

    def outcome(self, call_id: str) -> Outcome | None:
        """What the mode's log says of a call id (None: never called, or refused)."""
        ...


class Engine:
    """What the protocol needs of a kernel: its store, identity, tools, settings, pools."""

    def __init__(
        self,
        store: Store,
        owner: Owner,
        issuer: Issuer,
        settings: Settings,
        *,
        notify: Callable[[], None],
        notifiers: Sequence[Notifier] = (),
        on_call: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.owner = owner
        self.issuer = issuer
        self.settings = settings
        self.records: dict[str, ToolRecord] = {}
        self.plans: dict[str, CallPlan] = {}
        self.tools: dict[str, Tool] = {}  # each record's tool, by id: the call path's index
        self.names: dict[str, str] = {}  # a spec's name -> its tool id
        # Each Transactional record's database, by tool id: the call path's index.
        self.databases: dict[str, Database] = {}
        self.holds = Holds()
        self.lease_ttl = settings.lease_ttl
        self.deadline_margin = settings.deadline_margin
        self.wait_bound = settings.wait_bound
        self.default_retry = RetryPolicy(attempts=settings.max_attempts)
        self.notify = notify
        self.notifiers = notifiers  # an outbox row is written for these (their names)
        self.on_call = on_call  # before a call runs: the kernel's duties and logging
        self.closed = False
        self.sandbox: Sandboxed | None = None
        self._pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._pools_lock = threading.Lock()
        self.continuations: set[threading.Thread] = set()
        self.observer: Observers | None = None  # set while the kernel has observers
        # False: every call takes the generator protocol, never `flat_call` or `flat_acall`
        # (for the tests and the soak that run both).
        self.flat = True

    def record(
        self,
        registration: ToolRegistration,
        fn: Callable[..., Any],
        *,
        retry: RetryPolicy | None,
        description: str | None,
        requires_approval: object,
        approval_ttl: float | None,
        approvers: int,
        undo: str | None,
        undo_args: UndoArgs | None,
        coalesce: bool,
    ) -> ToolRecord:
        """A registration checked whole and made into its record; nothing is kept yet
        (`Kernel.register` documents the arguments)."""
        if not isinstance(coalesce, bool):
            raise RegistrationError(
                f"tool {getattr(registration, 'id', '?')!r}: coalesce must be True or False",
                tool_id=getattr(registration, "id", None),
            )
        if not isinstance(registration, ToolRegistration):
            raise RegistrationError(
                f"expected a ToolRegistration, got {type(registration).__name__}"
            )
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise RegistrationError(
                f"tool {registration.id!r}: retry must be a Retry, not {retry!r}",
                tool_id=registration.id,
            )
        if registration.id in self.tools:
            raise RegistrationError(
                f"tool {registration.id!r} is already registered", tool_id=registration.id
            )
        names = self.names
        if registration.id in names:  # an id and a name must never name two tools
            other = names[registration.id]
            raise RegistrationError(
                f"tool id {registration.id!r} is the model-facing name of tool {other!r}; "
                f"give {registration.id!r} another id",
                tool_id=registration.id,
                other=other,
            )
        tool = build_tool(registration, fn)
        effects = registration.effects
        if effects.guarded:
            _guard.install()
        db = Database(effects, self.store.url) if isinstance(effects, Transactional) else None
        rule = approval_rule(registration.id, requires_approval, approval_ttl, approvers)
        undoes = undo_rule(registration.id, undo, undo_args)
        if description is not None and not isinstance(description, str):
            raise RegistrationError(
                f"tool {registration.id!r}: description must be text", tool_id=registration.id
            )
        name = safe_name(registration.id, set(names))
        spec = spec_of(tool, name, description)
        return ToolRecord(
            tool=tool,
            spec=spec,
            retry=retry,
            approval=rule,
            undo=undoes,
            coalesce=coalesce,
            database=db,
        )

    def add(self, record: ToolRecord) -> None:
        """Keep a registered tool (checked whole before: nothing here refuses)."""
        self.records[record.tool.id] = record
        self.tools[record.tool.id] = record.tool
        self.plans[record.tool.id] = call_plan(record)
        self.names[record.spec.name] = record.tool.id
        if record.database is not None:
            self.databases[record.tool.id] = record.database

    def tool_id(self, name: str) -> str:
        """The tool id a spec's name stands for (an id works too, and is looked up first)."""
        if isinstance(name, str):
            if name in self.tools:
                return name
            if name in self.names:
                return self.names[name]
        raise UnknownToolError(f"no tool is registered as {name!r}", tool_id=name)

    def spec(self, tool: str) -> ToolSpec:
        """A tool as a model sees it, by id or by its spec's name."""
        r = self.records.get(tool) if isinstance(tool, str) else None
        return (r or self.records[self.tool_id(tool)]).spec

    def retry(self, t: Tool) -> RetryPolicy:
        r = self.records.get(t.id)
        return r.retry if r is not None and r.retry is not None else self.default_retry

    def policy(self, t: Tool) -> Policy:
        s = self.settings
        return Policy(
            max_attempts=self.retry(t).attempts,
            lookup_limit=s.lookup_limit,
            lookup_backoff=s.lookup_backoff,
            max_backoff=s.max_backoff,
        )

    def pool(self, name: str, size: int) -> concurrent.futures.ThreadPoolExecutor:
        p = self._pools.get(name)
        if p is None:
            with self._pools_lock:
                p = self._pools.get(name)
                if p is None:
                    p = self._pools[name] = concurrent.futures.ThreadPoolExecutor(
                        size, thread_name_prefix=f"poimen-{name}"
                    )
        return p

    def shutdown_pools(self, *, forked: bool = False) -> None:
        with self._pools_lock:
            pools, self._pools = self._pools, {}
        if forked:  # the parent's threads do not exist here: nothing to wait for
            self._pools_lock = threading.Lock()
            return
        for p in pools.values():
            p.shutdown(wait=False)

    def renew(self) -> None:
        """Renew the leases of the calls this kernel runs."""
        ids = self.holds.ids()
        if ids:
            now = self.store.now()
            n = self.store.renew_leases(self.owner.worker_id, ids, now + self.lease_ttl, now)
            _hooks.point(self, lambda base: LeasesRenewedEvent(**base, held=len(ids), renewed=n))

    def after_fork(self, owner: Owner) -> None:
        """In a forked child: its own identity, none of the parent's calls, threads, pools
        (its observers' are `poimen._observe.after_fork`'s)."""
        self.owner = owner
        self.holds.reset()
        self.continuations = set()
        self.shutdown_pools(forked=True)

    def claimable(self, intent: Intent, now: float) -> str:
        return claimability(
            intent, self.owner, held=intent.id in self.holds, now=now, alive=owner_alive
        )

    def slack(self) -> float:
        """How late an attempt may start after its deadline was stamped before the deadline
        is stamped again."""
        return self.deadline_margin / 4

    # The call entry.

    def run_call(
        self, tool: str, args: Mapping[str, Any], *, call_id: str, scope: str | None = None
    ) -> Outcome:
        """`Kernel.call`: journal, dispatch and settle one call (or the sandbox's answer)."""
        if _guard.current() is not None:
            # Called from inside a guarded tool: the kernel's writes are not that tool's, and
            # the inner tool is guarded by its own class.
            token = _guard.suspend()
            try:
                return self.run_call(tool, args, call_id=call_id, scope=scope)
            finally:
                _guard.resume(token)
        t, d, kwargs = self.prepare(tool, args, call_id, scope)
        if self.sandbox is not None and not self.sandbox.runs(t, d):
            return self.sandbox.answer(t, d)
        approval = self.approval(t, d)
        if t.is_async and loop_running() and approval is None:
            raise WrongRunnerError(
                f"tool {t.id!r} is async and an event loop runs in this thread: "
                "use `await kernel.acall(...)`; nothing was recorded",
                tool_id=t.id,
            )
        self.on_call()
        obs = self.observer
        observed = obs is not None and (
            _hooks.calls_wanted(obs) if obs.watching else obs.wants & CALLS
        )
        if approval is None and self.sandbox is None and self.flat:
            if observed:
                assert obs is not None
                return _hooks.observed_call(obs, d, flat_call, self, t, d, kwargs)
            return flat_call(self, t, d, kwargs)
        steps = call_steps(self, t, d, kwargs, CallState(), approval)
        if observed:
            assert obs is not None
            return _hooks.observed_call(obs, d, run_sync, self, steps)
        return run_sync(self, steps)

    async def arun_call(
        self, tool: str, args: Mapping[str, Any], *, call_id: str, scope: str | None = None
    ) -> Outcome:
        """`Kernel.acall`: `run_call` on an event loop."""
        if _guard.current() is not None:  # see run_call()
            token = _guard.suspend()
            try:
                return await self.arun_call(tool, args, call_id=call_id, scope=scope)
            finally:
                _guard.resume(token)
        t, d, kwargs = self.prepare(tool, args, call_id, scope)
        if self.sandbox is not None and not self.sandbox.runs(t, d):
            return await asyncio.to_thread(self.sandbox.answer, t, d)
        self.on_call()
        approval = self.approval(t, d)
        if approval is None and self.sandbox is None and self.flat and t.is_async:
            run = flat_acall(self, t, d, kwargs)
        else:
            c = CallState()
            run = run_async(self, call_steps(self, t, d, kwargs, c, approval), c)
        obs = self.observer
        if obs is not None and (_hooks.calls_wanted(obs) if obs.watching else obs.wants & CALLS):
            return await _hooks.observed_acall(obs, d, run)
        return await run

    # Outcomes of calls made earlier, for a caller that resumes.

    def outcome(self, call_id: str) -> Outcome | None:
        """What the log says of this call id now, or None if it was never called; a settled
        outcome read here is given to the call's caller (`protocol.given`)."""
        if self.sandbox is not None:
            return self.sandbox.outcome(call_id)
        intent = self.store.get_by_call_id(call_id)
        if intent is None:
            return None
        return given(self.store, answer(followed(self.store, intent)))

    def outcome_now(self, call_id: str) -> Outcome:
        """The outcome now; an intent nobody drives (approved and never run, or its owner
        gone) is driven here first, so a waiting caller resumes without a recovery pass."""
        if self.sandbox is not None:  # a sandbox drives nothing here
            out = self.sandbox.outcome(call_id)
            if out is None:
                raise IntentNotFoundError(f"no call has the call id {call_id!r}", call_id=call_id)
            return out
        read_at = self.store.now()  # before the read: a lease is judged as of then
        intent = self.store.get_by_call_id(call_id)
        if intent is None:
            raise IntentNotFoundError(f"no call has the call id {call_id!r}", call_id=call_id)
        intent = followed(self.store, intent)
        if approval_due(intent, read_at):  # no decision came within its window
            _hooks.expired(self, self.store.expire_approvals(read_at, 1, intent.id), intent)
            intent = self.store.get_intent(intent.id) or intent
        t = self.tools.get(intent.tool_id)
        if t is not None and self.claimable(intent, read_at) == "claimable":
            out = run_sync(self, orphan_steps(self, t, intent, CallState()))
            if out is not None:
                return given(self.store, out)
        return given(self.store, answer(intent))

    async def wait(self, call_id: str, timeout: float | None) -> Outcome:
        """`Kernel.wait`: `outcome_now` until it is final or `timeout` has passed."""
        end = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        while True:
            out = await asyncio.to_thread(self.outcome_now, call_id)
            if out.terminal or (end is not None and time.monotonic() >= end):
                return out
            await asyncio.sleep(_left(delay, end))
            delay = min(delay * 2, 1.0)

    def wait_sync(self, call_id: str, timeout: float | None) -> Outcome:
        """`wait` for a caller without an event loop."""
        end = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        while True:
            out = self.outcome_now(call_id)
            if out.terminal or (end is not None and time.monotonic() >= end):
                return out
            time.sleep(_left(delay, end))
            delay = min(delay * 2, 1.0)

    def prepare(
        self, tool: str, args: Mapping[str, Any], call_id: str, scope: str | None = None
    ) -> tuple[Tool, NewDispatch, dict[str, Any]]:
        """A call checked and made into the dispatch it would record (nothing written)."""
        if self.closed:
            raise PoimenError("the kernel is closed")
        p = self.plans.get(tool) if isinstance(tool, str) else None
        # `tools` stays the authority: an engine copied with fewer tools (a sandbox's
        # recovery) shares the plans of them all.
        if p is None or self.tools.get(tool) is not p.tool:
            raise UnknownToolError(f"no tool is registered as {tool!r}", tool_id=tool)
        t = p.tool
        # The common call id (ASCII, no NUL, short enough, no reserved prefix) is judged here;
        # any other goes through the checks that name what is wrong with it.
        if not (
            type(call_id) is str
            and call_id.isascii()
            and 0 < len(call_id) <= MAX_CALL_ID_BYTES
            and "\x00" not in call_id
        ):
            check_call_id(call_id)
        if call_id.startswith(("undo", "edit/")):
            check_not_reserved(call_id)
        data = None
        plain = p.plain
        if plain is not None and type(args) is dict and len(args) == len(plain):
            for name, kind in plain:
                if type(args.get(name)) is not kind:
                    break
            else:  # validation would give each back as it is: one pass, no pydantic
                data = dict(args)
        if data is not None:
            text = checked_text(data)
            recorded = kwargs = data
        else:
            data, given = encode_args(args)
            recorded, kwargs = t.validate(data)
            text = given if _same_scalars(data, recorded) else canonical(recorded)
        part = text.encode()
        key = request_id = None
        if p.key_of_text is not None:
            key = p.key_of_text(part)
        elif p.key is not None:
            key = p.key(recorded)
            if p.key_twice and p.key(recorded) != key:
                raise NondeterministicKeyError(
                    f"tool {t.id!r}: its key derivation gave two keys for one set of arguments",
                    tool_id=t.id,
                )
        elif p.asks_provider:
            request_id = _new_request_id()
        now = self.store.now()
        reg = t.registration
        timeout = reg.timeout
        d = new_dispatch(
            # The intent id: time-ordered, so recovery scans the oldest unfinished first.
            f"in_{_time_ns():016x}{_ids.getrandbits(40):010x}",
            call_id,
            reg.id,
            p.effect,
            text,
            _sha256(part).hexdigest(),  # args_digest(text)
            key,
            request_id,
            self.owner,
            now + max(self.lease_ttl, timeout),
            timeout,
            now + timeout + self.deadline_margin,
            now,
            # No scope given and no rule-2 id of this tool: scope_for's answer is None.
            None
            if scope is None and p.needle not in call_id
            else call_ids.scope_for(call_id, t.id, args, scope, p.coalesce),
        )
        return t, d, kwargs

    def approval_for(self, tool_id: str) -> ApprovalRule | None:
        """The approval a tool's calls may wait for: None if it needs none, or is unknown."""
        r = self.records.get(tool_id)
        return None if r is None else r.approval

    def approval(self, t: Tool, d: NewDispatch) -> Approval | None:
        """The approval this call waits for, if its tool's rule asks for one."""
        r = self.records.get(t.id)
        rule = None if r is None else r.approval
        if rule is None or not rule.needed(t.id, _recorded(d)):
            return None
        return Approval(None if rule.ttl is None else d.now + rule.ttl, rule.approvers)


def _dispatch_maker() -> Callable[..., NewDispatch]:
    """`NewDispatch(...)` by position, its fields set through their slots: the frozen
    dataclass's `__init__` sets each of its 14 through `object.__setattr__` (a third of the
    time). Made for the fields as they are: a field added later fails here, at import."""
    names = tuple(f.name for f in fields(NewDispatch))
    assert names == (
        "intent_id", "call_id", "tool_id", "effect", "args", "args_hash", "key",
        "request_id", "owner", "lease_expires_at", "timeout_s", "deadline_at", "now", "scope",
    ), names  # fmt: skip
    (s_in, s_call, s_tool, s_eff, s_args, s_hash, s_key, s_rq, s_own, s_lease, s_to, s_dl,
     s_now, s_scope) = (getattr(NewDispatch, n).__set__ for n in names)  # fmt: skip
    new = object.__new__

    def make(
        intent_id: str, call_id: str, tool_id: str, effect: str, args: str, args_hash: str,
        key: str | None, request_id: str | None, owner: Owner, lease_expires_at: float,
        timeout_s: float, deadline_at: float, now: float, scope: str | None,
    ) -> NewDispatch:  # fmt: skip
        d = new(NewDispatch)
        s_in(d, intent_id)
        s_call(d, call_id)
        s_tool(d, tool_id)
        s_eff(d, effect)
        s_args(d, args)
        s_hash(d, args_hash)
        s_key(d, key)
        s_rq(d, request_id)
        s_own(d, owner)
        s_lease(d, lease_expires_at)
        s_to(d, timeout_s)
        s_dl(d, deadline_at)
        s_now(d, now)
        s_scope(d, scope)
        return d

    return make


new_dispatch = _dispatch_maker()


def _same_scalars(given: Mapping[str, Any], recorded: Mapping[str, Any]) -> bool:
    """Whether validation left every argument as it was given, each a text, a whole number,
    a bool or None (no float: 0.0 == -0.0): then the given canonical text is the recorded
    one, and the second encoding is spared."""
    if len(given) != len(recorded):
        return False
    for name, v in given.items():
        t = type(v)
        if not (t is str or t is int or t is bool or v is None):
            return False
        w = recorded.get(name, given)  # `given` itself: a marker no value can be
        if type(w) is not t or w != v:
            return False
    return True


#: The undo or edited call id the kernel itself is calling right now, in this context: the one
#: call id under a reserved prefix a call may use (`poimen._undo`, `poimen._approval`).
MAKING: ContextVar[str | None] = ContextVar("poimen_undo_making", default=None)


def check_not_reserved(call_id: str) -> None:
    """Refuse an application's call id under undo's prefix (``undo/``, ``undo#<n>/``): undo
    finds its own calls by those ids and must never take another call for one."""
    # Both prefixes start so: any other call id is spared the pattern (a call's hot path).
    if not call_id.startswith(("undo", "edit/")):
        return
    if (is_undo(call_id) or is_edit(call_id)) and MAKING.get() != call_id:
        raise ReservedCallIdError(
            f"call id {call_id!r} starts with a prefix reserved for poimen's undo and edited "
            "calls (undo/, undo#<n>/, edit/): choose another call id; nothing was recorded",
            field="call_id",
            call_id=call_id,
        )


def _left(delay: float, end: float | None) -> float:
    """The next poll's wait: `delay`, cut short by the end of a caller's timeout."""
    return delay if end is None else min(delay, max(0.0, end - time.monotonic()))


def followed(store: Store, intent: Intent) -> Intent:
    """An intent approved with edited arguments answers with its edited call."""
    if intent.state == IntentState.FAILED and intent.reason == "edited":
        edited = store.get_by_call_id(call_ids.edit_of(intent.call_id))
        if edited is not None:
            return edited
    return intent


def _recorded(d: NewDispatch) -> dict[str, Any]:
    import json

    out: dict[str, Any] = json.loads(d.args)
    return out


def loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


# Intent ids need uniqueness, not secrecy. os.urandom per call hands the GIL back for a
# system call and, with the store's writer thread busy, waited 60 us to win it again (profile
# of 64 async callers); a generator seeded from it once per process, and again in a forked
# child, does not.
_ids = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(32)))


_time_ns = time.time_ns
_sha256 = hashlib.sha256


def _new_request_id() -> str:
    # Request ids go to providers, and a lookup trusts what answers under one: unpredictable.
    return "rq_" + secrets.token_hex(16)
