"""The typed handle `@kernel.tool` returns: the function itself, and `call`/`acall` with the
tool's own signature."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

from poimen._core.spec import ToolSpec
from poimen._core.undo import undo_rule

if TYPE_CHECKING:
    from poimen._capability.context import ToolContext
    from poimen._core.effects import EffectClass
    from poimen._core.intents import Outcome
    from poimen._core.tools import Caps
    from poimen._core.undo import UndoArgs
    from poimen._kernel import Kernel

P = ParamSpec("P")
R = TypeVar("R")
P2 = ParamSpec("P2")
R2 = TypeVar("R2")


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
        from poimen._runtime import engine_of

        kernel = self._kernel
        rule = undo_rule(self.id, id, args)
        assert rule is not None

        def decorate(fn: Callable[Concatenate[ToolContext, P2], R2]) -> ToolHandle[P2, R2]:
            _undo.check_free(engine_of(kernel), self.id)  # before the undo tool is registered
            handle = kernel.tool(id=id, effects=effects, caps=caps, timeout=timeout, **options)(fn)
            _undo.link(engine_of(kernel), self.id, rule)
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
