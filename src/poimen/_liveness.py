"""Who owns an in-flight intent, and whether that process is still alive on this host."""

from __future__ import annotations

import functools
import os
import socket
import uuid

from poimen._intents import Owner


@functools.cache
def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "noboot"


def default_host() -> str:
    # The boot id makes a rebooted machine a new host: pids from before mean nothing.
    return f"{socket.gethostname()}/{boot_id()[:8]}"


# Without /proc (macOS, the BSDs) a start time cannot be read: see `_exists`.
_PROC = os.path.exists("/proc/self/stat")


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, or None if there is no such pid;
    "" when the process exists but its start time cannot be known (no /proc)."""
    if not _PROC:
        return _exists(pid)
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    state = fields[0] if fields else "?"
    if state in ("Z", "X"):
        return None
    return fields[19] if len(fields) > 19 else None


def _exists(pid: int) -> str | None:
    # Signal 0 only asks. Without a start time a reused pid looks alive: the intent then
    # waits for its owner's lease to expire instead of being taken over at once.
    if pid <= 0:
        return None
    if os.name != "posix":  # there os.kill would end the process
        return ""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # another user's process: it exists
        return ""
    return ""


def process_alive(pid: int, start: str) -> bool:
    if pid <= 0:
        return False
    found = process_start(pid)
    if found is None:
        return False
    return found == start if start and found else True


def current_owner(worker_id: str | None = None, host: str | None = None) -> Owner:
    pid = os.getpid()
    return Owner(
        worker_id=worker_id or f"w-{uuid.uuid4().hex[:12]}",
        host=host or default_host(),
        pid=pid,
        pid_start=process_start(pid) or "",
    )


def owner_alive(o: Owner) -> bool:
    """Whether an owner's process (on this host) still runs."""
    return process_alive(o.pid, o.pid_start)
