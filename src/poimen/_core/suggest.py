"""The effect class a write needs, as `poimen scan` and `poimen crashtest` suggest it.

The suggestion is the strongest class the evidence supports: a key the provider takes
(Idempotent), a request id it can be asked about (Queryable), else Unsafe, which is always
safe to declare. Several writes in one tool: the weakest of theirs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_RANK = {"Unsafe": 0, "Queryable": 1, "Idempotent": 2}


@dataclass(frozen=True, slots=True)
class Suggestion:
    """`effect` (Idempotent, Queryable, Unsafe), the code to write, and why."""

    effect: str
    code: str
    why: str

    def to_json(self) -> dict[str, str]:
        return {"effect": self.effect, "code": self.code, "why": self.why}


def _fields(fields: Sequence[str]) -> str:
    names = ", ".join(f'"{f}"' for f in fields) if fields else "..."
    return f"KeyDerivation.fields({names})"


def keyed(fields: Sequence[str], why: str) -> Suggestion:
    return Suggestion("Idempotent", f"Idempotent(key={_fields(fields)})", why)


def lookup(why: str) -> Suggestion:
    return Suggestion("Queryable", "Queryable(lookup=...)", why)


def unsafe(why: str) -> Suggestion:
    return Suggestion("Unsafe", "Unsafe()", why)


def weakest(suggestions: Iterable[Suggestion]) -> Suggestion:
    return min(suggestions, key=lambda s: _RANK[s.effect])


def for_http(
    method: str, fields: Sequence[str], *, has_key: bool, has_request_id: bool
) -> Suggestion:
    """An HTTP write, by what its request carries."""
    if has_key:
        return keyed(fields, "the provider takes an Idempotency-Key: poimen derives it from the "
                     "arguments, the same on every attempt, instead of a new one per attempt")
    if has_request_id:
        return lookup("the request carries a request id: poimen records it before sending and "
                      "asks the provider whether it landed before sending again")
    if method.upper() in ("PUT", "DELETE"):
        return keyed(fields, f"{method.upper()} sets a state: sent again with the same "
                     "arguments it changes nothing, if the provider keeps HTTP's meaning")
    return unsafe(f"a {method.upper()} with neither key nor request id: after a crash an "
                  "operator decides; Idempotent(key=" + _fields(fields) + ") if the provider "
                  "accepts an Idempotency-Key, Queryable if it can be asked about a request id")
