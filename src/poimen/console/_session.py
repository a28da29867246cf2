"""The console's access: its options, who a request speaks for, server-side sessions, and
the `Console` that answers with pages (the routes are in `poimen.console._app`)."""

from __future__ import annotations

import asyncio
import hmac
import re
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import jinja2
from markupsafe import Markup
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from poimen._undo import Undoer
from poimen.errors import (
    ConsoleConfigError,
)
from poimen.operator import _ops as op
from poimen.operator._identity import Login, Operators
from poimen.store._base import Store

T = TypeVar("T")
COOKIE = "poimen_console"
Handler = Callable[[Request], Awaitable[Response]]
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")
MAX_SESSIONS = 10_000

_HEADERS = {
    # Everything is served from here: no CDN, no inline script, no framing.
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    # "no-referrer" would make browsers send "Origin: null" on our own form posts.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True, slots=True)
class ConsoleOptions:
    """How the console runs: `session_ttl` seconds a login lasts; `trust_proxy` believes
    X-Forwarded-Proto/-For; `allowed_hosts` are host names it answers to besides localhost;
    `checks` maps a tool id to what an operator should check before resolving its calls.

    Who decides: `operators_file` gives each operator a token of their own; `user_header`
    (with `trust_proxy`) takes the operator's name from that header of the proxy, which on
    an address beyond this machine also needs `proxy_is_the_only_way_in`. With neither,
    one shared token opens the console and each decision carries a typed name.
    `undo` is the application's `Kernel.undo` (only with its tools can calls be undone).
    `recording` is the log URL the intent diff page compares this log with (default: this
    log itself, one run's call-id prefix with another's).
    `metrics_token` serves ``/metrics`` (Prometheus text) to requests that carry it as a
    Bearer token, and to nobody else: no operator's token or session opens it.
    `evidence` is the application's `Kernel.evidence`, for the tools in `evidence_tools`;
    `escalations` maps a tool id to its ``escalate_after`` (the overview's overdue badge)."""

    session_ttl: float = 12 * 3600.0
    trust_proxy: bool = False
    allowed_hosts: tuple[str, ...] = ()
    checks: Mapping[str, str] = field(default_factory=dict)
    operators_file: str | None = None
    user_header: str | None = None
    proxy_is_the_only_way_in: bool = False
    undo: Undoer | None = None
    recording: str | None = None
    metrics_token: str | None = None
    evidence: Callable[..., Any] | None = None
    evidence_tools: frozenset[str] = frozenset()
    escalations: Mapping[str, float] = field(default_factory=dict)

    def with_hosts(self, *hosts: str) -> ConsoleOptions:
        return replace(self, allowed_hosts=(*self.allowed_hosts, *hosts))


_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,100}")


def check_modes(token: str | None, options: ConsoleOptions) -> None:
    """Refuse a mix of ways to know the operator that would leave it unclear who decides."""
    if options.operators_file and options.user_header:
        raise ConsoleConfigError(
            "--operators and --trust-user-header do not go together: pick one way to know "
            "the operator"
        )
    if token is not None and (options.operators_file or options.user_header):
        raise ConsoleConfigError(
            "a shared --token does not go with --operators or --trust-user-header: each "
            "operator is known by their own token or by the proxy"
        )
    mt = options.metrics_token
    if mt is not None:
        if not isinstance(mt, str) or len(mt) < 16:
            raise ConsoleConfigError("the metrics token must be at least 16 characters")
        if token is not None and _same(mt, token):
            raise ConsoleConfigError(
                "the metrics token must differ from the console token: whoever scrapes "
                "metrics must not be able to decide"
            )
    if options.user_header is not None:
        if not _HEADER_NAME.fullmatch(options.user_header):
            raise ConsoleConfigError(
                f"--trust-user-header {options.user_header[:100]!r} is not a header name",
                header=options.user_header[:100],
            )
        if not options.trust_proxy:
            raise ConsoleConfigError(
                "--trust-user-header needs --trust-proxy: the console believes a proxy's "
                "headers only when told it sits behind one"
            )


@dataclass(frozen=True, slots=True)
class Who:
    """Whom a session or a request speaks for: `name` None means the shared token, whose
    decisions carry a typed name; `login` is the operators-file line it was opened with."""

    name: str | None
    via: str
    login: Login | None = None


SHARED = Who(None, "typed-name")


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    csrf: str
    expires_at: float
    who: Who = SHARED


@dataclass(frozen=True, slots=True)
class Viewer:
    """Who is looking at a page: a session, or (no session) a Bearer request, which can
    read but not change anything."""

    who: Who
    session: Session | None


class Sessions:
    """Server-side sessions of one console process: random ids, an expiry, and logout that
    really ends them. A restart logs everyone out."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._by_id: dict[str, Session] = {}
        self._by_name: dict[str, str] = {}  # proxy-named user -> their session id
        self._lock = threading.Lock()

    def for_user(self, who: Who) -> Session:
        """The live session of a user the proxy names, else a new one: requests without a
        cookie do not each open a session (and push others' out)."""
        with self._lock:
            sid = self._by_name.get(who.name or "")
            s = self._by_id.get(sid or "")
            if s is not None and s.who == who and s.expires_at > time.monotonic():
                return s
        s = self.open(who)
        with self._lock:
            self._by_name[who.name or ""] = s.id
        return s

    def open(self, who: Who = SHARED) -> Session:
        s = Session(
            secrets.token_urlsafe(32), secrets.token_hex(32), time.monotonic() + self.ttl, who
        )
        with self._lock:
            self._purge()
            if len(self._by_id) >= MAX_SESSIONS:  # the oldest goes first
                self._by_id.pop(next(iter(self._by_id)))
            self._by_id[s.id] = s
        return s

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        with self._lock:
            s = self._by_id.get(sid)
            if s is not None and s.expires_at <= time.monotonic():
                del self._by_id[sid]
                return None
            return s

    def close(self, sid: str) -> None:
        with self._lock:
            self._by_id.pop(sid, None)

    def _purge(self) -> None:
        now = time.monotonic()
        for sid in [k for k, s in self._by_id.items() if s.expires_at <= now]:
            del self._by_id[sid]


#: Failed token logins a client may make at once, and how often it gets one more: each
#: failure under --operators costs a scrypt hash (16 MiB, tens of milliseconds).
LOGIN_BURST = 20
LOGIN_REFILL_S = 3.0
#: The same over all clients together, and how many scrypt checks run at once.
LOGIN_BURST_ALL = 100
LOGIN_REFILL_ALL_S = 0.5
SCRYPT_AT_ONCE = 2


class LoginLimiter:
    """Token buckets of failed logins, per client address and over all clients."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, at)

    def _level(self, key: str, burst: int, refill: float, now: float) -> float:
        tokens, at = self._buckets.get(key, (float(burst), now))
        return min(float(burst), tokens + (now - at) / refill)

    def allowed(self, client: str) -> bool:
        """Whether `client` may try a token now."""
        now = time.monotonic()
        with self._lock:
            return (
                self._level("c:" + client, LOGIN_BURST, LOGIN_REFILL_S, now) >= 1
                and self._level("*", LOGIN_BURST_ALL, LOGIN_REFILL_ALL_S, now) >= 1
            )

    def failed(self, client: str) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._buckets) > MAX_SESSIONS:  # forget the oldest clients
                for key in list(self._buckets)[: len(self._buckets) // 2]:
                    if key != "*":
                        del self._buckets[key]
            for key, burst, refill in (
                ("c:" + client, LOGIN_BURST, LOGIN_REFILL_S),
                ("*", LOGIN_BURST_ALL, LOGIN_REFILL_ALL_S),
            ):
                self._buckets[key] = (self._level(key, burst, refill, now) - 1, now)


def _same(a: str, b: str) -> bool:
    # Bytes, so that text outside ASCII is a mismatch rather than a TypeError.
    return hmac.compare_digest(a.encode("utf-8", "replace"), b.encode("utf-8", "replace"))


def _shown(value: Any) -> Any:
    # Recorded text may hold bidi overrides or control characters that would reorder or hide
    # what the page shows: they become visible escapes. Line breaks stay (form fields).
    if isinstance(value, str) and not isinstance(value, Markup):
        return op.escape_text(value, keep="\r\n\t")
    return value


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("poimen.console", "templates"),
        autoescape=jinja2.select_autoescape(["html"]),
        undefined=jinja2.StrictUndefined,
        finalize=_shown,
    )
    env.filters["time"] = op.fmt_time
    env.filters["age"] = op.fmt_age
    env.filters["pretty"] = lambda v: op.safe_json(v, indent=2)
    env.filters["compact"] = op.safe_json
    env.filters["urls"] = op.redact_urls
    return env


class Console:
    """Holds the store, how operators are known, the sessions and the options."""

    def __init__(self, store: Store, token: str | None, options: ConsoleOptions) -> None:
        check_modes(token, options)
        self.operators = Operators(options.operators_file) if options.operators_file else None
        self.header = options.user_header
        shared = self.operators is None and self.header is None
        if shared and (token is None or len(token) < 16):
            raise ConsoleConfigError("the console token must be at least 16 characters")
        self.store = store
        self.options = options
        self._token = token
        self.sessions = Sessions(options.session_ttl)
        self.env = _env()
        self.logins = LoginLimiter()
        self._scrypt_slots = asyncio.Semaphore(SCRYPT_AT_ONCE)

    # Authentication.

    async def token_login(self, candidate: Any) -> Who | None:
        """Whom this token opens the console for, or None."""
        if not isinstance(candidate, str) or self.header is not None:
            return None
        if self.operators is not None:
            async with self._scrypt_slots:  # scrypt: off the loop, a few at a time
                login = await _io(self.operators.login, candidate)
            return None if login is None else Who(login.name, "operator-token", login)
        assert self._token is not None
        return SHARED if _same(candidate, self._token) else None

    def header_user(self, request: Request) -> str | None:
        """The operator the trusted proxy names: one header, a printable name."""
        if self.header is None:
            return None
        values = request.headers.getlist(self.header)
        if len(values) != 1:
            return None
        try:  # the server decodes header bytes as Latin-1; proxies send names as UTF-8
            name = values[0].encode("latin-1").decode("utf-8").strip()
        except UnicodeError:
            name = values[0].strip()
        ok = 0 < len(name) <= op.MAX_OPERATOR and name.isprintable()
        return name if ok else None

    def session(self, request: Request) -> Session | None:
        """This request's session, if it still speaks for someone: an operator still in the
        file with the same token, or the user the proxy names on this very request."""
        s = self.sessions.get(request.cookies.get(COOKIE))
        if s is None:
            return None
        if self.operators is not None and (
            s.who.login is None or not self.operators.holds(s.who.login)
        ):
            self.sessions.close(s.id)
            return None
        if self.header is not None and s.who.name != self.header_user(request):
            return None
        return s

    async def identify(self, request: Request) -> Viewer | None:
        s = self.session(request)
        if s is not None:
            return Viewer(s.who, s)
        user = self.header_user(request)
        if user is not None:
            who = Who(user, "proxy-header")
            # A page view gets the session its forms will need (the user's own, made once); a
            # POST without one is refused by the CSRF check.
            opened = self.sessions.for_user(who) if request.method in ("GET", "HEAD") else None
            request.state.opened = opened
            return Viewer(who, opened)
        auth = request.headers.get("authorization", "")
        client = request.client.host if request.client else "?"
        if auth.startswith("Bearer ") and self.logins.allowed(client):
            bearer = await self.token_login(auth[len("Bearer ") :])
            if bearer is not None:
                return Viewer(bearer, None)
            self.logins.failed(client)
        return None

    def viewer(self, request: Request) -> Viewer | None:
        """Who the request was let in as (by `guarded`), else its cookie's session."""
        v = getattr(request.state, "viewer", None)
        if isinstance(v, Viewer):
            return v
        s = self.session(request)
        return None if s is None else Viewer(s.who, s)

    def csrf_ok(self, request: Request, form_value: Any) -> bool:
        v = self.viewer(request)
        if v is None or v.session is None or not isinstance(form_value, str):
            return False
        if not self.same_origin(request):
            return False
        return _same(form_value, v.session.csrf)

    def same_origin(self, request: Request) -> bool:
        """Whether the browser says the request comes from this console's own pages (or was
        typed by the user): a login another site makes (a form, a link with ?token=) would
        sign the operator in as whoever the other site chose."""
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
            return False
        return request.headers.get("sec-fetch-site", "same-origin") in ("same-origin", "none")

    def set_cookie(self, request: Request, response: Response, session: Session) -> None:
        response.set_cookie(
            COOKIE,
            session.id,
            max_age=int(self.options.session_ttl),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            path="/",
        )

    def login_response(self, request: Request, target: str, who: Who) -> Response:
        # Only ever a path of this console: "//host" would send the browser elsewhere.
        r = RedirectResponse("/" + target.lstrip("/"), status_code=303)
        self.set_cookie(request, r, self.sessions.open(who))
        return r

    # Rendering.

    def page(
        self,
        request: Request,
        name: str,
        status_code: int = 200,
        *,
        anonymous: bool = False,
        **ctx: Any,
    ) -> HTMLResponse:
        # A page for someone without a session must not carry a CSRF token.
        v = None if anonymous else self.viewer(request)
        session = v.session if v else None
        html = self.env.get_template(name).render(
            csrf=session.csrf if session else "",
            anonymous=anonymous,
            me=v.who if v else SHARED,
            mode="header" if self.header else "operators" if self.operators else "token",
            header=self.header,
            **ctx,
        )
        return HTMLResponse(html, status_code=status_code, headers=_HEADERS)

    def login_page(self, request: Request, status_code: int, error: str | None) -> HTMLResponse:
        return self.page(request, "login.html", status_code, error=error, anonymous=True)

    def refuse(self, request: Request, status_code: int, title: str, message: str) -> HTMLResponse:
        anonymous = self.viewer(request) is None
        return self.page(
            request, "refused.html", status_code, anonymous=anonymous, title=title, message=message
        )


async def _io(fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    # Store calls block (SQLite busy waits, network for PostgreSQL): keep them off the loop.
    return await run_in_threadpool(fn, *args, **kw)
