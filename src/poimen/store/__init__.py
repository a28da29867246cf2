"""Stores of the intent log, selected by URL: ``sqlite:///path`` or ``postgresql://...``."""

from __future__ import annotations

from typing import Any

from poimen._core.present import redact_store_url
from poimen.errors import StoreError
from poimen.store._base import NewDispatch, NewNotification, Store
from poimen.store._dialect import POSTGRES, sqlite_path
from poimen.store.sqlite import SqliteStore

__all__ = ["NewDispatch", "NewNotification", "SqliteStore", "Store", "open_store"]


def open_store(url: str, **options: Any) -> Store:
    """Open (and migrate) the store a URL names; ``readonly=True`` opens it for reading
    only, without migrating it."""
    path = sqlite_path(url) if isinstance(url, str) else None
    if path is not None:
        return SqliteStore(path, **options)
    if isinstance(url, str) and POSTGRES.opens(url):
        try:
            from poimen.store.postgres import PostgresStore  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            raise StoreError("PostgreSQL needs the extra: pip install 'poimen[postgres]'") from exc
        store: Store = PostgresStore(url, **options)
        return store
    shown = redact_store_url(url) if isinstance(url, str) else type(url).__name__
    raise StoreError(  # a mistyped URL still holds the real password: never shown
        f"unsupported store URL {shown!r}: use sqlite:///path or postgresql://...", url=shown
    )
