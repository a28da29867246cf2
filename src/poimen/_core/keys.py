"""Canonical encoding of recorded arguments and key hashing (docs/design.md §2)."""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
import json
import math
import sys
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from poimen.errors import ArgumentEncodingError, ArgumentError, ArgumentTooLargeError

#: Encoded arguments larger than this are refused: the intent log is not a blob store.
MAX_ARGS_BYTES = 1 << 20
#: Containers nested deeper than this are refused.
MAX_NESTING = 100
#: Call ids and tool ids are indexed: PostgreSQL cannot index a value over 2,704 bytes.
MAX_CALL_ID_BYTES = 512
MAX_TOOL_ID_BYTES = 200

KEY_DOMAIN = b"poimen.key.v1"
KEY_PREFIX = "pk1_"

JSONValue = None | bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"]

_SCALARS = (str, bool, int, type(None))


def to_json_value(value: Any, path: str, depth: int = 0) -> JSONValue:
    """Convert an argument to plain JSON data, refusing what has no canonical form.

    `path` names the argument in the error (``order.items[2].price``); `depth` counts the
    containers around `value`.
    """
    t = type(value)
    if t is str or t is int or t is bool or value is None:  # the common case, checked cheaply
        scalar: JSONValue = value
        return scalar
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _not_finite(path, value)
        return value
    if t is dict or isinstance(value, Mapping):
        _check_depth(path, depth)
        out: dict[str, JSONValue] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ArgumentEncodingError(
                    f"argument {path!r} has a non-string key {k!r}: only string keys encode",
                    argument=path,
                )
            tv = type(v)
            out[k] = (
                v
                if tv is str or tv is int or tv is bool or v is None
                else to_json_value(v, f"{path}.{k}", depth + 1)
            )
        return out
    if isinstance(value, list | tuple):
        _check_depth(path, depth)
        return [to_json_value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, bytes | bytearray | memoryview):
        raise ArgumentEncodingError(
            f"argument {path!r} is bytes without a declared encoding: "
            "pass text, or base64-encode it and annotate the parameter as str",
            argument=path,
        )
    if isinstance(value, enum.Enum):
        return to_json_value(value.value, path, depth)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    dump = getattr(value, "model_dump", None)
    if callable(dump):  # a pydantic model: its JSON form is its canonical form
        return to_json_value(dump(mode="json"), path, depth)
    raise ArgumentEncodingError(
        f"argument {path!r} is a {type(value).__name__}, which has no canonical encoding",
        argument=path,
    )


def _check_depth(path: str, depth: int) -> None:
    if depth >= MAX_NESTING:
        raise _too_deep(path)


def _not_finite(path: str, value: float) -> ArgumentEncodingError:
    return ArgumentEncodingError(
        f"argument {path!r} is {value!r}: NaN and Infinity have no canonical encoding",
        argument=path,
    )


def _too_deep(path: str) -> ArgumentEncodingError:
    return ArgumentEncodingError(
        f"argument {path!r} is nested more than {MAX_NESTING} containers deep",
        argument=path,
        limit=MAX_NESTING,
    )


# One encoder for every call: json.dumps with options builds a new one each time.
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


def _c_canonical() -> Any:
    """`_CANONICAL.encode`'s C encoder, made once: `encode` makes one per call (and a markers
    dict). Without markers a cycle is a RecursionError, not a ValueError: `_encode` names both
    alike. None where the C encoder is missing or its arguments differ from these."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    try:
        enc = make(None, _CANONICAL.default, json.encoder.encode_basestring, None, ":", ",",
                   True, False, False)  # fmt: skip
        probe = {"b": [1, 2.5, "\u00e9", None, True], "a": {"y": "\n", "x": -0.0}}
        if "".join(enc(probe, 0)) != _CANONICAL.encode(probe):
            return None
    except Exception:  # another Python's signature: the slower path, the same bytes
        return None
    return enc


_FAST = _c_canonical()


def canonical(value: JSONValue, path: str = "") -> str:
    """Sorted keys, no whitespace, UTF-8 text, NaN refused.

    A value with no UTF-8 JSON text (a lone surrogate, an integer too long to print, nesting
    too deep) raises `ArgumentEncodingError` naming its path under `path`.
    """
    return _encode(value, path)[0]


def _encode(value: JSONValue, path: str, depth: int = 0) -> tuple[str, int]:
    """The canonical text and its size in UTF-8 bytes."""
    try:
        text = "".join(_FAST(value, 0)) if _FAST is not None else _CANONICAL.encode(value)
        # isascii() is a flag read: only text outside ASCII pays for the encoding.
        return text, len(text) if text.isascii() else len(text.encode())
    except (ValueError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
        raise _unencodable(value, path, depth, exc) from None


def _unencodable(
    value: JSONValue, path: str, depth: int, exc: BaseException
) -> ArgumentEncodingError:
    """Find the value that has no canonical text, to name it (only on the error path)."""
    stack: list[tuple[str, Any, int]] = [(path, value, depth)]
    while stack:
        where, v, depth = stack.pop()
        if isinstance(v, str):
            if not _is_utf8(v):
                return _surrogate(where, "text")
        elif isinstance(v, bool) or v is None:
            continue
        elif isinstance(v, int):
            try:
                int.__repr__(v)
            except ValueError:
                return ArgumentEncodingError(
                    f"argument {where!r} is an integer of more than "
                    f"{sys.get_int_max_str_digits()} digits: pass it as text",
                    argument=where,
                )
        elif isinstance(v, float):
            if not math.isfinite(v):
                return _not_finite(where, v)
        elif isinstance(v, dict | list | tuple):
            if depth >= MAX_NESTING:
                return _too_deep(where)
            if isinstance(v, dict):
                for k in v:
                    if isinstance(k, str) and not _is_utf8(k):
                        return _surrogate(where, "a key")
                items = [(f"{where}.{k}" if where else k, x) for k, x in v.items()]
            else:
                items = [(f"{where}[{i}]", x) for i, x in enumerate(v)]
            stack.extend((w, x, depth + 1) for w, x in reversed(items))
    return ArgumentEncodingError(
        f"argument {path!r} has no canonical encoding: {type(exc).__name__}: {exc}",
        argument=path,
    )


def _is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _surrogate(path: str, what: str) -> ArgumentEncodingError:
    return ArgumentEncodingError(
        f"argument {path!r} has {what} with a lone surrogate (\\ud800-\\udfff), which is "
        "not UTF-8 text",
        argument=path,
    )


def encode_value(value: Any, path: str) -> str:
    """The canonical text of any value (a result, an answer), errors naming it as `path`."""
    return canonical(to_json_value(value, path), path)


def encode_args(args: Mapping[str, Any]) -> tuple[dict[str, JSONValue], str]:
    """Validate and encode call arguments; returns the JSON data and its canonical text."""
    if not isinstance(args, Mapping):
        raise ArgumentEncodingError(
            f"arguments must be a mapping of names to values, not {type(args).__name__}",
            argument="",
        )
    data: dict[str, JSONValue] = {}
    for name, value in args.items():
        if not isinstance(name, str):
            raise ArgumentEncodingError(f"argument name {name!r} is not a string", argument=name)
        t = type(value)
        data[name] = (
            value
            if t is str or t is int or t is bool or value is None
            else to_json_value(value, name)
        )
    return data, checked_text(data)


def checked_text(data: dict[str, JSONValue]) -> str:
    """The canonical text of arguments already in JSON form, refused over `MAX_ARGS_BYTES`."""
    # Paths start at the argument names; the mapping itself is not a level of nesting.
    text, size = _encode(data, "", -1)
    if size > MAX_ARGS_BYTES:
        largest = max(data, key=lambda n: _encode(data[n], n)[1])
        raise ArgumentTooLargeError(
            f"arguments encode to {size} bytes of UTF-8, over the {MAX_ARGS_BYTES}-byte "
            f"limit; the largest is {largest!r}",
            argument=largest,
            size=size,
            limit=MAX_ARGS_BYTES,
        )
    return text


def check_call_id(call_id: object) -> None:
    """Refuse a call id the log cannot store and index alike on every backend."""
    if not isinstance(call_id, str) or not call_id:
        raise ArgumentError(f"call_id must be a non-empty string, got {call_id!r}", field="call_id")
    try:
        size = len(call_id) if call_id.isascii() else len(call_id.encode())
    except UnicodeEncodeError:
        raise ArgumentEncodingError(
            "call_id has a lone surrogate (\\ud800-\\udfff), which is not UTF-8 text",
            field="call_id",
        ) from None
    if "\x00" in call_id:
        raise ArgumentEncodingError("call_id contains a NUL character", field="call_id")
    if size > MAX_CALL_ID_BYTES:
        raise ArgumentTooLargeError(
            f"call_id is {size} bytes of UTF-8, over the {MAX_CALL_ID_BYTES}-byte limit: "
            "derive a shorter id (e.g. a hash) from what identifies the call",
            field="call_id",
            size=size,
            limit=MAX_CALL_ID_BYTES,
        )


def args_digest(canonical_text: str) -> str:
    return hashlib.sha256(canonical_text.encode()).hexdigest()


def _framed(h: Any, part: bytes) -> None:
    h.update(len(part).to_bytes(8, "big"))
    h.update(part)


# The hash state after the domain tag, tool id and version, per (tool id, version): each key
# then hashes only its selected values. Only ever copied, never updated, once stored.
_PREFIXES: dict[tuple[str, int], Any] = {}


def _key_prefix(tool_id: str, version: int) -> Any:
    prefix = hashlib.sha256(KEY_DOMAIN)
    _framed(prefix, tool_id.encode())
    _framed(prefix, str(version).encode())
    return prefix


def _keyed(prefix: Any, selected: JSONValue, path: str) -> str:
    h = prefix.copy()
    _framed(h, canonical(selected, path).encode())
    digest: str = h.hexdigest()
    return KEY_PREFIX + digest[:48]


def key_hasher(tool_id: str, version: int) -> Callable[[JSONValue], str]:
    """`hash_key` for one tool id and version, its prefix hashed once (a tool's call plan)."""
    prefix = _key_prefix(tool_id, version)
    copy = prefix.copy

    def hasher(selected: JSONValue) -> str:  # _keyed, inlined: one frame a call
        h = copy()
        part = _encode(selected, "<key>")[0].encode()
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
        digest: str = h.hexdigest()
        return KEY_PREFIX + digest[:48]

    return hasher


def key_of_text(tool_id: str, version: int) -> Callable[[bytes], str]:
    """The key of values whose canonical text is known, given as its UTF-8 bytes: a call
    plan's, when the key's fields are all the arguments, so the arguments' own text is the
    selected values' text (one encoding a call, not two)."""
    copy = _key_prefix(tool_id, version).copy

    def hasher(part: bytes) -> str:
        h = copy()
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
        digest: str = h.hexdigest()
        return KEY_PREFIX + digest[:48]

    return hasher


def hash_key(tool_id: str, version: int, selected: JSONValue, path: str = "<key>") -> str:
    """The key: sha256 over domain tag, tool id, derivation version and the selected values.

    `path` names the selected values in an encoding error."""
    cacheable = type(version) is int and type(tool_id) is str
    prefix = _PREFIXES.get((tool_id, version)) if cacheable else None
    if prefix is None:
        prefix = _key_prefix(tool_id, version)
        if cacheable and len(_PREFIXES) < 4096:
            _PREFIXES[tool_id, version] = prefix
    return _keyed(prefix, selected, path)
