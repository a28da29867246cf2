"""The provider stand-in of `poimen crashtest`: the witness outside the agent.

An HTTP server on 127.0.0.1 (threads of the supervising process, never of the agent) that
answers every request and records it in its own SQLite ledger (`poimen.testing._provider`'s: effects
in ``entries``, deduplicated on an ``Idempotency-Key`` only; every arrival in ``received``).
Agents reach it at ``$POIMEN_CRASHTEST_URL`` or through ``HTTP_PROXY`` with any plain
``http://`` URL. HTTPS through the proxy (``CONNECT``) is refused: the witness cannot see inside
TLS, and a refusal is better than a write that reaches the real provider.

A write is POST, PUT, PATCH or DELETE; its content is the method, the target and the body
(JSON canonically encoded). Armed with a `Hold`, the witness stops at one write: ``before``
it is applied, or ``after`` (applied, its answer held back), and tells the supervisor, which
kills the agent there.
"""

from __future__ import annotations

import fnmatch
import json
import threading
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Final
from urllib.parse import unquote, urlsplit

from poimen.testing._provider import _canonical, _Ledger

WRITE_METHODS: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})
LOOKUP_PATH: Final = "/_witness/requests/"
_HOLD_BOUND_S: Final = 600.0  # a held handler gives up after this, if nobody stops the witness


class AnswersError(ValueError):
    """The answers file cannot be read, or a rule in it is malformed."""


@dataclass(frozen=True, slots=True)
class Rule:
    method: str  # "*" or one method
    path: str  # an fnmatch pattern over the target's path
    status: int
    body: Any


@dataclass(frozen=True, slots=True)
class Answers:
    """How the witness answers: the first rule that matches, else the default."""

    rules: tuple[Rule, ...] = ()
    default_status: int = 200

    @classmethod
    def load(cls, path: str | Path) -> Answers:
        """Read ``{"rules": [{"method", "path", "status", "body"}], "default_status"}``."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise AnswersError(f"answers file {str(path)!r}: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("rules", []), list):
            raise AnswersError(f"answers file {str(path)!r}: expected an object with a list 'rules'")
        rules = []
        for i, r in enumerate(data.get("rules", [])):
            if not isinstance(r, dict) or not isinstance(r.get("path"), str):
                raise AnswersError(f"answers file {str(path)!r}: rule {i} needs a string 'path'")
            status = r.get("status", 200)
            if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status < 600:
                raise AnswersError(f"answers file {str(path)!r}: rule {i}: bad status {status!r}")
            rules.append(Rule(str(r.get("method", "*")).upper(), r["path"], status, r.get("body")))
        default = data.get("default_status", 200)
        if isinstance(default, bool) or not isinstance(default, int) or not 200 <= default < 300:
            raise AnswersError(f"answers file {str(path)!r}: bad default_status {default!r}")
        return cls(tuple(rules), default)

    def answer(self, method: str, target: str, entry: int | None) -> tuple[int, Any]:
        path = urlsplit(target).path or "/"
        for r in self.rules:
            if r.method in ("*", method) and fnmatch.fnmatchcase(path, r.path):
                return r.status, r.body
        body: dict[str, Any] = {"ok": True}
        if entry is not None:
            body["id"] = f"w-{entry}"
        return self.default_status, body


@dataclass(frozen=True, slots=True)
class Write:
    """One write as it arrived: its content (`signature`) and the headers that identify it."""

    seq: int
    method: str
    target: str
    body: Any
    signature: str
    key: str | None
    request_id: str | None


@dataclass(frozen=True, slots=True)
class Hold:
    """Stop at the `occurrence`-th arrival of the write with this content, `when` before it
    is applied or after."""

    signature: str
    occurrence: int
    when: str


def signature(method: str, target: str, body: Any) -> str:
    """A write's content: what a double effect repeats."""
    return _canonical({"method": method, "target": target, "body": body})


def label(sig: str, width: int = 76) -> str:
    """A write's content as one short line: ``POST /charges {"amount":1200}``."""
    d = json.loads(sig)
    body = "" if d["body"] is None else " " + _canonical(d["body"])
    text = f"{d['method']} {d['target']}{body}"
    return text if len(text) <= width else text[: width - 1] + "…"


class Witness:
    """One case's witness: start it, point the agent at `url`, read `effects()` afterwards."""

    def __init__(self, ledger: str | Path, answers: Answers | None = None) -> None:
        self.ledger_path = Path(ledger)
        self.answers = answers or Answers()
        self.reached = threading.Event()  # the hold's write arrived (and was applied if "after")
        self.tls_refused = 0
        self._ledger: _Ledger | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._hold: Hold | None = None
        self._seen: Counter[str] = Counter()
        self._writes: list[Write] = []

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the witness is not running")
        return self._server.server_port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Witness:
        self._ledger = _Ledger(str(self.ledger_path))
        self._server = _Server(self)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
            name="crashtest-witness", daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._release.set()  # held handlers give up their connection
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._ledger is not None:
            self._ledger.close()
        self._server = self._thread = self._ledger = None

    def __enter__(self) -> Witness:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def arm(self, hold: Hold) -> None:
        """Stop at this write (once); `reached` is set when it arrives."""
        with self._lock:
            self._hold = hold

    def writes(self) -> list[Write]:
        """Every write that arrived, in order (held ones too)."""
        with self._lock:
            return list(self._writes)

    def effects(self) -> Counter[str]:
        """How many times the ledger applied each write's content: a key seen before is not a
        new effect, anything else is."""
        if self._ledger is None:
            raise RuntimeError("the witness is not running")
        return Counter(_canonical(e["body"]) for e in self._ledger.select({}))

    # Called by the handler threads.

    def _arrive(self, method: str, target: str, body: Any, key: str | None,
                request_id: str | None) -> tuple[Write, str | None]:
        sig = signature(method, target, body)
        with self._lock:
            self._seen[sig] += 1
            w = Write(len(self._writes) + 1, method, target, body, sig, key, request_id)
            self._writes.append(w)
            hold = self._hold
            when = None
            if hold is not None and hold.signature == sig and hold.occurrence == self._seen[sig]:
                self._hold, when = None, hold.when
        assert self._ledger is not None
        self._ledger.receive("write", sig, sig, None if when is None else f"held {when}")
        return w, when

    def _apply(self, w: Write) -> int:
        assert self._ledger is not None
        if w.key is not None:
            entry, _, _ = self._ledger.keyed(w.key, w.signature)
            return entry
        return self._ledger.insert("request" if w.request_id else "plain", w.signature,
                                   w.request_id)

    def _held(self) -> None:
        self.reached.set()
        self._release.wait(_HOLD_BOUND_S)

    def _lookup(self, request_id: str) -> tuple[int, Any]:
        assert self._ledger is not None
        found = self._ledger.first_request(request_id)
        if found is None:
            return 404, {"landed": False}
        entry, content = found
        return 200, {"landed": True, "entry_id": entry, "body": content.get("body")}

    def _refuse_tls(self, target: str) -> None:
        with self._lock:
            self.tls_refused += 1
        self._read("CONNECT", target)

    def _read(self, method: str, target: str) -> None:
        assert self._ledger is not None
        self._ledger.receive("read", f"{method} {target}", "null", None)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256

    def __init__(self, witness: Witness) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.witness = witness


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "poimen-crashtest-witness"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    @property
    def _witness(self) -> Witness:
        server = self.server
        assert isinstance(server, _Server)
        return server.witness

    def do_CONNECT(self) -> None:
        self._witness._refuse_tls(self.path)
        self._send(502, {"error": "poimen crashtest: the witness cannot see inside HTTPS; point "
                         "the tool at $POIMEN_CRASHTEST_URL or at a plain http:// URL"})
        self.close_connection = True

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("HEAD")

    def do_OPTIONS(self) -> None:
        self._handle("OPTIONS")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def _target(self) -> str:
        """The path for a request to the witness itself (direct or through the proxy), the
        absolute URL for one to another host through the proxy."""
        parts = urlsplit(self.path)
        if not parts.scheme:
            return self.path
        port = self._witness.port
        own = parts.hostname in ("127.0.0.1", "localhost") and parts.port == port
        rest = parts.path + (f"?{parts.query}" if parts.query else "")
        return rest if own else f"{parts.scheme}://{parts.netloc}{parts.path or '/'}" + (
            f"?{parts.query}" if parts.query else "")

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _handle(self, method: str) -> None:
        w = self._witness
        raw = self._body()
        target = self._target()
        if method not in WRITE_METHODS:
            if target.startswith(LOOKUP_PATH) and method == "GET":
                self._send(*w._lookup(unquote(target[len(LOOKUP_PATH):])))
                return
            w._read(method, target)
            self._send(*w.answers.answer(method, target, None))
            return
        body: Any
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = {"text": raw.decode("utf-8", "replace")}
        write, held = w._arrive(method, target, body, self.headers.get("Idempotency-Key") or None,
                                self.headers.get("X-Request-Id") or None)
        if held == "before":
            w._held()
            self.close_connection = True
            return
        entry = w._apply(write)
        if held == "after":
            w._held()
            self.close_connection = True
            return
        self._send(*w.answers.answer(method, target, entry))

    def _send(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

