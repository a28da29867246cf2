"""`poimen verify` and `poimen doctor`: the integrity of an intent log, and the facts a bug
report needs. Both only read: the store is opened read-only by the caller."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sqlite3
import sys
from dataclasses import dataclass
from typing import Any

from poimen._core.audit import sqlite_link
from poimen._core.decide import claimability
from poimen._core.intents import Intent
from poimen._engine.liveness import current_owner, default_host, owner_alive
from poimen.errors import StoreError
from poimen.operator import _audit
from poimen.operator._ops import (
    REDACTED,
    intent_summary,
    is_secret_name,
    redact_store_url,
    redact_urls,
)
from poimen.store._base import Store, latest_version, migrations
from poimen.store._chain import CHAIN_VERSION
from poimen.store._dialect import SQLITE, dialect_of
from poimen.store._fs import filesystem_of, is_network

# What the newest PostgreSQL schema holds that the guarantees rest on: keys, the checks on
# states and classes, the links between rows, and the triggers that keep the history
# append-only. Its SQLite counterpart is built from the migrations themselves.
PG_CONSTRAINTS = frozenset({
    "poimen_schema_pkey", "intents_pkey", "intents_call_id_key", "intents_effect_check",
    "intents_state_check", "attempts_pkey", "attempts_intent_id_fkey", "attempts_outcome_check",
    "events_pkey", "outbox_pkey", "outbox_delivery_id_key", "denials_pkey", "deliveries_pkey",
    "deliveries_notification_id_fkey",
})  # fmt: skip
PG_TRIGGERS = frozenset({
    "events_append_only", "events_append_only_t", "denials_append_only", "denials_append_only_t",
    "audit_pruned_append_only", "audit_pruned_append_only_t",
})  # fmt: skip
# The triggers that make the audit chain's links (schema version 10, docs/audit.md).
PG_CHAIN_TRIGGERS = frozenset({
    "events_chain", "denials_chain", "audit_pruned_chain", "intents_chain_settle",
})  # fmt: skip
# Rows that point at nothing, whatever constraints the database still has.
_DANGLING = {
    "attempts without their intent": "SELECT COUNT(*) FROM attempts a "
    "WHERE NOT EXISTS (SELECT 1 FROM intents i WHERE i.id = a.intent_id)",
    "deliveries without their notification": "SELECT COUNT(*) FROM deliveries d "
    "WHERE NOT EXISTS (SELECT 1 FROM outbox o WHERE o.id = d.notification_id)",
}
_PAGE = 1000


@dataclass(frozen=True, slots=True)
class Problem:
    check: str
    message: str


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
    dialect = "sqlite" if dialect_of(store.url) is SQLITE else "postgres"
    found, known = store.schema_version(), latest_version(dialect)
    problems: list[Problem] = []
    notes: list[str] = []
    checks = ["schema version"]
    if found < known:
        notes.append(
            f"schema version {found} is older than this poimen's {known}: `poimen migrate` "
            "upgrades it (a kernel of this version does so when it opens the log)"
        )
    if dialect == "sqlite":
        checks += ["integrity_check", "foreign_key_check", "schema objects", "row constraints",
                   "row types"]
        problems += _sqlite_problems(store, found)
    else:
        checks += ["constraints", "triggers"]
        problems += _postgres_problems(store, found, known)
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


def _sqlite_problems(store: Store, found: int) -> list[Problem]:
    out = []
    try:
        rows = [str(r[0]) for r in _read(store, "PRAGMA integrity_check")]
    except StoreError as exc:  # damage bad enough that SQLite stops reading
        rows = [str(exc)]
    if rows != ["ok"]:
        out += [Problem("integrity_check", r) for r in rows]
    for table, rowid, parent, _ in _read(store, "PRAGMA foreign_key_check"):
        out.append(Problem("foreign_key_check", f"{table} row {rowid} points at no {parent} row"))
    # Every table, index and trigger the migrations make must be there.
    reference = sqlite3.connect(":memory:")
    reference.create_function("poimen_link", -1, sqlite_link)  # the chain's triggers
    try:
        from poimen.store.sqlite import _statements

        for version, sql in migrations("sqlite"):
            if version <= found:
                for stmt in _statements(sql):
                    reference.execute(stmt)
        if found >= CHAIN_VERSION:  # the log's own head row is offered to it below
            reference.execute("DELETE FROM audit_head")
        want = set(reference.execute("SELECT type, name FROM sqlite_master").fetchall())
        out += _row_problems(store, reference)
    finally:
        reference.close()
    have = {(str(t), str(n)) for t, n in _read(store, "SELECT type, name FROM sqlite_master")}
    for kind, name in sorted(want - have):
        if not name.startswith("sqlite_"):
            out.append(Problem("schema objects", f"the {kind} {name} is missing"))
    return out


#: What SQLite stores for a column of each declared type, besides NULL.
_STORAGE = {"TEXT": ("text",), "INTEGER": ("integer",), "REAL": ("real", "integer")}
#: Row problems reported per table before the rest is only counted.
_MAX_ROW_PROBLEMS = 20


def _row_problems(store: Store, reference: sqlite3.Connection) -> list[Problem]:
    """Rows the schema would refuse: each is offered to `reference` (the schema as the
    migrations make it, in memory), whose NOT NULL and CHECK constraints then judge it, and
    each column's values must be of its declared type. SQLite's integrity_check does neither,
    and a file written with its checks off (or by hand) passes it."""
    out: list[Problem] = []
    tables = [str(r[0]) for r in reference.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
    )]
    for table in tables:
        try:
            out += _table_problems(store, reference, table)
        except StoreError as exc:  # damage bad enough that SQLite stops reading: said above
            out.append(Problem("row constraints", f"{table} could not be read: {exc}"))
    return out


def _table_problems(store: Store, reference: sqlite3.Connection, table: str) -> list[Problem]:
    out: list[Problem] = []
    info = reference.execute(f'PRAGMA table_info("{table}")').fetchall()
    declared = {str(r[1]): str(r[2]).upper() for r in info}
    # Paged by the primary key (intents and attempts have no rowid), else by rowid.
    pk = [f'"{r[1]}"' for r in sorted(info, key=lambda r: r[5]) if r[5]] or ["rowid"]
    have = {str(r[1]) for r in _read(store, f'PRAGMA table_info("{table}")')}
    cols = [c for c in declared if c in have]
    if not cols:
        return out
    for col in cols:
        kinds = _STORAGE.get(declared[col])
        if kinds is None:
            continue
        allowed = ", ".join(f"'{k}'" for k in (*kinds, "null"))
        n = int(_read(store, f'SELECT COUNT(*) FROM "{table}" '
                             f'WHERE typeof("{col}") NOT IN ({allowed})')[0][0])
        if n:
            out.append(Problem("row types", f"{n} rows of {table} have a {col} that is "
                                            f"not {declared[col]}"))
    names = ", ".join(f'"{c}"' for c in cols)
    insert = f'INSERT INTO "{table}" ({names}) VALUES ({", ".join("?" * len(cols))})'
    keys, marks = ", ".join(pk), ", ".join("?" * len(pk))
    bad = 0
    last: tuple[Any, ...] | None = None
    while True:
        where = "" if last is None else f"WHERE ({keys}) > ({marks}) "
        rows = _read(store, f'SELECT {keys}, {names} FROM "{table}" {where}'
                            f"ORDER BY {keys} LIMIT {_PAGE}", last or ())
        if not rows:
            break
        for row in rows:
            last, values = tuple(row[: len(pk)]), tuple(row[len(pk) :])
            reference.execute("SAVEPOINT row")
            try:
                reference.execute(insert, values)
            except sqlite3.IntegrityError as exc:
                bad += 1
                if bad <= _MAX_ROW_PROBLEMS:
                    key = ", ".join(map(str, last))
                    out.append(Problem("row constraints", f"{table} row {key}: {exc}"))
            finally:
                reference.execute("ROLLBACK TO row")
                reference.execute("RELEASE row")
    if bad > _MAX_ROW_PROBLEMS:
        out.append(Problem("row constraints", f"{table}: {bad} rows in all"))
    return out


def _postgres_problems(store: Store, found: int, known: int) -> list[Problem]:
    if found != known:
        return []  # the lists below describe the newest schema
    out = []
    rows = _read(
        store,
        "SELECT c.conname, c.convalidated FROM pg_constraint c "
        "JOIN pg_namespace n ON n.oid = c.connamespace WHERE n.nspname = current_schema()",
    )
    have = {str(name): bool(valid) for name, valid in rows}
    for name in sorted(PG_CONSTRAINTS - have.keys()):
        out.append(Problem("constraints", f"the constraint {name} is missing"))
    for name in sorted(n for n in PG_CONSTRAINTS & have.keys() if not have[n]):
        out.append(Problem("constraints", f"the constraint {name} is NOT VALID"))
    rows = _read(
        store,
        "SELECT t.tgname, t.tgenabled FROM pg_trigger t JOIN pg_class r ON r.oid = t.tgrelid "
        "JOIN pg_namespace n ON n.oid = r.relnamespace "
        "WHERE n.nspname = current_schema() AND NOT t.tgisinternal",
    )
    triggers = {str(name): str(enabled) for name, enabled in rows}
    for what, names in (("append-only", PG_TRIGGERS), ("audit chain", PG_CHAIN_TRIGGERS)):
        for name in sorted(names - triggers.keys()):
            out.append(Problem("triggers", f"the {what} trigger {name} is missing"))
        for name in sorted(n for n in names & triggers.keys() if triggers[n] == "D"):
            out.append(Problem("triggers", f"the {what} trigger {name} is disabled"))
    return out


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
    facts: dict[str, Any] = {"schema_version": store.schema_version()}
    if dialect_of(store.url) is SQLITE:
        path = str(getattr(store, "path", ""))
        facts["known_version"] = latest_version("sqlite")
        facts["file_bytes"] = os.path.getsize(path) if os.path.exists(path) else None
        for pragma in ("journal_mode", "page_size", "page_count", "freelist_count"):
            facts[pragma] = _read(store, f"PRAGMA {pragma}")[0][0]
        m = filesystem_of(path)
        facts["filesystem"] = None if m is None else {
            "type": m.fstype, "mount_point": m.point, "source": m.source,
            "network_or_fuse": is_network(m.fstype),
        }  # fmt: skip
    else:
        facts["known_version"] = latest_version("postgres")
        for name in ("server_version", "synchronous_commit", "default_transaction_isolation",
                     "TimeZone"):
            facts[name.lower()] = _read(store, f"SHOW {name}")[0][0]
        facts["current_schema"] = _read(store, "SELECT current_schema()")[0][0]
    return facts
