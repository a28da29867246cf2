"""Canonical encoding of recorded arguments and key hashing (docs/design.md §2)."""

from __future__ import annotations

import datetime as dt
import enum
import hashlib
import json
import math
import uuid
from collections.abc import Mapping
from typing import Any

from poimen.errors import ArgumentEncodingError, ArgumentTooLargeError

#: Encoded arguments larger than this are refused: the intent log is not a blob store.
MAX_ARGS_BYTES = 1 << 20

KEY_DOMAIN = b"poimen.key.v1"
KEY_PREFIX = "pk1_"

JSONValue = None | bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"]

_SCALARS = (str, bool, int, type(None))


def to_json_value(value: Any, path: str) -> JSONValue:
    """Convert an argument to plain JSON data, refusing what has no canonical form.

    `path` names the argument in the error (``order.items[2].price``).
    """
    t = type(value)
    if t is str or t is int or t is bool or value is None:  # the common case, checked cheaply
        scalar: JSONValue = value
        return scalar
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ArgumentEncodingError(
                f"argument {path!r} is {value!r}: NaN and Infinity have no canonical encoding",
                argument=path,
            )
        return value
    if t is dict or isinstance(value, Mapping):
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
                else to_json_value(v, f"{path}.{k}")
            )
        return out
    if isinstance(value, list | tuple):
        return [to_json_value(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, bytes | bytearray | memoryview):
        raise ArgumentEncodingError(
            f"argument {path!r} is bytes without a declared encoding: "
            "pass text, or base64-encode it and annotate the parameter as str",
            argument=path,
        )
    if isinstance(value, enum.Enum):
        return to_json_value(value.value, path)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    dump = getattr(value, "model_dump", None)
    if callable(dump):  # a pydantic model: its JSON form is its canonical form
        return to_json_value(dump(mode="json"), path)
    raise ArgumentEncodingError(
        f"argument {path!r} is a {type(value).__name__}, which has no canonical encoding",
        argument=path,
    )


# One encoder for every call: json.dumps with options builds a new one each time.
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


def canonical(value: JSONValue) -> str:
    """Sorted keys, no whitespace, UTF-8 text, NaN refused."""
    return _CANONICAL.encode(value)


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
    text = canonical(data)
    if len(text) > MAX_ARGS_BYTES and len(text.encode()) > MAX_ARGS_BYTES:
        largest = max(data, key=lambda n: len(canonical(data[n])))
        raise ArgumentTooLargeError(
            f"arguments encode to {len(text.encode())} bytes, over the {MAX_ARGS_BYTES}-byte "
            f"limit; the largest is {largest!r}",
            argument=largest,
            size=len(text.encode()),
            limit=MAX_ARGS_BYTES,
        )
    return data, text


def args_digest(canonical_text: str) -> str:
    return hashlib.sha256(canonical_text.encode()).hexdigest()


def _framed(h: Any, part: bytes) -> None:
    h.update(len(part).to_bytes(8, "big"))
    h.update(part)


# The hash state after the domain tag, tool id and version, per (tool id, version): each key
# then hashes only its selected values. Only ever copied, never updated, once stored.
_PREFIXES: dict[tuple[str, int], Any] = {}


def hash_key(tool_id: str, version: int, selected: JSONValue) -> str:
    """The key: sha256 over domain tag, tool id, derivation version and the selected values."""
    cacheable = type(version) is int and type(tool_id) is str
    prefix = _PREFIXES.get((tool_id, version)) if cacheable else None
    if prefix is None:
        prefix = hashlib.sha256(KEY_DOMAIN)
        _framed(prefix, tool_id.encode())
        _framed(prefix, str(version).encode())
        if cacheable and len(_PREFIXES) < 4096:
            _PREFIXES[tool_id, version] = prefix
    h = prefix.copy()
    _framed(h, canonical(selected).encode())
    return KEY_PREFIX + h.hexdigest()[:48]
