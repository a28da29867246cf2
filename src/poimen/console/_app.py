"""The console's Starlette app: pages over the same `_operator` calls as the CLI.

Access: a token, given once (``?token=`` on any page, the login form, or an
``Authorization: Bearer`` header), becomes an HttpOnly, SameSite=Strict session cookie.
State changes (resolve, logout) are POSTs that must carry the session's CSRF token and,
if the browser sends an Origin, come from this console's own origin. Anything else is
refused before a store method is called.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlencode

import jinja2
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from poimen import _operator as op
from poimen._intents import IntentState
from poimen.errors import IntentNotFoundError, NotIndeterminateError
from poimen.store._base import Store

T = TypeVar("T")
COOKIE = "poimen_console"
Handler = Callable[[Request], Awaitable[Response]]

_HEADERS = {
    # Everything is served from here: no CDN, no inline script, no framing.
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    # "no-referrer" would make browsers send "Origin: null" on our own form posts.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("poimen.console", "templates"),
        autoescape=jinja2.select_autoescape(["html"]),
        undefined=jinja2.StrictUndefined,
    )
    env.filters["time"] = op.fmt_time
    env.filters["age"] = op.fmt_age
    env.filters["pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=True, ensure_ascii=False)
    env.filters["compact"] = lambda v: json.dumps(v, sort_keys=True, ensure_ascii=False)
    return env


class Console:
    """Holds the store, the access token and the per-process key that signs sessions."""

    def __init__(self, store: Store, token: str) -> None:
        if len(token) < 16:
            raise ValueError("the console token must be at least 16 characters")
        self.store = store
        self._token = token
        self._key = secrets.token_bytes(32)
        self._session = self._mac(b"session:" + token.encode("utf-8"))
        self.env = _env()

    def _mac(self, data: bytes) -> str:
        return hmac.new(self._key, data, hashlib.sha256).hexdigest()

    # Authentication.

    def token_ok(self, candidate: str | None) -> bool:
        return candidate is not None and hmac.compare_digest(
            candidate.encode("utf-8"), self._token.encode("utf-8")
        )

    def authenticated(self, request: Request) -> bool:
        cookie = request.cookies.get(COOKIE)
        if cookie is not None and hmac.compare_digest(cookie, self._session):
            return True
        auth = request.headers.get("authorization", "")
        return auth.startswith("Bearer ") and self.token_ok(auth[len("Bearer ") :])

    def csrf_token(self) -> str:
        return self._mac(b"csrf:" + self._session.encode("ascii"))

    def csrf_ok(self, request: Request, form_value: Any) -> bool:
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
            return False
        return isinstance(form_value, str) and hmac.compare_digest(form_value, self.csrf_token())

    def login_response(self, target: str) -> Response:
        r = RedirectResponse(target, status_code=303)
        r.set_cookie(COOKIE, self._session, httponly=True, samesite="strict", path="/")
        return r

    # Rendering.

    def page(
        self, name: str, status_code: int = 200, *, anonymous: bool = False, **ctx: Any
    ) -> HTMLResponse:
        # A page for someone without a session must not carry the CSRF token.
        csrf = "" if anonymous else self.csrf_token()
        html = self.env.get_template(name).render(csrf=csrf, anonymous=anonymous, **ctx)
        return HTMLResponse(html, status_code=status_code, headers=_HEADERS)

    def refuse(self, status_code: int, title: str, message: str) -> HTMLResponse:
        return self.page("refused.html", status_code, title=title, message=message)


async def _io(fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    # Store calls block (SQLite busy waits, network for PostgreSQL): keep them off the loop.
    return await run_in_threadpool(fn, *args, **kw)


def create_app(store: Store, *, token: str) -> Starlette:
    """The console over `store`; `token` is what an operator must present."""
    c = Console(store, token)

    def guarded(handler: Handler) -> Handler:
        async def run(request: Request) -> Response:
            given = request.query_params.get("token")
            if given is not None and request.method == "GET":
                if not c.token_ok(given):
                    return c.page("login.html", 401, error="wrong token", anonymous=True)
                rest = {k: v for k, v in request.query_params.items() if k != "token"}
                target = request.url.path + (f"?{urlencode(rest)}" if rest else "")
                return c.login_response(target)
            if not c.authenticated(request):
                return c.page("login.html", 401, error=None, anonymous=True)
            return await handler(request)

        return run

    async def overview(request: Request) -> Response:
        st = await _io(op.status, store)
        queue = await _io(op.list_intents, store, state=IntentState.INDETERMINATE, limit=500)
        return c.page("overview.html", st=st, queue=queue, states=[s.value for s in IntentState])

    async def intents(request: Request) -> Response:
        q = request.query_params
        try:
            state = op.parse_state(q["state"]) if q.get("state") else None
            limit = int(q.get("limit") or 200)
            rows = await _io(
                op.list_intents, store, state=state, tool_id=q.get("tool") or None, limit=limit
            )
        except (op.OperatorInputError, ValueError) as exc:
            return c.refuse(400, "Bad filter", str(exc))
        return c.page(
            "intents.html",
            rows=rows,
            state=q.get("state") or "",
            tool=q.get("tool") or "",
            states=[s.value for s in IntentState],
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
            return c.refuse(404, "No such intent", str(exc))
        return c.page(
            "intent.html",
            status_code,
            d=d,
            form=form,
            errors=errors,
            resolved=request.query_params.get("resolved") == "1",
        )

    async def resolve(request: Request) -> Response:
        form_data = await request.form()
        if not c.csrf_ok(request, form_data.get("csrf")):
            return c.refuse(403, "Refused", "missing or wrong CSRF token: nothing was changed")
        form = {k: v for k, v in form_data.items() if isinstance(v, str)}
        intent_id = request.path_params["intent_id"]
        decision = form.get("decision", "")
        errors: dict[str, str] = {}
        if decision not in ("landed", "not_landed"):
            errors["decision"] = "choose landed or not landed"
        if not form.get("operator", "").strip():
            errors["operator"] = "the operator's name is required"
        if not form.get("reason", "").strip():
            errors["reason"] = "a reason is required"
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
        if errors:
            return await _intent_page(request, form=form, errors=errors, status_code=400)
        try:
            current = await _io(op.find, store, intent_id)
        except IntentNotFoundError as exc:
            return c.refuse(404, "No such intent", str(exc))
        if current.state != IntentState.INDETERMINATE:
            return c.refuse(
                409,
                "Refused",
                f"intent {current.id} is {current.state}; only an INDETERMINATE intent can be "
                "resolved. Nothing was changed.",
            )
        if form.get("step") != "confirm":
            return c.page(
                "confirm.html",
                intent=current,
                decision=decision,
                result=result,
                result_text=raw,
                operator=form["operator"].strip(),
                reason=form["reason"].strip(),
            )
        try:
            await _io(
                op.resolve,
                store,
                current.id,
                landed=decision == "landed",
                result=result,
                operator=form["operator"],
                reason=form["reason"],
            )
        except NotIndeterminateError as exc:
            return c.refuse(409, "Refused", f"{exc}. Nothing was changed.")
        except op.OperatorInputError as exc:
            return c.refuse(400, "Refused", f"{exc}. Nothing was changed.")
        return RedirectResponse(f"/intents/{current.id}?resolved=1", status_code=303)

    async def audit(request: Request) -> Response:
        tool = request.query_params.get("tool") or None
        rows = await _io(op.audit, store, tool_id=tool, limit=1000)
        tools = sorted({t for (t, _s) in (await _io(store.counts))} | {d.tool_id for d in rows})
        return c.page("audit.html", rows=rows, tool=tool or "", tools=tools)

    async def login(request: Request) -> Response:
        if request.method == "GET":
            return c.page("login.html", error=None, anonymous=True)
        form = await request.form()
        given = form.get("token")
        if not c.token_ok(given if isinstance(given, str) else None):
            return c.page("login.html", 401, error="wrong token", anonymous=True)
        return c.login_response("/")

    async def logout(request: Request) -> Response:
        form = await request.form()
        if not c.csrf_ok(request, form.get("csrf")):
            return c.refuse(403, "Refused", "missing or wrong CSRF token")
        r = RedirectResponse("/login", status_code=303)
        r.delete_cookie(COOKIE, path="/")
        return r

    static = StaticFiles(packages=[("poimen.console", "static")])
    routes = [
        Route("/", guarded(overview)),
        Route("/intents", guarded(intents)),
        Route("/intents/{intent_id}", guarded(intent)),
        Route("/intents/{intent_id}/resolve", guarded(resolve), methods=["POST"]),
        Route("/audit", guarded(audit)),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/logout", guarded(logout), methods=["POST"]),
        Mount("/static", app=static, name="static"),
    ]
    return Starlette(routes=routes)
