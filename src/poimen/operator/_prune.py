"""Retention: `poimen prune` removes settled intents and their history past a window, in
small batches, archiving first when asked (docs/retention.md).

What is never removed: an unfinished intent (DISPATCHED, AWAITING_APPROVAL), an unresolved
INDETERMINATE one, one with an undelivered notification, one younger than the window, and one
younger than its tool's provider key window (`Idempotent(key_ttl=...)`, known when the
application is given). The window is at least `MIN_AGE`: that long, a call id is promised to
answer with its recorded outcome. The store adds two rules (docs/design.md sections 7 and 9):
an undo intent stays while its original does, and an intent whose history changed after it
was read (and archived) is not deleted by this run.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from poimen._core.audit import COLUMNS
from poimen._core.intents import Owner
from poimen.operator._ops import OperatorInputError
from poimen.store._base import RetentionStore
from poimen.store._retention import History

#: Seven days: a call id re-used within them answers with the recorded outcome. After a
#: prune, a re-used call id is a new call.
MIN_AGE = 7 * 86400.0
#: The most intents per batch: a batch is one statement's parameters, and PostgreSQL takes at
#: most 65,535 of them (SQLite's default limit is 32,766).
MAX_BATCH = 10_000


@dataclass(slots=True)
class PruneReport:
    scanned: int = 0
    pruned: int = 0
    kept_for_key_window: int = 0
    denials: int = 0
    archive: str | None = None


def prune(
    store: RetentionStore,
    *,
    older_than: float,
    archive: str | os.PathLike[str] | None = None,
    key_ttls: Mapping[str, float] | None = None,
    batch: int = 500,
    progress: Callable[[int], object] | None = None,
    allow_short: bool = False,
) -> PruneReport:
    """Remove settled intents last changed more than `older_than` seconds ago, `batch` at a
    time (each batch one short transaction). With `archive`, each batch's whole history is
    appended to that JSON Lines file and synced to disk before the batch is deleted."""
    if not (older_than > 0):
        raise OperatorInputError("older_than must be a positive duration", field="older_than")
    if older_than < MIN_AGE and not allow_short:
        raise OperatorInputError(
            f"a window under {MIN_AGE / 86400:g} days would let a re-used call id run again "
            "instead of answering with its outcome; pass the short-window flag to do it anyway",
            field="older_than",
        )
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH:
        raise OperatorInputError(
            f"batch must be a whole number from 1 to {MAX_BATCH}", field="batch"
        )
    ttls = dict(key_ttls or {})
    now = store.now()
    before = now - older_than
    report = PruneReport(archive=None if archive is None else str(archive))
    out: IO[str] | None = None
    try:
        if archive is not None:
            out = _open_archive(archive)
        after = ""
        while True:
            found = store.prune_candidates(after_id=after, before=before, limit=batch)
            if not found:
                break
            after = found[-1].id
            report.scanned += len(found)
            go = [i for i in found if i.updated_at < now - max(older_than, ttls.get(i.tool_id, 0))]
            report.kept_for_key_window += len(found) - len(go)
            # The store deletes an intent only if its history is still this one.
            histories = store.histories(go)
            if out is not None and histories:
                for h in histories:
                    out.write(json.dumps(history_json(h), sort_keys=True) + "\n")
                out.flush()
                os.fsync(out.fileno())  # archived for good before anything is deleted
            report.pruned += len(store.prune(histories, before=before))
            if progress is not None:
                progress(report.scanned)
        while n := store.prune_denials(before=before, limit=batch):
            report.denials += n
    finally:
        if out is not None:
            out.close()
    return report


def _open_archive(path: str | os.PathLike[str]) -> IO[str]:
    """The archive, for appending; made owner-only (0600), like the operators file: it holds
    the raw arguments. A folder that is missing or not writable is the operator's mistake."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    except OSError as exc:
        raise OperatorInputError(
            f"archive {os.fspath(path)!r} cannot be opened for appending: {exc.strerror}; "
            "nothing was pruned",
            field="archive",
        ) from None
    return os.fdopen(fd, "a", encoding="utf-8")


def history_json(h: History) -> dict[str, Any]:
    """One archive line: the intent and everything the log held of it."""
    return {
        "intent": _plain(h.intent),
        "attempts": [_plain(a) for a in h.attempts],
        "events": [_plain(e) for e in h.events],
        "notifications": [_plain(n) for n in h.notifications],
        "denials": [_plain(d) for d in h.denials],
        # Its rows' links of the audit chain: the archive carries the segment it removed.
        "chain": [
            {"kind": x.kind, "seq": x.seq, "hash": x.hash,
             "row": dict(zip((c for c, _ in COLUMNS[x.kind]), x.values, strict=True))}
            for x in h.links
        ],
    }


def _plain(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, Owner):
            v = dataclasses.asdict(v)
        elif hasattr(v, "value"):  # enums: their stored value
            v = v.value
        out[f.name] = v
    return out


def read_archive(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The archive's lines (a batch archived twice, after a crash, appears twice)."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]
