"""The console's pages that help an operator decide: gather a call's evidence again, and
resolve many calls at once (*Resolve many*: a filter or a CSV, a preview, then one audited
batch). Both are POSTs under the same session, CSRF and Origin checks as any decision, and
the batch is recorded as the operator the console knows (docs/email-outage.md)."""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from poimen.console._session import Console, ConsoleOptions, Handler, Who, _io
from poimen.errors import IntentNotFoundError
from poimen.operator import _ops as op
from poimen.operator import _reconcile as rc
from poimen.store._base import Store

MAX_SOURCE = 500


Decided = Callable[[dict[str, str], dict[str, str], Who], tuple[op.Identity | None, str]]


def routes(
    c: Console,
    store: Store,
    options: ConsoleOptions,
    guarded: Callable[[Handler], Handler],
    decided: Decided,
) -> list[Route]:
    """`guarded` wraps a handler in the console's login; `decided` reads who decides and
    why from a form, as for a single resolve."""

    async def evidence(request: Request) -> Response:
        form = await request.form()
        if not c.csrf_ok(request, form.get("csrf")):
            return c.refuse(request, 403, "Refused", "missing or wrong CSRF token: nothing was "
                            "gathered")
        if options.evidence is None:
            return c.refuse(request, 404, "Evidence is not available",
                            "This console was started without --app: it cannot run the "
                            "application's evidence functions. Start it with --app module:kernel.")
        try:
            intent = await _io(op.find, store, request.path_params["intent_id"])
        except IntentNotFoundError as exc:
            return c.refuse(request, 404, "No such intent", str(exc))
        if intent.tool_id not in options.evidence_tools:
            return c.refuse(request, 409, "No evidence function",
                            f"tool {intent.tool_id} declares no evidence. Nothing was gathered.")
        viewer = c.viewer(request)
        assert viewer is not None  # guarded
        who = viewer.who
        asker = op.Identity(who.name, via=who.via) if who.name is not None else "console"
        await _io(options.evidence, intent.id, operator=asker)
        return RedirectResponse(f"/intents/{intent.id}?done=evidence#evidence", status_code=303)

    async def many(request: Request) -> Response:
        if request.method == "GET":
            return await _form(request, {}, {})
        data = await request.form()
        if not c.csrf_ok(request, data.get("csrf")):
            return c.refuse(request, 403, "Refused", "missing or wrong CSRF token: nothing was "
                            "changed")
        form = {k: v for k, v in data.items() if isinstance(v, str)}
        upload = data.get("csv_file")
        if upload is not None and not isinstance(upload, str):
            raw = await upload.read(rc.MAX_CSV_BYTES + 1)
            if raw:
                try:
                    form["csv"] = raw.decode("utf-8-sig")
                    form["csv_name"] = upload.filename or "upload.csv"
                except UnicodeDecodeError:
                    return await _form(request, form, {"csv": "the file is not UTF-8 text"})
        errors: dict[str, str] = {}
        viewer = c.viewer(request)
        assert viewer is not None  # guarded
        operator, reason = decided(form, errors, viewer.who)
        if form.get("step") == "confirm":
            if errors or operator is None:
                return await _form(request, form, errors)
            return await _apply(request, form, operator, reason)
        errors.pop("reason", None)  # asked for at the confirmation
        errors.pop("operator", None)
        try:
            plan = await _io(_plan, store, form)
        except op.OperatorInputError as exc:
            return await _form(request, form, {"plan": str(exc)})
        return c.page(request, "resolve_many.html", plan=plan, plan_lines=rc.plan_lines(plan),
                      form=form, errors={}, tools=await _tools(), report=None)

    async def _tools() -> list[str]:
        counts = await _io(store.counts)
        return sorted({t for (t, s), n in counts.items() if s == "INDETERMINATE" and n})

    async def _form(request: Request, form: dict[str, str], errors: dict[str, str]) -> Response:
        return c.page(request, "resolve_many.html", 400 if errors else 200, plan=None,
                      plan_lines="", form=form, errors=errors, tools=await _tools(), report=None)

    async def _apply(request: Request, form: dict[str, str], operator: op.Identity,
                     reason: str) -> Response:
        source = form.get("source", "")[:MAX_SOURCE] or "console"
        try:
            plan = await _io(rc.plan_from_lines, store, form.get("plan", ""), source=source)
            report = await _io(rc.apply, store, plan, operator=operator, reason=reason)
        except op.OperatorInputError as exc:
            return c.refuse(request, 400, "Refused", f"{exc}. Nothing was changed.")
        return c.page(request, "resolve_many.html", plan=None, plan_lines="", form={},
                      errors={}, tools=[], report=report)

    return [
        Route("/intents/{intent_id}/evidence", guarded(evidence), methods=["POST"]),
        Route("/resolve-many", guarded(many), methods=["GET", "POST"]),
    ]


def _plan(store: Store, form: dict[str, str]) -> rc.Plan:
    """The preview's plan: from the CSV, or from the filter's fields; never both."""
    text = form.get("csv", "").strip()
    terms = [f"{name}{sign}{form[field].strip()}" for field, name, sign in (
        ("tool", "tool", "="), ("reason_code", "reason", "="), ("call_id", "call_id", "="),
        ("created_before", "created", "<"), ("created_after", "created", ">"),
    ) if form.get(field, "").strip()]
    if text and terms:
        raise op.OperatorInputError("give a filter or a CSV, not both", field="plan")
    if text:
        name = form.get("csv_name") or "pasted.csv"
        return rc.plan_csv(store, rc.read_csv(text), name=name, text=text)
    decision = form.get("decision")
    if decision not in ("landed", "not_landed"):
        raise op.OperatorInputError("a filter needs a decision: landed or not landed",
                                    field="decision")
    flt = rc.parse_filter(terms, store.now())
    return rc.plan_filter(store, flt, landed=decision == "landed")

