"""What only a SQLite log can say of itself: `poimen verify`'s checks (SQLite's own, the schema
objects, every row judged by the schema) and `poimen doctor`'s facts (the file, its pragmas, the
filesystem under it). `SqliteStore.integrity` and `SqliteStore.server_facts` answer with these."""

from __future__ import annotations

import os
import sqlite3
from typing import TYPE_CHECKING, Any

from poimen._core.audit import sqlite_link
from poimen.errors import StoreError
from poimen.store._base import Problem, migrations
from poimen.store._chain import CHAIN_VERSION
from poimen.store._fs import filesystem_of, is_network

if TYPE_CHECKING:
    from poimen.store.sqlite import SqliteStore

#: The checks `problems` makes, as `poimen verify` lists them.
CHECKS = ("integrity_check", "foreign_key_check", "schema objects", "row constraints", "row types")
_PAGE = 1000


def problems(store: SqliteStore, found: int) -> list[Problem]:
    """`poimen verify` on a SQLite log: SQLite's own checks, the schema objects the migrations
    make, and every row judged by the schema."""
    out = []
    try:
        rows = [str(r[0]) for r in store._read("PRAGMA integrity_check")]
    except StoreError as exc:  # damage bad enough that SQLite stops reading
        rows = [str(exc)]
    if rows != ["ok"]:
        out += [Problem("integrity_check", r) for r in rows]
    for table, rowid, parent, _ in store._read("PRAGMA foreign_key_check"):
        out.append(Problem("foreign_key_check", f"{table} row {rowid} points at no {parent} row"))
    # Every table, index and trigger the migrations make must be there.
    reference = sqlite3.connect(":memory:")
    reference.create_function("poimen_link", -1, sqlite_link)  # the chain's triggers
    try:
        from poimen.store.sqlite import _statements  # sqlite.py imports this module

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
    have = {(str(t), str(n)) for t, n in store._read("SELECT type, name FROM sqlite_master")}
    for kind, name in sorted(want - have):
        if not name.startswith("sqlite_"):
            out.append(Problem("schema objects", f"the {kind} {name} is missing"))
    return out


#: What SQLite stores for a column of each declared type, besides NULL.
_STORAGE = {"TEXT": ("text",), "INTEGER": ("integer",), "REAL": ("real", "integer")}
#: Row problems reported per table before the rest is only counted.
_MAX_ROW_PROBLEMS = 20


def _row_problems(store: SqliteStore, reference: sqlite3.Connection) -> list[Problem]:
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


def _table_problems(store: SqliteStore, reference: sqlite3.Connection, table: str) -> list[Problem]:
    out: list[Problem] = []
    info = reference.execute(f'PRAGMA table_info("{table}")').fetchall()
    declared = {str(r[1]): str(r[2]).upper() for r in info}
    # Paged by the primary key (intents and attempts have no rowid), else by rowid.
    pk = [f'"{r[1]}"' for r in sorted(info, key=lambda r: r[5]) if r[5]] or ["rowid"]
    have = {str(r[1]) for r in store._read(f'PRAGMA table_info("{table}")')}
    cols = [c for c in declared if c in have]
    if not cols:
        return out
    for col in cols:
        kinds = _STORAGE.get(declared[col])
        if kinds is None:
            continue
        allowed = ", ".join(f"'{k}'" for k in (*kinds, "null"))
        n = int(store._read(f'SELECT COUNT(*) FROM "{table}" '
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
        rows = store._read(f'SELECT {keys}, {names} FROM "{table}" {where}'
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


def facts(store: SqliteStore) -> dict[str, Any]:
    """`poimen doctor`'s facts of a SQLite log: its file, pragmas and filesystem."""
    path = store.path
    out: dict[str, Any] = {"file_bytes": os.path.getsize(path) if os.path.exists(path) else None}
    for pragma in ("journal_mode", "page_size", "page_count", "freelist_count"):
        out[pragma] = store._read(f"PRAGMA {pragma}")[0][0]
    m = filesystem_of(path)
    out["filesystem"] = None if m is None else {
        "type": m.fstype, "mount_point": m.point, "source": m.source,
        "network_or_fuse": is_network(m.fstype),
    }  # fmt: skip
    return out
