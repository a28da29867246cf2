"""The effect classes and what each one's recovery needs (docs/design.md §2)."""

from __future__ import annotations

import types
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, get_args

from poimen._core.keys import JSONValue, hash_key, to_json_value
from poimen.errors import (
    ArgumentError,
    KeyDerivationError,
    NondeterministicKeyError,
    RegistrationError,
)

# Names whose presence in a custom derivation means it reads a clock, a counter or randomness.
_IMPURE_NAMES = frozenset(
    {
        "time",
        "time_ns",
        "monotonic",
        "monotonic_ns",
        "perf_counter",
        "perf_counter_ns",
        "now",
        "utcnow",
        "today",
        "random",
        "randint",
        "randrange",
        "choice",
        "getrandbits",
        "uuid1",
        "uuid4",
        "urandom",
        "token_hex",
        "token_bytes",
        "token_urlsafe",
        "count",
        "next",
        "getpid",
        "environ",
        "getenv",
    }
)


@dataclass(frozen=True, slots=True)
class KeyDerivation:
    """How an Idempotent tool's key is derived from its recorded arguments.

    Build one with `KeyDerivation.fields(...)`, `KeyDerivation.all_args(...)` or
    `KeyDerivation.custom(...)`. Bump `version` when the derivation changes on purpose.
    """

    mode: Literal["fields", "all_args", "custom"]
    paths: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    func: Callable[[Mapping[str, JSONValue]], Any] | None = field(default=None, compare=False)
    version: int = 1

    def __post_init__(self) -> None:
        v = self.version
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise RegistrationError(
                f"key derivation version must be a positive whole number, not {v!r}",
                field="version",
            )
        if self.mode == "custom" and not callable(self.func):
            raise RegistrationError("KeyDerivation.custom() needs a callable", field="func")
        if not all(isinstance(name, str) for name in self.exclude):
            raise RegistrationError(
                f"excluded names must be strings, got {self.exclude!r}", field="exclude"
            )

    @classmethod
    def fields(cls, *paths: str, version: int = 1) -> KeyDerivation:
        if not paths:
            raise RegistrationError("KeyDerivation.fields() needs at least one field name")
        for p in paths:
            if not isinstance(p, str) or not p or any(not s for s in p.split(".")):
                raise RegistrationError(f"key field {p!r} is not a valid (dotted) argument name")
        return cls("fields", paths=tuple(paths), version=version)

    @classmethod
    def all_args(cls, *, exclude: Iterable[str] = (), version: int = 1) -> KeyDerivation:
        if isinstance(exclude, str):
            raise RegistrationError(
                f"exclude must be a collection of names, not the string {exclude!r}",
                field="exclude",
            )
        return cls("all_args", exclude=tuple(exclude), version=version)

    @classmethod
    def custom(
        cls, func: Callable[[Mapping[str, JSONValue]], Any], *, version: int = 1
    ) -> KeyDerivation:
        """A pure function of the recorded arguments; re-checked at every recovery."""
        impure = sorted(_impure_names(func))
        if impure:
            raise NondeterministicKeyError(
                f"key derivation {getattr(func, '__qualname__', func)!r} reads "
                f"{', '.join(impure)}: a key must depend on the recorded arguments only",
                names=impure,
            )
        return cls("custom", func=func, version=version)

    def select(self, args: Mapping[str, JSONValue], tool_id: str = "") -> JSONValue:
        """The values the key is computed over."""
        if self.mode == "fields":
            return {p: _pick(args, p) for p in self.paths}
        if self.mode == "all_args":
            return {k: v for k, v in args.items() if k not in self.exclude}
        assert self.func is not None
        try:
            result = self.func(args)
        except Exception as exc:  # the user's code: whatever it raises refuses the call
            name = getattr(self.func, "__qualname__", repr(self.func))
            raise KeyDerivationError(
                f"tool {tool_id!r}: key derivation {name!r} raised {type(exc).__name__}: {exc}",
                argument="<key derivation>",
                tool_id=tool_id,
            ) from exc
        return to_json_value(result, _RESULT)

    def derive(self, tool_id: str, args: Mapping[str, JSONValue]) -> str:
        """The key for these recorded arguments of tool `tool_id`."""
        selected = self.select(args, tool_id)
        return hash_key(tool_id, self.version, selected, _RESULT if self.mode == "custom" else "<key>")


_RESULT = "<key derivation result>"


def _pick(args: Mapping[str, JSONValue], path: str) -> JSONValue:
    if "." not in path and path in args:  # a top-level field: no walk, no copy of the args
        return args[path]
    node: JSONValue = dict(args)
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise ArgumentError(f"key field {path!r} is missing from the arguments", argument=path)
        node = node[part]
    return node


def _impure_names(func: Callable[..., Any]) -> set[str]:
    code = getattr(func, "__code__", None)
    if not isinstance(code, types.CodeType):
        return set()
    found: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        # co_names holds every global, attribute and method name the code loads.
        found.update(n for n in c.co_names if n in _IMPURE_NAMES)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    if getattr(func, "__closure__", None):
        found.update("closure:" + n for n in code.co_freevars if n in _IMPURE_NAMES)
    return found


# Answers of a Queryable tool's lookup.


@dataclass(frozen=True, slots=True)
class Landed:
    """The provider has the request; `result` is what it answered."""

    result: Any = None


@dataclass(frozen=True, slots=True)
class NotLanded:
    """The provider never received the request."""


@dataclass(frozen=True, slots=True)
class Unknown:
    """The provider could not say; ask again later."""

    reason: str


LookupAnswer = Landed | NotLanded | Unknown


class RequestIdLookup(Protocol):
    """Asks the provider whether the request with this id landed (sync, or async: an async
    lookup runs in a loop of its own, off the caller's)."""

    def __call__(self, request_id: str, /) -> LookupAnswer | Awaitable[LookupAnswer]: ...


# The effect classes. Each carries what its recovery path needs, and its traits as class
# variables: the engine, the store and the sandbox read the traits, never a chain of
# isinstance checks, so a new class states once what it is. The closed union below and
# `decide`'s exhaustive match still name every class.

EffectName = Literal["idempotent", "queryable", "unsafe", "readonly", "transactional"]
#: The effect classes' names as the log records them: the store's check of a row and the
#: schema's CHECK constraints (tests/contract/test_effect_names.py) follow this tuple.
EFFECT_NAMES: tuple[EffectName, ...] = get_args(EffectName)


class _Traits:
    """What the engine needs to know of an effect class, whatever the class."""

    __slots__ = ()
    #: How the log records the class (one of `EFFECT_NAMES`).
    name: ClassVar[EffectName]
    #: The kernel derives a key from the arguments; the tool's writes carry it.
    keyed: ClassVar[bool] = False
    #: A request id is recorded, and recovery asks the provider whether it landed.
    asks_provider: ClassVar[bool] = False
    #: A running attempt's handles carry a write token, and the audit hook catches its
    #: out-of-band writes.
    guarded: ClassVar[bool] = False
    #: An attempt's requests may land until its deadline: "not landed" is trusted only after.
    has_deadline: ClassVar[bool] = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Idempotent(_Traits):
    """A retry with the same key is safe: the provider deduplicates on it.

    `key_ttl`: how many seconds the provider remembers a key (Stripe: at least 24 h). Once
    something may have gone out under the key, no request carrying it leaves if it could
    reach the provider later than that after the call was recorded (the send gate): the
    intent becomes Indeterminate (`key_expired`). None: keys never expire.
    """

    name: ClassVar[EffectName] = "idempotent"
    keyed: ClassVar[bool] = True
    guarded: ClassVar[bool] = True

    key: KeyDerivation
    key_ttl: float | None = None

    def __post_init__(self) -> None:
        ttl = self.key_ttl
        if ttl is not None and (
            isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0
        ):
            raise RegistrationError(
                f"Idempotent(key_ttl=...) must be a positive number of seconds or None, "
                f"not {ttl!r}",
                field="key_ttl",
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Queryable(_Traits):
    """The provider can be asked whether a request id landed."""

    name: ClassVar[EffectName] = "queryable"
    asks_provider: ClassVar[bool] = True
    has_deadline: ClassVar[bool] = True

    lookup: RequestIdLookup


@dataclass(frozen=True, slots=True)
class Unsafe(_Traits):
    """Nothing makes a retry safe: an unknown outcome becomes Indeterminate."""

    name: ClassVar[EffectName] = "unsafe"


@dataclass(frozen=True, slots=True)
class ReadOnly(_Traits):
    """The tool has no effect: recovery runs it again freely, and every write it tries
    (through its handles or out of band) is denied and recorded."""

    name: ClassVar[EffectName] = "readonly"
    guarded: ClassVar[bool] = True


#: A Transactional tool's database: a URL (``sqlite:///path``, ``postgresql://...``) or a
#: function returning a new DB-API connection (sqlite3 or psycopg 3) each time it is called.
Database = str | Callable[[], Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class Transactional(_Traits):
    """The tool's whole effect is a write to one SQL database, made through `ctx.tx` (a
    connection inside a transaction poimen opens): poimen commits that transaction with a
    marker of the call, so the write lands exactly once (docs/design.md §2). Every other
    write the tool tries (HTTP, sinks, files) is denied and recorded.

    `database`: ``sqlite:///path``, ``postgresql://...``, or a function returning a new
    sqlite3 or psycopg 3 connection (called once per attempt; poimen closes what it returns).
    """

    name: ClassVar[EffectName] = "transactional"
    guarded: ClassVar[bool] = True

    database: Database

    def __post_init__(self) -> None:
        db = self.database
        if isinstance(db, str):
            if not db.startswith(("sqlite:///", "postgresql://", "postgres://")) or db in (
                "sqlite:///",
            ):
                raise RegistrationError(
                    "Transactional(database=...) must be a sqlite:///path or postgresql://... "
                    f"URL, or a function returning a connection, not {_shown(db)!r}",
                    field="database",
                )
        elif not callable(db):
            raise RegistrationError(
                "Transactional(database=...) must be a sqlite:///path or postgresql://... URL, "
                f"or a function returning a connection, not {type(db).__name__}",
                field="database",
            )


def _shown(url: str) -> str:
    from poimen._core.present import redact_store_url  # the URL may hold a password

    return redact_store_url(url)


EffectClass = Idempotent | Queryable | Unsafe | ReadOnly | Transactional
EFFECT_CLASSES: tuple[type[EffectClass], ...] = get_args(EffectClass)


def effect_name(effects: EffectClass) -> EffectName:
    return effects.name
