"""Whether an owner process lives: without /proc (as on macOS, the BSDs and Windows) a live
process must still be seen alive, and a pid from another container's pid namespace is never
read in this one's process table. Real child processes; real namespaces where this machine
lets us make them (root with unshare), otherwise skipped."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from poimen._engine.liveness import default_host, pid_namespace, process_alive, process_start

SRC = str(Path(__file__).resolve().parents[2] / "src")

# In a child: a live process, then the same pid once it has exited, judged by _liveness.
_JUDGE = """
import subprocess, sys
import psutil
from poimen._engine import liveness as _liveness
if len(sys.argv) > 2 and sys.argv[1] == "--psutil-proc":
    psutil.PROCFS_PATH = sys.argv[2]  # psutil's own view of processes, as on other systems
if len(sys.argv) > 2 and sys.argv[1] == "--poimen-proc":
    _liveness.PROC_ROOT = sys.argv[2]  # where poimen looks for procfs: nothing there
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
start = _liveness.process_start(child.pid)
me = _liveness.current_owner()
alive = _liveness.process_alive(child.pid, start or "")
other = _liveness.process_alive(child.pid, "not its start")
child.kill()
child.wait()
print(start is not None, bool(me.pid_start), alive, other, _liveness.process_alive(child.pid, start or ""))
"""


def _need_unshare(what: str) -> None:
    """Skip loudly without root and unshare; in CI (POIMEN_REQUIRE_MOUNTS=1) fail instead."""
    if os.geteuid() == 0 and shutil.which("unshare") is not None and sys.platform == "linux":
        return
    if os.environ.get("POIMEN_REQUIRE_MOUNTS") == "1":
        pytest.fail(f"POIMEN_REQUIRE_MOUNTS=1 but this test {what}")
    pytest.skip(what)


def _run(cmd: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_a_live_process_is_seen_alive_on_a_host_without_proc(tmp_path: Path) -> None:
    _need_unshare("needs root and unshare to hide /proc")
    # A mount namespace where /proc is an empty tmpfs: poimen finds no procfs, as on macOS.
    # psutil reads the real one, bound elsewhere, as it uses the system's own calls there.
    real = tmp_path / "realproc"
    real.mkdir()
    script = (
        f"mount --bind /proc {real} && mount -t tmpfs none /proc && "
        f'exec {sys.executable} -c "$0" --psutil-proc {real}'
    )
    got = _run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, _JUDGE])
    # Started, own start known, alive, a reused pid is not the owner, dead once exited.
    assert got == "True True True False False"


def test_a_live_process_is_seen_alive_through_psutil_when_procfs_is_elsewhere(
    tmp_path: Path,
) -> None:
    # Without root: poimen is pointed at an empty directory for procfs.
    got = _run([sys.executable, "-c", _JUDGE, "--poimen-proc", str(tmp_path)])
    assert got == "True True True False False"


def test_a_live_process_is_seen_alive_with_proc() -> None:
    assert _run([sys.executable, "-c", _JUDGE]) == "True True True False False"


def test_another_pid_namespace_is_another_host() -> None:
    _need_unshare("needs root and unshare for a new pid namespace")
    inside = _run(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-c",
            "from poimen._engine.liveness import default_host; print(default_host())",
        ]
    )
    here = default_host()
    assert inside != here
    assert inside.rsplit("/", 1)[0] == here.rsplit("/", 1)[0]  # same hostname and boot


def test_the_host_names_the_pid_namespace() -> None:
    assert default_host("4026531836") != default_host("4026532178")
    assert default_host("4026531836").endswith("/pidns4026531836")
    if sys.platform == "linux":
        assert pid_namespace() is not None
        assert default_host() == default_host(pid_namespace())


def test_no_such_process_is_dead() -> None:
    assert not process_alive(0, "")
    assert not process_alive(-1, "")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert process_start(gone.pid) is None
    assert not process_alive(gone.pid, "")
