"""What agent frameworks need to see of a tool: its spec (name, description, argument schema,
effect class) under a name every model provider accepts. The typed handle that calls it is
`poimen._tool_handle`'s."""

from __future__ import annotations

import hashlib
import inspect
import re
from dataclasses import dataclass
from typing import Any

from poimen._core.effects import EffectName, effect_name
from poimen._core.tools import Tool
from poimen.errors import RegistrationError

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
