"""The console's Starlette app: pages over the same `_operator` calls as the CLI.

Access: a token, given once (``?token=`` on any page, the login form, or an
``Authorization: Bearer`` header), opens a session: a random id in an HttpOnly,
SameSite=Strict cookie (Secure over HTTPS), kept server-side with its expiry, its own
CSRF token and who it belongs to, and ended server-side by logging out. The token is an
operator's own (``--operators``: the session carries their name, and ends at the next
request once their line leaves the file) or one shared token (the name is typed into each
decision). Behind an authenticating proxy (``--trust-user-header``) the proxy's header
names the operator instead, and each name gets its own session. State changes (resolve,
abandon, undo, logout) are POSTs that must carry the session's CSRF token and, if the browser
sends an Origin, come from this console's own origin. Requests naming another host than the console's are
refused before routing. Anything else is refused before a store method is called.
"""

from __future__ import annotations

import hmac
import re
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast
from urllib.parse import urlencode

import jinja2
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp

from poimen import _metrics, sandbox
from poimen import _operator as op
from poimen._identity import Login, Operators
from poimen._intents import Intent, IntentState
from poimen._undo import Undoer
from poimen.errors import (
    ConsoleConfigError,
    IntentNotFoundError,
    NotDispatchedError,
    NotIndeterminateError,
    PoimenError,
    StoreError,
    UndoError,
    UnknownToolError,
)
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
    Bearer token, and to nobody else: no operator's token or session opens it."""

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
        self._lock = threading.Lock()

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

    # Authentication.

    async def token_login(self, candidate: Any) -> Who | None:
        """Whom this token opens the console for, or None."""
        if not isinstance(candidate, str) or self.header is not None:
            return None
        if self.operators is not None:
            login = await _io(self.operators.login, candidate)  # scrypt: off the loop
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
            # A page view opens the session its forms will need; a POST without one is
            # refused by the CSRF check.
            opened = self.sessions.open(who) if request.method in ("GET", "HEAD") else None
            request.state.opened = opened
            return Viewer(who, opened)
        auth = request.headers.get("authorization", "")
        if auth.startswith("Bearer "):
            bearer = await self.token_login(auth[len("Bearer ") :])
            if bearer is not None:
                return Viewer(bearer, None)
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
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
            return False
        return _same(form_value, v.session.csrf)

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


def _decided(
    form: dict[str, str], errors: dict[str, str], who: Who
) -> tuple[op.Identity | None, str]:
    """Who decides and why, with an error for each one missing. A known operator decides
    as themselves, whatever the form says; under the shared token the name is typed."""
    reason = form.get("reason", "").strip()
    if not reason:
        errors["reason"] = "a reason is required"
    if who.name is not None:
        return op.Identity(who.name, via=who.via), reason
    typed = form.get("operator", "").strip()
    if not typed:
        errors["operator"] = "the operator's name is required"
        return None, reason
    return op.Identity(typed, via=who.via), reason


def _diff_page(c: Console, store: Store) -> Handler:
    """The intent diff: the recording's calls (or one run of this log) against this log's."""

    async def page(request: Request) -> Response:
        q = request.query_params
        scope = q.get("scope") or None
        run_scope = q.get("run_scope") or None
        recording = c.options.recording
        ctx: dict[str, Any] = {
            "recording": None if recording is None else sandbox.log_name(recording),
            "scope": scope or "",
            "run_scope": run_scope or "",
            "d": None,
            "labels": sandbox.LABELS,
        }
        if recording is None and (scope is None or (run_scope or scope) == scope):
            return c.page(request, "diff.html", **ctx)  # this log with itself: ask for runs
        try:
            ctx["d"] = await _io(
                sandbox.diff, recording or store, store, scope=scope, run_scope=run_scope
            )
        except PoimenError as exc:
            return c.refuse(request, 400, "Cannot compare", op.redact_urls(str(exc)))
        return c.page(request, "diff.html", **ctx)

    return page


def create_app(
    store: Store, *, token: str | None = None, options: ConsoleOptions | None = None
) -> ASGIApp:
    """The console over `store`. `token` is the shared token an operator must present,
    unless `options` names an operators file or a trusted user header instead."""
    options = options or ConsoleOptions()
    c = Console(store, token, options)
    states = [s.value for s in IntentState]

    def guarded(handler: Handler) -> Handler:
        async def run(request: Request) -> Response:
            given = request.query_params.get("token")
            if given is not None and request.method == "GET":
                who = await c.token_login(given)
                if who is None:
                    return c.login_page(request, 401, "wrong token")
                rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
                target = request.url.path + (f"?{urlencode(rest)}" if rest else "")
                return c.login_response(request, target, who)
            viewer = await c.identify(request)
            if viewer is None:
                return c.login_page(request, 401, None)
            request.state.viewer = viewer
            response = await handler(request)
            opened = getattr(request.state, "opened", None)
            if isinstance(opened, Session):
                c.set_cookie(request, response, opened)
            return response

        return run

    async def overview(request: Request) -> Response:
        st = await _io(op.status, store)
        queue = await _io(op.list_intents, store, state=IntentState.INDETERMINATE, limit=500)
        return c.page(request, "overview.html", st=st, queue=queue, states=states)

    async def intents(request: Request) -> Response:
        q = request.query_params
        call_id = q.get("call_id") or ""
        try:
            limit = op.parse_limit(q.get("limit"), 200)
            if call_id:
                rows = await _io(op.search, store, call_id, limit=limit)
            else:
                state = op.parse_state(q["state"]) if q.get("state") else None
                rows = await _io(
                    op.list_intents, store, state=state, tool_id=q.get("tool") or None, limit=limit
                )
        except op.OperatorInputError as exc:
            return c.refuse(request, 400, "Bad filter", str(exc))
        return c.page(
            request,
            "intents.html",
            can_undo=options.undo is not None,
            rows=rows,
            call_id=call_id,
            state=q.get("state") or "",
            tool=q.get("tool") or "",
            states=states,
            now=store.now(),
        )

    async def intent(request: Request) -> Response:
        return await _intent_page(request, form={}, errors={})

    async def _intent_page(
        request: Request, *, form: dict[str, str], errors: dict[str, str], status_code: int = 200
    ) -> Response:
        try:
            d = await _io(op.show, store, request.path_params["intent_id"])
        except IntentNotFoundError as exc:
            return c.refuse(request, 404, "No such intent", str(exc))
        run = await _io(op.same_run, store, d.intent)
        return c.page(
            request,
            "intent.html",
            status_code,
            d=d,
            form=form,
            errors=errors,
            run=run,
            run_prefix=op.run_prefix(d.intent.call_id),
            check=options.checks.get(d.intent.tool_id),
            done=request.query_params.get("done", ""),
            can_undo=options.undo is not None,
        )

    async def _current(request: Request, form: Any) -> Intent | Response:
        """The intent a decision names, or the refusal that ends the request."""
        if not c.csrf_ok(request, form.get("csrf")):
            return c.refuse(
                request, 403, "Refused", "missing or wrong CSRF token: nothing was changed"
            )
        try:
            return await _io(op.find, store, request.path_params["intent_id"])
        except IntentNotFoundError as exc:
            return c.refuse(request, 404, "No such intent", str(exc))

    async def resolve(request: Request) -> Response:
        form_data = await request.form()
        if not c.csrf_ok(request, form_data.get("csrf")):
            return c.refuse(
                request, 403, "Refused", "missing or wrong CSRF token: nothing was changed"
            )
        form = {k: v for k, v in form_data.items() if isinstance(v, str)}
        decision = form.get("decision", "")
        errors: dict[str, str] = {}
        if decision not in ("landed", "not_landed"):
            errors["decision"] = "choose landed or not landed"
        result: Any = None
        raw = form.get("result", "").strip()
        if raw:
            if decision != "landed":
                errors["result"] = "a result goes only with landed"
            else:
                try:
                    result = op.parse_result(raw)
                except op.OperatorInputError as exc:
                    errors["result"] = str(exc)
        viewer = c.viewer(request)
        assert viewer is not None  # guarded
        operator, reason = _decided(form, errors, viewer.who)
        if errors or operator is None:
            return await _intent_page(request, form=form, errors=errors, status_code=400)
        current = await _current(request, form_data)
        if not isinstance(current, Intent):
            return current
        if current.state != IntentState.INDETERMINATE:
            return c.refuse(
                request,
                409,
                "Refused",
                f"intent {current.id} is {current.state}; only an INDETERMINATE intent can be "
                "resolved. Nothing was changed.",
            )
        if form.get("step") != "confirm":
            return c.page(
                request,
                "confirm.html",
                intent=current,
                decision=decision,
                result=result,
                result_text=raw,
                operator=operator,
                reason=reason,
            )
        try:
            await _io(
                op.resolve,
                store,
                current.id,
                landed=decision == "landed",
                result=result,
                operator=operator,
                reason=reason,
            )
        except NotIndeterminateError as exc:
            return c.refuse(request, 409, "Refused", f"{exc}. Nothing was changed.")
        except op.OperatorInputError as exc:
            return c.refuse(request, 400, "Refused", f"{exc}. Nothing was changed.")
        return RedirectResponse(f"/intents/{current.id}?done=resolved", status_code=303)

    async def abandon(request: Request) -> Response:
        form_data = await request.form()
        form = {k: v for k, v in form_data.items() if isinstance(v, str)}
        current = await _current(request, form_data)
        if not isinstance(current, Intent):
            return current
        errors: dict[str, str] = {}
        viewer = c.viewer(request)
        assert viewer is not None  # guarded
        operator, reason = _decided(form, errors, viewer.who)
        if errors or operator is None:
            return await _intent_page(request, form=form, errors=errors, status_code=400)
        if current.state != IntentState.DISPATCHED:
            return c.refuse(
                request,
                409,
                "Refused",
                f"intent {current.id} is {current.state}; only a DISPATCHED intent can be "
                "abandoned. Nothing was changed.",
            )
        if form.get("step") != "confirm":
            return c.page(
                request,
                "confirm_abandon.html",
                intent=current,
                operator=operator,
                reason=reason,
                now=store.now(),
            )
        try:
            await _io(op.abandon, store, current.id, operator=operator, reason=reason)
        except NotDispatchedError as exc:
            return c.refuse(request, 409, "Refused", f"{exc}. Nothing was changed.")
        except op.OperatorInputError as exc:
            return c.refuse(request, 400, "Refused", f"{exc}. Nothing was changed.")
        return RedirectResponse(f"/intents/{current.id}?done=abandoned", status_code=303)

    async def undo(request: Request) -> Response:
        """GET: what undoing a scope would do (a dry run) and the form; POST: undo it."""
        if options.undo is None:
            return c.refuse(
                request, 404, "Undo is not available",
                "This console was started without --app: it cannot run the application's "
                "undo tools. Start it with --app module:kernel.",
            )
        form: dict[str, str] = {}
        if request.method == "POST":
            form_data = await request.form()
            if not c.csrf_ok(request, form_data.get("csrf")):
                return c.refuse(
                    request, 403, "Refused", "missing or wrong CSRF token: nothing was changed"
                )
            form = {k: v for k, v in form_data.items() if isinstance(v, str)}
        scope = form.get("scope") or request.query_params.get("scope") or ""
        errors: dict[str, str] = {}
        viewer = c.viewer(request)
        assert viewer is not None  # guarded
        who, reason = _decided(form, errors, viewer.who) if form else (None, "")
        operator = who.name if who is not None else ""
        run = request.method == "POST" and not errors
        report = None
        try:
            if scope:
                report = await _io(
                    options.undo, scope, operator=operator if run else None,
                    reason=reason if run else None, dry_run=not run,
                )
        except (UndoError, UnknownToolError, op.OperatorInputError) as exc:
            return c.refuse(request, 400, "Refused", f"{exc}. Nothing was changed.")
        except StoreError as exc:
            return c.refuse(
                request, 503, "The intent log failed",
                f"{exc}. Undos made before it failed stay made; undo again to resume "
                "(nothing is undone twice).",
            )
        return c.page(
            request, "undo.html", 400 if errors else 200, report=report, scope=scope,
            form=form, errors=errors, ran=run,
        )

    async def audit(request: Request) -> Response:
        tool = request.query_params.get("tool") or None
        rows = await _io(op.audit, store, tool_id=tool, limit=1000)
        tools = sorted({t for (t, _s) in (await _io(store.counts))} | {d.tool_id for d in rows})
        return c.page(request, "audit.html", rows=rows, tool=tool or "", tools=tools)

    async def login(request: Request) -> Response:
        if request.method == "GET":
            return c.login_page(request, 200, None)
        form = await request.form()
        who = await c.token_login(form.get("token"))
        if who is None:
            return c.login_page(request, 401, "wrong token")
        return c.login_response(request, "/", who)

    async def logout(request: Request) -> Response:
        form = await request.form()
        if not c.csrf_ok(request, form.get("csrf")):
            return c.refuse(request, 403, "Refused", "missing or wrong CSRF token")
        c.sessions.close(request.cookies.get(COOKIE, ""))
        r = RedirectResponse("/login", status_code=303)
        r.delete_cookie(COOKIE, path="/")
        return r

    async def not_found(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException) and exc.status_code == 405:
            return c.refuse(request, 405, "Not allowed", f"{request.method} is not allowed here.")
        return c.refuse(request, 404, "Not found", f"There is no page at {request.url.path}.")

    async def server_error(request: Request, exc: Exception) -> Response:
        # Never a traceback on the page; the process log has it.
        return c.refuse(request, 500, "Something went wrong", "Nothing was changed by this page.")

    denials = _metrics.DenialCounter()

    async def metrics(request: Request) -> Response:
        # Its own token only: the scraper is not an operator, and no operator's token or
        # session cookie opens this page.
        auth = request.headers.get("authorization", "")
        given = auth[len("Bearer ") :] if auth.startswith("Bearer ") else ""
        if options.metrics_token is None or not _same(given, options.metrics_token):
            return PlainTextResponse(
                "the metrics token is required (Authorization: Bearer ...)\n",
                status_code=401,
                headers={**_HEADERS, "WWW-Authenticate": 'Bearer realm="poimen metrics"'},
            )
        text = await _io(
            lambda: _metrics.prometheus_text(_metrics.store_families(store, denials))
        )
        return Response(text, media_type=_metrics.CONTENT_TYPE, headers=_HEADERS)

    static = StaticFiles(packages=[("poimen.console", "static")])
    routes = [
        Route("/", guarded(overview)),
        Route("/intents", guarded(intents)),
        Route("/intents/{intent_id}", guarded(intent)),
        Route("/intents/{intent_id}/resolve", guarded(resolve), methods=["POST"]),
        Route("/intents/{intent_id}/abandon", guarded(abandon), methods=["POST"]),
        Route("/undo", guarded(undo), methods=["GET", "POST"]),
        Route("/audit", guarded(audit)),
        Route("/diff", guarded(_diff_page(c, store))),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/logout", guarded(logout), methods=["POST"]),
        *([Route("/metrics", metrics)] if options.metrics_token is not None else []),
        Mount("/static", app=static, name="static"),
    ]
    app = Starlette(
        routes=routes,
        # Requests for another host are refused before anything else: redirects and links
        # are built from the Host header.
        middleware=[
            Middleware(
                TrustedHostMiddleware,
                allowed_hosts=[*LOCAL_HOSTS, *options.allowed_hosts],
                www_redirect=False,
            )
        ],
        exception_handlers={404: not_found, 405: not_found, Exception: server_error},
    )
    # "/intents/" would be redirected to an absolute URL built from the request: a 404 instead.
    app.router.redirect_slashes = False
    if not options.trust_proxy:
        return app
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    return cast(ASGIApp, ProxyHeadersMiddleware(cast(Any, app), trusted_hosts="*"))
