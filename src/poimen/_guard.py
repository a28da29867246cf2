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
import sys
import threading
from collections.abc import Awaitable, Callable
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from poimen._capability import CallScope

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
    db = _text(args[0]) if args else ""
    if db in ("", ":memory:") or (
        db.startswith("file:") and ("mode=ro" in db or "mode=memory" in db)
    ):
        return None
    return "file_write", f"sqlite3 {db}"


_CHECKS: dict[str, Callable[[tuple[Any, ...]], tuple[str, str] | None]] = {
    "open": _open,
    "os.remove": _path_op("file_remove"),
    "os.rmdir": _path_op("file_remove"),
    "os.mkdir": _path_op("file_mkdir"),
    "os.truncate": _path_op("file_write"),
    "os.chmod": _path_op("file_chmod"),
    "os.chown": _path_op("file_chmod"),
    "os.utime": _path_op("file_write"),
    "os.link": _path_op("file_link"),
    "os.symlink": _path_op("file_link"),
    "os.rename": _rename,
    "shutil.rmtree": _path_op("file_remove"),
    "sqlite3.connect": _sqlite,
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
