"""The kernels of this process: one identity (worker id) each, and a new identity, new
connections and new threads for each of them in a forked child."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Protocol

from poimen.errors import DuplicateWorkerError

log = logging.getLogger("poimen")


class Kernel(Protocol):
    """What this module needs of a kernel (`poimen.Kernel` is one)."""

    @property
    def _closed(self) -> bool: ...

    def _after_fork_in_child(self) -> None: ...


LIVE: weakref.WeakSet[Kernel] = weakref.WeakSet()
_WORKERS: dict[str, weakref.ref[Kernel]] = {}
_WORKERS_LOCK = threading.Lock()


def claim_worker_id(worker_id: str, k: Kernel) -> None:
    with _WORKERS_LOCK:
        ref = _WORKERS.get(worker_id)
        other = ref() if ref is not None else None
        if other is not None and other is not k and not other._closed:
            raise DuplicateWorkerError(
                f"worker id {worker_id!r} is taken by another live kernel of this process; "
                "two kernels with one identity would take over each other's calls",
                worker_id=worker_id,
            )
        _WORKERS[worker_id] = weakref.ref(k)


def release_worker_id(worker_id: str, k: Kernel) -> None:
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
        if k._closed:
            continue
        try:
            k._after_fork_in_child()
        except Exception:
            log.exception("poimen: a kernel could not start again in a forked child")


os.register_at_fork(after_in_child=_after_fork_in_child)
