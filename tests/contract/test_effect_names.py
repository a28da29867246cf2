"""The effect classes' names have one source, `EFFECT_NAMES`: the classes' `name` traits, the
store's check of a row and the schema's CHECK constraints, after every migration, all follow it
(a new effect class that misses one of them fails here, not in production)."""

from __future__ import annotations

import re

from poimen._core.effects import EFFECT_CLASSES, EFFECT_NAMES
from poimen.store import open_store
from poimen.store._base import _EFFECTS
from tests.contract.test_store_contract import raw


def test_every_effect_class_is_named_once_in_the_names_tuple() -> None:
    assert tuple(c.name for c in EFFECT_CLASSES) == EFFECT_NAMES
    assert frozenset(EFFECT_NAMES) == _EFFECTS


def _checks(url: str) -> dict[str, tuple[str, ...]]:
    """Each table with an `effect` column and the names its CHECK constraint allows."""
    if url.startswith("sqlite:///"):
        rows = raw(url, "SELECT name, sql FROM sqlite_master WHERE type = 'table'")
        found = {}
        for table, sql in rows:
            if re.search(r"^\s*effect\s", sql or "", re.MULTILINE):
                # `effect IN (...)`, or (schema 12 on) `effect = '...' OR effect = '...'`
                m = re.search(r"CHECK \((effect (?:IN \([^)]*\)|=[^)]*))\)", sql)
                found[table] = tuple(re.findall(r"'([a-z_]+)'", m.group(1))) if m else ()
        return found
    columns = raw(
        url,
        "SELECT table_name FROM information_schema.columns "
        "WHERE column_name = 'effect' AND table_schema = current_schema()",
    )
    found = {str(t): () for (t,) in columns}
    for table, definition in raw(
        url,
        "SELECT conrelid::regclass::text, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE contype = 'c' AND strpos(pg_get_constraintdef(oid), 'effect') > 0",
    ):
        found[str(table)] = tuple(re.findall(r"'([a-z_]+)'::text", definition))
    return found


def test_the_schema_allows_exactly_the_effect_names(store_url: str) -> None:
    open_store(store_url).close()  # migrated to the current schema
    checks = _checks(store_url)
    assert "intents" in checks, checks
    for table, names in checks.items():
        assert names == EFFECT_NAMES, f"{table}: CHECK (effect IN {names}) != {EFFECT_NAMES}"
