"""`row_bytes` and `sqlite_link` (the triggers' ``poimen_link``) take a fast path generated
from `COLUMNS` for the values SQLite hands the chain's triggers: their bytes must be those of
the definition (`_value` over every column) for every value, or every link written since would
fail `poimen audit verify`."""

from __future__ import annotations

import hashlib
import itertools
import math
import re
import sqlite3
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poimen._core.audit import (
    _TYPES,
    COLUMNS,
    GENESIS,
    _text,
    _value,
    link,
    row_bytes,
    sqlite_link,
)
from poimen.store._base import migrations


def reference(kind: str, values: list[Any]) -> bytes:
    """The definition, one column at a time."""
    return _text(kind) + b"".join(_value(t, v) for t, v in zip(_TYPES[kind], values, strict=True))


_values = st.one_of(
    st.none(),
    st.text(),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)),  # lone surrogates
    st.integers(),
    st.integers(min_value=-(2**63) - 2, max_value=-(2**63) + 2),
    st.integers(min_value=2**63 - 2, max_value=2**63 + 2),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 3.0, 2.0**63, -(2.0**63), 1e300, math.nan, math.inf]),
    st.booleans(),
    st.binary(),
)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(COLUMNS)), st.data())
def test_row_bytes_are_the_definitions_for_every_value(kind: str, data: Any) -> None:
    values = data.draw(st.lists(_values, min_size=len(COLUMNS[kind]), max_size=len(COLUMNS[kind])))
    try:
        want = reference(kind, values)
    except OverflowError:  # an integer too large for a float column: the definition raises
        with pytest.raises(OverflowError):
            row_bytes(kind, values)
        return
    assert row_bytes(kind, values) == want


_texts = st.one_of(
    st.text(),
    st.text(st.characters(exclude_categories=())),  # non-BMP and lone surrogates mixed
    st.sampled_from(["", "\x00", "\ud800", "\udfff", "\U0010ffff", "\u00e9" * 512]),
    # past 1 KiB of UTF-8, where the header is packed rather than looked up
    st.tuples(st.text(min_size=1, max_size=4), st.integers(1021, 1400)).map(lambda p: p[0] * p[1]),
)
# What SQLite hands a trigger, in any column: NULL, INTEGER, REAL, TEXT, BLOB.
_sqlite_values = st.one_of(
    st.none(),
    _texts,
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([0, 1, -1, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, 5e-324]),
    st.binary(),
)


def _outcome(f: Any, *args: Any) -> object:
    try:
        return f(*args)
    except (ValueError, KeyError, OverflowError) as exc:
        return type(exc)


def _defined_link(prev: Any, kind: Any, *values: Any) -> str:
    """The link by the definition: SHA-256 over the previous hash and `reference`."""
    if str(kind) not in _TYPES:
        raise KeyError(kind)
    if len(values) != len(_TYPES[str(kind)]):
        raise ValueError(kind)
    return hashlib.sha256(bytes.fromhex(str(prev)) + reference(str(kind), list(values))).hexdigest()


@settings(max_examples=300, deadline=None)
@given(
    st.binary(min_size=32, max_size=32).map(bytes.hex),
    st.sampled_from(sorted(COLUMNS)),
    st.data(),
)
def test_sqlite_link_is_the_definitions_for_every_value(prev: str, kind: str, data: Any) -> None:
    # Each column drawn from its own type half the time (the fast path) and from anything
    # SQLite may hold in it (the columns have affinities, not types) otherwise.
    own = {"t": _texts, "i": st.integers(-(2**63), 2**63 - 1), "f": st.floats()}
    values = [
        data.draw(st.one_of(own[t], _sqlite_values, st.booleans(), st.integers()))
        for t in _TYPES[kind]
    ]
    assert _outcome(sqlite_link, prev, kind, *values) == _outcome(_defined_link, prev, kind, *values)


def _storable(v: object) -> bool:
    """SQLite's module binds a text as strict UTF-8: a lone surrogate never reaches it."""
    return not isinstance(v, str) or not any("\ud800" <= c <= "\udfff" for c in v)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_poimen_link_through_sqlite_is_the_definitions(data: Any) -> None:
    # The values as SQLite itself hands them to the function (NaN as NULL, each storage
    # class), and calls with a column too few or too many, or of a kind no table has.
    kind = data.draw(st.sampled_from([*sorted(COLUMNS), "other"]))
    n = len(_TYPES.get(kind, "ttt")) + data.draw(st.sampled_from([0, 0, 0, -1, 1]))
    values = data.draw(st.lists(_sqlite_values.filter(_storable), min_size=n, max_size=n))
    db = sqlite3.connect(":memory:")
    db.create_function("poimen_link", -1, sqlite_link)
    marks = ", ".join("?" for _ in range(n + 2))
    params = (GENESIS, kind, *values)
    try:
        handed = db.execute(f"SELECT {marks}", params).fetchone()
        try:
            got: object = db.execute(f"SELECT poimen_link({marks})", params).fetchone()[0]
        except sqlite3.OperationalError:  # the function raised
            got = "refused"
    finally:
        db.close()
    want = _outcome(_defined_link, *handed)
    assert got == (want if isinstance(want, str) else "refused")


def test_a_settled_intents_link_is_unchanged() -> None:
    # A row as SQLite gives it to the trigger, and its link as the definition made it.
    row = ["in_1", "c1", "t", "idempotent", '{"a":1}', "h" * 64, "k", None, "COMPLETED", 1,
           "w", "host", 42, "123", None, 10.0, 1796196354.25, None, 0, 1, "null", None, None,
           1796196354.0, 1796196354.5, None]  # fmt: skip
    prev = "0" * 64
    assert row_bytes("intent", row) == reference("intent", row)
    assert link(prev, "intent", row) == link(prev, "intent", tuple(row))
    assert sqlite_link(prev, "intent", *row) == _defined_link(prev, "intent", *row)


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1025, 70_000])
@pytest.mark.parametrize("char", ["a", "\u00e9", "\U0001f600", "\ud800"])
def test_a_texts_bytes_are_the_definitions_at_every_length(n: int, char: str) -> None:
    # The tag and length of a short text come from a table; a lone surrogate takes the
    # definition's encoding after strict UTF-8 refuses it.
    row = [char * n, "c", None, "x", *([None] * 22)]
    assert row_bytes("intent", row) == reference("intent", row)


def test_a_row_of_another_length_is_refused() -> None:
    with pytest.raises(ValueError, match="columns"):
        row_bytes("pruned", [1, 2.0, "[]"])


STATES = ("AWAITING_APPROVAL", "DISPATCHED", "COMPLETED", "FAILED", "INDETERMINATE",
          "RESOLVED_LANDED", "RESOLVED_NOT_LANDED")  # fmt: skip


def _when(version: int) -> str:
    """The settle trigger's WHEN, as migration `version` writes it."""
    [(_, sql)] = [m for m in migrations("sqlite") if m[0] == version]
    found = re.search(r"AFTER UPDATE OF state ON intents\s+WHEN (.*?)\s+BEGIN", sql, re.S)
    assert found is not None
    return found.group(1).replace("OLD.", "o_").replace("NEW.", "n_")


def test_the_settle_trigger_links_the_transitions_version_10_linked() -> None:
    # Version 12 writes the WHEN without IN lists (each a temporary b-tree per row): the
    # transitions it links must be version 10's, for every pair of states.
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE audit_head (id INTEGER)")
    db.execute("INSERT INTO audit_head VALUES (1)")
    old, new = _when(10), _when(12)
    assert "IN (" in old and " IN (" not in new
    for o, n in itertools.product((*STATES, "OTHER"), repeat=2):
        got = db.execute(
            f"SELECT ({old}), ({new}) FROM (SELECT ? AS o_state, ? AS n_state)", (o, n)
        ).fetchone()
        assert got[0] == got[1], (o, n)
    db.close()


EFFECTS = ("idempotent", "queryable", "unsafe", "readonly", "transactional")


def _log_at(version: int) -> sqlite3.Connection:
    """An in-memory log migrated to `version`, as the migrator runs the files."""
    from poimen.store.sqlite import _statements

    db = sqlite3.connect(":memory:", isolation_level=None)
    db.create_function("poimen_link", -1, sqlite_link)
    db.execute("PRAGMA foreign_keys=ON")
    db.execute("BEGIN")
    for v, sql in migrations("sqlite"):
        if v <= version:
            for stmt in _statements(sql):
                db.execute(stmt)
    db.execute("COMMIT")
    return db


def _accepts(db: sqlite3.Connection, effect: object, state: object) -> bool:
    db.execute("SAVEPOINT probe")
    try:
        db.execute(
            "INSERT INTO intents (id, call_id, tool_id, effect, args, args_hash, state, fence, "
            "timeout_s, created_at, updated_at) VALUES ('i', 'c', 't', ?, '{}', 'h', ?, 1, 1, 0, 0)",
            (effect, state),
        )
        return True
    except sqlite3.IntegrityError:
        return False
    finally:
        db.execute("ROLLBACK TO probe")
        db.execute("RELEASE probe")


def test_version_12s_intents_accept_what_version_11s_accepted() -> None:
    # Version 12 copies intents into a table whose CHECKs of effect and state are comparisons,
    # not IN lists (a temporary b-tree per row written): the same columns, indexes and foreign
    # key, and exactly the same values accepted (case, unknown names, NULL, other types).
    old, new = _log_at(11), _log_at(12)
    for table in ("intents", "attempts"):
        for pragma in ("table_xinfo", "foreign_key_list", "index_list"):
            q = f"PRAGMA {pragma}('{table}')"
            assert old.execute(q).fetchall() == new.execute(q).fetchall(), (table, pragma)
    odd = ("IDEMPOTENT", "Completed", "other", "", None, 1, b"unsafe")
    for effect, state in itertools.product((*EFFECTS, *odd), (*STATES, *odd)):
        assert _accepts(old, effect, state) == _accepts(new, effect, state), (effect, state)
    assert _accepts(new, "unsafe", "DISPATCHED") and not _accepts(new, "unsafe", "other")
    assert new.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
