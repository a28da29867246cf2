"""What agent frameworks need to see of a tool: its spec (name, description, argument schema,
effect class) under a name every model provider accepts, and a typed handle to call it."""

from __future__ import annotations

import hashlib
import inspect
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

from poimen._core.effects import EffectName, effect_name
from poimen._core.tools import Tool
from poimen.errors import RegistrationError

if TYPE_CHECKING:
    from poimen._capability.context import ToolContext
    from poimen._core.effects import EffectClass
    from poimen._core.intents import Outcome
    from poimen._core.tools import Caps
    from poimen._kernel import Kernel
    from poimen._undo import UndoArgs

P = ParamSpec("P")
R = TypeVar("R")
P2 = ParamSpec("P2")
R2 = TypeVar("R2")

# What OpenAI, Anthropic and Gemini accept as a function name.
_SAFE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_UNSAFE_CHARS = re.compile(r"[^a-zA-Z0-9_-]")


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A registered tool as a model sees it.

    `name` is the tool id if a model provider accepts it as a function name
    (``[a-zA-Z0-9_-]{1,64}``), else a safe alias (``billing.charge`` -> ``billing_charge``);
    `Kernel.tool_id(name)` maps it back. `parameters` is the JSON schema of the arguments.
    """

    id: str
    name: str
    description: str
    parameters: dict[str, Any]
    effect: EffectName
    timeout: float


def safe_name(tool_id: str, taken: set[str]) -> str:
    """A provider-safe function name for `tool_id`, distinct from the names in `taken`."""
    if _SAFE.match(tool_id) and tool_id not in taken:
        return tool_id
    base = _UNSAFE_CHARS.sub("_", tool_id)[:55] or "tool"
    if base not in taken:
        return base
    digest = hashlib.sha256(tool_id.encode()).hexdigest()
    for n in range(8, len(digest) + 1):  # a longer digest until no tool has the name
        name = f"{base}_{digest[:n]}"
        if name not in taken:
            return name
    raise AssertionError(f"no free name for {tool_id!r}")


def spec_of(t: Tool, name: str, description: str | None) -> ToolSpec:
    """The tool as a model sees it; `RegistrationError` when its arguments have no JSON
    schema (a `Callable` parameter, an unresolvable ``$ref``)."""
    try:
        schema = t.model.model_json_schema()
    except Exception as exc:  # pydantic's errors, or a KeyError from a schema it cannot walk
        raise RegistrationError(
            f"tool {t.id!r}: its arguments have no JSON schema a model could be shown "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else exc!r}); "
            "nothing was registered",
            tool_id=t.id,
        ) from exc
    schema.pop("title", None)
    doc = description if description is not None else (inspect.getdoc(t.fn) or "")
    return ToolSpec(
        id=t.id,
        name=name,
        description=doc,
        parameters=schema,
        effect=effect_name(t.registration.effects),
        timeout=t.registration.timeout,
    )


class ToolHandle(Generic[P, R]):
    """What `@kernel.tool` returns: the function itself (call it as before), plus `call` and
    `acall` with the tool's own signature, so a type checker catches a misspelled argument:

        charge.call("run-9/step-3", order_id="o-17", amount_cents=4200)
    """

    __slots__ = ("__wrapped__", "_kernel", "id")

    def __init__(self, kernel: Kernel, tool_id: str, fn: Callable[..., R]) -> None:
        self._kernel = kernel
        self.id = tool_id
        self.__wrapped__ = fn

    def __call__(self, ctx: ToolContext, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.__wrapped__(ctx, *args, **kwargs)

    def call(self, call_id: str, /, *args: P.args, **kwargs: P.kwargs) -> Outcome:
        """`kernel.call(id, kwargs, call_id=call_id)`, typed by the tool's signature."""
        return self._kernel.call(self.id, _named(args, kwargs), call_id=call_id)

    def acall(self, call_id: str, /, *args: P.args, **kwargs: P.kwargs) -> Awaitable[Outcome]:
        """`kernel.acall(...)`, typed by the tool's signature."""
        return self._kernel.acall(self.id, _named(args, kwargs), call_id=call_id)

    @property
    def spec(self) -> ToolSpec:
        """The tool as a model sees it."""
        return self._kernel.spec(self.id)

    def undo(
        self,
        *,
        id: str,
        effects: EffectClass,
        caps: Caps,
        timeout: float,
        args: UndoArgs | None = None,
        **options: Any,
    ) -> Callable[[Callable[Concatenate[ToolContext, P2], R2]], ToolHandle[P2, R2]]:
        """Register the decorated function as a tool (`id`, `effects`, ... as for
        `Kernel.tool`) and as this tool's undo; `args` derives its arguments from a call's
        recorded arguments and result (default: the same arguments)."""
        from poimen import _undo

        kernel = self._kernel
        rule = _undo.rule(self.id, id, args)
        assert rule is not None

        def decorate(fn: Callable[Concatenate[ToolContext, P2], R2]) -> ToolHandle[P2, R2]:
            _undo.check_free(kernel, self.id)  # before the undo tool is registered
            handle = kernel.tool(id=id, effects=effects, caps=caps, timeout=timeout, **options)(fn)
            _undo.link(kernel, self.id, rule)
            return handle

        return decorate

    def __repr__(self) -> str:
        return f"<poimen tool {self.id!r}>"


def _named(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    if args:
        from poimen.errors import ArgumentError

        raise ArgumentError(
            "pass a tool's arguments by name: they are recorded by name", argument="<positional>"
        )
    return kwargs
