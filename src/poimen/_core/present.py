"""How the operator path shows and reads text: redaction of secrets (by argument name and in
URLs), escaping of control and bidi characters, and parsing of what operators type (times,
durations, states, results, limits). The CLI and the console both use these, through
`poimen.operator._ops`."""

from __future__ import annotations

import datetime as dt
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from poimen._core.intents import IntentState
from poimen.errors import PoimenError

#: An argument (or result field) whose name contains one of these, after lower-casing and
#: turning ``-`` into ``_``, is shown as REDACTED at any depth. Over-redaction is the safe error.
SECRET_NAME = re.compile(
    r"password|passwd|passphrase|secret|token|api_?key|authori[sz]ation|credential"
    r"|private_?key|cookie|session_?id"
)
REDACTED = "[redacted]"

#: How deep an operator's JSON result may nest; deeper is refused before it can exhaust
#: the recursion of the encoders that handle it later.
MAX_DEPTH = 64
#: The largest `limit` a listing accepts (the backends' integers end at 2**63).
MAX_LIMIT = 1_000_000


class OperatorInputError(PoimenError):
    """An operator's input was refused before anything changed."""


# Redaction.


def is_secret_name(name: str) -> bool:
    return SECRET_NAME.search(name.lower().replace("-", "_")) is not None


def redact(value: Any) -> Any:
    """A copy of JSON data with every value under a secret-looking key replaced."""
    if isinstance(value, Mapping):
        return {
            k: (REDACTED if isinstance(k, str) and is_secret_name(k) else redact(v))
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    return value


def _redacted_json(text: str | None) -> Any:
    """Decode recorded JSON text and redact it; text that does not decode is shown as is."""
    if text is None:
        return None
    try:
        return redact(json.loads(text))
    except ValueError:
        return text


# Showing recorded text: escapes, never raw control characters.


def _escape_char(c: str) -> str:
    n = ord(c)
    if c in _NAMED:
        return _NAMED[c]
    if n < 0x100:
        return f"\\x{n:02x}"
    if n < 0x10000:
        return f"\\u{n:04x}"
    return f"\\U{n:08x}"


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape_text(text: str, *, keep: str = "") -> str:
    """One line of recorded text (a call id, an error, a reason) safe for a terminal or a
    page: every character that is not printable, newlines, C0 and C1 controls and the bidi
    overrides included, becomes a visible escape (except those in `keep`)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else _escape_char(c) for c in text)


def escape_lines(text: str) -> str:
    """`escape_text` for each line of a multi-line text, keeping the line breaks."""
    return "\n".join(escape_text(line) for line in text.split("\n"))


_UNPRINTABLE = re.compile(r"[^\n\x20-\x7e]")


def _json_escape(m: re.Match[str]) -> str:
    c = m.group(0)
    if c.isprintable():
        return c
    n = ord(c)
    if n < 0x10000:
        return f"\\u{n:04x}"
    n -= 0x10000  # beyond the BMP: a surrogate pair, as JSON spells it
    return f"\\u{0xD800 + (n >> 10):04x}\\u{0xDC00 + (n & 0x3FF):04x}"


def safe_json(value: Any, *, indent: int | None = None) -> str:
    """JSON text with every unprintable character (C0, C1, bidi controls, line separators)
    as a ``\\u`` escape; printable non-ASCII text stays readable. The same data."""
    text = json.dumps(value, indent=indent, sort_keys=True, ensure_ascii=False, default=str)
    # Outside strings JSON text is ASCII, so every match is inside a string.
    return _UNPRINTABLE.sub(_json_escape, text)


# Showing URLs: a webhook's path or query is often its credential.

_URL = re.compile(r"\bhttps?://[^\s'\"<>]+", re.IGNORECASE)
_STORE_URL = re.compile(r"\b(?:postgres(?:ql)?|sqlite)://[^\s'\"<>]+", re.IGNORECASE)
_TRAILING = ".,;:!?)]}"


def redact_url(url: str) -> str:
    """Scheme and host (and port) only: ``https://hooks.slack.com/…``. User info, path,
    query and fragment are dropped, since any of them may be the credential."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "[url]"
    host = parts.netloc.rpartition("@")[2]
    if not parts.scheme or not host:
        return "[url]"
    base = f"{parts.scheme}://{host}"
    hidden = "@" in parts.netloc or parts.query or parts.fragment or parts.path not in ("", "/")
    return base + "/…" if hidden else base + parts.path


def redact_store_url(url: str) -> str:
    """A store URL as it can be shown: the password and every secret-looking query value
    (``password``, ``sslpassword``, ``token``, ...) replaced; the rest kept, to be recognised.
    Split by hand, so that a URL redacted once comes out the same."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return _redact_loose(url)
    cut = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    tail, hashed, fragment = tail.partition("#")
    path, _, query = tail.partition("?")
    user, at, host = netloc.rpartition("@")
    if at and ":" in user:
        netloc = f"{user.partition(':')[0]}:{REDACTED}@{host}"
    query = "&".join(
        f"{k}={REDACTED if is_secret_name(k) or k == 'sslkey' else v}"
        for k, v in parse_qsl(query, keep_blank_values=True)
    )
    return f"{scheme}://{netloc}{path}" + (f"?{query}" if query else "") + hashed + fragment


_KEYWORD = re.compile(r"""([A-Za-z_][\w.-]*)(\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&;]*)""")
_USERINFO = re.compile(r"([^\s:/@]*):[^\s@/]*@")


def _redact_loose(text: str) -> str:
    """What is not a URL (``postgresql:/u:pw@h``, a libpq ``password=...`` string): every
    secret-looking ``key=value`` and every ``user:password@`` masked, the rest kept."""

    def keyword(m: re.Match[str]) -> str:
        name = m.group(1)
        secret = is_secret_name(name) or name.lower() == "sslkey"
        return f"{name}{m.group(2)}{REDACTED}" if secret else m.group(0)

    return _USERINFO.sub(rf"\1:{REDACTED}@", _KEYWORD.sub(keyword, text))


def redact_urls(text: str) -> str:
    """`redact_url` applied to every http(s) URL inside a text (an error message), and
    `redact_store_url` to every store URL."""

    def by(redactor: Callable[[str], str]) -> Callable[[re.Match[str]], str]:
        def one(m: re.Match[str]) -> str:
            url = m.group(0)
            tail = ""
            while url and url[-1] in _TRAILING:
                url, tail = url[:-1], url[-1] + tail
            return redactor(url) + tail

        return one

    return _STORE_URL.sub(by(redact_store_url), _URL.sub(by(redact_url), text))


# Parsing operator input.


_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str, now: float) -> float:
    """``15m``, ``2h``, ``7d`` (that long ago), an ISO 8601 date or time (UTC unless it
    says otherwise), or seconds since the epoch."""
    m = _RELATIVE.match(text)
    if m:
        return now - float(m.group(1)) * _UNIT[m.group(2)]
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if math.isfinite(value):
            return value
    try:
        when = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise OperatorInputError(
            f"since {text!r} is not a duration (15m, 2h, 7d), an ISO 8601 time or epoch seconds",
            field="since",
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def parse_duration(text: str, what: str) -> float:
    """``90s``, ``15m``, ``12h``, ``7d`` or plain seconds, positive."""
    m = _RELATIVE.match(text)
    try:
        seconds = float(m.group(1)) * _UNIT[m.group(2)] if m else float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise OperatorInputError(
            f"{what} {text!r} is not a positive duration (90s, 15m, 12h, 7d)", field=what
        )
    return seconds


def parse_state(text: str) -> IntentState:
    try:
        return IntentState(text.strip().upper())
    except ValueError:
        names = ", ".join(s.value for s in IntentState)
        raise OperatorInputError(f"state {text!r} is not one of {names}", field="state") from None


def parse_result(text: str) -> Any:
    """The JSON an operator gives as a landed call's result; refused when it does not parse."""

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    too_deep = OperatorInputError(
        f"result is nested deeper than {MAX_DEPTH} levels", field="result"
    )
    try:
        value = json.loads(text, parse_constant=no_constant)
    except RecursionError:
        raise too_deep from None
    except ValueError as exc:
        raise OperatorInputError(f"result is not valid JSON: {exc}", field="result") from exc
    if _depth(value) > MAX_DEPTH:
        raise too_deep
    return value


def _depth(value: Any) -> int:
    """How deep JSON data nests, without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            deepest = max(deepest, d)
            if d <= MAX_DEPTH:
                stack.extend((x, d + 1) for x in v)
    return deepest


def parse_limit(text: str | None, default: int) -> int:
    """A listing's `limit` as given on a page: a whole number from 1 to MAX_LIMIT."""
    text = (text or "").strip()
    if not text:
        return default
    if not (text.isascii() and text.isdigit() and len(text) <= 9):
        raise OperatorInputError(
            f"limit {text[:40]!r} is not a whole number from 1 to {MAX_LIMIT}", field="limit"
        )
    return _check_limit(int(text))


def _check_limit(limit: int) -> int:
    if not 1 <= limit <= MAX_LIMIT:
        raise OperatorInputError(f"limit must be from 1 to {MAX_LIMIT}, not {limit}", field="limit")
    return limit


# Formatting shared by the CLI and the console.


def fmt_time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


# Reading.
