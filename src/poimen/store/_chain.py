"""The audit chain as the store reads it (schema version 10, docs/audit.md): its head, and its
links in position order, read in one snapshot and streamed, so a check of a large log holds
one row per table in memory, not the log. The links themselves are made by the database's
triggers (migration 0009); the rules that check them are `poimen._core.audit`'s.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from poimen._core.audit import COLUMNS, SETTLED, TABLES, Head, Link

#: The first schema version with the chain.
CHAIN_VERSION = 10
#: A query inside a streaming snapshot: its rows, fetched as they are read.
Stream = Callable[[str, tuple[Any, ...]], Iterator[Any]]
_SETTLED = "(" + ", ".join(f"'{s}'" for s in SETTLED) + ")"


def _columns(kind: str) -> str:
    return ", ".join(name for name, _ in COLUMNS[kind])


def _where(kind: str, linked: bool) -> str:
    cond = "chain_seq IS NOT NULL" if linked else "chain_seq IS NULL"
    return f"{cond} AND state IN {_SETTLED}" if kind == "intent" else cond


@dataclass(slots=True)
class ChainView:
    """The chain in one snapshot of the log."""

    head: Head | None
    _q: Stream

    def links(self) -> Iterator[Link]:
        """Every linked row, in position order (rows sharing a position side by side)."""
        streams = [self._kind(kind, linked=True) for kind in COLUMNS]
        return heapq.merge(*streams, key=lambda x: x.seq)

    def kind(self, kind: str) -> Iterator[Link]:
        """The linked rows of one kind, in position order."""
        return self._kind(kind, linked=True)

    def unlinked(self) -> Iterator[Link]:
        """The rows that should carry a link and do not (position 0, no hash)."""
        for kind in COLUMNS:
            yield from self._kind(kind, linked=False)

    def _kind(self, kind: str, *, linked: bool) -> Iterator[Link]:
        order = "chain_seq" if linked else "1"
        sql = (
            f"SELECT chain_seq, chain_hash, {_columns(kind)} FROM {TABLES[kind]} "
            f"WHERE {_where(kind, linked)} ORDER BY {order}"
        )
        for r in self._q(sql, ()):
            yield Link(int(r[0] or 0), str(r[1] or ""), kind, tuple(r[2:]))


class Chain:
    """Mixed into the SQL stores; `_streaming` and `schema_version` come from the backend."""

    dialect: ClassVar[str]

    def schema_version(self) -> int:
        raise NotImplementedError

    def _streaming(self) -> contextlib.AbstractContextManager[Stream]:
        raise NotImplementedError

    def _read(self, sql: str, params: Any = ()) -> list[Any]:
        raise NotImplementedError

    def audit_head(self) -> Head | None:
        """The chain's last link; None for a log without a chain (before version 10, or its
        head row gone)."""
        if self.schema_version() < CHAIN_VERSION:
            return None
        rows = self._read("SELECT log_id, seq, hash FROM audit_head WHERE id = 1")
        return Head(str(rows[0][0]), int(rows[0][1]), str(rows[0][2])) if rows else None

    @contextlib.contextmanager
    def audit_chain(self) -> Iterator[ChainView]:
        """The chain as of one snapshot: its head and its rows, read while the block runs."""
        with self._streaming() as q:
            rows = list(q("SELECT log_id, seq, hash FROM audit_head WHERE id = 1", ()))
            head = Head(str(rows[0][0]), int(rows[0][1]), str(rows[0][2])) if rows else None
            yield ChainView(head, q)
