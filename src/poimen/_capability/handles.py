"""The handles a tool writes through: `ctx.http` (an httpx client that sends the kernel's key
on every write and checks host, token and key), `ctx.ahttp` (the same for async tools; its
requests run in threads the attempt waits for) and `ctx.sink(name)`. For an Idempotent or
ReadOnly call they hold the call's write token (`poimen._capability.context`). For every class, each
request passes the send gate right before it leaves, through the attempt's record."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import httpx

from poimen._capability import guard as _guard
from poimen.errors import NotSent, PoimenError

if TYPE_CHECKING:
    from poimen._capability.context import AttemptRecord, CallScope, Issuer, Sink

# Methods that change nothing on the server (RFC 9110 "safe"); every other method is a write.
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _host_allowed(url: httpx.URL, hosts: tuple[str, ...]) -> bool:
    host = url.host
    if not host:
        return False
    port = url.port or _DEFAULT_PORTS.get(url.scheme)
    bracketed = f"[{host}]" if ":" in host else host
    return host in hosts or f"{host}:{port}" in hosts or f"{bracketed}:{port}" in hosts


class HttpHandle:
    """`ctx.http`: an httpx-based client. For an Idempotent tool every write (any method but
    GET, HEAD, OPTIONS and TRACE) carries the registration's key header set to the kernel key,
    and every request must go to a host in the registration's caps. Redirects are never
    followed."""

    __slots__ = ("_issuer", "_record", "_scope", "_timeout", "_token")

    def __init__(
        self,
        issuer: Issuer,
        scope: CallScope | None,
        timeout: float | None,
        record: AttemptRecord | None = None,
    ) -> None:
        self._issuer = issuer
        self._scope = scope
        self._timeout = timeout
        self._token = scope.token() if scope is not None else None
        self._record = record  # None: a handle made outside a call, which sends nothing

    def request(
        self,
        method: str,
        url: str | httpx.URL,
        *,
        params: Mapping[str, Any] | None = None,
        headers: Mapping[str, str] | None = None,
        json: Any = None,
        content: str | bytes | None = None,
        data: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send one request; for a guarded call, checked (host, token, key) and, for a write,
        carrying the kernel's key."""
        m = method.upper()
        sent = dict(headers) if headers else {}
        scope = self._scope
        if scope is not None:
            # Parsed once here and handed on, so the check costs the client no second parse.
            url = u = url if isinstance(url, httpx.URL) else httpx.URL(url)
            name = scope.caps.key_header
            lowered = name.lower()
            supplied = None
            for h in [h for h in sent if h.lower() == lowered]:
                supplied = sent.pop(h) or ""
            key = self._check(m, u, supplied)
            if key is not None:
                sent[name] = key
        # Bodies are data, never callables: nothing of the tool's runs while the guard is off.
        if content is not None and not isinstance(content, str | bytes):
            raise PoimenError("ctx.http: content must be str or bytes", argument="content")
        if data is not None and not isinstance(data, Mapping):
            raise PoimenError("ctx.http: data must be a mapping", argument="data")
        t = timeout if timeout is not None else self._timeout
        write = m not in READ_METHODS
        guard = _guard.suspend()
        try:
            propagate = self._issuer.propagate
            if propagate is not None:  # with the guard off: the propagator is not the tool's
                propagate(sent)
            with self._sent(m, url, write, t):
                return self._issuer.client().request(
                    m,
                    url,
                    params=params,
                    headers=sent,
                    json=json,
                    content=content,
                    data=data,
                    timeout=t if t is not None else httpx.USE_CLIENT_DEFAULT,
                )
        finally:
            _guard.resume(guard)

    @contextlib.contextmanager
    def _sent(
        self, method: str, url: str | httpx.URL, write: bool, timeout: float | None
    ) -> Iterator[None]:
        """The send gate, then the request: a write counts as gone out from before it is sent;
        a connection that never opened takes it back, and if nothing of the attempt went out,
        says so with `NotSent`."""
        record = self._record
        if record is None:
            raise PoimenError("this handle was not made for a call: it sends nothing")
        record.admit("http", lambda: _target(method, url), write, timeout)
        try:
            yield
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            if record.not_sent(write) == 0:
                raise NotSent(f"{type(exc).__name__}: {exc}") from exc
            raise

    def _check(self, method: str, u: httpx.URL, supplied: str | None) -> str | None:
        """Deny (recorded) or pass; returns the key a write must carry, None for a read."""
        scope = self._scope
        assert scope is not None and self._token is not None
        target = _target(method, u)
        key = scope.authorize(self._token, "http", target, supplied)
        if not _host_allowed(u, scope.caps.hosts):
            (_guard.current() or scope).deny(
                "http",
                target,
                f"host_not_in_caps: {u.host}:{u.port or _DEFAULT_PORTS.get(u.scheme)} "
                f"is not in the registration's caps.hosts {list(scope.caps.hosts)}",
            )
        return None if method in READ_METHODS else key

    @property
    def transport(self) -> httpx.BaseTransport:
        """For client libraries built on httpx: ``httpx.Client(transport=ctx.http.transport)``
        sends each of their requests through this handle's checks and key."""
        return _HandleTransport(self)

    def get(self, url: str | httpx.URL, **kw: Any) -> httpx.Response:
        """`request("GET", url, ...)`."""
        return self.request("GET", url, **kw)

    def head(self, url: str | httpx.URL, **kw: Any) -> httpx.Response:
        """`request("HEAD", url, ...)`."""
        return self.request("HEAD", url, **kw)

    def options(self, url: str | httpx.URL, **kw: Any) -> httpx.Response:
        """`request("OPTIONS", url, ...)`."""
        return self.request("OPTIONS", url, **kw)

    def post(self, url: str | httpx.URL, **kw: Any) -> httpx.Response:
        """`request("POST", url, ...)`: a write."""
        return self.request("POST", url, **kw)

    def put(self, url: str | httpx.URL, **kw: Any) -> httpx.Response:
        """`request("PUT", url, ...)`: a write."""
        return self.request("PUT", url, **kw)

    def patch(self, url: str | httpx.URL, **kw: Any) -> httpx.Response:
        """`request("PATCH", url, ...)`: a write."""
        return self.request("PATCH", url, **kw)

    def delete(self, url: str | httpx.URL, **kw: Any) -> httpx.Response:
        """`request("DELETE", url, ...)`: a write."""
        return self.request("DELETE", url, **kw)


def _target(method: str, url: str | httpx.URL) -> str:
    u = url if isinstance(url, httpx.URL) else httpx.URL(url)
    return f"{method} {u.scheme}://{u.netloc.decode('ascii', 'replace')}{u.path}"


class _HandleTransport(httpx.BaseTransport):
    def __init__(self, handle: HttpHandle) -> None:
        self._handle = handle

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        handle = self._handle
        request.read()  # a streamed body is the caller's code: run it while the guard is on
        scope = handle._scope
        if scope is not None:
            name = scope.caps.key_header
            key = handle._check(request.method.upper(), request.url, request.headers.get(name))
            if key is not None:
                request.headers[name] = key
        guard = _guard.suspend()
        try:
            propagate = handle._issuer.propagate
            if propagate is not None:
                trace: dict[str, str] = {}
                propagate(trace)
                for name, value in trace.items():
                    request.headers.setdefault(name, value)
            m = request.method.upper()
            timeout = request.extensions.get("timeout", {}).get("read")
            with handle._sent(m, request.url, m not in READ_METHODS, timeout):
                r = handle._issuer.client().send(request, stream=True)
            try:
                raw = b"".join(r.iter_raw())
            finally:
                r.close()
        finally:
            _guard.resume(guard)
        return httpx.Response(
            r.status_code, headers=r.headers, stream=httpx.ByteStream(raw), extensions=r.extensions
        )


class AsyncHttpHandle:
    """`ctx.ahttp`: `ctx.http` for async tools; each request runs in a worker thread (the
    guard's scope follows it there), so one connection pool serves every event loop. A
    request still running when its tool times out or is cancelled keeps the attempt open:
    the kernel settles the call only once the request has returned."""

    __slots__ = ("_sync",)

    def __init__(self, sync: HttpHandle) -> None:
        self._sync = sync

    async def request(self, method: str, url: str | httpx.URL, **kw: Any) -> httpx.Response:
        """`HttpHandle.request`, awaited; the request runs in a worker thread the attempt waits
        for."""
        sync = self._sync
        ctx = contextvars.copy_context()
        fut = sync._issuer.executor().submit(ctx.run, functools.partial(sync.request, method, url, **kw))
        if sync._record is not None:
            sync._record.track(fut)
        return await asyncio.wrap_future(fut)

    async def get(self, url: str | httpx.URL, **kw: Any) -> httpx.Response:
        """`request("GET", url, ...)`."""
        return await self.request("GET", url, **kw)

    async def post(self, url: str | httpx.URL, **kw: Any) -> httpx.Response:
        """`request("POST", url, ...)`: a write."""
        return await self.request("POST", url, **kw)

    async def put(self, url: str | httpx.URL, **kw: Any) -> httpx.Response:
        """`request("PUT", url, ...)`: a write."""
        return await self.request("PUT", url, **kw)

    async def patch(self, url: str | httpx.URL, **kw: Any) -> httpx.Response:
        """`request("PATCH", url, ...)`: a write."""
        return await self.request("PATCH", url, **kw)

    async def delete(self, url: str | httpx.URL, **kw: Any) -> httpx.Response:
        """`request("DELETE", url, ...)`: a write."""
        return await self.request("DELETE", url, **kw)


class SinkHandle:
    """`ctx.sink(name)`: writes to a sink the application registered with the kernel. For an
    Idempotent tool the write is applied under the kernel key and needs a live token."""

    __slots__ = ("_name", "_record", "_scope", "_sink", "_token")

    def __init__(
        self, name: str, sink: Sink, scope: CallScope | None, record: AttemptRecord
    ) -> None:
        self._name = name
        self._sink = sink
        self._scope = scope
        self._record = record
        self._token = scope.token() if scope is not None else None

    @property
    def name(self) -> str:
        """The name the sink was registered under."""
        return self._name

    def write(self, payload: Any, *, key: str | None = None) -> Any:
        """Write `payload` to the sink; for an Idempotent tool under the kernel's key, checked
        against this call's token."""
        scope = self._scope
        if scope is not None:
            assert self._token is not None
            key = scope.authorize(self._token, "sink", self._name, key)
        guard = _guard.suspend()  # the sink is the application's code, trusted to write
        try:
            # Every sink write is a write of the attempt, whatever the class: once it is let
            # through, nothing later of the attempt can say "nothing happened".
            self._record.admit("sink", lambda: self._name, True, None)
            return self._sink.apply(payload, key=key)
        finally:
            _guard.resume(guard)
