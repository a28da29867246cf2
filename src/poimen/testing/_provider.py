"""A stand-in external provider that counts real effects.

The provider runs as its own OS process with its own SQLite ledger, so a test
can crash the agent side and then ask an independent witness how many effects
actually landed. The ledger deduplicates ``/keyed`` writes on the supplied
idempotency key only, never on content: a ledger that deduplicated on content
would let a double issue with a fresh key slip through as a single effect. Like a real
provider it can forget keys (``POST /admin/key-ttl``): a key written again more than that many
seconds after its first write is a new effect.

With ``--faults SPEC`` (`poimen.testing._faults`) it injects errors before and after the effect,
lost responses, refusals and latency, and records every write it receives in a ``received``
table: the kill soak's witness of what was sent, not only of what landed.

Run it with::

    python -m poimen.testing._provider --ledger PATH --port-file PATH [--port 0]

or through `ProviderProcess` (`poimen.testing._provider_client`, re-exported here with
`ProviderClient`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sqlite3
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any, Final
from urllib.parse import parse_qs, unquote, urlsplit

from poimen.testing._faults import Fault, FaultCounter, Faults
from poimen.testing._provider_client import LOOKUP_MODES, ProviderClient, ProviderProcess

__all__ = ["LOOKUP_MODES", "ProviderClient", "ProviderProcess", "main"]

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    key TEXT,
    request_id TEXT,
    body TEXT NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_keyed ON entries (key, id) WHERE kind = 'keyed';
CREATE TABLE IF NOT EXISTS received (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    identity TEXT NOT NULL,
    body TEXT NOT NULL,
    fault TEXT,
    at REAL NOT NULL
);
"""

_LEDGER_FILTERS: Final = ("kind", "key", "request_id")


# --------------------------------------------------------------------------- server


class _Lost(Exception):
    """The write was applied; its response is lost (the connection closes without one)."""


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _reject_constant(name: str) -> Any:
    # NaN/Infinity are not JSON; storing them would make the ledger unreadable to strict parsers.
    raise ValueError(f"non-standard JSON constant {name!r}")


def _canonical(value: Any) -> str:
    # A canonical text form lets "same key, different content" be detected reliably.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _row_id(cursor: sqlite3.Cursor) -> int:
    row_id = cursor.lastrowid
    if row_id is None:
        raise RuntimeError("INSERT did not report a row id")
    return row_id


class _Ledger:
    """The provider's own record of effects; one connection guarded by one lock."""

    def __init__(self, path: str) -> None:
        # Autocommit: every INSERT is its own durable transaction (WAL + synchronous=FULL).
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.executescript(_SCHEMA)

    def keyed(self, key: str, body: str, ttl: float | None = None) -> tuple[int, bool, bool]:
        """Return (entry_id, duplicate, content_differs). With `ttl`, a key is remembered
        that many seconds from its first write, as real providers forget keys."""
        with self._lock:
            row = self._conn.execute(
                "SELECT id, body, at FROM entries WHERE kind = 'keyed' AND key = ? "
                "ORDER BY id DESC LIMIT 1",
                (key,),
            ).fetchone()
            if row is not None and (ttl is None or time.time() - float(row[2]) <= ttl):
                return int(row[0]), True, str(row[1]) != body
            cur = self._conn.execute(
                "INSERT INTO entries (kind, key, request_id, body, at) VALUES ('keyed', ?, NULL, ?, ?)",
                (key, body, time.time()),
            )
            return _row_id(cur), False, False

    def insert(self, kind: str, body: str, request_id: str | None = None) -> int:
        with self._lock:
            cur = self._conn.execute(
                "INSERT INTO entries (kind, key, request_id, body, at) VALUES (?, NULL, ?, ?, ?)",
                (kind, request_id, body, time.time()),
            )
            return _row_id(cur)

    def receive(self, kind: str, identity: str, body: str, fault: str | None) -> None:
        """A write that arrived, whatever became of it (kept only when faults are on)."""
        with self._lock:
            self._conn.execute(
                "INSERT INTO received (kind, identity, body, fault, at) VALUES (?, ?, ?, ?, ?)",
                (kind, identity, body, fault, time.time()),
            )

    def first_request(self, request_id: str) -> tuple[int, Any] | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT id, body FROM entries WHERE kind = 'request' AND request_id = ?"
                " ORDER BY id LIMIT 1",
                (request_id,),
            ).fetchone()
        if row is None:
            return None
        return int(row[0]), json.loads(row[1])

    def select(self, filters: Mapping[str, str]) -> list[dict[str, Any]]:
        # Column names come from the fixed _LEDGER_FILTERS allow-list, never from the request.
        clauses = [f"{name} = ?" for name in _LEDGER_FILTERS if name in filters]
        params = [filters[name] for name in _LEDGER_FILTERS if name in filters]
        where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
        with self._lock:
            rows = self._conn.execute(
                f"SELECT id, kind, key, request_id, body, at FROM entries{where} ORDER BY id",
                params,
            ).fetchall()
        return [
            {
                "id": r[0],
                "kind": r[1],
                "key": r[2],
                "request_id": r[3],
                "body": json.loads(r[4]),
                "at": r[5],
            }
            for r in rows
        ]

    def close(self) -> None:
        # Taking the lock first means no write is half-applied when the connection goes away.
        with self._lock:
            self._conn.close()


class _ProviderServer(ThreadingHTTPServer):
    daemon_threads = True
    # Tests open hundreds of connections at once. With the default backlog of 5 a busy accept
    # loop overflows it, the kernel drops the connections, and clients retry seconds later,
    # past their tools' timeouts.
    request_queue_size = 1024

    def __init__(
        self, address: tuple[str, int], ledger: _Ledger, lookup_mode: str,
        faults: Faults | None = None,
    ) -> None:
        super().__init__(address, _Handler)
        self.ledger = ledger
        self.faults = faults
        self.arrivals = FaultCounter()
        # Plain attribute swaps are atomic under the GIL, so these need no lock.
        self.lookup_mode = lookup_mode
        self.write_delay = 0.0
        self.key_ttl: float | None = None  # None: keys are remembered for ever


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.1 keeps httpx connections alive; every response sets Content-Length.
    protocol_version = "HTTP/1.1"
    server_version = "poimen-provider"

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def log_message(self, format: str, *args: Any) -> None:
        if os.environ.get("POIMEN_PROVIDER_LOG") == "1":
            super().log_message(format, *args)

    @property
    def _state(self) -> _ProviderServer:
        server = self.server
        if not isinstance(server, _ProviderServer):
            raise TypeError("handler is bound to the wrong server type")
        return server

    def _dispatch(self, method: str) -> None:
        try:
            # Always drain the body first so a rejected request cannot desync a kept-alive socket.
            raw = self._read_body() if method == "POST" else b""
            status, payload = self._route(method, raw)
        except _Lost:
            self.close_connection = True
            return
        except _HttpError as exc:
            status, payload = exc.status, {"error": exc.message}
        except Exception:
            # Server boundary: report a 500 instead of dropping the connection, keep the trace.
            traceback.print_exc()
            status, payload = 500, {"error": "internal provider error"}
        self._send(status, payload)

    def _read_body(self) -> bytes:
        header = self.headers.get("Content-Length")
        if header is None:
            return b""
        try:
            length = int(header)
        except ValueError:
            self.close_connection = True
            raise _HttpError(400, f"invalid Content-Length {header!r}") from None
        if length < 0:
            self.close_connection = True
            raise _HttpError(400, f"invalid Content-Length {header!r}")
        return self.rfile.read(length)

    def _send(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            # The client gave up (often on purpose, mid-delay); the effect already landed.
            self.close_connection = True

    def _route(self, method: str, raw: bytes) -> tuple[int, Any]:
        parts = urlsplit(self.path)
        path = parts.path
        if path.startswith("/requests/") and len(path) > len("/requests/"):
            self._require(method, "GET")
            return self._lookup(unquote(path[len("/requests/") :]))
        routes: dict[str, tuple[str, Callable[[], tuple[int, Any]]]] = {
            "/health": ("GET", lambda: (200, {"ok": True, "pid": os.getpid()})),
            "/ledger": ("GET", lambda: self._ledger(parts.query)),
            "/keyed": ("POST", lambda: self._keyed(raw)),
            "/requests": ("POST", lambda: self._request(raw)),
            "/plain": ("POST", lambda: self._plain(raw)),
            "/admin/lookup-mode": ("POST", lambda: self._set_lookup_mode(raw)),
            "/admin/delay": ("POST", lambda: self._set_delay(raw)),
            "/admin/faults": ("POST", lambda: self._set_faults(raw)),
            "/admin/key-ttl": ("POST", lambda: self._set_key_ttl(raw)),
        }
        if path not in routes:
            raise _HttpError(404, f"unknown path {path!r}")
        allowed, handler = routes[path]
        self._require(method, allowed)
        return handler()

    @staticmethod
    def _require(method: str, allowed: str) -> None:
        if method != allowed:
            raise _HttpError(405, f"method {method} not allowed; use {allowed}")

    @staticmethod
    def _parse_json(raw: bytes) -> Any:
        if not raw:
            raise _HttpError(400, "request body is empty; expected JSON")
        try:
            return json.loads(raw, parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError) as exc:
            raise _HttpError(400, f"request body is not valid JSON: {exc}") from None

    def _header(self, name: str) -> str:
        value = self.headers.get(name)
        if not value:
            raise _HttpError(400, f"missing or empty {name} header")
        return value

    def _before_write(self) -> None:
        # Sleeping before the write is applied lets a test kill a client mid-flight.
        delay = self._state.write_delay
        if delay > 0:
            time.sleep(delay)

    def _arrive(self, kind: str, identity: str, body: str) -> Fault | None:
        """Before a write: its fault (recorded as received), its latency, an error before it."""
        faults = self._state.faults
        fault = None
        if faults is not None:
            fault = faults.write(f"{kind}/{identity}", self._state.arrivals.next(identity))
            self._state.ledger.receive(kind, identity, body, fault.kind)
            time.sleep(fault.delay)
        self._before_write()
        if fault is not None and fault.kind == "before":
            raise _HttpError(503, "injected fault before the effect")
        if fault is not None and fault.kind == "refuse":
            raise _HttpError(409, "injected refusal")
        return fault

    @staticmethod
    def _landed(fault: Fault | None) -> None:
        """After a write was applied: an error, or a lost response, if its fault says so."""
        if fault is not None and fault.kind == "after":
            raise _HttpError(503, "injected fault after the effect")
        if fault is not None and fault.kind == "lost":
            raise _Lost

    def _keyed(self, raw: bytes) -> tuple[int, Any]:
        key = self._header("Idempotency-Key")
        body = _canonical(self._parse_json(raw))
        fault = self._arrive("keyed", key, body)
        entry_id, duplicate, differs = self._state.ledger.keyed(key, body, self._state.key_ttl)
        self._landed(fault)
        if not duplicate:
            return 201, {"entry_id": entry_id, "duplicate": False, "key": key}
        return 200, {
            "entry_id": entry_id,
            "duplicate": True,
            "key": key,
            "content_differs": differs,
        }

    def _request(self, raw: bytes) -> tuple[int, Any]:
        request_id = self._header("X-Request-Id")
        body = _canonical(self._parse_json(raw))
        fault = self._arrive("request", request_id, body)
        entry_id = self._state.ledger.insert("request", body, request_id)
        self._landed(fault)
        return 201, {"entry_id": entry_id, "request_id": request_id}

    def _plain(self, raw: bytes) -> tuple[int, Any]:
        body = _canonical(self._parse_json(raw))
        fault = self._arrive("plain", body, body)
        entry_id = self._state.ledger.insert("plain", body)
        self._landed(fault)
        return 201, {"entry_id": entry_id}

    def _lookup(self, request_id: str) -> tuple[int, Any]:
        mode = self._state.lookup_mode
        faults = self._state.faults
        if faults is not None and faults.lookup(
            request_id, self._state.arrivals.next(f"lookup/{request_id}")
        ):
            return 503, {"error": "injected lookup fault"}
        if mode == "landed":
            return 200, {"landed": True, "entry_id": None}
        if mode == "never_arrived":
            return 404, {"landed": False}
        if mode == "error":
            return 503, {"error": "lookup unavailable"}
        found = self._state.ledger.first_request(request_id)
        if found is None:
            return 404, {"landed": False}
        entry_id, body = found
        return 200, {"landed": True, "entry_id": entry_id, "body": body}

    def _ledger(self, query: str) -> tuple[int, Any]:
        params = parse_qs(query, keep_blank_values=True)
        # Rejecting unknown filters stops a typo from silently counting the whole ledger.
        unknown = sorted(set(params) - set(_LEDGER_FILTERS))
        if unknown:
            raise _HttpError(400, f"unknown ledger filter(s): {', '.join(unknown)}")
        filters = {name: values[-1] for name, values in params.items()}
        entries = self._state.ledger.select(filters)
        return 200, {"count": len(entries), "entries": entries}

    def _set_lookup_mode(self, raw: bytes) -> tuple[int, Any]:
        payload = self._parse_json(raw)
        mode = payload.get("mode") if isinstance(payload, dict) else None
        if mode not in LOOKUP_MODES:
            raise _HttpError(400, f"unknown lookup mode {mode!r}; expected one of {LOOKUP_MODES}")
        self._state.lookup_mode = mode
        return 200, {"mode": mode}

    def _set_faults(self, raw: bytes) -> tuple[int, Any]:
        payload = self._parse_json(raw)
        spec = payload.get("spec") if isinstance(payload, dict) else None
        if spec is not None and not isinstance(spec, str):
            raise _HttpError(400, f"spec must be a string or null, got {spec!r}")
        try:
            self._state.faults = None if spec is None else Faults.parse(spec)
        except ValueError as exc:
            raise _HttpError(400, str(exc)) from None
        return 200, {"spec": spec}

    def _set_delay(self, raw: bytes) -> tuple[int, Any]:
        payload = self._parse_json(raw)
        raw_seconds = payload.get("seconds") if isinstance(payload, dict) else None
        # bool is an int subclass; {"seconds": true} is a caller bug, not one second.
        if isinstance(raw_seconds, bool) or not isinstance(raw_seconds, int | float):
            raise _HttpError(400, f"seconds must be a number, got {raw_seconds!r}")
        seconds = float(raw_seconds)
        if not math.isfinite(seconds) or seconds < 0:
            raise _HttpError(400, f"seconds must be finite and >= 0, got {seconds!r}")
        self._state.write_delay = seconds
        return 200, {"seconds": seconds}


    def _set_key_ttl(self, raw: bytes) -> tuple[int, Any]:
        payload = self._parse_json(raw)
        ttl = payload.get("seconds") if isinstance(payload, dict) else None
        if ttl is not None and (
            isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0
            or not math.isfinite(ttl)
        ):
            raise _HttpError(400, f"seconds must be a positive number or null, got {ttl!r}")
        self._state.key_ttl = None if ttl is None else float(ttl)
        return 200, {"seconds": ttl}


def _write_port_file(path: str, port: int) -> None:
    # Write-then-rename so a poller never reads a half-written port number.
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="ascii") as fh:
        fh.write(f"{port}\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m poimen.testing._provider",
                                     description=__doc__)
    parser.add_argument("--ledger", required=True, help="SQLite ledger file")
    parser.add_argument("--port-file", required=True, help="where to write the bound port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks an ephemeral port")
    parser.add_argument("--lookup-mode", choices=LOOKUP_MODES, default="truthful")
    parser.add_argument("--faults", help="inject faults (poimen.testing._faults); every write "
                        "received is then recorded in the ledger's `received` table")
    args = parser.parse_args(argv)

    faults = Faults.parse(args.faults) if args.faults is not None else None
    ledger = _Ledger(args.ledger)
    server = _ProviderServer((args.host, args.port), ledger, args.lookup_mode, faults)
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    # serve_forever runs off the main thread so the signal handler never has to call
    # shutdown() from inside the loop it would be waiting on.
    # A short poll interval keeps shutdown (and so test teardown) fast.
    serving = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="provider-serve"
    )
    serving.daemon = True
    serving.start()
    _write_port_file(args.port_file, server.server_port)
    # A bounded wait keeps the main thread responsive to signals on every platform.
    while not stop.wait(0.05):
        pass
    server.shutdown()
    server.server_close()
    ledger.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
