"""poimen tools over MCP, and MCP tools as poimen tools. Needs ``pip install 'poimen[mcp]'``.

Serve a kernel's tools::

    server = mcp_server(kernel)        # the MCP SDK's low-level Server
    run_stdio(server)                  # or server.streamable_http_app() for HTTP

Each tool is listed with its spec (name, description, JSON schema) and hints from its effect
class. A client that sends ``_meta: {"poimen/call_id": "..."}`` with a call names the call
(`CALL_ID_META`): calling again with the same id, after a crash or a lost answer, returns the
recorded outcome instead of running the tool twice. Without it, the call id is derived
(`poimen.call_ids.CallIds`) within the server's scope. Every result carries the call id and
the outcome in its ``_meta``; an Indeterminate call is not an error of the call: it answers
the standard text (``outcome.for_model()``) with ``poimen/outcome: "indeterminate"``. The
server's scope (or the session's) is the calls' scope: a call identical to one still unsettled
there gets its outcome instead of a second dispatch. A Pending call is waited for up to
`pending_wait` seconds; still Pending, it is an error result the client retries with the same
``poimen/call_id`` (``_meta``: ``poimen/outcome: "pending"``, the call id to send again).

A call awaiting an operator's approval is asked of the client's user by MCP elicitation
(`APPROVAL_FORM`: decision, operator, reason, edited arguments as JSON): with MCP 2026-07-28
and later an ``input_required`` result (`APPROVAL_INPUT`) the client answers by sending the
call again, before that an elicitation request on the session. The answer is applied to the
call's intent (the one it was asked about), audited; a four-eyes call is asked again until
enough distinct operators approved, about the edited call after an edit. A client that cannot
be asked, or a user who declines, gets Pending until an operator decides elsewhere.

Import a remote server's tools::

    await import_mcp_tools(kernel, session, declare={"lookup_order": ReadOnly()})

Every imported tool is Unsafe unless the application declares its class: a remote server's
annotations are hints from a party poimen cannot check. See docs/integrations/mcp.md.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import secrets
from collections.abc import Coroutine, Iterable, Mapping
from typing import Any, cast
from urllib.parse import unquote

from poimen.errors import MissingExtraError

try:
    import anyio
    import jsonschema  # type: ignore[import-untyped]
    from mcp import Client, ClientSession, MCPError, types
    from mcp.server import Server
    from mcp.server.context import ServerRequestContext
    from mcp.server.stdio import stdio_server
    from mcp_types.version import is_version_at_least
    from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
    from pydantic_core import core_schema
except ImportError as exc:  # the extra is missing: say which one
    raise MissingExtraError.of("poimen.integrations.mcp", "mcp", exc) from exc

from poimen import (
    Caps,
    Completed,
    EffectClass,
    Failed,
    Kernel,
    Outcome,
    Resolved,
    ToolContext,
    ToolRegistration,
    ToolSpec,
    Unsafe,
    call_ids,
)
from poimen._core.spec import spec_of
from poimen._core.tools import build_tool
from poimen.errors import (
    ArgumentError,
    CallIdMismatchError,
    DefiniteFailure,
    NotSent,
    RegistrationError,
    SameApproverError,
    UnknownToolError,
)
from poimen.integrations._outcomes import (
    PENDING_WAIT,
    apply_decision,
    awaiting,
    followed,
    request,
    settle,
    waitable,
)

__all__ = [
    "APPROVAL_FORM",
    "APPROVAL_INPUT",
    "CALL_ID_META",
    "INTENT_META",
    "OUTCOME_META",
    "REASON_META",
    "RETRYABLE_META",
    "RETRY_CALL_ID_META",
    "annotations_for",
    "import_mcp_tools",
    "mcp_server",
    "run_stdio",
]

log = logging.getLogger("poimen")

#: A request's ``_meta`` key naming the call; a result's, naming the call it answers.
CALL_ID_META = "poimen/call_id"
#: A result's ``_meta`` keys: the outcome (completed, failed, indeterminate, pending,
#: resolved), the intent id an operator sees, why it is not settled, and whether calling the
#: tool again is right.
OUTCOME_META = "poimen/outcome"
INTENT_META = "poimen/intent_id"
REASON_META = "poimen/reason"
RETRYABLE_META = "poimen/retryable"
#: A still Pending call's error result: the client's call id to send again (as
#: ``poimen/call_id``); without one, the same arguments are the same call.
RETRY_CALL_ID_META = "poimen/retry_call_id"

# Serving.


def annotations_for(effect: str) -> types.ToolAnnotations:
    """MCP hints from an effect class name (`ToolSpec.effect`).

    Idempotent: a repeat with the same arguments has no further effect. Queryable: a repeat
    is a second effect, and poimen cannot tell an additive effect from a destructive one, so
    it keeps MCP's default (destructive). Unsafe: destructive, not idempotent. ReadOnly: reads.
    """
    if effect == "readonly":
        return types.ToolAnnotations(read_only_hint=True)
    if effect == "idempotent":
        return types.ToolAnnotations(
            read_only_hint=False, destructive_hint=False, idempotent_hint=True
        )
    return types.ToolAnnotations(read_only_hint=False, destructive_hint=True, idempotent_hint=False)


def mcp_server(
    kernel: Kernel,
    *,
    scope: str | None = None,
    name: str = "poimen",
    tools: Iterable[str] | None = None,
    pending_wait: float = PENDING_WAIT,
) -> Server[Any]:
    """An MCP server listing `kernel`'s tools (or only `tools`, by id or name) and calling
    them through the kernel.

    `scope` names this server's calls in the intent log. A client's ``poimen/call_id`` becomes
    ``scope/<id>`` (default scope ``mcp``); a call without one gets a derived id in `scope`
    if given (keep it across restarts, e.g. one server per conversation), else in this
    connection's session (or this server's run when the transport has no session)."""
    exposed = None if tools is None else frozenset(kernel.tool_id(t) for t in tools)
    ids = _ServerCallIds(scope)

    def listed(tool_id: str) -> bool:
        return exposed is None or tool_id in exposed

    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[_tool(s) for s in kernel.specs() if listed(s.id)])

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult | types.InputRequiredResult:
        try:
            tool_id = kernel.tool_id(params.name)
        except UnknownToolError:
            tool_id = None
        if tool_id is None or not listed(tool_id):
            raise MCPError(types.INVALID_PARAMS, f"no tool is named {params.name!r}")
        args = params.arguments or {}
        try:
            call_id, scope = ids.call_id(ctx, params.meta, tool_id, args)
            outcome = await kernel.acall(tool_id, args, call_id=call_id, scope=scope)
        except (ArgumentError, CallIdMismatchError) as exc:
            # Refused before anything was recorded: the model may correct the input.
            return types.CallToolResult(content=[types.TextContent(text=str(exc))], is_error=True)
        outcome = followed(kernel, call_id, outcome)  # approved with edited arguments
        if awaiting(outcome) and _input_required(ctx):
            asked = await _answered(kernel, params, call_id, tool_id, args, outcome)
            if isinstance(asked, types.InputRequiredResult):
                return asked
            outcome = asked
        elif awaiting(outcome):
            outcome = await _elicited(kernel, ctx, call_id, tool_id, args, outcome)
        outcome = await settle(kernel, call_id, outcome, pending_wait)
        ids.answered(scope, call_id, outcome)
        given = (params.meta or {}).get(CALL_ID_META)
        return _result(outcome, call_id, given if isinstance(given, str) else None)

    return Server(name, on_list_tools=list_tools, on_call_tool=call_tool)


# What a client's user answers when asked to approve a call (MCP elicitation, form mode).
APPROVAL_FORM: dict[str, Any] = {
    "type": "object",
    "properties": {
        "decision": {"type": "string", "enum": ["approve", "edit", "reject"]},
        "operator": {"type": "string", "description": "who decides (audited)"},
        "reason": {"type": "string"},
        "args": {"type": "string", "description": "edit: the arguments to use, as JSON"},
    },
    "required": ["decision", "operator", "reason"],
}


def _question(kernel: Kernel, call_id: str, tool_id: str, args: Mapping[str, Any],
              outcome: Outcome) -> str:
    """What the approver is asked of a call awaiting approval: the call, its arguments (the
    edited ones after an edit), and for four eyes who has approved so far."""
    asked = request(kernel, call_id, tool_id, args, outcome)
    needed, given = asked["approvals"]["needed"], asked["approvals"]["given"]
    message = (
        f"Approve the call of {tool_id!r} with {json.dumps(asked['args'], sort_keys=True)} "
        f"(intent {outcome.intent_id})?"
    )
    if needed > 1:
        message += (
            f" {needed} distinct operators must approve it; approved so far by "
            f"{', '.join(given) or 'no one'}."
        )
    return message


def _decision(content: Mapping[str, Any]) -> dict[str, Any]:
    """An approver's answer to `APPROVAL_FORM`, its edited arguments parsed."""
    decision = dict(content)
    if decision.get("decision") == "edit":
        try:
            decision["args"] = json.loads(str(decision.get("args") or ""))
        except ValueError as exc:
            raise ArgumentError(f"the edited arguments are not JSON: {exc}") from exc
    return decision


async def _decide(kernel: Kernel, call_id: str, outcome: Outcome, content: Any) -> Outcome:
    """Apply an approver's answer to the intent asked about; the call's outcome then."""
    try:
        await asyncio.to_thread(apply_decision, kernel, outcome.intent_id, _decision(content))
    except SameApproverError as exc:  # four eyes: another operator must; asked again
        log.info("call %s: %s", call_id, exc)
    return kernel.outcome(call_id) or outcome


#: The key of the approval asked for in an ``input_required`` result (MCP 2026-07-28).
APPROVAL_INPUT = "poimen/approval"


def _input_required(ctx: ServerRequestContext[Any]) -> bool:
    """Whether this request asks its client through an ``input_required`` result (MCP
    2026-07-28 and later) rather than an elicitation request on the session."""
    version = getattr(ctx, "protocol_version", None)
    return isinstance(version, str) and is_version_at_least(version, "2026-07-28")


async def _answered(
    kernel: Kernel,
    params: types.CallToolRequestParams,
    call_id: str,
    tool_id: str,
    args: Mapping[str, Any],
    outcome: Outcome,
) -> Outcome | types.InputRequiredResult:
    """The approval asked in ``input_required`` rounds: the client asks its user and sends
    the call again with the answer. The answer counts only for the intent it was asked about
    (``request_state``, which the client echoes): another is asked about afresh."""
    answer = (params.input_responses or {}).get(APPROVAL_INPUT)
    try:
        about = json.loads(params.request_state or "{}").get("intent_id")
    except (ValueError, AttributeError):
        about = None
    if answer is not None and about == outcome.intent_id:
        content = getattr(answer, "content", None)
        if getattr(answer, "action", None) != "accept" or not content:
            return outcome  # declined: the call awaits an operator's decision elsewhere
        outcome = await _decide(kernel, call_id, outcome, content)
        if not awaiting(outcome):
            return outcome
    form = types.ElicitRequestFormParams(
        message=_question(kernel, call_id, tool_id, args, outcome),
        requested_schema=cast(Any, APPROVAL_FORM),
    )
    return types.InputRequiredResult(
        input_requests={APPROVAL_INPUT: types.ElicitRequest(params=form)},
        request_state=json.dumps({"intent_id": outcome.intent_id}),
    )


async def _elicited(
    kernel: Kernel,
    ctx: ServerRequestContext[Any],
    call_id: str,
    tool_id: str,
    args: Mapping[str, Any],
    outcome: Outcome,
) -> Outcome:
    """Ask the client's user to approve the call (elicitation), and apply the decision to its
    intent; a four-eyes call is asked again until enough distinct operators approved (about
    the edited call after an edit). A client that cannot be asked, or a user who declines to
    answer, leaves it awaiting an operator's decision."""
    asks, needed = 0, 1
    while awaiting(outcome) and asks < needed + _REPEATS:
        asks += 1
        needed = request(kernel, call_id, tool_id, args, outcome)["approvals"]["needed"]
        message = _question(kernel, call_id, tool_id, args, outcome)
        try:
            answer = await ctx.session.elicit_form(message, cast(Any, APPROVAL_FORM))
        except Exception as exc:  # no back-channel, or a client without elicitation
            log.info("call %s: its approval could not be asked over MCP: %s", call_id, exc)
            break
        if answer.action != "accept" or not answer.content:
            break
        outcome = await _decide(kernel, call_id, outcome, answer.content)
    return outcome


# How many answers beyond the approvals needed one call asks for: a user answering as the
# same operator again and again is not asked for ever.
_REPEATS = 3



def run_stdio(server: Server[Any]) -> None:
    """Serve `server` on this process's stdin and stdout until the client goes away."""

    async def serve() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(serve)


class _ServerCallIds:
    def __init__(self, scope: str | None) -> None:
        if scope is not None:
            call_ids.framework_id(scope, "-")  # refuses an empty or non-text scope now
        self.scope = scope
        self.run = f"mcp-{secrets.token_hex(8)}"
        self.derived: dict[str, call_ids.CallIds] = {}

    def call_id(
        self,
        ctx: ServerRequestContext[Any],
        meta: Mapping[str, Any] | None,
        tool_id: str,
        args: Mapping[str, Any],
    ) -> tuple[str, str]:
        """The call id and the call's scope: the server's scope, else the session's (or this
        server's run when the transport has no session)."""
        scope = self.scope
        if scope is None:
            session = _session_id(ctx)
            scope = f"mcp/{session}" if session else self.run
        given = (meta or {}).get(CALL_ID_META)
        if given is not None:
            if not isinstance(given, str) or not given:
                raise MCPError(
                    types.INVALID_PARAMS,
                    f"_meta {CALL_ID_META!r} must be a non-empty string, not {given!r}",
                )
            return call_ids.framework_id(self.scope or "mcp", given), scope
        ids = self.derived.get(scope)
        if ids is None:
            ids = self.derived[scope] = call_ids.CallIds(scope)
        return ids.next(tool_id, args), scope

    def answered(self, scope: str, call_id: str, outcome: Outcome) -> None:
        ids = self.derived.get(scope)
        if ids is not None:
            ids.answered(call_id, outcome)


def _session_id(ctx: ServerRequestContext[Any]) -> str | None:
    headers = getattr(ctx.request, "headers", None)
    if headers is None:
        return None
    value = headers.get("mcp-session-id")
    return value if isinstance(value, str) and value else None


def _tool(spec: ToolSpec) -> types.Tool:
    return types.Tool(
        name=spec.name,
        description=spec.description,
        input_schema={"type": "object", **spec.parameters},
        annotations=annotations_for(spec.effect),
    )


def _result(outcome: Outcome, call_id: str, given: str | None = None) -> types.CallToolResult:
    meta: dict[str, Any] = {
        CALL_ID_META: call_id,
        INTENT_META: outcome.intent_id,
        OUTCOME_META: type(outcome).__name__.lower(),
        RETRYABLE_META: outcome.retryable,
    }
    reason = getattr(outcome, "reason", None)
    if reason is not None:
        meta[REASON_META] = reason
    landed = isinstance(outcome, Completed) or (isinstance(outcome, Resolved) and outcome.landed)
    value = outcome.result if isinstance(outcome, Completed | Resolved) else None
    text = outcome.for_model()
    if waitable(outcome):  # still Pending: an error the client retries with the call id
        again = "the same arguments"
        if given is not None:
            meta[RETRY_CALL_ID_META] = given
            again = f"_meta {{{CALL_ID_META!r}: {given!r}}}"
        text = f"{text} Call this tool again with {again} to get its outcome; it never runs twice."
    return types.CallToolResult(
        content=[types.TextContent(text=text)],
        structured_content=value if landed and isinstance(value, dict) else None,
        is_error=isinstance(outcome, Failed)
        or (isinstance(outcome, Resolved) and not landed)
        or waitable(outcome),
        _meta=meta,
    )


# Importing.


async def import_mcp_tools(
    kernel: Kernel,
    session: ClientSession | Client,
    *,
    declare: Mapping[str, EffectClass] | None = None,
    tools: Iterable[str] | None = None,
    prefix: str = "",
    timeout: float = 30.0,
) -> list[ToolSpec]:
    """Register the tools of the MCP server behind `session` (all, or only `tools`) as
    `prefix + name`; returns their specs.

    Each is **Unsafe unless `declare` gives its class** (by the remote name): the remote's
    annotations are not trusted. Call the tools with ``await kernel.acall(...)``; recovery may
    run them from another thread, and the call is carried to this event loop. Each call sends
    ``_meta: {"poimen/call_id": ...}`` (the Idempotent key, the Queryable request id, or the
    intent id), so a remote poimen server settles a repeat from its own log."""
    declared = dict(declare or {})
    listed = {t.name: t for t in await _list_tools(session)}
    names = list(listed) if tools is None else list(tools)
    missing = sorted((set(declared) | set(names)) - set(listed))
    if missing:
        raise RegistrationError(
            f"the MCP server has no tool named {', '.join(map(repr, missing))}; it lists "
            f"{', '.join(map(repr, sorted(listed))) or 'none'}",
            tool_id=missing[0],
        )
    loop = asyncio.get_running_loop()
    taken = kernel.registered()
    built = []
    for remote in names:
        tool_id = prefix + remote
        if tool_id in taken:
            raise RegistrationError(f"tool {tool_id!r} is already registered", tool_id=tool_id)
        registration = ToolRegistration(
            id=tool_id, effects=declared.get(remote, Unsafe()), caps=Caps(), timeout=timeout
        )
        built.append((registration, _remote_tool(session, loop, listed[remote], tool_id), remote))
    for registration, fn, remote in built:  # refused here, before anything is registered
        spec_of(build_tool(registration, fn), remote, listed[remote].description or "")
    specs = []
    for registration, fn, remote in built:
        kernel.register(registration, fn, description=listed[remote].description or "")
        specs.append(kernel.spec(registration.id))
    return specs


#: The most pages of tools a server may list: a server whose cursor never ends is refused.
MAX_PAGES = 1000


async def _list_tools(session: ClientSession | Client) -> list[types.Tool]:
    found: list[types.Tool] = []
    cursor: str | None = None
    seen: set[str] = set()
    for _ in range(MAX_PAGES):
        if isinstance(session, ClientSession):
            page = await session.list_tools(
                params=None if cursor is None else types.PaginatedRequestParams(cursor=cursor)
            )
        else:
            page = await session.list_tools(cursor=cursor)
        found.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return found
        if cursor in seen:
            raise RegistrationError(
                f"the MCP server's tool list does not end: it gave the cursor {cursor[:100]!r} "
                "twice; nothing was registered"
            )
        seen.add(cursor)
    raise RegistrationError(
        f"the MCP server listed more than {MAX_PAGES} pages of tools without an end; "
        "nothing was registered"
    )


def _remote_tool(
    session: ClientSession | Client,
    loop: asyncio.AbstractEventLoop,
    remote: types.Tool,
    tool_id: str,
) -> Any:
    """A function with one keyword parameter per property of the remote's input schema, each
    checked against its schema before anything is recorded."""
    schema = remote.input_schema
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    defs: dict[str, Any] = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    hints: dict[str, Any] = {}
    for name, prop in props.items():
        if name == "ctx":
            raise RegistrationError(
                f"tool {tool_id!r}: an argument named 'ctx' would take the place of the tool's "
                "context, so poimen cannot pass it; leave the tool out with tools=[...]",
                tool_id=tool_id, field=name,
            )
        try:
            params.append(
                inspect.Parameter(
                    name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=inspect.Parameter.empty if name in required else None,
                )
            )
        except ValueError:
            raise RegistrationError(
                f"tool {tool_id!r}: argument {name!r} is not a Python identifier, so poimen "
                "cannot record it; leave the tool out with tools=[...]",
                tool_id=tool_id, field=name,
            ) from None
        hints[name] = _remote_value(tool_id, name, prop if isinstance(prop, dict) else {}, defs)

    async def call(ctx: ToolContext, **kwargs: Any) -> Any:
        arguments = {k: v for k, v in kwargs.items() if k in required or v is not None}
        meta = {CALL_ID_META: ctx.key or ctx.request_id or ctx.intent_id}
        return await _on_loop(loop, _send(session, remote.name, arguments, meta))

    call.__name__ = remote.name
    call.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    call.__annotations__ = hints
    return call


def _remote_value(
    tool_id: str, name: str, prop: dict[str, Any], defs: dict[str, Any]
) -> type:
    """A type pydantic validates against the property's JSON schema and shows as that schema."""
    full = {**prop, **defs}
    shown = _inline(tool_id, name, prop, full)
    try:
        cls = jsonschema.validators.validator_for(full)
        cls.check_schema(full)
    except jsonschema.SchemaError as exc:
        raise RegistrationError(
            f"tool {tool_id!r}: argument {name!r} has no valid JSON schema: {exc.message}",
            tool_id=tool_id, field=name,
        ) from None
    validator = cls(full)

    def check(value: Any) -> Any:
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
        if error is not None:
            raise ValueError(error.message)
        return value

    class RemoteValue:
        @classmethod
        def __get_pydantic_core_schema__(
            cls, source: Any, handler: GetCoreSchemaHandler
        ) -> core_schema.CoreSchema:
            return core_schema.no_info_after_validator_function(check, core_schema.any_schema())

        @classmethod
        def __get_pydantic_json_schema__(
            cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
        ) -> dict[str, Any]:
            return dict(shown)

    return RemoteValue


#: The most schema nodes an argument's schema may expand to once its references are inlined.
MAX_SCHEMA_NODES = 10_000


def _inline(tool_id: str, name: str, prop: dict[str, Any], schema: dict[str, Any]) -> Any:
    """The argument's schema `prop` with every ``$ref`` replaced by what it points at inside
    `schema` (the property with the tool's ``$defs``): what a model is shown. A reference elsewhere (it would be fetched), one
    that resolves nowhere, a recursive one or an expansion too large is refused."""
    budget = [MAX_SCHEMA_NODES]

    def refuse(ref: Any, why: str) -> RegistrationError:
        return RegistrationError(
            f"tool {tool_id!r}: argument {name!r} refers to {str(ref)[:200]!r}, {why}; "
            "nothing was registered",
            tool_id=tool_id, field=name,
        )

    def walk(node: Any, path: tuple[str, ...]) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise refuse(path[-1] if path else "itself", "which expands beyond "
                         f"{MAX_SCHEMA_NODES} schema nodes")
        if isinstance(node, list):
            return [walk(x, path) for x in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if ref is None:
            return {k: walk(v, path) for k, v in node.items()}
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise refuse(ref, "which is not inside its schema")
        if ref in path:
            raise refuse(ref, "which refers to itself (recursive schemas are not supported)")
        target = _resolve(schema, ref)
        if target is None:
            raise refuse(ref, "which its schema does not hold")
        rest = {k: v for k, v in node.items() if k != "$ref"}
        inlined = walk(target, (*path, ref))
        return {**inlined, **walk(rest, path)} if isinstance(inlined, dict) else inlined

    return walk(prop, ())


def _resolve(schema: dict[str, Any], ref: str) -> Any:
    node: Any = schema
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


async def _on_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    """Await `coro` on the session's event loop, from whichever loop runs the tool."""
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        return await coro
    if loop.is_closed() or not loop.is_running():
        coro.close()
        raise NotSent("the MCP session's event loop no longer runs")
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


async def _send(
    session: ClientSession | Client, name: str, arguments: dict[str, Any], meta: dict[str, Any]
) -> Any:
    try:
        result = await session.call_tool(name, arguments, meta=cast(types.RequestParamsMeta, meta))
    except MCPError as exc:
        if exc.code in (types.INVALID_PARAMS, types.METHOD_NOT_FOUND):
            raise DefiniteFailure(f"the MCP server refused the call: {exc.message}") from exc
        raise
    unsettled = (result.meta or {}).get(OUTCOME_META) in ("indeterminate", "pending")
    if result.is_error or unsettled:
        # A remote tool may report an error after its effect (servers turn a tool's exception
        # into an error result), and a remote poimen server may not know either.
        raise RuntimeError(f"the remote tool {name!r} answered: {_text(result)}")
    if result.structured_content is not None:
        return result.structured_content
    if all(isinstance(c, types.TextContent) for c in result.content):
        return "\n".join(c.text for c in result.content if isinstance(c, types.TextContent))
    return [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in result.content]


def _text(result: types.CallToolResult) -> str:
    text = " ".join(c.text for c in result.content if isinstance(c, types.TextContent))
    return text[:500] or "an error without text"
