"""The filesystem under a SQLite log, and refusing those whose locks and fsync cannot be trusted.

SQLite's WAL mode needs POSIX locks and a shared-memory file that every process maps; on a
network filesystem (NFS, SMB/CIFS, ...) or most FUSE filesystems locks may be advisory, lost
or emulated and fsync may return before the data is safe, so two processes can both commit
and a "durable" commit can vanish. The log must then live in PostgreSQL.

The mount is found in /proc/self/mountinfo on Linux (exact about stacked mounts), elsewhere
(macOS, Windows, the BSDs) in `psutil.disk_partitions`; a Windows network drive or UNC path is
refused by what Windows says of it (remote), whatever its filesystem.
"""

from __future__ import annotations

import ntpath
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import psutil

from poimen.errors import NetworkFilesystemError

MOUNTINFO = "/proc/self/mountinfo"
#: Set to 1 to open a SQLite log on a filesystem poimen would refuse.
ALLOW_ENV = "POIMEN_ALLOW_NETWORK_FS"

# Network filesystems, and local ones that share a directory with another machine or the host
# of a VM (9p: WSL2's drives, QEMU shares). Every FUSE filesystem ("fuse", "fuseblk",
# "fuse.sshfs", ...) is refused too: its locks and fsync are whatever its daemon does.
NETWORK_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb", "smb2", "smb3", "smbfs", "ncpfs", "afs", "coda", "9p",
    "ceph", "glusterfs", "lustre", "gpfs", "ocfs2", "gfs2", "beegfs", "davfs", "orangefs",
    "pvfs2", "vboxsf", "vmhgfs", "prl_fs",
    # macOS's names for its network and FUSE filesystems (as psutil reports them).
    "afpfs", "webdav", "osxfuse", "macfuse", "fusefs",
})  # fmt: skip


_OCTAL = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True, slots=True)
class Mount:
    """One mount: where it is mounted, its type, what is mounted, and whether the system
    itself calls it remote (a Windows network drive)."""

    point: str
    fstype: str
    source: str
    remote: bool = False


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as \ooo octal escapes.
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a mountinfo text, in its order; lines that do not parse are skipped."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)  # optional fields end at a lone "-"
            mounts.append(Mount(_unescape(fields[4]), fields[sep + 1], _unescape(fields[sep + 2])))
        except (ValueError, IndexError):
            continue
    return mounts


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount holding the absolute, resolved `path`: the longest mount point above it,
    the last one mounted there when several are stacked."""
    best: Mount | None = None
    for m in mounts:
        point = m.point.rstrip("/") or "/"
        inside = point == "/" or path == point or path.startswith(point + "/")
        if inside and (best is None or len(point) >= len(best.point.rstrip("/") or "/")):
            best = m
    return best


def is_network(fstype: str) -> bool:
    return (
        fstype in NETWORK_TYPES
        or fstype in ("fuse", "fuseblk")
        or fstype.startswith(("fuse.", "fusefs."))
    )


def mounts_of_partitions(parts: Iterable[Any], *, windows: bool = False) -> list[Mount]:
    """`psutil.disk_partitions(all=True)` as mounts (on Windows, paths with ``/``, folded)."""
    out = []
    for p in parts:
        point = _windows_path(p.mountpoint) if windows else p.mountpoint
        remote = "remote" in str(p.opts).split(",")
        out.append(Mount(point, str(p.fstype).lower(), p.device, remote))
    return out


def _windows_path(path: str) -> str:
    path = path.replace("\\", "/").casefold()
    return path[4:] if path.startswith("//?/") and not path.startswith("//?/unc/") else path


def _unc(path: str) -> Mount | None:
    """A Windows path on a share (``\\\\server\\share``): a network filesystem."""
    if path.startswith("//?/unc/"):
        path = "//" + path[len("//?/unc/") :]
    if not path.startswith("//") or path.startswith("//./"):
        return None
    share = "/".join(path.split("/")[:4])
    return Mount(share, "smb", share, remote=True)


def _log_dir(path: str, *, windows: bool = False) -> str:
    # Symlinks resolved as far as the folders exist: a log's folder made later is made on
    # the mount that holds its nearest existing parent, or one below it.
    paths: Any = ntpath if windows else os.path
    return str(paths.realpath(paths.dirname(paths.abspath(path))))


def filesystem_of(
    path: str,
    *,
    mountinfo: str = MOUNTINFO,
    partitions: Iterable[Any] | None = None,
    windows: bool = os.name == "nt",
) -> Mount | None:
    """The mount holding the directory of the file at `path`: from mountinfo where it can
    be read (Linux), else from `partitions` (default `psutil.disk_partitions(all=True)`);
    None when neither can be read."""
    if partitions is None:
        try:
            with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
                return mount_of(_log_dir(path), parse_mountinfo(f.read()))
        except OSError:
            pass
        try:
            partitions = psutil.disk_partitions(all=True)
        except Exception:  # psutil raises OSError, or its own errors on odd platforms
            return None
    where = _log_dir(path, windows=windows)
    if windows:
        where = _windows_path(where)
        share = _unc(where)
        if share is not None:
            return share
    return mount_of(where, mounts_of_partitions(partitions, windows=windows))


def refuse_network_fs(
    path: str,
    *,
    allow: bool = False,
    mountinfo: str = MOUNTINFO,
    partitions: Iterable[Any] | None = None,
    windows: bool = os.name == "nt",
) -> None:
    """Raise `NetworkFilesystemError` when the SQLite log at `path` would live on a network
    or FUSE filesystem, unless `allow` or ``POIMEN_ALLOW_NETWORK_FS=1`` says otherwise."""
    if allow or os.environ.get(ALLOW_ENV) == "1":
        return
    mount = filesystem_of(path, mountinfo=mountinfo, partitions=partitions, windows=windows)
    if mount is None or not (mount.remote or is_network(mount.fstype)):
        return
    raise NetworkFilesystemError(
        f"the SQLite intent log {path!r} would be on a {mount.fstype} filesystem "
        f"({mount.source} on {mount.point}), where SQLite's locks and fsync cannot be trusted: "
        "two processes could both commit and a commit could be lost. Keep the log on a local "
        "disk, or use PostgreSQL (postgresql://...) to share it between machines; "
        f"{ALLOW_ENV}=1 opens it anyway",
        path=path,
        fstype=mount.fstype,
        mount_point=mount.point,
    )


def sqlite_writes(name: str) -> bool:
    """Whether SQLite may create or change a file when it opens (or attaches) `name`.

    URIs are read as SQLite reads them: the scheme in any case, the URI ending at '#',
    parameters split on '&' and '=' before %-decoding, a decoded NUL ending a name or value,
    and the last `mode` winning. Only ``mode=ro`` and ``mode=memory`` (or an in-memory or
    temporary database) write nothing.
    """
    if name in ("", ":memory:"):
        return False
    if name[:5].lower() != "file:":
        return True
    path, _, query = name[5:].split("#", 1)[0].partition("?")
    mode = None
    for param in query.split("&"):
        key, _, value = param.partition("=")
        if _decoded(key) == "mode":
            mode = _decoded(value)
    if mode in ("ro", "memory"):
        return False
    if path.startswith("//"):  # file://host/path: only an empty or local host opens
        path = "/" + path[2:].partition("/")[2]
        if path == "/":
            return True
    return _decoded(path) not in ("", ":memory:")


def _decoded(part: str) -> str:
    return unquote(part, errors="surrogateescape").split("\x00", 1)[0]
