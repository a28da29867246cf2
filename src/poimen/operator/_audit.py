"""`poimen audit verify` (and `poimen verify`'s chain check) over a store: the chain read in
one snapshot (`poimen.store._chain`) and walked by the rules of `poimen._core.audit`; prune
archives read for their links (docs/audit.md)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from poimen._core.audit import (
    COLUMNS,
    Finding,
    Link,
    Report,
    check_archived,
    parse_published,
    pruned_ranges,
    unchained_finding,
    walk,
)
from poimen.store._chain import CHAIN_VERSION


def verify(
    store: Any, *, published: str | None = None, archived: Sequence[Link] = ()
) -> Report:
    """Walk the log's chain (`walk`) in one snapshot; `published` (``SEQ:HASH`` or ``HASH``):
    a head published earlier, which must be a link of it; `archived`: the rows of prune
    archives (`archive_links`), which must be the links the chain removed."""
    want = None if published is None else parse_published(published)
    if store.schema_version() < CHAIN_VERSION:
        return Report(None, 0, 0, None, note="the log's schema is older than version 10 "
                      "(`poimen migrate` adds the chain)")
    with store.audit_chain() as view:
        return check_view(view, want, archived)


def check_view(
    view: Any, want: tuple[int | None, str] | None = None, archived: Sequence[Link] = ()
) -> Report:
    """`verify` over a store's `ChainView` (`poimen.store._chain`)."""
    head = view.head
    if head is None:
        return Report(None, 0, 0, Finding(
            "deleted", None, "deleted: the chain's head row (audit_head) is gone"
        ))
    ranges = pruned_ranges(view.kind("pruned"))
    w = walk(view.links(), head, ranges, again=view.links, published=want)
    finding = w.finding
    if finding is None:
        stray = next(iter(view.unlinked()), None)
        if stray is not None:
            finding = unchained_finding(stray)
    checked = 0
    if finding is None and archived:
        checked, finding = check_archived(archived, ranges, view.links())
    return Report(head, w.rows, w.pruned, finding, w.published, archived=checked)


def archive_links(paths: Sequence[Any]) -> list[Link]:
    """The links a prune archive carries (its lines' ``chain``), in position order."""
    out: dict[tuple[int, str], Link] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                try:
                    for c in json.loads(line).get("chain", ()):
                        kind = c["kind"]
                        values = tuple(c["row"].get(name) for name, _ in COLUMNS[kind])
                        x = Link(int(c["seq"]), str(c["hash"]), kind, values)
                        out[(x.seq, x.hash)] = x  # a batch archived twice is the same
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    raise ValueError(f"{path}: line {n} is not an archive line ({exc})") from None
    return sorted(out.values(), key=lambda x: x.seq)


