"""The tamper-evident audit's rules: one hash chain per log over its history (docs/audit.md).

Every event and denial, each intent once it is settled, and each prune's record carries a
link: its position in the chain (``chain_seq``, in commit order) and ``chain_hash`` =
SHA-256 over (the previous link's hash, 32 bytes || the row's canonical bytes). The first
link follows `GENESIS`. The database makes the links, whatever code writes the rows
(schema version 10: triggers; on SQLite they call `sqlite_link`, on PostgreSQL a PL/pgSQL
copy of `row_bytes`), under one head row (``audit_head``) that every chained write moves in
its own transaction: one linear chain, whatever number of writers.

`row_bytes` is the one definition of a row's canonical bytes (`_value`, column by column;
the code that runs is generated from `COLUMNS`, and tests hold it to `_value`); `walk`
checks a chain and names the first row edited, deleted, inserted or reordered. Pure: reading
the rows is the store's (`poimen.store._chain`), checking a log and exporting it the
operator's (`poimen.operator._audit`, `poimen.operator._audit_export`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

#: The hash before the first link.
GENESIS = "0" * 64
#: The intent states whose row is chained (settled for good: the row no longer changes).
SETTLED = ("COMPLETED", "FAILED", "RESOLVED_LANDED", "RESOLVED_NOT_LANDED")

# The columns each kind of chained row is hashed over, in order: t text, i integer, f float.
# The PL/pgSQL functions of migration 0009 (poimen_audit_bytes) say the same.
COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "event": (
        ("id", "i"), ("intent_id", "t"), ("at", "f"), ("kind", "t"), ("from_state", "t"),
        ("to_state", "t"), ("actor", "t"), ("detail", "t"),
    ),
    "denial": (
        ("id", "i"), ("at", "f"), ("tool_id", "t"), ("intent_id", "t"), ("attempt", "i"),
        ("action", "t"), ("target", "t"), ("reason", "t"),
    ),
    "intent": (
        ("id", "t"), ("call_id", "t"), ("tool_id", "t"), ("effect", "t"), ("args", "t"),
        ("args_hash", "t"), ("key", "t"), ("request_id", "t"), ("state", "t"), ("fence", "i"),
        ("owner_id", "t"), ("owner_host", "t"), ("owner_pid", "i"), ("owner_start", "t"),
        ("lease_expires_at", "f"), ("timeout_s", "f"), ("deadline_at", "f"),
        ("next_check_at", "f"), ("unknown_count", "i"), ("attempts", "i"), ("result", "t"),
        ("error", "t"), ("reason", "t"), ("created_at", "f"), ("updated_at", "f"),
        ("scope", "t"),
    ),
    "pruned": (("id", "i"), ("at", "f"), ("ranges", "t"), ("rows", "i")),
}  # fmt: skip
#: The table of each kind.
TABLES = {"event": "events", "denial": "denials", "intent": "intents", "pruned": "audit_pruned"}
_TYPES = {kind: "".join(t for _, t in cols) for kind, cols in COLUMNS.items()}
_NULL = b"\x00"
_INT = struct.Struct(">q")
_FLOAT = struct.Struct(">d")
_LEN = struct.Struct(">I")


def _text(v: str) -> bytes:
    b = v.encode("utf-8", "surrogatepass")
    return b"\x01" + _LEN.pack(len(b)) + b


def _value(t: str, v: Any) -> bytes:
    """One column: NULL 00; text 01, length (4 bytes), UTF-8; integer 02, 8 bytes; float 03,
    IEEE 754 double, 8 bytes; all big-endian. A value of another type than its column's
    (SQLite lets a column hold one) is encoded as what it is, so it never passes for the
    value that was hashed."""
    if v is None:
        return _NULL
    if isinstance(v, float) and t == "i" and v.is_integer():
        v = int(v)
    elif isinstance(v, int) and not isinstance(v, bool) and t == "f":
        v = float(v)
    if isinstance(v, str):
        return _text(v)
    if isinstance(v, bool) or not isinstance(v, int | float):
        return b"\x04" + _text(repr(v))
    if isinstance(v, int):
        if -(2**63) <= v < 2**63:
            return b"\x02" + _INT.pack(v)
        return b"\x04" + _text(repr(v))
    return b"\x03" + _FLOAT.pack(v)


def link(prev: str, kind: str, values: Sequence[Any]) -> str:
    """The hash of a row's link: SHA-256 over (the previous hash || the row's bytes)."""
    return hashlib.sha256(bytes.fromhex(prev) + row_bytes(kind, values)).hexdigest()


def _sqlite_link(prev: Any, kind: Any, *values: Any) -> str:
    """`link` for whatever SQLite hands the triggers."""
    return link(str(prev), str(kind), values)


# The fast path: every settle hashes a row (the settle trigger's ``poimen_link``), so each
# kind's encoder is generated from `COLUMNS`, straight-line code with no loop or type table
# per column, for the values SQLite hands the triggers: None and each column's own type. Any
# other value takes `_value`, the definition; a test holds both to the same bytes.
_NO = object()  # a column SQLite did not pass
_ENCODE = {
    "t": (
        "if type(v{i}) is str:\n"
        "    try:  # strict UTF-8 (the codec's fast path): the same bytes where it succeeds\n"
        "        b{i} = v{i}.encode()\n"
        "    except UnicodeEncodeError:\n"
        "        b{i} = v{i}.encode('utf-8', 'surrogatepass')\n"
        "    try:\n"
        "        h{i} = HEADS[len(b{i})]\n"
        "    except IndexError:  # 1 KiB or more\n"
        "        h{i} = TEXT(1, len(b{i}))\n"
        "elif v{i} is None:\n"
        "    h{i}, b{i} = NULL, b''\n"
        "else:\n"
        "    h{i}, b{i} = value('t', v{i}), b''\n"
    ),
    "i": (
        "if type(v{i}) is int:\n"
        "    try:\n"
        "        h{i} = INT(2, v{i})\n"
        "    except error:  # past 64 bits\n"
        "        h{i} = value('i', v{i})\n"
        "elif v{i} is None:\n"
        "    h{i} = NULL\n"
        "else:\n"
        "    h{i} = value('i', v{i})\n"
    ),
    "f": (
        "if type(v{i}) is float:\n"
        "    h{i} = FLOAT(3, v{i})\n"
        "elif v{i} is None:\n"
        "    h{i} = NULL\n"
        "else:\n"
        "    h{i} = value('f', v{i})\n"
    ),
}


def _fast_source() -> str:
    """Per kind, ``row_KIND(v0, ...)`` (its bytes) and a branch of ``sqlite_link`` (its hash).
    ``sqlite_link`` takes the columns as parameters, each defaulting to `_NO`, so that no
    tuple is made of them; a call with more columns than any kind has takes ``generic``."""
    rows, branches = [], []
    most = max(map(len, _TYPES.values()))
    for kind in sorted(_TYPES, key=lambda k: k != "intent"):  # the settle's kind first
        types = _TYPES[kind]
        n = len(types)
        names = [f"v{i}" for i in range(n)]
        body = "".join(_ENCODE[t].format(i=i) for i, t in enumerate(types))
        pieces = "".join(f"h{i}, b{i}, " if t == "t" else f"h{i}, " for i, t in enumerate(types))
        rows.append(
            f"def row_{kind}({', '.join(names)}):\n"
            + _indent(body, 1)
            + f"    return b''.join((KIND_{kind}, {pieces}))\n"
        )
        complete = f"v{n - 1} is not NO" + (f" and v{n} is NO" if n < most else "")
        branches.append(
            f"    if kind == {kind!r} and {complete} and type(prev) is str:\n"
            + _indent(body, 2)
            + f"        return sha256(b''.join((fromhex(prev), KIND_{kind}, {pieces}))).hexdigest()\n"
        )
    params = ", ".join(f"v{i}=NO" for i in range(most))
    link = (
        f"def sqlite_link(prev, kind, {params}, *more):\n"
        "    \"`link` as SQLite calls it from the chain's triggers (``poimen_link``).\"\n"
        "    if not more:\n"
        + "".join(_indent(b, 1) for b in branches)
        + f"    values = ({', '.join(f'v{i}' for i in range(most))}, *more)\n"
        + "    return generic(prev, kind, *(v for v in values if v is not NO))\n"
    )
    return "\n".join([*rows, link])


def _indent(text: str, level: int) -> str:
    pad = "    " * level
    return "".join(pad + line for line in text.splitlines(keepends=True))


def _fast() -> tuple[dict[str, Callable[..., bytes]], Callable[..., str]]:
    text = struct.Struct(">BI").pack
    ns: dict[str, Any] = {
        "__name__": __name__,
        "HEADS": tuple(text(1, n) for n in range(1024)),  # a text's tag and length, made once
        "TEXT": text, "INT": struct.Struct(">Bq").pack, "FLOAT": struct.Struct(">Bd").pack,
        "NULL": _NULL, "NO": _NO, "error": struct.error, "value": _value,
        "sha256": hashlib.sha256, "fromhex": bytes.fromhex, "generic": _sqlite_link,
        **{f"KIND_{kind}": _text(kind) for kind in COLUMNS},
    }  # fmt: skip
    exec(compile(_fast_source(), f"<{__name__} fast path>", "exec"), ns)
    return {kind: ns[f"row_{kind}"] for kind in COLUMNS}, ns["sqlite_link"]


_ROWS, sqlite_link = _fast()


def row_bytes(kind: str, values: Sequence[Any]) -> bytes:
    """The canonical bytes of a chained row: its kind, then its columns (`COLUMNS`)."""
    types = _TYPES[kind]
    if len(values) != len(types):
        raise ValueError(f"a {kind} row has {len(types)} columns, not {len(values)}")
    return _ROWS[kind](*values)


# Reading a chain: its rows, as the store (or an export) gives them.


@dataclass(frozen=True, slots=True)
class Link:
    """One chained row: its position, its hash, its kind and its columns (`COLUMNS`)."""

    seq: int
    hash: str
    kind: str
    values: tuple[Any, ...]

    @property
    def row(self) -> dict[str, Any]:
        return {name: v for (name, _), v in zip(COLUMNS[self.kind], self.values, strict=True)}

    def label(self) -> str:
        """The row as a person finds it: ``event 17 (completed) of intent in_...``."""
        r = self.row
        if self.kind == "event":
            return f"event {r['id']} ({r['kind']}) of intent {r['intent_id']}"
        if self.kind == "denial":
            of = f" of intent {r['intent_id']}" if r["intent_id"] else ""
            return f"denial {r['id']} ({r['tool_id']}){of}"
        if self.kind == "intent":
            return f"the settled record of intent {r['id']} ({r['state']})"
        return f"prune record {r['id']}"


@dataclass(frozen=True, slots=True)
class Head:
    """The last link of a log's chain (``audit_head``)."""

    log_id: str
    seq: int
    hash: str

    def token(self) -> str:
        """``SEQ:HASH``, what `poimen audit verify --head` takes."""
        return f"{self.seq}:{self.hash}"


@dataclass(frozen=True, slots=True)
class Pruned:
    """A run of positions a prune removed, and the hash of its last one."""

    first: int
    last: int
    hash: str
    record: int  # the position of the prune record that says so


def pruned_ranges(records: Iterable[Link]) -> list[Pruned]:
    """The runs the prune records name, in order (a bad record names none: the walk reports
    that record when it reaches it)."""
    out = []
    for rec in records:
        try:
            for first, last, h in json.loads(rec.row["ranges"]):
                out.append(Pruned(int(first), int(last), str(h), rec.seq))
        except (ValueError, TypeError):
            continue
    out.sort(key=lambda p: p.first)
    return out


def ranges_of(links: Iterable[tuple[int, str]]) -> list[list[Any]]:
    """The runs of positions among `links` ((position, hash), any order): each run's first
    and last position and the last one's hash, as a prune record stores them."""
    out: list[list[Any]] = []
    for seq, h in sorted(links):
        if out and out[-1][1] == seq - 1:
            out[-1][1], out[-1][2] = seq, h
        else:
            out.append([seq, seq, h])
    return out


# Checking a chain.


@dataclass(frozen=True, slots=True)
class Finding:
    """What the walk found wrong first: edited, deleted, inserted, reordered, or head."""

    what: str
    seq: int | None
    message: str


@dataclass(slots=True)
class Walked:
    """What `walk` saw: the rows checked, the positions pruned, the first finding."""

    rows: int = 0
    pruned: int = 0
    last: int = 0
    last_hash: str = GENESIS
    finding: Finding | None = None
    published: str | None = None  # what the published head check found, when asked
    hashes_seen: set[str] = field(default_factory=set)


class _Ranges:
    def __init__(self, ranges: list[Pruned]) -> None:
        self._r = ranges
        self._firsts = [r.first for r in ranges]

    def at(self, seq: int) -> Pruned | None:
        i = bisect.bisect_right(self._firsts, seq) - 1
        if i >= 0 and self._r[i].first <= seq <= self._r[i].last:
            return self._r[i]
        return None


def walk(
    links: Iterable[Link],
    head: Head,
    ranges: list[Pruned],
    *,
    again: Callable[[], Iterator[Link]],
    published: tuple[int | None, str] | None = None,
) -> Walked:
    """Check the chain: `links` in position order, the log's `head`, the prune records'
    `ranges`. Stops at the first finding. `again` reads the links once more, only to tell
    a reordered row from an edited one. `published`: a head published earlier ((position
    or None, hash)), which must be a link of this chain."""
    w = Walked()
    gaps = _Ranges(ranges)
    prev, expect = GENESIS, 1
    want_seq, want_hash = published if published is not None else (None, "")
    last_label = "the start of the chain"

    def skip(to: int, nxt: str) -> bool:
        """Pass the positions before `to`, each pruned; False (and a finding) if one is not."""
        nonlocal prev, expect
        while expect < to:
            r = gaps.at(expect)
            if r is None:
                w.finding = Finding(
                    "deleted", expect,
                    f"deleted: chain position {expect} is missing (after {last_label}, "
                    f"before {nxt})",
                )
                return False
            if r.record <= r.last:
                w.finding = Finding(
                    "inserted", r.record,
                    f"inserted: the prune record at chain position {r.record} names positions "
                    f"up to {r.last}, written after it",
                )
                return False
            w.pruned += r.last - expect + 1
            if want_seq is not None and expect <= want_seq <= r.last:
                w.published = "pruned" if want_seq != r.last else _cmp(r.hash, want_hash)
            prev, expect = r.hash, r.last + 1
            w.hashes_seen.add(r.hash)
        return True

    for seq, group in groupby(links, key=lambda x: x.seq):
        at = list(group)
        if seq > head.seq:
            w.finding = Finding(
                "inserted", seq,
                f"inserted: {at[0].label()} claims chain position {seq}, past the head "
                f"({head.seq})",
            )
            return w
        if seq < expect:
            w.finding = Finding(
                "inserted", seq,
                f"inserted: {at[0].label()} claims chain position {seq}, which a prune "
                "record says was removed",
            )
            return w
        if not skip(seq, at[0].label()):
            return w
        good = [x for x in at if link(prev, x.kind, x.values) == x.hash]
        if len(good) == 1 and len(at) > 1:
            bad = next(x for x in at if x is not good[0])
            w.finding = Finding(
                "inserted", seq,
                f"inserted: {bad.label()} claims chain position {seq}, held by "
                f"{good[0].label()}",
            )
            return w
        if not good:
            w.finding = _classify(at[0], prev, again)
            return w
        x = good[0]
        prev, expect = x.hash, seq + 1
        w.rows += 1
        w.hashes_seen.add(x.hash)
        last_label = x.label()
        if want_seq == seq:
            w.published = _cmp(x.hash, want_hash)
    if not skip(head.seq + 1, "the head"):
        return w
    w.last, w.last_hash = expect - 1, prev
    if prev != head.hash:
        w.finding = Finding(
            "head", head.seq,
            f"edited: the chain head ({head.seq}:{head.hash[:16]}...) is not the hash of the "
            f"last row ({prev[:16]}...): the head was changed, or rows rewritten after it",
        )
    if published is not None and w.published is None:
        if want_seq is None:
            w.published = "ok" if want_hash in w.hashes_seen else "missing"
        else:
            w.published = "ahead" if want_seq > head.seq else "missing"
    return w


def _cmp(have: str, want: str) -> str:
    return "ok" if have == want else "differs"


def _classify(x: Link, prev: str, again: Callable[[], Iterator[Link]]) -> Finding:
    """Why `x` does not follow `prev`: moved (its hash follows another row, or another row's
    follows `prev`), its id exchanged with another row's, or else edited."""
    seq = x.seq
    same_kind: list[Link] = []
    for y in again():
        if y.seq == seq:
            continue
        if link(y.hash, x.kind, x.values) == x.hash:
            return Finding(
                "reordered", seq,
                f"reordered: {x.label()} sits at chain position {seq} but was chained after "
                f"position {y.seq} ({y.label()})",
            )
        if link(prev, y.kind, y.values) == x.hash:
            return Finding(
                "reordered", seq,
                f"reordered: chain position {seq} belongs to {y.label()}, found at position "
                f"{y.seq}; {x.label()} holds it",
            )
        if y.kind == x.kind:
            same_kind.append(y)
    for y in same_kind:
        swapped = (y.values[0], *x.values[1:])
        if link(prev, x.kind, swapped) == x.hash:
            return Finding(
                "reordered", seq,
                f"reordered: {x.label()} at chain position {seq} was written as id "
                f"{y.values[0]}: the ids of two {TABLES[x.kind]} rows were exchanged",
            )
    return Finding(
        "edited", seq,
        f"edited: {x.label()} at chain position {seq} does not match its hash",
    )


def unchained_finding(row: Link) -> Finding:
    """A row of a chained table without a link: written behind the log's back."""
    return Finding(
        "inserted", None, f"inserted: {row.label()} carries no chain link"
    )


def parse_published(text: str) -> tuple[int | None, str]:
    """``SEQ:HASH`` or ``HASH`` (64 hex digits), as `Head.token` prints it."""
    seq_text, _, h = text.strip().rpartition(":")
    h = h.lower()
    if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
        raise ValueError(f"a published head is SEQ:HASH or HASH (64 hex digits), not {text!r}")
    if not seq_text:
        return None, h
    if not seq_text.isdigit():
        raise ValueError(f"a published head is SEQ:HASH or HASH (64 hex digits), not {text!r}")
    return int(seq_text), h


# The check's report, and the archived rows' check (the store's side: poimen.operator._audit).


@dataclass(frozen=True, slots=True)
class Report:
    """What `verify` found. `ok`: the chain holds, and the published head (if given) is a
    link of it."""

    head: Head | None
    rows: int
    pruned: int
    finding: Finding | None
    published: str | None = None  # ok | differs | missing | ahead | pruned
    note: str | None = None  # why there is nothing to check
    archived: int = 0  # archived rows checked against the chain

    @property
    def ok(self) -> bool:
        return self.head is not None and self.finding is None and self.published in (None, "ok")

    def line(self) -> str:
        """The one line an operator reads."""
        if self.finding is not None:
            return self.finding.message
        if self.head is None:
            return f"no audit chain: {self.note}"
        if self.published not in (None, "ok"):
            return _PUBLISHED[self.published or ""]
        pub = "; the published head is a link of it" if self.published == "ok" else ""
        arch = f"; {self.archived} archived rows match it" if self.archived else ""
        return (
            f"the audit chain holds: {self.rows} rows up to position {self.head.seq}"
            f"{f', {self.pruned} positions pruned' if self.pruned else ''}; head "
            f"{self.head.token()}{pub}{arch}"
        )

    def to_json(self) -> dict[str, Any]:
        h = self.head
        f = self.finding
        return {
            "ok": self.ok,
            "log_id": None if h is None else h.log_id,
            "head": None if h is None else {"seq": h.seq, "hash": h.hash},
            "rows": self.rows,
            "pruned": self.pruned,
            "finding": None if f is None else {"what": f.what, "seq": f.seq, "message": f.message},
            "published": self.published,
            "archived": self.archived,
            "message": self.line(),
        }


_PUBLISHED = {
    "differs": "rewritten: the published head is not the link this log holds at its position",
    "missing": "rewritten: the published head is no link of this log's chain",
    "ahead": "deleted: the published head is past this log's last link",
    "pruned": "cannot check the published head: its position was pruned (check the archive)",
}


def check_archived(
    archived: Sequence[Link], ranges: list[Pruned], links: Iterable[Link]
) -> tuple[int, Finding | None]:
    """Each archived row must be the link the chain removed at its position: its hash
    follows the one before it (in the log, the archives, or a prune record), and the prune
    record's hash where its run ended. Returns the rows checked and the first finding."""
    gaps = _Ranges(ranges)
    need = {x.seq - 1 for x in archived}
    seqs = {x.seq for x in archived}
    known: dict[int, str] = {0: GENESIS}
    for p in ranges:
        known[p.last] = p.hash
    in_log: dict[int, str] = {}
    for y in links:
        if y.seq in need:
            known[y.seq] = y.hash
        if y.seq in seqs:
            in_log[y.seq] = y.hash
    by_seq: dict[int, Link] = {}
    for x in archived:
        if x.seq in by_seq:
            return 0, Finding("edited", x.seq, f"edited: the archives hold two rows for chain "
                              f"position {x.seq}: {by_seq[x.seq].label()} and {x.label()}")
        by_seq[x.seq] = x
        known.setdefault(x.seq, x.hash)
    for x in archived:
        r = gaps.at(x.seq)
        if r is None and in_log.get(x.seq) != x.hash:
            return 0, Finding("edited", x.seq, f"edited: the archived {x.label()} claims chain "
                              f"position {x.seq}, which the log neither holds nor pruned")
        if r is not None and r.last == x.seq and r.hash != x.hash:
            return 0, Finding("edited", x.seq, f"edited: the archived {x.label()} is not the "
                              f"row pruned at chain position {x.seq}")
        prev = known.get(x.seq - 1)
        if prev is not None and link(prev, x.kind, x.values) != x.hash:
            return 0, Finding("edited", x.seq, f"edited: the archived {x.label()} at chain "
                              f"position {x.seq} does not match its hash")
    return len(archived), None
