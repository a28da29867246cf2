"""A SQLite log on a network or FUSE filesystem is refused, with PostgreSQL named as the way
out; a local one (a real tmpfs mount) is accepted. The FUSE mount is real (bindfs); NFS, SMB
and sshfs are read from a recorded /proc/self/mountinfo."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import namedtuple
from collections.abc import Iterator
from pathlib import Path

import pytest

from poimen import Completed, Kernel
from poimen.errors import NetworkFilesystemError, StoreError
from poimen.store import SqliteStore
from poimen.store._fs import filesystem_of, mount_of, parse_mountinfo, refuse_network_fs
from poimen.testing import EMAIL, ProviderClient, ProviderProcess, register_test_tools
from tests.integration.operator_app import poimen

# In CI (root, bindfs installed by .ci/run) the real mounts must work: a failure, not a skip.
REQUIRE_MOUNTS = os.environ.get("POIMEN_REQUIRE_MOUNTS") == "1"

RECORDED = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684096k
60 27 0:52 / /mnt/nfs rw,relatime shared:40 - nfs4 files.example:/export rw,vers=4.2
61 27 0:53 / /mnt/smb\\040share rw,relatime - cifs //nas.example/share rw,vers=3.1.1
62 27 0:54 / /home/ana/remote rw,nosuid,nodev - fuse.sshfs ana@box.example:/srv rw,user_id=0
63 60 254:0 /var/local /mnt/nfs/local rw,relatime - ext4 /dev/vda rw
64 27 0:55 / /srv/logs rw,relatime - ext4 /dev/vdb rw
65 27 0:56 / /srv/logs rw,relatime - nfs srv.example:/logs rw,vers=3
not a mountinfo line
"""


@pytest.fixture
def mountinfo(tmp_path: Path) -> str:
    path = tmp_path / "mountinfo"
    path.write_text(RECORDED, encoding="utf-8")
    return str(path)


def test_the_mount_holding_a_path_is_found_in_mountinfo() -> None:
    mounts = parse_mountinfo(RECORDED)
    assert len(mounts) == 9  # the line that does not parse is skipped

    def fstype(path: str) -> str:
        m = mount_of(path, mounts)
        assert m is not None
        return m.fstype

    assert fstype("/var/lib/agent") == "ext4"
    assert fstype("/mnt/nfs") == "nfs4"
    assert fstype("/mnt/nfs/deep/dir") == "nfs4"
    assert fstype("/mnt/nfsx") == "ext4"  # a prefix of the name is not a parent
    assert fstype("/mnt/nfs/local/db") == "ext4"  # a local mount under the NFS one
    assert fstype("/mnt/smb share/logs") == "cifs"  # \040 in mountinfo is a space
    assert fstype("/home/ana/remote/x") == "fuse.sshfs"
    assert fstype("/srv/logs") == "nfs"  # stacked on one point: the last mount wins


@pytest.mark.parametrize(
    ("path", "fstype"),
    [
        ("/mnt/nfs/agent/intents.db", "nfs4"),
        ("/mnt/smb share/intents.db", "cifs"),
        ("/home/ana/remote/intents.db", "fuse.sshfs"),
        ("/mnt/nfs/not/made/yet/intents.db", "nfs4"),  # its folder does not exist yet
    ],
)
def test_a_log_on_a_network_filesystem_is_refused(
    mountinfo: str, path: str, fstype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POIMEN_ALLOW_NETWORK_FS", raising=False)
    with pytest.raises(NetworkFilesystemError) as e:
        refuse_network_fs(path, mountinfo=mountinfo)
    assert e.value.fstype == fstype and e.value.path == path
    assert "PostgreSQL" in str(e.value) and "POIMEN_ALLOW_NETWORK_FS=1" in str(e.value)
    assert isinstance(e.value, StoreError)
    refuse_network_fs(path, allow=True, mountinfo=mountinfo)  # the escape hatch
    monkeypatch.setenv("POIMEN_ALLOW_NETWORK_FS", "1")
    refuse_network_fs(path, mountinfo=mountinfo)


def test_local_logs_and_unreadable_mountinfo_are_accepted(mountinfo: str, tmp_path: Path) -> None:
    refuse_network_fs("/var/lib/agent/intents.db", mountinfo=mountinfo)
    refuse_network_fs("/mnt/nfs/local/intents.db", mountinfo=mountinfo)
    refuse_network_fs("/dev/shm/intents.db", mountinfo=mountinfo)
    # No mountinfo and no partitions known: nothing can be known, nothing is refused.
    assert filesystem_of("/mnt/nfs/x.db", mountinfo=mountinfo, partitions=[]) is None
    refuse_network_fs("/mnt/nfs/x.db", mountinfo=str(tmp_path / "absent"), partitions=[])


# Elsewhere than Linux: psutil's partitions, as psutil reports them on each system.

Part = namedtuple("Part", "device mountpoint fstype opts")  # psutil's sdiskpart fields

MACOS = [
    Part("/dev/disk3s1s1", "/", "apfs", "ro,local,rootfs,dovolfs,journaled,multilabel"),
    Part("/dev/disk3s5", "/System/Volumes/Data", "apfs", "rw,local,dovolfs,journaled"),
    Part("files.example:/export", "/Volumes/nfs", "nfs", "rw,nodev,nosuid"),
    Part("//ana@nas.example/share", "/Volumes/share", "smbfs", "rw,nodev,nosuid"),
    Part("afp_0TQ@nas.example", "/Volumes/afp", "afpfs", "rw,nodev,nosuid"),
    Part("ana@box.example:/srv", "/Volumes/sshfs", "macfuse", "rw,nodev,nosuid,synchronous"),
]
WINDOWS = [
    Part("C:\\", "C:\\", "NTFS", "rw,fixed"),
    Part("D:\\", "D:\\", "", "cdrom"),
    Part("Z:\\", "Z:\\", "NTFS", "rw,remote"),
]


@pytest.mark.parametrize(
    ("path", "fstype"),
    [
        ("/Volumes/nfs/agent/intents.db", "nfs"),
        ("/Volumes/share/intents.db", "smbfs"),
        ("/Volumes/afp/intents.db", "afpfs"),
        ("/Volumes/sshfs/intents.db", "macfuse"),
    ],
)
def test_macos_network_and_fuse_volumes_are_refused(
    tmp_path: Path, path: str, fstype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POIMEN_ALLOW_NETWORK_FS", raising=False)
    absent = str(tmp_path / "absent")
    with pytest.raises(NetworkFilesystemError) as e:
        refuse_network_fs(path, mountinfo=absent, partitions=MACOS, windows=False)
    assert e.value.fstype == fstype
    refuse_network_fs("/Users/ana/agent/intents.db", mountinfo=absent, partitions=MACOS)
    refuse_network_fs(
        "/System/Volumes/Data/agent/intents.db", mountinfo=absent, partitions=MACOS
    )


@pytest.mark.parametrize(
    "path", ["Z:\\logs\\intents.db", "z:\\intents.db", "\\\\nas\\share\\logs\\intents.db"]
)
def test_windows_network_drives_and_shares_are_refused(
    tmp_path: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POIMEN_ALLOW_NETWORK_FS", raising=False)
    absent = str(tmp_path / "absent")
    with pytest.raises(NetworkFilesystemError) as e:
        refuse_network_fs(path, mountinfo=absent, partitions=WINDOWS, windows=True)
    assert "PostgreSQL" in str(e.value)
    for local in ("C:\\agent\\intents.db", "c:\\Users\\ana\\intents.db"):
        refuse_network_fs(local, mountinfo=absent, partitions=WINDOWS, windows=True)
        m = filesystem_of(local, mountinfo=absent, partitions=WINDOWS, windows=True)
        assert m is not None and m.fstype == "ntfs" and not m.remote


def test_without_mountinfo_this_machines_partitions_name_the_same_mount(tmp_path: Path) -> None:
    # What macOS and Windows use, read on this machine: psutil agrees with mountinfo.
    by_psutil = filesystem_of(str(tmp_path / "intents.db"), mountinfo=str(tmp_path / "absent"))
    by_mountinfo = filesystem_of(str(tmp_path / "intents.db"))
    assert by_psutil is not None and by_mountinfo is not None
    assert (by_psutil.point, by_psutil.fstype) == (by_mountinfo.point, by_mountinfo.fstype)


def test_this_machines_own_mountinfo_names_the_mount_of_a_log(tmp_path: Path) -> None:
    m = filesystem_of(str(tmp_path / "intents.db"))
    assert m is not None  # Linux: /proc/self/mountinfo is there
    # GNU stat finds the mount point its own way.
    point = subprocess.run(
        ["stat", "-c", "%m", str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert m.point == point


# Real mounts.


def _cannot(what: str) -> None:
    if REQUIRE_MOUNTS:
        pytest.fail(f"POIMEN_REQUIRE_MOUNTS=1 but {what}")
    pytest.skip(what)


def _mounted(point: Path) -> bool:
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return any(m.point == str(point) for m in parse_mountinfo(f.read()))


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    point = tmp_path / "tmpfs"
    point.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(point)], capture_output=True, text=True)
    if r.returncode != 0:
        _cannot(f"cannot mount a tmpfs (root needed): {r.stderr.strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.fixture
def fuse(tmp_path: Path) -> Iterator[Path]:
    """A real FUSE mount (bindfs of a local folder): a FUSE filesystem to SQLite."""
    if shutil.which("bindfs") is None:
        _cannot("bindfs is not installed (apt-get install bindfs)")
    source, point = tmp_path / "fuse-source", tmp_path / "fuse"
    source.mkdir()
    point.mkdir()
    r = subprocess.run(["bindfs", str(source), str(point)], capture_output=True, text=True)
    if r.returncode != 0 or not _mounted(point):
        _cannot(f"cannot mount FUSE here: {r.stderr.strip()}")
    try:
        yield point
    finally:
        for umount in (["fusermount", "-u"], ["fusermount3", "-u"], ["umount", "-l"]):
            if shutil.which(umount[0]) and subprocess.run([*umount, str(point)]).returncode == 0:
                break


def test_a_log_on_a_real_tmpfs_is_accepted(
    tmpfs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POIMEN_ALLOW_NETWORK_FS", raising=False)
    m = filesystem_of(str(tmpfs / "intents.db"))
    assert m is not None and m.fstype == "tmpfs" and m.point == str(tmpfs)
    with ProviderProcess(tmp_path / "ledger.db") as provider, ProviderClient(provider.url) as led:
        kernel = Kernel(f"sqlite:///{tmpfs / 'intents.db'}")
        register_test_tools(kernel, provider.url)
        try:
            out = kernel.call(EMAIL, {"to": "t@example.com", "subject": "hi"}, call_id="tmpfs-1")
            assert isinstance(out, Completed)
        finally:
            kernel.close()
        assert led.count(kind="plain") == 1


def test_a_log_on_a_real_fuse_mount_is_refused_unless_allowed(
    fuse: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POIMEN_ALLOW_NETWORK_FS", raising=False)
    db = fuse / "intents.db"
    m = filesystem_of(str(db))
    assert m is not None and m.fstype.startswith("fuse") and m.point == str(fuse)
    by_psutil = filesystem_of(str(db), mountinfo=str(fuse.parent / "absent"))
    assert by_psutil is not None and by_psutil.fstype.startswith("fuse")
    assert by_psutil.point == str(fuse)
    with pytest.raises(NetworkFilesystemError) as e:
        Kernel(f"sqlite:///{db}")
    assert "PostgreSQL" in str(e.value)
    with pytest.raises(NetworkFilesystemError):
        SqliteStore(db, readonly=True)
    assert not db.exists()  # refused before SQLite made a file

    # The CLI says the same in one line, exit 3 (the store cannot be opened).
    r = poimen("migrate", "--json", db=f"sqlite:///{db}")
    assert r.returncode == 3, r.stderr
    assert "PostgreSQL" in r.stderr and "POIMEN_ALLOW_NETWORK_FS=1" in r.stderr
    assert json.loads(r.stdout)["error"]["type"] == "NetworkFilesystemError"
    assert not db.exists()

    # The escape hatch, for those who know their filesystem: the argument or the variable.
    SqliteStore(db, allow_network_fs=True).close()
    assert db.exists()
    r = poimen("status", db=f"sqlite:///{db}", POIMEN_ALLOW_NETWORK_FS="1")
    assert r.returncode == 0, r.stderr
