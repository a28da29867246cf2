"""Tool registrations: no field has a default, and only the effect classes register."""

from __future__ import annotations

import datetime as dt
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pydantic

from poimen._core.effects import (
    EFFECT_CLASSES,
    EffectClass,
    Idempotent,
    KeyDerivation,
    Queryable,
)
from poimen._core.keys import MAX_TOOL_ID_BYTES, JSONValue
from poimen.errors import ArgumentError, RegistrationError

_TIME_LIKE = (dt.datetime, dt.date, dt.time)


@dataclass(frozen=True, slots=True, kw_only=True)
class Caps:
    """What a tool may write to. Hosts are ``host`` or ``host:port``; sinks are names."""

    hosts: tuple[str, ...] = ()
    sinks: tuple[str, ...] = ()
    key_header: str = "Idempotency-Key"

    def __post_init__(self) -> None:
        for name in ("hosts", "sinks"):
            object.__setattr__(self, name, _names(name, getattr(self, name)))
        bad_host = next((h for h in self.hosts if _NOT_IN_HOST.search(h)), None)
        if bad_host is not None:
            raise RegistrationError(
                f"caps.hosts entry {bad_host!r} is not a host or host:port "
                "(no scheme, path or spaces): e.g. 'api.example.com' or 'localhost:8080'",
                field="hosts",
            )
        header = self.key_header
        if not isinstance(header, str) or not _TOKEN.fullmatch(header):
            raise RegistrationError(
                f"caps.key_header must be an HTTP header name, not {header!r}",
                field="key_header",
            )


# An HTTP header name is a token (RFC 9110 section 5.6.2).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_NOT_IN_HOST = re.compile(r"[/?#@\s]")


def _names(field: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, tuple | list):
        raise RegistrationError(
            f"caps.{field} must be a tuple of strings, not {value!r}"
            + (f": write {field}=({value!r},)" if isinstance(value, str) else ""),
            field=field,
        )
    for item in value:
        if not isinstance(item, str) or not item.strip():
            raise RegistrationError(
                f"caps.{field} entries must be non-empty strings, not {item!r}", field=field
            )
    return tuple(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolRegistration:
    """A tool's declaration. Every field is required: there is no default effect class."""

    id: str
    effects: EffectClass
    caps: Caps
    timeout: float

    def __post_init__(self) -> None:
        check_tool_id(self.id)
        if not isinstance(self.effects, EFFECT_CLASSES):
            raise RegistrationError(
                f"tool {self.id!r}: effects must be Idempotent(key=...), Queryable(lookup=...), "
                f"Unsafe(), ReadOnly() or Transactional(database=...), not {self.effects!r}",
                tool_id=self.id,
            )
        if isinstance(self.effects, Idempotent) and not isinstance(self.effects.key, KeyDerivation):
            raise RegistrationError(
                f"tool {self.id!r}: Idempotent(key=...) needs a KeyDerivation", tool_id=self.id
            )
        if isinstance(self.effects, Queryable) and not callable(self.effects.lookup):
            raise RegistrationError(
                f"tool {self.id!r}: Queryable(lookup=...) needs a callable", tool_id=self.id
            )
        if not isinstance(self.caps, Caps):
            raise RegistrationError(f"tool {self.id!r}: caps must be a Caps", tool_id=self.id)
        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, int | float)
            or not math.isfinite(self.timeout)
            or self.timeout <= 0
        ):
            raise RegistrationError(
                f"tool {self.id!r}: timeout must be a positive number of seconds, "
                f"got {self.timeout!r}",
                tool_id=self.id,
            )


def check_tool_id(tool_id: object) -> None:
    if not isinstance(tool_id, str) or not tool_id.strip():
        raise RegistrationError(f"tool id must be a non-empty string, got {tool_id!r}")
    try:
        size = len(tool_id.encode())
    except UnicodeEncodeError:
        size = -1
    if size < 0 or "\x00" in tool_id:
        raise RegistrationError(
            f"tool id {tool_id!r} is not valid UTF-8 text (a lone surrogate or a NUL)",
            tool_id=tool_id,
        )
    if size > MAX_TOOL_ID_BYTES:
        raise RegistrationError(
            f"tool id {tool_id[:40]!r}... is {size} bytes of UTF-8, over the "
            f"{MAX_TOOL_ID_BYTES} bytes a tool id may have",
            tool_id=tool_id,
            size=size,
            limit=MAX_TOOL_ID_BYTES,
        )


@dataclass(frozen=True, slots=True)
class Tool:
    """A registered tool: its declaration, its callable and its argument schema."""

    registration: ToolRegistration
    fn: Callable[..., Any]
    is_async: bool
    model: type[pydantic.BaseModel]
    params: tuple[str, ...]

    @property
    def id(self) -> str:
        return self.registration.id

    def validate(
        self, data: Mapping[str, JSONValue]
    ) -> tuple[dict[str, JSONValue], dict[str, Any]]:
        """Check recorded-form arguments; returns (recorded JSON, keyword arguments)."""
        try:
            # The model's validator and serializer directly: model_validate and model_dump
            # only add argument handling that this call never uses.
            inst = self.model.__pydantic_validator__.validate_python(data)
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "<arguments>"
            raise ArgumentError(
                f"tool {self.id!r}: argument {loc!r}: {err['msg']}", argument=loc, tool_id=self.id
            ) from exc
        recorded = self.model.__pydantic_serializer__.to_python(inst, mode="json")
        return recorded, {name: getattr(inst, name) for name in self.params}


def build_tool(registration: ToolRegistration, fn: Callable[..., Any]) -> Tool:
    if not callable(fn):
        raise RegistrationError(f"tool {registration.id!r} is not callable")
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if not params or params[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        raise RegistrationError(
            f"tool {registration.id!r}: the first parameter must take the ToolContext (ctx)",
            tool_id=registration.id,
        )
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:
        raise RegistrationError(
            f"tool {registration.id!r}: its annotations do not resolve: {exc}",
            tool_id=registration.id,
        ) from exc
    fields: dict[str, Any] = {}
    for p in params[1:]:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise RegistrationError(
                f"tool {registration.id!r}: parameter {p.name!r} is variadic; "
                "arguments must be named so they can be recorded",
                tool_id=registration.id,
            )
        if p.name.startswith(("_", "model_")) or hasattr(pydantic.BaseModel, p.name):
            # The argument schema is a pydantic model: such a name could never be passed.
            raise RegistrationError(
                f"tool {registration.id!r}: parameter {p.name!r} cannot be an argument name "
                "(names starting with '_' or 'model_', and names like 'json' or 'schema', "
                "are reserved by the argument schema); rename it",
                tool_id=registration.id,
                field=p.name,
            )
        ann = hints.get(p.name, Any)
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (ann, default)
    try:
        model = pydantic.create_model(
            "Args_" + "".join(c if c.isalnum() else "_" for c in registration.id),
            __config__=pydantic.ConfigDict(extra="forbid"),
            **fields,
        )
    except (pydantic.PydanticSchemaGenerationError, TypeError) as exc:
        raise RegistrationError(
            f"tool {registration.id!r}: arguments have no schema: {exc}", tool_id=registration.id
        ) from exc
    if isinstance(registration.effects, Idempotent):
        _check_key_fields(
            registration.id, registration.effects.key, {n: a for n, (a, _) in fields.items()}
        )
    return Tool(
        registration=registration,
        fn=fn,
        is_async=inspect.iscoroutinefunction(fn),
        model=model,
        params=tuple(fields),
    )


def _check_key_fields(tool_id: str, derivation: KeyDerivation, anns: dict[str, Any]) -> None:
    if derivation.mode == "fields":
        for path in derivation.paths:
            head, *rest = path.split(".")
            if head not in anns:
                raise RegistrationError(
                    f"tool {tool_id!r}: key field {path!r} is not a parameter of the tool",
                    tool_id=tool_id,
                    field=path,
                )
            ann = _resolve_path(anns[head], rest)
            if _time_like(ann):
                raise RegistrationError(
                    f"tool {tool_id!r}: key field {path!r} is time-like ({_name(ann)}); "
                    "a key must not change with the clock",
                    tool_id=tool_id,
                    field=path,
                )
    elif derivation.mode == "all_args":
        for name in derivation.exclude:
            if name not in anns:
                raise RegistrationError(
                    f"tool {tool_id!r}: excluded field {name!r} is not a parameter of the tool",
                    tool_id=tool_id,
                    field=name,
                )
        for name, ann in anns.items():
            if name not in derivation.exclude and _time_like(ann):
                raise RegistrationError(
                    f"tool {tool_id!r}: parameter {name!r} is time-like ({_name(ann)}); "
                    f"exclude it: KeyDerivation.all_args(exclude=({name!r},))",
                    tool_id=tool_id,
                    field=name,
                )


def _resolve_path(ann: Any, rest: list[str]) -> Any:
    for part in rest:
        if isinstance(ann, type) and issubclass(ann, pydantic.BaseModel):
            fld = ann.model_fields.get(part)
            ann = fld.annotation if fld is not None else Any
        elif typing.is_typeddict(ann):
            ann = typing.get_type_hints(ann).get(part, Any)
        else:
            return Any
    return ann


def _time_like(ann: Any) -> bool:
    if isinstance(ann, type):
        return issubclass(ann, _TIME_LIKE)
    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        return _time_like(typing.get_args(ann)[0])
    if origin in (typing.Union, types.UnionType):
        return any(_time_like(a) for a in typing.get_args(ann))
    return False


def _name(ann: Any) -> str:
    return getattr(ann, "__name__", repr(ann))
