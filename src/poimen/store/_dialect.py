"""What differs between the two SQL dialects, in one place: the URLs each opens, the file of a
SQLite log, the placeholder, the larger of two values, a row lock for the rest of a write
transaction. The stores, retention, the CLI and the sandbox ask here instead of reading URLs
themselves; what `poimen verify` and `doctor` ask of a backend, its store answers."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Dialect:
    """One SQL dialect of the intent log."""

    name: Literal["sqlite", "postgres"]
    """The dialect's name, also the folder of its migrations (``store/sql/<name>/``)."""
    schemes: tuple[str, ...]
    """The URL prefixes it opens."""
    placeholder: str
    """A statement's parameter marker."""
    greatest: str
    """The larger of two values: ``MAX(a, b)`` in SQLite, ``GREATEST`` in PostgreSQL."""
    lock: str
    """Takes the rows read for the rest of a write transaction (SQLite's one writer needs
    nothing)."""
    same: str
    """Equality that holds for two NULLs as well."""

    def opens(self, url: str) -> bool:
        return url.startswith(self.schemes)


SQLITE = Dialect("sqlite", ("sqlite:///",), "?", "MAX", "", "IS")
POSTGRES = Dialect(
    "postgres",
    ("postgresql://", "postgres://"),
    "%s",
    "GREATEST",
    " FOR UPDATE",
    "IS NOT DISTINCT FROM",
)
DIALECTS: dict[str, Dialect] = {d.name: d for d in (SQLITE, POSTGRES)}


def dialect_of(url: str) -> Dialect | None:
    """The dialect a store URL names; None for a URL neither opens."""
    return next((d for d in DIALECTS.values() if d.opens(url)), None)


def sqlite_path(url: str) -> str | None:
    """The file a ``sqlite:///`` URL names; None for any other URL."""
    return url[len(SQLITE.schemes[0]) :] if SQLITE.opens(url) else None


def same_log(a: str, b: str) -> bool:
    """Whether two store URLs name one log (two SQLite URLs: one file, however spelled)."""
    pa, pb = sqlite_path(a), sqlite_path(b)
    if pa is not None and pb is not None:
        return os.path.realpath(pa) == os.path.realpath(pb)
    return a == b
