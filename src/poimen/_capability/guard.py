"""Out-of-band writes: a PEP 578 audit hook scoped to the running Idempotent tool (docs/capability.md).

The hook is installed once per process and costs one context-variable read per audit event
when no guarded tool runs. The kernel sets the variable only around an Idempotent tool's body,
in that tool's own thread or task, so the kernel's writes, other threads and tasks, and
Queryable/Unsafe tools are never seen. Threads the tool starts itself begin with an empty
context and are not guarded (see docs/capability.md for every limit).
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import sys
import threading
from collections.abc import Awaitable, Callable
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, TypeVar

from poimen.errors import CapabilityDeniedError
from poimen.store._fs import sqlite_writes

if TYPE_CHECKING:
    from poimen._capability.context import CallScope

T = TypeVar("T")

# The scope of the Idempotent call running in this thread or task; None everywhere else.
_active: ContextVar[CallScope | None] = ContextVar("poimen_guard", default=None)

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_installed = False
_install_lock = threading.Lock()


def current() -> CallScope | None:
    return _active.get()


def suspend() -> Token[CallScope | None]:
    """Let a handle (or the kernel's own audit write) through; undo with `resume`."""
    return _active.set(None)


def resume(token: Token[CallScope | None]) -> None:
    _active.reset(token)


def run(scope: CallScope, fn: Callable[..., Any], ctx: Any, kwargs: dict[str, Any]) -> Any:
    """Run a sync tool body under `scope` in the current thread's context."""
    token = _active.set(scope)
    try:
        return fn(ctx, **kwargs)
    finally:
        _active.reset(token)


async def arun(scope: CallScope, aw: Awaitable[T]) -> T:
    """Await an async tool body under `scope`; only this task (and what it spawns) is guarded."""
    token = _active.set(scope)
    try:
        return await aw
    finally:
        _active.reset(token)


def install() -> None:
    """Add the audit hook once per process. Audit hooks cannot be removed, hence the scoping."""
    global _installed
    if _installed:
        return
    with _install_lock:
        if not _installed:
            sys.addaudithook(_hook)
            _installed = True


def _hook(event: str, args: tuple[Any, ...]) -> None:
    scope = _active.get()
    if scope is None:
        return
    check = _CHECKS.get(event)
    if check is None:
        return
    found = check(args)
    if found is not None:
        action, target = found
        scope.deny_out_of_band(action, target)


# Each check maps an event's arguments to (action, target), or None when it is not a write.


def _text(value: Any, limit: int = 500) -> str:
    if isinstance(value, bytes | os.PathLike):
        try:
            value = os.fsdecode(value)
        except (TypeError, ValueError):
            value = repr(value)
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_PYC = re.compile(r"[^/]+\.pyc(\.\d+)?")


def _bytecode_cache(path: Any) -> bool:
    # Importing a module inside a tool may write its .pyc; that is the interpreter, not the tool.
    try:
        p = os.fsdecode(path)
    except (TypeError, ValueError):
        return False
    head, name = os.path.split(p)
    # The interpreter writes NAME.pyc through a temporary NAME.pyc.<digits> it then renames.
    return (os.path.basename(head) == "__pycache__" and _PYC.fullmatch(name) is not None) or (
        name == "__pycache__"
    )


def _open(args: tuple[Any, ...]) -> tuple[str, str] | None:
    path, mode, flags = args[0], args[1], args[2]
    if isinstance(path, int):
        return None  # an already-open descriptor: the open that made it was checked
    writes = (isinstance(flags, int) and flags & _WRITE_FLAGS) or (
        isinstance(mode, str) and any(c in mode for c in "wax+")
    )
    if not writes or _bytecode_cache(path):
        return None
    return "file_write", _text(path)


def _path_op(action: str) -> Callable[[tuple[Any, ...]], tuple[str, str] | None]:
    def check(args: tuple[Any, ...]) -> tuple[str, str] | None:
        if args and _bytecode_cache(args[0]):
            return None
        return action, _text(args[0] if args else "")

    return check


def _rename(args: tuple[Any, ...]) -> tuple[str, str] | None:
    src, dst = args[0], args[1]
    if _bytecode_cache(dst):
        return None
    return "file_rename", f"{_text(src, 240)} -> {_text(dst, 240)}"


def _connect(args: tuple[Any, ...]) -> tuple[str, str] | None:
    # Callers clean up only on OSError; close the socket so a denial leaks no descriptor.
    close = getattr(args[0], "close", None)
    if close is not None:
        with contextlib.suppress(OSError):
            close()
    return "connect", _text(args[1])


def _send(args: tuple[Any, ...]) -> tuple[str, str] | None:
    address = args[1] if len(args) > 1 else None
    if address is None:
        return None  # a connected socket: its connect was checked
    return "send", _text(address)


def _spawn(index: int) -> Callable[[tuple[Any, ...]], tuple[str, str] | None]:
    def check(args: tuple[Any, ...]) -> tuple[str, str] | None:
        return "spawn", _text(args[index] if len(args) > index else "")

    return check


def _sqlite(args: tuple[Any, ...]) -> tuple[str, str] | None:
    name = _fsname(args[0]) if args else ""
    if not sqlite_writes(name):
        return None
    return "file_write", f"sqlite3 {_text(name)}"


def _fsname(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return os.fsdecode(value)
    except (TypeError, ValueError):
        return repr(value)


def _sqlite_handle(args: tuple[Any, ...]) -> tuple[str, str] | None:
    # ATTACH and VACUUM INTO open files from within SQL, unseen by audit events; SQLite's
    # authorizer sees both as an attach of the file. The connection is announced before its
    # __init__ has finished, when no authorizer can be set yet: a profile function sets it on
    # this thread's next event after __init__, which comes before any statement can run.
    if not args or sys.getprofile() is not None:  # a profiler runs: leave it alone
        return None
    _pending.conns = [*getattr(_pending, "conns", ()), args[0]]
    _pending.events = 0
    sys.setprofile(_set_authorizers)
    return None


_pending = threading.local()

# SQLite's authorizer codes (sqlite3.h), stable across versions.
_SQLITE_OK, _SQLITE_DENY, _SQLITE_ATTACH = 0, 1, 24


def _set_authorizers(frame: Any, event: str, arg: Any) -> None:
    waiting = []
    for conn in _pending.conns:
        try:
            conn.set_authorizer(_authorize)
        except sqlite3.ProgrammingError:  # its __init__ is still running
            waiting.append(conn)
        except Exception:  # not a connection we can guard
            pass
    _pending.events += 1
    # A connection whose __init__ failed never becomes usable: stop waiting for it.
    _pending.conns = waiting if _pending.events < 100 else []
    if not _pending.conns:
        sys.setprofile(None)


def _authorize(action: int, arg1: str | None, *_: object) -> int:
    if action != _SQLITE_ATTACH:
        return _SQLITE_OK
    scope = _active.get()
    # A parameter's value is not known when the statement is prepared: arg1 is None.
    if scope is None or (arg1 is not None and not sqlite_writes(arg1)):
        return _SQLITE_OK
    try:
        scope.deny_out_of_band("file_write", f"sqlite3 ATTACH {_text(arg1 or '<a parameter>')}")
    except CapabilityDeniedError as exc:
        # SQLite swallows what its authorizer raises; the kernel finds the denial here.
        scope.unseen = exc
    return _SQLITE_DENY


def _enable_load_extension(args: tuple[Any, ...]) -> tuple[str, str] | None:
    # A loaded extension is native code: its writes raise no audit event.
    if len(args) > 1 and not args[1]:
        return None  # switching loading off
    return "load_extension", "sqlite3 enable_load_extension(True)"


def _load_extension(args: tuple[Any, ...]) -> tuple[str, str] | None:
    return "load_extension", f"sqlite3 {_text(args[1]) if len(args) > 1 else ''}"


_CHECKS: dict[str, Callable[[tuple[Any, ...]], tuple[str, str] | None]] = {
    "open": _open,
    "os.remove": _path_op("file_remove"),
    "os.rmdir": _path_op("file_remove"),
    "os.mkdir": _path_op("file_mkdir"),
    "os.truncate": _path_op("file_write"),
    "os.chmod": _path_op("file_chmod"),
    "os.chown": _path_op("file_chmod"),
    "os.utime": _path_op("file_write"),
    "os.setxattr": _path_op("file_write"),
    "os.removexattr": _path_op("file_write"),
    "os.link": _path_op("file_link"),
    "os.symlink": _path_op("file_link"),
    "os.rename": _rename,
    "shutil.rmtree": _path_op("file_remove"),
    "sqlite3.connect": _sqlite,
    "sqlite3.connect/handle": _sqlite_handle,
    "sqlite3.enable_load_extension": _enable_load_extension,
    "sqlite3.load_extension": _load_extension,
    "socket.connect": _connect,
    "socket.sendto": _send,
    "socket.sendmsg": _send,
    "subprocess.Popen": _spawn(1),
    "os.system": _spawn(0),
    "os.exec": _spawn(1),
    "os.spawn": _spawn(2),
    "os.posix_spawn": _spawn(1),
    "os.fork": _spawn(0),
    "os.forkpty": _spawn(0),
    "os.startfile": _spawn(0),
    "pty.spawn": _spawn(0),
}
