"""`poimen verify` and `poimen doctor`: the integrity of an intent log, and the facts a bug
report needs. Both only read: the store is opened read-only by the caller. The checks and facts
only a backend knows are its store's (`Store.integrity`, `Store.server_facts`); the ones here
hold for every SQL dialect."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sqlite3
import sys
from dataclasses import dataclass
from typing import Any

from poimen._core.decide import claimability
from poimen._core.intents import Intent
from poimen._engine.liveness import current_owner, default_host, owner_alive
from poimen.operator import _audit
from poimen.operator._ops import (
    REDACTED,
    intent_summary,
    is_secret_name,
    redact_store_url,
    redact_urls,
)
from poimen.store._base import Problem, Store, latest_version
from poimen.store._chain import CHAIN_VERSION

# Rows that point at nothing, whatever constraints the database still has.
_DANGLING = {
    "attempts without their intent": "SELECT COUNT(*) FROM attempts a "
    "WHERE NOT EXISTS (SELECT 1 FROM intents i WHERE i.id = a.intent_id)",
    "deliveries without their notification": "SELECT COUNT(*) FROM deliveries d "
    "WHERE NOT EXISTS (SELECT 1 FROM outbox o WHERE o.id = d.notification_id)",
}
_PAGE = 1000


@dataclass(frozen=True, slots=True)
class Orphan:
    """An unfinished intent whose owner is gone: nothing will finish it until recovery runs."""

    intent: Intent
    why: str

    def to_json(self) -> dict[str, Any]:
        o = self.intent.owner
        owner = None if o is None else {"worker_id": o.worker_id, "host": o.host, "pid": o.pid}
        return {**intent_summary(self.intent), "owner": owner, "why": self.why}


@dataclass(frozen=True, slots=True)
class Verification:
    backend: str
    schema_version: int
    known_version: int
    checks: tuple[str, ...]
    problems: tuple[Problem, ...] = ()
    orphans: tuple[Orphan, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems and not self.orphans

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "backend": self.backend,
            "schema_version": self.schema_version,
            "known_version": self.known_version,
            "checks": list(self.checks),
            "problems": [{"check": p.check, "message": p.message} for p in self.problems],
            "orphans": [o.to_json() for o in self.orphans],
            "notes": list(self.notes),
        }


def _read(store: Store, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
    reader: Any = store._read  # type: ignore[attr-defined]
    rows: list[Any] = reader(sql, params) if params else reader(sql)
    return rows


def verify(store: Store) -> Verification:
    """Integrity, schema and the unfinished intents no live process owns."""
    dialect = store.dialect
    found, known = store.schema_version(), latest_version(dialect)
    problems: list[Problem] = []
    notes: list[str] = []
    checks = ["schema version"]
    if found < known:
        notes.append(
            f"schema version {found} is older than this poimen's {known}: `poimen migrate` "
            "upgrades it (a kernel of this version does so when it opens the log)"
        )
    own, found_there = store.integrity(found)  # the backend's own checks
    checks += own
    problems += found_there
    checks.append("dangling rows")
    for what, sql in _DANGLING.items():
        n = int(_read(store, sql)[0][0])
        if n:
            problems.append(Problem("dangling rows", f"{n} {what}"))
    if found >= CHAIN_VERSION:
        checks.append("audit chain")
        chain = _audit.verify(store)
        if not chain.ok:
            problems.append(Problem("audit chain", chain.line()))
    checks.append("unfinished intents with dead owners")
    return Verification(
        backend=dialect,
        schema_version=found,
        known_version=known,
        checks=tuple(checks),
        problems=tuple(problems),
        orphans=tuple(orphans(store)),
        notes=tuple(notes),
    )


def orphans(store: Store) -> list[Orphan]:
    """DISPATCHED intents that recovery may take over now: by the same rule recovery uses.
    A pid says something only on this host; elsewhere an expired lease does."""
    me = current_owner(worker_id="poimen-verify", host=default_host())
    now = store.now()
    out: list[Orphan] = []
    after = ""
    while True:
        page = store.list_unfinished(after_id=after, limit=_PAGE)
        for it in page:
            if claimability(it, me, held=False, now=now, alive=owner_alive) != "claimable":
                continue
            o = it.owner
            if o is None:
                why = "no owner"
            elif it.lease_expires_at is not None and it.lease_expires_at <= now:
                why = f"lease of {o.worker_id} on {o.host} expired {now - it.lease_expires_at:.0f}s ago"
            else:
                why = f"pid {o.pid} of {o.worker_id} is gone from this host"
            out.append(Orphan(it, why))
        if len(page) < _PAGE:
            return out
        after = page[-1].id


# doctor


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Versions and the platform: what a bug report starts with."""
    info: dict[str, Any] = {
        "poimen": _version("poimen"),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "host": default_host(),
        "sqlite_library": sqlite3.sqlite_version,
        "psycopg": None,
        "libpq": None,
    }
    try:
        import psycopg
    except ImportError:
        pass
    else:
        info["psycopg"] = psycopg.__version__
        v = psycopg.pq.version()
        info["libpq"] = f"{v // 10000}.{v % 10000}"
    info["settings"] = {
        # POIMEN_DB may be any text: mistyped, foreign or a libpq string, password included.
        k: REDACTED if is_secret_name(k) else redact_store_url(v) if k == "POIMEN_DB"
        else redact_urls(v)
        for k, v in sorted(os.environ.items())
        if k.startswith("POIMEN_")
    }
    return info


def store_facts(store: Store) -> dict[str, Any]:
    """The store's own settings: schema, and what its durability depends on."""
    return {
        "schema_version": store.schema_version(),
        "known_version": latest_version(store.dialect),
        **store.server_facts(),
    }
