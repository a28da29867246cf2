"""Crash points for crash tests, set by environment variable in a child process.

``POIMEN_CRASH_AT=point[,point]`` SIGKILLs the process when it reaches a point;
``POIMEN_PAUSE_AT=point`` writes ``POIMEN_PAUSE_FILE`` and waits there for the parent's SIGKILL.
Points: ``before_dispatch_commit``, ``after_dispatch_commit``, ``mid_call`` (inside a test tool,
before its effect), ``after_effect`` (the tool returned, its outcome not yet committed),
``before_tx_commit`` (a Transactional tool returned and its marker, or on the log's own
database its outcome, is written in its transaction, which is not yet committed),
``before_notify`` (an INDETERMINATE state and its outbox row committed, not yet delivered),
``undo_landed`` (`Kernel.undo`: an undo's outcome committed, its "undone" event not yet
recorded), ``between_undos`` (an undo and its event recorded, the next undo not started),
``after_approval`` (an integration applied an approver's decision, the call not yet run).

``POIMEN_CRASH_CALL=call id`` narrows both to the points the kernel hits for that call
(``before_dispatch_commit``, ``after_dispatch_commit``, ``after_effect``,
``before_tx_commit``): `poimen crashtest`
stops one call of a run that makes many, whatever order they run in.
"""

from __future__ import annotations

import os
import signal
import threading
import time

POINTS = (
    "before_dispatch_commit",
    "after_dispatch_commit",
    "mid_call",
    "after_effect",
    "before_tx_commit",
    "before_notify",
    "undo_landed",
    "between_undos",
    "after_approval",
)

_CRASH = frozenset(p for p in os.environ.get("POIMEN_CRASH_AT", "").split(",") if p)
_PAUSE = frozenset(p for p in os.environ.get("POIMEN_PAUSE_AT", "").split(",") if p)
_CALL = os.environ.get("POIMEN_CRASH_CALL") or None
ACTIVE = bool(_CRASH or _PAUSE)


def hit(point: str, call_id: str | None = None) -> None:
    if not ACTIVE:
        return
    if _CALL is not None and call_id != _CALL:
        return
    if point in _CRASH:
        os.kill(os.getpid(), signal.SIGKILL)
    if point in _PAUSE:
        marker = os.environ.get("POIMEN_PAUSE_FILE")
        if marker:
            from poimen._capability import guard as _guard

            _guard.suspend()  # the marker is the harness's write, not the tool's; we die here
            tmp = f"{marker}.{os.getpid()}.{threading.get_ident()}.tmp"  # threads may pause at once
            with open(tmp, "w", encoding="ascii") as f:
                f.write(f"{os.getpid()} {point}\n")
            os.replace(tmp, marker)
        while True:  # the parent kills us here
            time.sleep(3600)
