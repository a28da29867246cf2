"""The context the kernel hands every tool, and its keyed write handles (layer 2, docs/capability.md).

For an Idempotent tool every handle carries a write token: an HMAC over (tool id, intent,
attempt, key) with a per-kernel secret the tool never receives, live only while its call runs.
A handle checks the token and the key on every write; a bad write is recorded as a denial
(committed) and only then raised as `CapabilityDeniedError`. Every handle, of every class, also
holds its attempt's record (`AttemptRecord`): each request passes the send gate
(`poimen._core.decide.send_gate`) right before it leaves, and each write is counted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, runtime_checkable

import httpx

from poimen._capability import guard as _guard
from poimen._capability.handles import (
    AsyncHttpHandle,
    HttpHandle,
    SinkHandle,
)
from poimen._core.decide import Fail, MarkIndeterminate, Refused, Send, after_refusal, send_gate
from poimen.errors import CapabilityDeniedError, PoimenError, RegistrationError

if TYPE_CHECKING:
    from poimen._capability.tx import Tx
    from poimen._core.effects import EffectClass
    from poimen._core.intents import Intent
    from poimen._core.tools import Caps
    from poimen.store import Store


@runtime_checkable
class Sink(Protocol):
    """Something the application lets tools write to: apply this payload under this key.

    For an Idempotent tool `key` is always the kernel-derived key; a sink that deduplicates
    on it makes the recovery retry harmless. Other tools pass whatever key they choose.
    """

    def apply(self, payload: Any, *, key: str | None) -> Any:
        """Apply `payload` under `key` (for an Idempotent tool, always the kernel's key)."""
        ...


@dataclass(frozen=True, slots=True)
class WriteToken:
    """The kernel's grant for one attempt of one call. Only the kernel's secret makes `mac`."""

    tool_id: str
    intent_id: str
    attempt: int
    key: str
    mac: bytes = field(repr=False)


class _Authority:
    """Mints, verifies and revokes write tokens. The secret never leaves this object."""

    __slots__ = ("_live", "_secret")

    def __init__(self) -> None:
        self._secret = os.urandom(32)
        # mac -> the token minted with it, for as long as its call runs.
        self._live: dict[bytes, WriteToken] = {}

    def _mac(self, tool_id: str, intent_id: str, attempt: int, key: str) -> bytes:
        msg = "\x1f".join((tool_id, intent_id, str(attempt), key)).encode()
        return hmac.digest(self._secret, msg, "sha256")

    def mint(self, tool_id: str, intent_id: str, attempt: int, key: str) -> WriteToken:
        token = WriteToken(
            tool_id, intent_id, attempt, key, self._mac(tool_id, intent_id, attempt, key)
        )
        self._live[token.mac] = token
        return token

    def problem(self, token: object) -> str | None:
        """None for a live token this kernel minted; else why not."""
        if not isinstance(token, WriteToken) or not isinstance(token.mac, bytes):
            return "forged"
        minted = self._live.get(token.mac)
        if minted is token or (minted is not None and minted == token):
            return None  # the live table holds exactly what was minted: no MAC to recompute
        expected = self._mac(token.tool_id, token.intent_id, token.attempt, token.key)
        if not hmac.compare_digest(expected, token.mac):
            return "forged"
        return "revoked"

    def revoke(self, token: WriteToken) -> None:
        self._live.pop(token.mac, None)


class Issuer:
    """The kernel's side of layer 2: the token authority, registered sinks, one HTTP pool."""

    def __init__(self, store: Store, *, live: bool = True) -> None:
        self.store = store
        self.live = live  # False in shadow and replay modes: no write leaves
        self.sinks: dict[str, Sink] = {}
        self._authority = _Authority()
        self._lock = threading.Lock()
        self._client: httpx.Client | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        # Adds trace context headers (W3C traceparent) that a request lacks: set by
        # `poimen.otel`, None without it.
        self.propagate: Callable[[dict[str, str]], None] | None = None
        # Told of each denial after its row is committed: set while the kernel has observers.
        self.denied: Callable[[dict[str, Any]], None] | None = None

    def register_sink(self, name: str, sink: Sink) -> None:
        if not isinstance(name, str) or not name.strip():
            raise RegistrationError(f"sink name must be a non-empty string, got {name!r}")
        if not callable(getattr(sink, "apply", None)):
            raise RegistrationError(
                f"sink {name!r} must have an apply(payload, *, key) method", field="sink"
            )
        if name in self.sinks:
            raise RegistrationError(f"sink {name!r} is already registered", field="name")
        self.sinks[name] = sink

    def client(self) -> httpx.Client:
        # Built on first use: creating an httpx client (TLS context) is milliseconds.
        client = self._client
        if client is None:
            with self._lock:
                if self._closed:
                    raise PoimenError("the kernel is closed; its HTTP handles are gone")
                if self._client is None:
                    self._client = httpx.Client(follow_redirects=False)
                client = self._client
        return client

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads `ctx.ahttp` requests run in."""
        pool = self._executor
        if pool is None:
            with self._lock:
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(
                        64, thread_name_prefix="poimen-ahttp"
                    )
                pool = self._executor
        return pool

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
            pool, self._executor = self._executor, None
        if pool is not None:
            pool.shutdown(wait=True)
        if client is not None:
            client.close()

    def after_fork(self) -> None:
        """In a forked child: the parent's pool threads and connections are not ours."""
        self._lock = threading.Lock()
        self._client = None
        self._executor = None

    def scope(
        self,
        tool_id: str,
        intent_id: str,
        attempt: int,
        key: str,
        caps: Caps,
        *,
        read_only: bool = False,
        transactional: bool = False,
    ) -> CallScope:
        return CallScope(
            self, tool_id, intent_id, attempt, key, caps, read_only=read_only,
            transactional=transactional,
        )


class CallScope:
    """One running attempt of a guarded call (Idempotent: writes carry its key; ReadOnly: no
    write at all; Transactional: none but through `ctx.tx`): what its handles may do, and its
    denials."""

    __slots__ = (
        "_issuer",
        "_token",
        "abort",
        "attempt",
        "caps",
        "ended",
        "intent_id",
        "key",
        "read_only",
        "tool_id",
        "transactional",
        "unseen",
    )

    def __init__(
        self,
        issuer: Issuer,
        tool_id: str,
        intent_id: str,
        attempt: int,
        key: str,
        caps: Caps,
        *,
        read_only: bool = False,
        transactional: bool = False,
    ) -> None:
        self._issuer = issuer
        self.read_only = read_only or transactional
        self.transactional = transactional
        # Run before a denial is recorded (a Transactional call's: roll its transaction back,
        # which may hold the lock the denial's commit needs).
        self.abort: Callable[[], object] | None = None
        self.tool_id = tool_id
        self.intent_id = intent_id
        self.attempt = attempt
        self.key = key
        self.caps = caps
        self.ended = False
        # A denial raised where the tool cannot see it (inside SQLite): the error the tool
        # does see is then this denial's.
        self.unseen: CapabilityDeniedError | None = None
        self._token: WriteToken | None = None

    def token(self) -> WriteToken:
        # Minted on a handle's first use, so a tool that writes nothing pays no HMAC.
        token = self._token
        if token is None:
            with self._issuer._lock:
                if self._token is None:
                    self._token = self._issuer._authority.mint(
                        self.tool_id, self.intent_id, self.attempt, self.key
                    )
                token = self._token
        if self.ended:
            self._issuer._authority.revoke(token)
        return token

    def end(self) -> None:
        """The call is over: its token is revoked and late writes are denied."""
        self.ended = True
        if self._token is not None:
            self._issuer._authority.revoke(self._token)

    def authorize(self, token: WriteToken, action: str, target: str, key_used: str | None) -> str:
        """Check a handle's token and the key its write uses; returns the key to send."""
        running = _guard.current()
        # The kernel running this call judges the token, not whoever built the handle.
        blame = running if running is not None else self
        problem = blame._issuer._authority.problem(token)
        if problem == "forged":
            blame.deny(action, target, "forged_token: the token was not minted by this kernel")
        if problem == "revoked":
            blame.deny(
                action,
                target,
                f"revoked_token: the call that was granted it (intent {token.intent_id}, "
                f"attempt {token.attempt}) has ended",
            )
        if running is not None and (running.intent_id, running.attempt) != (
            token.intent_id,
            token.attempt,
        ):
            blame.deny(
                action,
                target,
                f"other_call_token: the token belongs to intent {token.intent_id} attempt "
                f"{token.attempt}, not to the running call",
            )
        if key_used is not None and key_used != token.key:
            blame.deny(
                action,
                target,
                "no_key: the write cleared the kernel's key"
                if not key_used
                else "key_mismatch: the write carries a key other than the kernel's",
            )
        return token.key

    def deny_out_of_band(self, action: str, target: str) -> NoReturn:
        if self.ended:
            self.deny(action, target, "call_ended: the tool wrote after its call ended")
        if self.transactional:
            self.deny(action, target, "transactional: a Transactional tool writes only through ctx.tx")
        if self.read_only:
            self.deny(action, target, "read_only: a ReadOnly tool writes nothing")
        self.deny(
            action,
            target,
            "out_of_band: an Idempotent tool writes only through ctx.http or ctx.sink(...)",
        )

    def deny(self, action: str, target: str, reason: str) -> NoReturn:
        """Commit the denial row, then raise."""
        deny(
            self._issuer, self.tool_id, self.intent_id, self.attempt, action, target, reason,
            self.abort,
        )


def deny(
    issuer: Issuer,
    tool_id: str,
    intent_id: str,
    attempt: int,
    action: str,
    target: str,
    reason: str,
    abort: Callable[[], object] | None = None,
) -> NoReturn:
    """Commit the denial row, then raise. The audit write itself must pass the guard.
    `abort` runs first: a denied write ends a Transactional attempt, and its open
    transaction may hold the lock the denial's commit waits for (SQLite, one database)."""
    # A name that is not UTF-8 text, or holds a NUL, must still fit in the denial row.
    target = target.encode("utf-8", "backslashreplace").decode().replace("\x00", "\\x00")
    msg = (
        f"tool {tool_id!r} (intent {intent_id}, attempt {attempt}): "
        f"{action} {target} denied: {reason}"
    )
    data: dict[str, Any] = {
        "tool_id": tool_id,
        "intent_id": intent_id,
        "attempt": attempt,
        "action": action,
        "target": target,
        "reason": reason,
    }
    store = issuer.store
    token = _guard.suspend()
    try:
        if abort is not None:
            abort()
        denial = store.record_denial(now=store.now(), **data)
        if issuer.denied is not None:  # still unguarded: an observer may write its log
            issuer.denied(data)
    except PoimenError as exc:
        raise CapabilityDeniedError(
            f"{msg} (the denial could not be recorded: {exc})", denial_id=None, **data
        ) from exc
    finally:
        _guard.resume(token)
    raise CapabilityDeniedError(msg, denial_id=denial.id, **data)


class AttemptRecord:
    """One attempt of a call as its handles see it, for every class: the facts the send gate
    judges each request on, how many writes may have gone out, the gate's first refusal, and
    the requests of `ctx.ahttp` still running in their threads."""

    __slots__ = ("_issuer", "_lock", "_pending", "abort", "effect", "intent", "refused",
                 "timeout", "tool_id", "writes")

    def __init__(
        self,
        issuer: Issuer,
        tool_id: str,
        intent: Intent,
        effect: EffectClass,
        timeout: float,
    ) -> None:
        # Made for every attempt (the hot path): the facts are read from `intent` when a
        # request asks, never copied here.
        self._issuer = issuer
        self.tool_id = tool_id
        self.intent = intent
        self.effect = effect
        self.timeout = timeout
        self.writes = 0
        self.refused: Refused | None = None
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[Any]] | None = None
        self.abort: Callable[[], object] | None = None  # as `CallScope.abort`

    def admit(self, action: str, target: Callable[[], str], write: bool, within: float | None) -> None:
        """The send gate, right before a request leaves: let it go (a write counts as gone
        out from now on) or record the refusal as a denial and raise it."""
        issuer, it = self._issuer, self.intent
        now = issuer.store.now()
        with self._lock:
            refused = send_gate(
                Send(
                    effect=self.effect,
                    recorded=it.effect,
                    write=write,
                    live=issuer.live,
                    state=it.state,
                    attempt=it.attempts,
                    writes=self.writes,
                    key_from=it.created_at,
                    now=now,
                    within=self.timeout if within is None else within,
                )
            )
            if refused is None:
                if write:
                    self.writes += 1
                return
            if self.refused is None:
                self.refused = refused
        deny(
            issuer,
            self.tool_id,
            it.id,
            it.attempts,
            action,
            target(),
            f"{refused.reason}: {refused.detail}",
            self.abort,
        )

    def not_sent(self, write: bool) -> int:
        """A request whose connection never opened: its write did not go out. Returns the
        writes of the attempt that may have."""
        with self._lock:
            if write:
                self.writes -= 1
            return self.writes

    def outcome(self) -> Fail | MarkIndeterminate | None:
        """How the attempt ends if the gate refused one of its requests (None if it did not)."""
        refused = self.refused
        if refused is None:
            return None
        return after_refusal(self.effect, self.intent.attempts, self.writes, refused)

    def track(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            if self._pending is None:
                self._pending = set()
            self._pending.add(fut)
        fut.add_done_callback(self._done)

    def _done(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            if self._pending is not None:
                self._pending.discard(fut)

    async def drain(self) -> None:
        """Wait until no request of this attempt runs any more, even when cancelled (the
        cancellation is raised once they have returned)."""
        cancelled = False
        while True:
            with self._lock:
                pending = [f for f in self._pending or () if not f.done()]
            if not pending:
                break
            try:
                await asyncio.shield(asyncio.wait([asyncio.wrap_future(f) for f in pending]))
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError


class ToolContext:
    """What a tool receives as its first argument. Read-only: a tool cannot set its own key."""

    __slots__ = (
        "_ahttp",
        "_attempt",
        "_call_id",
        "_http",
        "_intent_id",
        "_issuer",
        "_key",
        "_record",
        "_request_id",
        "_scope",
        "_timeout",
        "_tool_id",
        "_tx",
    )

    def __init__(
        self,
        *,
        tool_id: str,
        intent_id: str,
        call_id: str,
        attempt: int,
        key: str | None,
        request_id: str | None,
        issuer: Issuer | None = None,
        scope: CallScope | None = None,
        timeout: float | None = None,
        record: AttemptRecord | None = None,
        tx: Tx | None = None,
    ) -> None:
        self._tool_id = tool_id
        self._intent_id = intent_id
        self._call_id = call_id
        self._attempt = attempt
        self._key = key
        self._request_id = request_id
        self._issuer = issuer
        self._scope = scope
        self._timeout = timeout
        self._http: HttpHandle | None = None
        self._ahttp: AsyncHttpHandle | None = None
        self._record = record
        self._tx = tx

    @property
    def tool_id(self) -> str:
        """The id of the tool being called."""
        return self._tool_id

    @property
    def intent_id(self) -> str:
        """The intent this call is recorded as."""
        return self._intent_id

    @property
    def call_id(self) -> str:
        """The caller's call id."""
        return self._call_id

    @property
    def attempt(self) -> int:
        """The attempt number (1 for the first dispatch)."""
        return self._attempt

    @property
    def key(self) -> str | None:
        """The kernel-derived idempotency key (Idempotent tools only)."""
        return self._key

    @property
    def request_id(self) -> str | None:
        """The kernel-minted request id (Queryable tools only)."""
        return self._request_id

    @property
    def tx(self) -> Tx:
        """A Transactional tool's connection, inside the transaction poimen commits with the
        call's marker once the tool returns (docs/concepts.md): execute on it, never commit."""
        if self._tx is None:
            raise PoimenError(
                f"tool {self._tool_id!r} is not Transactional: ctx.tx exists only for a tool "
                "registered with effects=Transactional(database=...)",
                tool_id=self._tool_id,
            )
        return self._tx

    def _need_issuer(self) -> tuple[Issuer, AttemptRecord]:
        if self._issuer is None or self._record is None:
            raise PoimenError("this ToolContext was not made by a kernel; it has no handles")
        return self._issuer, self._record

    @property
    def http(self) -> HttpHandle:
        """An HTTP client; for an Idempotent tool it sends the kernel key on every write."""
        handle = self._http
        if handle is None:
            issuer, record = self._need_issuer()
            handle = self._http = HttpHandle(issuer, self._scope, self._timeout, record)
        return handle

    @property
    def ahttp(self) -> AsyncHttpHandle:
        """`http` for async tools."""
        handle = self._ahttp
        if handle is None:
            handle = self._ahttp = AsyncHttpHandle(self.http)
        return handle

    def sink(self, name: str) -> SinkHandle:
        """A writer over the sink the application registered as `name`."""
        issuer, record = self._need_issuer()
        sink = issuer.sinks.get(name)
        scope = self._scope
        if scope is not None and name not in scope.caps.sinks:
            (_guard.current() or scope).deny(
                "sink",
                str(name),
                f"sink_not_in_caps: {name!r} is not in the registration's caps.sinks "
                f"{list(scope.caps.sinks)}",
            )
        if sink is None:
            raise PoimenError(
                f"no sink is registered as {name!r}; use kernel.register_sink", sink=name
            )
        return SinkHandle(name, sink, scope, record)

    def __repr__(self) -> str:
        return (
            f"ToolContext(tool_id={self._tool_id!r}, intent_id={self._intent_id!r}, "
            f"attempt={self._attempt}, key={self._key!r}, request_id={self._request_id!r})"
        )
