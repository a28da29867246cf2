"""The console's Starlette app: pages over the same `poimen.operator._ops` calls as the CLI.

Access: a token, given once (``?token=`` on any page, the login form, or an
``Authorization: Bearer`` header), opens a session: a random id in an HttpOnly,
SameSite=Strict cookie (Secure over HTTPS), kept server-side with its expiry, its own
CSRF token and who it belongs to, and ended server-side by logging out. The token is an
operator's own (``--operators``: the session carries their name, and ends at the next
request once their line leaves the file) or one shared token (the name is typed into each
decision). Behind an authenticating proxy (``--trust-user-header``) the proxy's header
names the operator instead, and each name gets its own session. State changes (resolve,
resolve many, abandon, undo, gather evidence, logout) are POSTs that must carry the session's CSRF token and, if the browser
sends an Origin, come from this console's own origin. Requests naming another host than the console's are
refused before routing. Anything else is refused before a store method is called.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast
from urllib.parse import urlencode

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp

from poimen import sandbox
from poimen._core.intents import Intent, IntentState
from poimen.console import _aids
from poimen.console._session import (
    COOKIE,
    LOCAL_HOSTS,
    Console,
    ConsoleOptions,
    Handler,
    Session,
    Who,
    _io,
    _same,
)
from poimen.errors import (
    IntentNotFoundError,
    NotDispatchedError,
    NotIndeterminateError,
    PoimenError,
    StoreError,
    UndoError,
    UnknownToolError,
)
from poimen.operator import _ageing, _metrics
from poimen.operator import _ops as op
from poimen.store._base import Store

T = TypeVar("T")
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


def _client(request: Request) -> str:
    return request.client.host if request.client else "?"


def _login_refused(c: Console, request: Request) -> Response | None:
    """A login another site started, or one more failed try than allowed: refused before
    the token is looked at."""
    if not c.same_origin(request):
        return c.refuse(
            request, 403, "Refused",
            "This login did not come from the console's own page. Open the console's address "
            "yourself (paste the link into the address bar) and log in there.",
        )
    if not c.logins.allowed(_client(request)):
        r = c.refuse(
            request, 429, "Too many failed logins",
            "Too many wrong tokens from here: wait a minute, then try again.",
        )
        r.headers["Retry-After"] = "60"
        return r
    return None


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
                refused = _login_refused(c, request)
                if refused is not None:
                    return refused
                who = await c.token_login(given)
                if who is None:
                    c.logins.failed(_client(request))
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
        overdue = {i.id for i in queue if _ageing.is_overdue(i, options.escalations, st.now)}
        return c.page(request, "overview.html", st=st, queue=queue, states=states,
                      overdue=overdue)

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
            can_gather=options.evidence is not None
            and d.intent.tool_id in options.evidence_tools,
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
                suggestion=(await _io(op.show, store, current.id)).suggestion,
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
        run = request.method == "POST" and not errors
        report = None
        try:
            if scope:
                report = await _io(
                    options.undo, scope, operator=who if run else None,
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
        refused = _login_refused(c, request)
        if refused is not None:
            return refused
        form = await request.form()
        who = await c.token_login(form.get("token"))
        if who is None:
            c.logins.failed(_client(request))
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

    async def http_error(request: Request, exc: Exception) -> Response:
        # Starlette's own refusals (a multipart body without a boundary, a form too large):
        # the console's page and headers, never the framework's bare text.
        code = exc.status_code if isinstance(exc, HTTPException) else 400
        if code in (404, 405):
            return await not_found(request, exc)
        return c.refuse(
            request, code, "Bad request",
            "The request could not be read (its body or headers are malformed). "
            "Nothing was changed.",
        )

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
        *_aids.routes(c, store, options, guarded, _decided),
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
        exception_handlers={
            404: not_found, 405: not_found, HTTPException: http_error, Exception: server_error
        },
    )
    # "/intents/" would be redirected to an absolute URL built from the request: a 404 instead.
    app.router.redirect_slashes = False
    if not options.trust_proxy:
        return app
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    return cast(ASGIApp, ProxyHeadersMiddleware(cast(Any, app), trusted_hosts="*"))
