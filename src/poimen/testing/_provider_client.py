"""The witness provider's process and client: `ProviderProcess` runs `poimen.testing._provider`
as a process of its own, `ProviderClient` speaks its HTTP API (the ledger, writes, lookups, and
the admin switches for lookup answers, delays and faults)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final
from urllib.parse import quote

import httpx

from poimen.testing._faults import Faults

__all__ = ["LOOKUP_MODES", "ProviderClient", "ProviderProcess"]

LOOKUP_MODES: Final[tuple[str, ...]] = ("truthful", "landed", "never_arrived", "error")
# The provider answers once its interpreter has started and bound its port, or exits (seen
# at once): on a loaded machine the start alone can take tens of seconds.
_START_TIMEOUT_S: Final = 120.0
_STOP_TIMEOUT_S: Final = 5.0


def _child_env() -> dict[str, str]:
    # The child must import poimen from this same source tree, installed or not.
    package_parent = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    existing = env.get("PYTHONPATH")
    env["PYTHONPATH"] = package_parent + (os.pathsep + existing if existing else "")
    return env


class ProviderProcess:
    """Runs the provider as its own OS process; context manager."""

    def __init__(
        self, ledger_path: str | os.PathLike[str], *, lookup_mode: str = "truthful",
        faults: str | None = None,
    ) -> None:
        if lookup_mode not in LOOKUP_MODES:
            raise ValueError(f"unknown lookup mode {lookup_mode!r}; expected one of {LOOKUP_MODES}")
        if faults is not None:
            Faults.parse(faults)  # refused here, not in the child
        self.ledger_path = Path(ledger_path)
        self.lookup_mode = lookup_mode
        self.faults = faults
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: str | None = None
        self._stderr: IO[bytes] | None = None
        self._url: str | None = None
        self._returncode: int | None = None

    @property
    def url(self) -> str:
        """The provider's base URL."""
        if self._url is None:
            raise RuntimeError("provider is not running; call start() first")
        return self._url

    @property
    def pid(self) -> int:
        """The provider process's pid."""
        if self._proc is None:
            raise RuntimeError("provider is not running; call start() first")
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """Exit status of the last stopped process (None while running or never started)."""
        return self._returncode

    def start(self) -> ProviderProcess:
        """Start the process and wait until it serves."""
        if self._proc is not None:
            raise RuntimeError("provider already started")
        self._workdir = tempfile.mkdtemp(prefix="poimen-provider-")
        port_file = os.path.join(self._workdir, "port")
        # stderr goes to a file, not a pipe, so a chatty child can never block on a full pipe.
        self._stderr = open(os.path.join(self._workdir, "stderr.log"), "w+b")  # noqa: SIM115
        self._returncode = None
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "poimen.testing._provider",
                "--ledger",
                str(self.ledger_path),
                "--port-file",
                port_file,
                "--lookup-mode",
                self.lookup_mode,
                *(["--faults", self.faults] if self.faults is not None else []),
            ],
            env=_child_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
        )
        try:
            self._url = self._wait_ready(self._proc, port_file)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, proc: subprocess.Popen[bytes], port_file: str) -> str:
        deadline = time.monotonic() + _START_TIMEOUT_S
        with httpx.Client(timeout=1.0) as http:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"provider exited with status {proc.returncode} during startup:\n"
                        f"{self._read_stderr()}"
                    )
                if os.path.exists(port_file):
                    with open(port_file, encoding="ascii") as fh:
                        url = f"http://127.0.0.1:{int(fh.read().strip())}"
                    try:
                        if http.get(f"{url}/health").status_code == 200:
                            return url
                    except httpx.TransportError:
                        pass  # bound but not yet answering; poll again
                time.sleep(0.02)
        raise RuntimeError(
            f"provider not ready within {_START_TIMEOUT_S} s:\n{self._read_stderr()}"
        )

    def _read_stderr(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL)."""
        proc, self._proc, self._url = self._proc, None, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=_STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self._returncode = proc.returncode
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> ProviderProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class ProviderClient:
    """Thin typed client for the provider's HTTP API."""

    def __init__(self, url: str) -> None:
        self._http = httpx.Client(base_url=url, timeout=10)

    @staticmethod
    def _filters(kind: str | None, key: str | None, request_id: str | None) -> dict[str, str]:
        given = {"kind": kind, "key": key, "request_id": request_id}
        return {name: value for name, value in given.items() if value is not None}

    def entries(
        self, *, kind: str | None = None, key: str | None = None, request_id: str | None = None
    ) -> list[dict[str, Any]]:
        """The ledger's entries, optionally only those of one kind, key or request id."""
        response = self._http.get("/ledger", params=self._filters(kind, key, request_id))
        response.raise_for_status()
        entries: list[dict[str, Any]] = response.json()["entries"]
        return entries

    def count(
        self, *, kind: str | None = None, key: str | None = None, request_id: str | None = None
    ) -> int:
        """How many ledger entries match: the witness's count of effects."""
        response = self._http.get("/ledger", params=self._filters(kind, key, request_id))
        response.raise_for_status()
        return int(response.json()["count"])

    def keyed_write(self, key: str | None, body: Mapping[str, Any]) -> httpx.Response:
        """POST /keyed: a write the ledger deduplicates on `key` (the Idempotency-Key header)."""
        headers = {} if key is None else {"Idempotency-Key": key}
        return self._http.post("/keyed", json=dict(body), headers=headers)

    def request_write(self, request_id: str, body: Mapping[str, Any]) -> httpx.Response:
        """POST /requests: a write recorded under `request_id` (X-Request-Id), never
        deduplicated."""
        return self._http.post("/requests", json=dict(body), headers={"X-Request-Id": request_id})

    def plain_write(self, body: Mapping[str, Any]) -> httpx.Response:
        """POST /plain: a write the ledger never deduplicates."""
        return self._http.post("/plain", json=dict(body))

    def lookup(self, request_id: str) -> httpx.Response:
        # safe="" so a request id containing "/" stays one path segment.
        """GET /requests/<request_id>: 200 with the first request's body, or 404."""
        return self._http.get(f"/requests/{quote(request_id, safe='')}")

    def set_lookup_mode(self, mode: str) -> None:
        """How lookups answer: one of `LOOKUP_MODES` (truthful by default)."""
        self._http.post("/admin/lookup-mode", json={"mode": mode}).raise_for_status()

    def set_faults(self, spec: str | None) -> None:
        """Inject faults as `poimen.testing._faults` reads `spec`; None: no more faults."""
        self._http.post("/admin/faults", json={"spec": spec}).raise_for_status()

    def set_delay(self, seconds: float) -> None:
        """Hold every write this many seconds before it lands."""
        self._http.post("/admin/delay", json={"seconds": seconds}).raise_for_status()

    def set_key_ttl(self, seconds: float | None) -> None:
        """Forget a key `seconds` after its first write (None: remember keys for ever), as a
        real provider's idempotency window does."""
        self._http.post("/admin/key-ttl", json={"seconds": seconds}).raise_for_status()

    def close(self) -> None:
        """Close the HTTP client."""
        self._http.close()

    def __enter__(self) -> ProviderClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
