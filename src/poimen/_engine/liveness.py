"""Who owns an in-flight intent, and whether that process is still alive on this host.

A host is the hostname, its boot and, on Linux, the pid namespace: a pid means something only
to processes that share all three (containers share a hostname and a boot, never a pid
namespace). A process is its pid plus its start time, so a reused pid is not mistaken for the
owner. Linux answers from /proc, the cheapest source; elsewhere (macOS, the BSDs, Windows, or
a Linux without /proc mounted) psutil does.
"""

from __future__ import annotations

import functools
import os
import socket
import uuid

import psutil

from poimen._core.intents import Owner

# Where procfs is mounted; tests point it elsewhere to stand for a host without one.
PROC_ROOT = "/proc"


@functools.cache
def _has_proc(root: str) -> bool:
    return os.path.exists(f"{root}/self/stat")


def _proc() -> str | None:
    root = PROC_ROOT
    return root if _has_proc(root) else None


@functools.cache
def boot_id() -> str:
    try:
        with open(f"{PROC_ROOT}/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        pass
    try:  # a boot is its start time where there is no boot id
        return f"boot{int(psutil.boot_time())}"
    except (psutil.Error, OSError):
        return "noboot"


@functools.cache
def pid_namespace() -> str | None:
    """This process's pid namespace (``4026531836``), on Linux; None elsewhere."""
    try:
        link = os.readlink(f"{PROC_ROOT}/self/ns/pid")  # pid:[4026531836]
    except OSError:
        return None
    return link.removeprefix("pid:[").removesuffix("]")


def default_host(namespace: str | None = None) -> str:
    # The boot id makes a rebooted machine a new host: pids from before mean nothing. The pid
    # namespace keeps another container's pids from being read in this one's process table.
    ns = namespace if namespace is not None else pid_namespace()
    host = f"{socket.gethostname()}/{boot_id()[:8]}"
    return f"{host}/pidns{ns}" if ns else host


class _Unknown:
    """A process that exists but whose start time we may not read."""


_UNKNOWN = _Unknown()


def _start(pid: int) -> str | _Unknown | None:
    root = _proc()
    if root is None:
        return _psutil_start(pid)
    try:
        with open(f"{root}/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    state = fields[0] if fields else "?"
    if state in ("Z", "X"):
        return None
    return fields[19] if len(fields) > 19 else None


def _psutil_start(pid: int) -> str | _Unknown | None:
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return f"{p.create_time():.6f}"
    except psutil.ZombieProcess:  # it has exited
        return None
    except psutil.NoSuchProcess:  # or psutil cannot see it (a Linux without /proc): ask
        return _exists(pid)
    except psutil.AccessDenied:  # another user's process: it exists
        return _UNKNOWN
    except (psutil.Error, OSError):  # psutil cannot see either (a Linux without /proc)
        return _exists(pid)


def _exists(pid: int) -> _Unknown | None:
    # Signal 0 only asks. Without a start time a reused pid looks alive: the intent then
    # waits for its owner's lease to expire instead of being taken over at once.
    if pid <= 0:
        return None
    if os.name != "posix":  # there os.kill would end the process
        return _UNKNOWN
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # another user's process: it exists
        return _UNKNOWN
    return _UNKNOWN


def process_start(pid: int) -> str | None:
    """The process's start time (clock ticks since boot from /proc, or seconds since the
    epoch from psutil), or None if there is no such live process or it cannot be read."""
    found = _start(pid)
    return found if isinstance(found, str) else None


def process_alive(pid: int, start: str) -> bool:
    if pid <= 0:
        return False
    found = _start(pid)
    if found is None:
        return False
    if isinstance(found, _Unknown):  # cannot tell a reused pid: assume the owner lives on
        return True
    return found == start if start else True


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
