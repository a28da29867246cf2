"""`poimen scan`'s static analysis (Python `ast`): the tools a module defines, and the writes to
the outside their bodies make, directly or through a function of the same module.

A tool: PydanticAI ``@agent.tool`` / ``@agent.tool_plain`` / ``@toolset.tool`` and
``Tool(f)`` / ``FunctionToolset([f])``; OpenAI Agents ``@function_tool``; LangChain and LangGraph
``@tool``, ``StructuredTool.from_function``, ``ToolNode([f])``; MCP ``@mcp.tool()``; CrewAI
``@tool`` and ``BaseTool`` subclasses. Under poimen: registered with ``effects=`` (a
``@kernel.tool``), or calling ``kernel.call``/``acall``.

A write: HTTP POST/PUT/PATCH/DELETE (requests, httpx, aiohttp, urllib), email (smtplib), cloud
SDK sends, puts and deletes, subprocesses, database writes (SQL, ORM commits, document and
key-value stores). ``error`` where the call is known, ``warning`` where only its name says so.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass

from poimen._core import suggest as _suggest
from poimen._core.suggest import Suggestion

_WRITE_METHODS = frozenset({"post", "put", "patch", "delete"})
_HTTP_MODULES = ("requests", "httpx", "aiohttp", "urllib3")
_HTTP_CLIENTS = frozenset({
    "httpx.Client", "httpx.AsyncClient", "requests.Session", "requests.session",
    "aiohttp.ClientSession", "urllib3.PoolManager", "http.client.HTTPConnection",
    "http.client.HTTPSConnection",
})
_SMTP = frozenset({"smtplib.SMTP", "smtplib.SMTP_SSL", "smtplib.LMTP", "aiosmtplib.SMTP",
                   "aiosmtplib.send"})
_PROCESS = frozenset({
    "subprocess.run", "subprocess.call", "subprocess.check_call", "subprocess.check_output",
    "subprocess.Popen", "subprocess.getoutput", "subprocess.getstatusoutput", "os.system",
    "os.popen", "os.execv", "os.execve", "os.execvp", "os.execl", "os.execlp", "os.spawnv",
    "os.spawnl", "os.posix_spawn", "asyncio.create_subprocess_exec",
    "asyncio.create_subprocess_shell",
})
_CLOUD_STATE = frozenset({
    "put_object", "delete_object", "delete_objects", "copy_object", "upload_file",
    "upload_fileobj", "put_item", "update_item", "delete_item", "batch_write_item",
    "transact_write_items", "upload_blob", "delete_blob", "upload_from_string",
    "upload_from_filename", "upload_from_file", "put_parameter", "put_secret_value",
})
_CLOUD_SEND = frozenset({
    "send_message", "send_message_batch", "send_email", "send_raw_email",
    "send_templated_email", "send_bulk_templated_email", "publish", "publish_batch",
    "put_record", "put_records", "put_events", "start_execution", "send_messages",
    "chat_postMessage", "invoke",
})
_CLOUD_PREFIXES = ("create_", "put_", "delete_", "update_", "send_", "upload_", "remove_",
                   "insert_", "publish_", "start_", "terminate_", "modify_")
_CLOUD_CLIENTS = ("boto3.", "botocore.", "google.cloud.", "azure.", "slack_sdk.")
_TOKENS = frozenset({"ClientToken", "ClientRequestToken", "MessageDeduplicationId",
                     "IdempotencyToken", "idempotency_key", "IdempotencyKey"})
_DOC_STATE = frozenset({"update_one", "update_many", "replace_one", "delete_one", "delete_many",
                        "find_one_and_update", "find_one_and_replace", "find_one_and_delete"})
_DOC_NEW = frozenset({"insert_one", "insert_many", "bulk_write"})
_KV_STATE = frozenset({"set", "hset", "mset", "delete", "expire", "hdel", "setex"})
_KV_NEW = frozenset({"incr", "decr", "incrby", "lpush", "rpush", "sadd", "zadd", "xadd",
                     "publish", "hincrby"})
_SQL_WRITE = re.compile(r"^\s*(insert|update|delete|replace|merge|upsert|create|drop|alter|"
                        r"truncate|grant|revoke)\b", re.IGNORECASE)
_SQL_INSERT = re.compile(r"^\s*insert\b(?!.*\bon\s+conflict\b)", re.IGNORECASE | re.DOTALL)
_SQL_READ = re.compile(r"^\s*(select|with|pragma|show|explain|describe|values)\b", re.IGNORECASE)
_CONTEXT_PARAMS = frozenset({"self", "cls", "ctx", "context", "run_context", "tool_context"})
_CONTEXT_TYPES = ("RunContext", "ToolContext", "Context", "RunContextWrapper")
_REGISTRARS = {
    "Tool": None, "FunctionToolset": "pydantic-ai", "function_tool": "openai-agents",
    "from_function": "langchain", "ToolNode": "langgraph", "create_react_agent": "langgraph",
    "add_tool": "mcp", "add_function": "pydantic-ai", "tool": None, "Agent": None,
}
_FRAMEWORKS = (("pydantic_ai", "pydantic-ai"), ("agents", "openai-agents"),
               ("langgraph", "langgraph"), ("langchain", "langchain"), ("crewai", "crewai"),
               ("mcp", "mcp"), ("fastmcp", "mcp"))


@dataclass(frozen=True, slots=True)
class Write:
    """A call in a tool's body (or in a function it calls) that writes to the outside."""

    line: int
    column: int
    what: str
    level: str  # "error" | "warning"
    suggestion: Suggestion
    via: str | None = None  # the same module's function it is in, if not the tool itself


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool definition found in a module."""

    path: str
    name: str
    line: int
    column: int
    framework: str
    under_poimen: bool
    params: tuple[str, ...]
    writes: tuple[Write, ...]

    @property
    def level(self) -> str | None:
        if self.under_poimen or not self.writes:
            return None
        return "error" if any(w.level == "error" for w in self.writes) else "warning"

    @property
    def suggestion(self) -> Suggestion | None:
        if not self.writes:
            return None
        return _suggest.weakest(w.suggestion for w in self.writes)


Func = ast.FunctionDef | ast.AsyncFunctionDef


def find_tools(path: str, source: str) -> list[Tool]:
    """The tools in one module's source (raises SyntaxError if it does not parse)."""
    return _Module(path, ast.parse(source, filename=path)).tools()


class _Module:
    def __init__(self, path: str, tree: ast.Module) -> None:
        self.path = path
        self.tree = tree
        self.names: dict[str, str] = {}  # local name -> qualified name
        self.bound: dict[str, str] = {}  # "client", "self.http" -> "httpx.Client()"
        self.funcs: dict[str, Func] = {}
        self.imports: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.names[a.asname or a.name.split(".")[0]] = (a.asname and a.name) or (
                        a.name.split(".")[0])
                    self.imports.add(a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.module:
                self.imports.add(node.module.split(".")[0])
                for a in node.names:
                    self.names[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.funcs.setdefault(node.name, node)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Call):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    self.bound[ast.unparse(t)] = self.qual(node.value.func) + "()"
            elif isinstance(node, ast.With | ast.AsyncWith):
                for item in node.items:
                    if item.optional_vars is not None and isinstance(item.context_expr, ast.Call):
                        self.bound[ast.unparse(item.optional_vars)] = (
                            self.qual(item.context_expr.func) + "()")
        self._memo: dict[int, tuple[Write, ...]] = {}

    def qual(self, e: ast.expr) -> str:
        """A dotted name for `e`, imports and bound objects resolved."""
        if isinstance(e, ast.Name):
            return self.bound.get(e.id) or self.names.get(e.id, e.id)
        if isinstance(e, ast.Attribute):
            text = ast.unparse(e)
            if text in self.bound:
                return self.bound[text]
            return f"{self.qual(e.value)}.{e.attr}"
        if isinstance(e, ast.Call):
            return self.qual(e.func) + "()"
        return ast.unparse(e)

    def _guess(self, qualified: str = "") -> str:
        for prefix, name in _FRAMEWORKS:
            if qualified.startswith(prefix + ".") or qualified.startswith(prefix + "_"):
                return name
        for prefix, name in _FRAMEWORKS:
            if prefix in self.imports:
                return name
        return "unknown"

    # Tools.

    def tools(self) -> list[Tool]:
        found: dict[int, Tool] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                kind = self._decorated(node)
                if kind is not None:
                    found[id(node)] = self._tool(node.name, node, [node], *kind)
            elif isinstance(node, ast.ClassDef):
                base = next((self.qual(b) for b in node.bases
                             if self.qual(b).rsplit(".", 1)[-1] == "BaseTool"), None)
                if base is not None:
                    runs = [f for f in node.body if isinstance(f, ast.FunctionDef |
                            ast.AsyncFunctionDef) and f.name in ("_run", "_arun", "run")]
                    found[id(node)] = self._tool(node.name, node, runs, self._guess(base), False)
            elif isinstance(node, ast.Call):
                for fn, framework in self._registered(node):
                    if id(fn) not in found:
                        found[id(fn)] = self._tool(fn.name, fn, [fn], framework, False)
        return sorted(found.values(), key=lambda t: (t.line, t.column))

    def _decorated(self, fn: Func) -> tuple[str, bool] | None:
        """(framework, under poimen) if a decorator makes `fn` a tool."""
        for d in fn.decorator_list:
            call = d if isinstance(d, ast.Call) else None
            target = call.func if call is not None else d
            q = self.qual(target)
            last = q.rsplit(".", 1)[-1]
            if call is not None and any(k.arg == "effects" for k in call.keywords):
                return "poimen", True
            if last in ("tool", "tool_plain") and isinstance(target, ast.Attribute):
                owner = self.qual(target.value)
                if owner.startswith("poimen."):
                    return "poimen", True
                return self._guess(owner), False
            if last == "call_tool" and isinstance(target, ast.Attribute):
                return "mcp", False
            if last == "function_tool":
                return "openai-agents", False
            if last == "tool":
                return self._guess(q) if q != "tool" else self._guess(), False
        return None

    def _registered(self, call: ast.Call) -> Iterator[tuple[Func, str]]:
        """The module's functions handed to a tool constructor or registrar."""
        q = self.qual(call.func)
        last = q.rsplit(".", 1)[-1].removesuffix("()")
        if last not in _REGISTRARS:
            return
        framework = _REGISTRARS[last] or self._guess(q)
        if last == "tool" and not call.args:
            return  # @tool("name") as a decorator factory: handled by _decorated
        values: list[ast.expr] = list(call.args) + [k.value for k in call.keywords
                                                    if k.arg in (None, "tools", "func",
                                                                 "function", "coroutine", "fn")]
        while values:
            v = values.pop()
            if isinstance(v, ast.List | ast.Tuple | ast.Set):
                values.extend(v.elts)
            elif isinstance(v, ast.Call) and self.qual(v.func).rsplit(".", 1)[-1] in _REGISTRARS:
                values.extend(v.args)
                values.extend(k.value for k in v.keywords if k.arg in ("func", "function"))
            elif isinstance(v, ast.Name) and v.id in self.funcs:
                yield self.funcs[v.id], framework

    def _tool(self, name: str, node: ast.AST, bodies: list[Func], framework: str,
              under: bool) -> Tool:
        writes: list[Write] = []
        for fn in bodies:
            writes += self._writes(fn, via=None, depth=0)
            under = under or self._calls_kernel(fn)
        if any(w.what.startswith(("SQL ", "database ")) and not w.what.startswith(
                "database commit") for w in writes):  # the statement says what it writes
            writes = [w for w in writes if not w.what.startswith("database commit")]
        params = tuple(p for fn in bodies[:1] for p in _params(fn))
        if params:
            writes = [_with_fields(w, params) for w in writes]
        line, col = getattr(node, "lineno", 1), getattr(node, "col_offset", 0) + 1
        return Tool(self.path, name, line, col, framework, under, params, tuple(writes))

    def _calls_kernel(self, fn: Func) -> bool:
        for c in _calls(fn):
            if isinstance(c.func, ast.Attribute) and c.func.attr in ("call", "acall"):
                owner = self.qual(c.func.value)
                if owner.startswith("poimen.") or "kernel" in ast.unparse(c.func.value).lower():
                    return True
        return False

    # Writes.

    def _writes(self, fn: Func, via: str | None, depth: int) -> list[Write]:
        out: list[Write] = []
        for c in _calls(fn):
            w = self._write(c)
            if w is not None:
                out.append(Write(c.lineno, c.col_offset + 1, w[0], w[1], w[2], via))
                continue
            helper = self._helper(c)
            if helper is not None and helper is not fn and depth < 4:
                out += self._writes(helper, via or helper.name, depth + 1)
        return out

    def _helper(self, c: ast.Call) -> Func | None:
        f = c.func
        if isinstance(f, ast.Name):
            return self.funcs.get(f.id)
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in (
                "self", "cls"):
            return self.funcs.get(f.attr)
        return None

    def _write(self, c: ast.Call) -> tuple[str, str, Suggestion] | None:
        q = self.qual(c.func)
        last = q.rsplit(".", 1)[-1]
        owner = q.rsplit(".", 1)[0] if "." in q else ""
        owner_text = ast.unparse(c.func.value) if isinstance(c.func, ast.Attribute) else ""
        keys = {k.arg for k in c.keywords if k.arg}
        if q in _PROCESS:
            return f"runs a command ({q})", "error", _suggest.unsafe(
                "a command run again runs again: nothing deduplicates it")
        if q in _SMTP or (last in ("sendmail", "send_message") and (
                "smtp" in q.lower() or "mail" in owner_text.lower())):
            return f"sends email ({q})", "error", _suggest.unsafe(
                "an email sent again is a second email: no mail server deduplicates it")
        found = self._http(c, q, last, owner, owner_text) or self._database(
            c, q, last, owner, owner_text)
        if found is not None:
            return found
        if last in _CLOUD_STATE or last in _CLOUD_SEND or (
                last.startswith(_CLOUD_PREFIXES) and owner.startswith(_CLOUD_CLIENTS)):
            known = owner.startswith(_CLOUD_CLIENTS) or last in _CLOUD_STATE or last in _CLOUD_SEND
            level = "error" if known else "warning"
            if keys & _TOKENS:
                return f"{owner_text or owner}.{last}", level, _suggest.keyed(
                    (), "the call carries a deduplication token: make it the poimen key, "
                    "derived from the arguments")
            if last in _CLOUD_STATE or last.startswith(("put_", "delete_", "upload_", "update_")):
                return f"{owner_text or owner}.{last}", level, _suggest.keyed(
                    (), "writing the same object again overwrites it with the same content")
            return f"{owner_text or owner}.{last}", level, _suggest.unsafe(
                "a message or job sent again is sent again, unless the service deduplicates on "
                "an id you give it: then Idempotent, with that id derived from the arguments")
        if last.startswith(_CLOUD_PREFIXES) and owner_text:
            return f"{owner_text}.{last}", "warning", _suggest.unsafe(
                f"{last} looks like a remote write; Idempotent if the service takes a key")
        if last in ("create", "modify", "capture", "refund", "cancel") and isinstance(
                c.func, ast.Attribute) and owner_text:
            level = "error" if owner.split(".")[0] in ("stripe", "twilio", "openai") else "warning"
            if keys & (_TOKENS | {"idempotency_key"}):
                return f"{owner_text}.{last}", level, _suggest.keyed(
                    (), "the call takes an idempotency key: poimen derives it from the arguments")
            return f"{owner_text}.{last}", level, _suggest.unsafe(
                "creating again creates a second one, unless the service takes an idempotency "
                "key: then Idempotent")
        return None

    def _http(self, c: ast.Call, q: str, last: str, owner: str, owner_text: str
              ) -> tuple[str, str, Suggestion] | None:
        client = owner.removesuffix("()") in _HTTP_CLIENTS or owner in _HTTP_MODULES
        method: str | None = None
        if last in _WRITE_METHODS and (client or owner_text.endswith(("ctx.http", "ctx.ahttp"))):
            method, level = last.upper(), "error"
        elif last in _WRITE_METHODS and re.search(r"(client|session|http|api)", owner_text, re.I):
            method, level = last.upper(), "warning"
        elif last == "request" and (client or q in ("requests.request", "httpx.request")):
            given = c.args[0] if c.args else next(
                (k.value for k in c.keywords if k.arg == "method"), None)
            if isinstance(given, ast.Constant) and isinstance(given.value, str):
                if given.value.lower() not in _WRITE_METHODS:
                    return None
                method, level = given.value.upper(), "error"
            else:
                method, level = "request (its method is not known statically)", "warning"
        elif q in ("urllib.request.urlopen", "urllib.request.Request"):
            m = next((k.value for k in c.keywords if k.arg == "method"), None)
            data = len(c.args) > 1 or any(k.arg == "data" for k in c.keywords)
            if isinstance(m, ast.Constant) and str(m.value).lower() in _WRITE_METHODS:
                method, level = str(m.value).upper(), "error"
            elif data:
                method, level = "POST", "error"
        if method is None:
            return None
        headers = _dict_keys(next((k.value for k in c.keywords if k.arg == "headers"), None))
        body = _dict_keys(next((k.value for k in c.keywords if k.arg in ("json", "data")), None))
        has_key = any("idempotency" in h.lower() for h in headers)
        has_rid = any("request-id" in h.lower() or "request_id" in h.lower() for h in headers) \
            or "request_id" in body
        return f"HTTP {method}", level, _suggest.for_http(
            method.split()[0], (), has_key=has_key, has_request_id=has_rid)

    def _database(self, c: ast.Call, q: str, last: str, owner: str, owner_text: str
                  ) -> tuple[str, str, Suggestion] | None:
        if last in ("execute", "executemany", "executescript", "exec_driver_sql") and c.args:
            sql = _sql_text(c.args[0])
            if sql is None:
                return "SQL (a statement not known statically)", "warning", _suggest.lookup(
                    "store ctx.request_id with what the statement writes, and look it up")
            if _SQL_READ.match(sql) or not _SQL_WRITE.match(sql):
                return None
            verb = sql.split()[0].upper()
            if _SQL_INSERT.match(sql):
                return f"SQL {verb}", "error", _suggest.lookup(
                    "an INSERT run again adds a second row: store ctx.request_id in the row and "
                    "look it up (or make it an upsert keyed on the arguments: Idempotent)")
            return f"SQL {verb}", "error", _suggest.keyed(
                (), "setting the same values again changes nothing")
        if last == "commit" and not c.args and isinstance(c.func, ast.Attribute):
            return f"database commit ({owner_text}.commit)", "error", _suggest.lookup(
                "store ctx.request_id with what the transaction writes, and look it up")
        if last in _DOC_NEW:
            return f"{owner_text}.{last}", "error", _suggest.lookup(
                "an insert run again adds a second document: store ctx.request_id in it and "
                "look it up")
        if last in _DOC_STATE:
            return f"{owner_text}.{last}", "error", _suggest.keyed(
                (), "setting the same values again changes nothing")
        if "redis" in (owner + owner_text).lower() and last in _KV_STATE | _KV_NEW:
            if last in _KV_STATE:
                return f"{owner_text}.{last}", "error", _suggest.keyed(
                    (), "setting the same value again changes nothing")
            return f"{owner_text}.{last}", "error", _suggest.unsafe(
                f"{last} applied again counts twice")
        return None


def _calls(fn: Func) -> Iterator[ast.Call]:
    """The calls in `fn`'s own body, not in functions or classes nested in it."""
    stack: list[ast.AST] = list(fn.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        if isinstance(node, ast.Call):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _params(fn: Func) -> list[str]:
    out = []
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    for i, a in enumerate(args):
        ann = ast.unparse(a.annotation) if a.annotation is not None else ""
        if a.arg in _CONTEXT_PARAMS or (i == 0 and any(t in ann for t in _CONTEXT_TYPES)):
            continue
        out.append(a.arg)
    return out


def _with_fields(w: Write, params: tuple[str, ...]) -> Write:
    s = w.suggestion
    fields = ", ".join(f'"{p}"' for p in params)
    fixed = Suggestion(s.effect, s.code.replace("fields(...)", f"fields({fields})"),
                       s.why.replace("fields(...)", f"fields({fields})"))
    return Write(w.line, w.column, w.what, w.level, fixed, w.via)


def _dict_keys(e: ast.expr | None) -> set[str]:
    if isinstance(e, ast.Dict):
        return {k.value for k in e.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return set()


def _sql_text(e: ast.expr) -> str | None:
    if isinstance(e, ast.Call) and e.args:  # sqlalchemy.text("...")
        return _sql_text(e.args[0])
    if isinstance(e, ast.Constant) and isinstance(e.value, str):
        return e.value
    if isinstance(e, ast.JoinedStr) and e.values and isinstance(e.values[0], ast.Constant):
        return str(e.values[0].value)
    return None
