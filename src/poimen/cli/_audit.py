"""``poimen audit ACTION``: the log's tamper-evident chain (docs/audit.md). Each failure is
one line; a chain or an export that does not hold exits 6, as `poimen verify` does."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from poimen._core.audit import parse_published
from poimen.operator import _audit
from poimen.operator import _ops as op
from poimen.operator._audit_export import (
    export,
    keygen,
    load_private,
    load_public,
    verify_export,
)
from poimen.store import Store

OK, NOT_FOUND, USAGE, VERIFY_FAILED = 0, 1, 2, 6
#: The actions that read no log.
OFFLINE = frozenset({"verify-export", "keygen"})


def _emit(ns: argparse.Namespace, data: Any, text: str, *, err: bool = False) -> None:
    if getattr(ns, "json", False):
        print(op.safe_json(data, indent=2))
    else:
        print(op.escape_lines(text), file=sys.stderr if err else sys.stdout)


def _parse_head(text: str | None) -> str | None:
    if text is None:
        return None
    try:
        parse_published(text)
    except ValueError as exc:
        raise op.OperatorInputError(str(exc), field="head") from None
    return text


def run(ns: argparse.Namespace, store: Store) -> int:
    """An action on the log at --db."""
    if ns.audit_cmd == "verify":
        try:
            archived = _audit.archive_links(ns.archive)
        except (OSError, ValueError) as exc:
            raise op.OperatorInputError(f"--archive: {exc}", field="archive") from None
        report = _audit.verify(store, published=_parse_head(ns.head), archived=archived)
        _emit(ns, report.to_json(), report.line(), err=not report.ok)
        return OK if report.ok else VERIFY_FAILED
    if ns.audit_cmd == "head":
        head = store.audit_head()
        if head is None:
            _emit(ns, {"head": None}, "this log has no audit chain (schema older than "
                  "version 10, or its head row is gone)", err=True)
            return NOT_FOUND
        data = {"log_id": head.log_id, "seq": head.seq, "hash": head.hash, "at": store.now()}
        _emit(ns, data, head.token())
        return OK
    return _export(ns, store)


def _export(ns: argparse.Namespace, store: Store) -> int:
    key = load_private(ns.sign)
    if ns.out is None:
        done = export(store, sys.stdout.buffer, key, now=store.now())
    else:
        try:
            fd = os.open(ns.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise op.OperatorInputError(
                f"--out {ns.out!r} cannot be made: {exc.strerror} (an export is never "
                "overwritten)", field="out",
            ) from None
        with os.fdopen(fd, "wb") as f:
            done = export(store, f, key, now=store.now())
        if not done.report.ok:
            os.unlink(ns.out)
    if not done.report.ok:
        print(op.escape_text(f"poimen: not exported: {done.report.line()}"), file=sys.stderr)
        return VERIFY_FAILED
    if ns.out is not None:
        _emit(ns, {"file": ns.out, "rows": done.rows, "key": done.key, **done.report.to_json()},
              f"exported {done.rows} rows up to position "
              f"{done.report.head.seq if done.report.head else 0} to {ns.out}, signed with "
              f"key {done.key}")
    return OK


def run_offline(ns: argparse.Namespace) -> int:
    """An action that reads no log: keygen, verify-export."""
    if ns.audit_cmd == "keygen":
        private, public = keygen(ns.out)
        _emit(ns, {"private_key": str(private), "public_key": str(public)},
              f"wrote {private} (keep it secret) and {public} (give it to auditors)")
        return OK
    report = verify_export(ns.file, load_public(ns.public_key))
    _emit(ns, report.to_json(), report.line() if not report.ok
          else f"the export is signed by this key and {report.line()}", err=not report.ok)
    return OK if report.ok else VERIFY_FAILED
