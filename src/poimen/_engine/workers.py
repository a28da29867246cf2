"""The kernels of this process: one identity (worker id) each, and a new identity, new
connections and new threads for each of them in a forked child."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable

from poimen.errors import DuplicateWorkerError

log = logging.getLogger("poimen")


class Live:
    """A live kernel as this module knows it, made by the kernel and held by it: whether it
    closed, and what it does in a forked child. Held here weakly: gone with its kernel."""

    __slots__ = ("__weakref__", "closed", "in_child")

    def __init__(self, in_child: Callable[[], None]) -> None:
        self.closed = False
        self.in_child = in_child


LIVE: weakref.WeakSet[Live] = weakref.WeakSet()
_WORKERS: dict[str, weakref.ref[Live]] = {}
_WORKERS_LOCK = threading.Lock()


def claim_worker_id(worker_id: str, k: Live) -> None:
    with _WORKERS_LOCK:
        ref = _WORKERS.get(worker_id)
        other = ref() if ref is not None else None
        if other is not None and other is not k and not other.closed:
            raise DuplicateWorkerError(
                f"worker id {worker_id!r} is taken by another live kernel of this process; "
                "two kernels with one identity would take over each other's calls",
                worker_id=worker_id,
            )
        _WORKERS[worker_id] = weakref.ref(k)


def release_worker_id(worker_id: str, k: Live) -> None:
    with _WORKERS_LOCK:
        ref = _WORKERS.get(worker_id)
        if ref is not None and ref() in (k, None):
            del _WORKERS[worker_id]


def forget_worker_id(worker_id: str) -> None:
    with _WORKERS_LOCK:
        _WORKERS.pop(worker_id, None)


def _after_fork_in_child() -> None:
    global _WORKERS_LOCK
    _WORKERS_LOCK = threading.Lock()  # another thread of the parent may have held it
    for k in list(LIVE):
        if k.closed:
            continue
        try:
            k.in_child()
        except Exception:
            log.exception("poimen: a kernel could not start again in a forked child")


os.register_at_fork(after_in_child=_after_fork_in_child)
