"""Hostile input: every value a caller, a tool or a registration can hand poimen that is not what
it expects. Each row is refused with a typed poimen error that names the problem, before
anything is recorded, or (for writes) denied and audited; the store's own limits are never
mistaken for an outage.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.server
import os
import secrets
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from poimen import (
    MAX_ARGS_BYTES,
    MAX_CALL_ID_BYTES,
    MAX_NESTING,
    MAX_TOOL_ID_BYTES,
    Caps,
    Completed,
    Failed,
    Idempotent,
    IntentState,
    Kernel,
    KeyDerivation,
    ToolContext,
    ToolRegistration,
    Unsafe,
)
from poimen._core.intents import Owner
from poimen.errors import (
    ArgumentEncodingError,
    ArgumentError,
    ArgumentTooLargeError,
    KeyDerivationError,
    PoimenError,
    RegistrationError,
    StoreError,
    StoreUnavailableError,
)
from poimen.store import NewDispatch, SqliteStore, open_store
from tests.integration.operator_app import poimen

ROOT = Path(__file__).resolve().parents[2]


def nothing_recorded(k: Kernel) -> None:
    assert k.store.list_intents(limit=10) == []
    assert k.denials() == []


# 1. A log that is never saved is refused, naming the URL and what to do instead.

NEVER_SAVED = [
    "sqlite:///",
    "sqlite:///:memory:",
    "sqlite:///file::memory:?cache=shared",
    "sqlite:///file:intents.db?mode=memory",
]


@pytest.mark.parametrize("url", NEVER_SAVED)
def test_a_log_that_is_never_saved_is_refused(url: str) -> None:
    with pytest.raises(StoreError) as refused:
        open_store(url)
    assert url in str(refused.value) and "sqlite:///path/to/intents.db" in str(refused.value)
    assert refused.value.url == url
    with pytest.raises(StoreError, match="never saved"):
        Kernel(url)
    with pytest.raises(StoreError, match="never saved"):
        SqliteStore(url.removeprefix("sqlite:///"))


@pytest.mark.parametrize("url", NEVER_SAVED)
def test_migrate_refuses_a_log_that_is_never_saved(url: str) -> None:
    r = poimen("migrate", "--db", url)
    assert r.returncode != 0, r.stdout
    assert "never saved" in r.stderr and "schema is current" not in r.stdout


# 2. Every HTTP method other than GET, HEAD, OPTIONS and TRACE is a write and carries the key.


class Recorder(http.server.BaseHTTPRequestHandler):
    """Answers any method with 200 and records (method, key header) on the server."""

    server: RecordingServer

    def __getattr__(self, name: str) -> Callable[[], None]:
        if name.startswith("do_"):
            return self._record
        raise AttributeError(name)

    def _record(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        with self.server.lock:
            self.server.seen.append((self.command, self.headers.get("Idempotency-Key")))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:
        pass


class RecordingServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Recorder)
        self.lock = threading.Lock()
        self.seen: list[tuple[str, str | None]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def server() -> Iterator[RecordingServer]:
    s = RecordingServer()
    t = threading.Thread(target=s.serve_forever, daemon=True)
    t.start()
    try:
        yield s
    finally:
        s.shutdown()
        s.server_close()
        t.join()


@pytest.fixture
def http_kernel(sqlite_url: str, server: RecordingServer) -> Iterator[Kernel]:
    k = Kernel(sqlite_url)
    caps = Caps(hosts=(f"127.0.0.1:{server.server_address[1]}",))
    idem = Idempotent(key=KeyDerivation.fields("method"))

    @k.tool(id="http.sync", effects=idem, caps=caps, timeout=10)
    def sync_tool(ctx: ToolContext, method: str, via: str, clear_key: bool = False) -> Any:
        headers = {"Idempotency-Key": ""} if clear_key else {}
        if via == "transport":
            with httpx.Client(transport=ctx.http.transport) as sdk:
                return sdk.request(method, f"{server.url}/w", headers=headers).status_code
        return ctx.http.request(method, f"{server.url}/w", headers=headers).status_code

    @k.tool(id="http.async", effects=idem, caps=caps, timeout=10)
    async def async_tool(ctx: ToolContext, method: str) -> Any:
        return (await ctx.ahttp.request(method, f"{server.url}/w")).status_code

    try:
        yield k
    finally:
        k.close()


WRITE_METHODS = ["PROPPATCH", "MERGE", "PURGE", "proppatch", "Lock", "REPORT"]
READ_METHODS = ["GET", "HEAD", "OPTIONS", "TRACE", "get"]
WAYS = ["request", "transport", "ahttp"]


def _send(k: Kernel, method: str, via: str, **extra: Any) -> Any:
    args = {"method": method, **extra}
    if via == "ahttp":
        return asyncio.run(k.acall("http.async", args, call_id=f"{method}-{via}"))
    return k.call("http.sync", {**args, "via": via}, call_id=f"{method}-{via}")


@pytest.mark.parametrize("via", WAYS)
@pytest.mark.parametrize("method", WRITE_METHODS + READ_METHODS)
def test_every_method_but_the_safe_four_carries_the_key(
    http_kernel: Kernel, server: RecordingServer, method: str, via: str
) -> None:
    out = _send(http_kernel, method, via)
    assert isinstance(out, Completed), out
    intent = http_kernel.store.get_intent(out.intent_id)
    assert intent is not None and intent.key is not None
    expected = None if method in READ_METHODS else intent.key
    assert server.seen == [(method.upper(), expected)]


@pytest.mark.parametrize("via", ["request", "transport"])
def test_a_write_method_with_its_key_cleared_is_denied(
    http_kernel: Kernel, server: RecordingServer, via: str
) -> None:
    out = _send(http_kernel, "PURGE", via, clear_key=True)
    assert isinstance(out, Failed) and "no_key" in out.error, out
    assert [d.reason.split(":")[0] for d in http_kernel.denials()] == ["no_key"]
    assert server.seen == []


# 3. The guard: SQLite URIs parsed as SQLite parses them, ATTACH and VACUUM INTO caught, and
#    the blind spots docs/capability.md lists really are blind.


def _guard_case(how: str, target: Path, existing: Path) -> Any:
    t, e = str(target), str(existing)
    match how:
        case "plain_file":
            sqlite3.connect(t).close()
        case "mode_in_another_parameter":
            sqlite3.connect(f"file:{t}?mode=rwc&x=mode=ro", uri=True).close()
        case "last_mode_wins":
            sqlite3.connect(f"file:{t}?mode=ro&mode=rwc", uri=True).close()
        case "escaped_parameter_name":
            sqlite3.connect(f"file:{t}?mode=ro&mo%64e=rwc", uri=True).close()
        case "nul_ends_the_name":
            sqlite3.connect(f"file:{t}?mode=ro&mode%00x=rwc", uri=True).close()
        case "mode_after_fragment":
            sqlite3.connect(f"file:{t}#?mode=ro", uri=True).close()
        case "mode_past_500_characters":
            pad = "p" * 600
            sqlite3.connect(f"file:{t}?mode=ro&pad={pad}&mode=rwc", uri=True).close()
        case "upper_case_scheme":
            sqlite3.connect(f"FILE:{t}?mode=rwc", uri=True).close()
        case "attach":
            sqlite3.connect(":memory:").execute(f"ATTACH '{t}' AS x")
        case "attach_parameter":
            sqlite3.connect(":memory:").execute("ATTACH ? AS x", (t,))
        case "attach_writable_uri":
            sqlite3.connect(":memory:", uri=True).execute(f"ATTACH 'file:{t}?mode=rwc' AS x")
        case "vacuum_into":
            conn = sqlite3.connect(":memory:", isolation_level=None)
            conn.execute("CREATE TABLE t (x)")
            conn.execute(f"VACUUM INTO '{t}'")
        case "vacuum_into_from_read_only":
            conn = sqlite3.connect(f"file:{e}?mode=ro", uri=True, isolation_level=None)
            conn.execute(f"VACUUM INTO '{t}'")
        case "setxattr":
            os.setxattr(e, "user.poimen", b"1")
        case "load_extension":
            conn = sqlite3.connect(":memory:")
            if hasattr(conn, "enable_load_extension"):
                conn.enable_load_extension(True)
            else:  # this Python's sqlite3 cannot load extensions: raise the event it would
                sys.audit("sqlite3.enable_load_extension", conn, True)
        # Read-only opens and in-memory databases pass.
        case "read_only_uri":
            return (
                sqlite3.connect(f"file:{e}?mode=ro", uri=True).execute("SELECT x FROM t").fetchall()
            )
        case "read_only_nul_ends_the_value":
            conn = sqlite3.connect(f"file:{e}?mode=ro%00junk", uri=True)
            return conn.execute("SELECT x FROM t").fetchall()
        case "memory":
            conn = sqlite3.connect(":memory:")
            conn.execute("ATTACH ':memory:' AS scratch")
            conn.execute("CREATE TABLE scratch.t (x)")
            return conn.execute("SELECT count(*) FROM scratch.t").fetchall()
        case "memory_uri":
            conn = sqlite3.connect("file::memory:?cache=shared", uri=True)
            return conn.execute("SELECT 1").fetchall()
        case "attach_read_only":
            conn = sqlite3.connect(":memory:", uri=True)
            conn.execute(f"ATTACH 'file:{e}?mode=ro' AS ro")
            return conn.execute("SELECT x FROM ro.t").fetchall()
        case "vacuum_in_memory":
            conn = sqlite3.connect(":memory:", isolation_level=None)
            conn.execute("VACUUM")
            return [[1]]
        # Blind spots (docs/capability.md): these writes go through.
        case "thread":
            th = threading.Thread(target=target.write_text, args=("x",))
            th.start()
            th.join()
        case "thread_pool":
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pool.submit(target.write_text, "x").result()
        case "run_in_executor":

            async def main() -> None:
                await asyncio.get_running_loop().run_in_executor(None, target.write_text, "x")

            asyncio.run(main())
        case _:
            raise AssertionError(how)
    return None


SQLITE_DENIED = [
    "plain_file",
    "mode_in_another_parameter",
    "last_mode_wins",
    "escaped_parameter_name",
    "nul_ends_the_name",
    "mode_after_fragment",
    "mode_past_500_characters",
    "upper_case_scheme",
    "attach",
    "attach_parameter",
    "attach_writable_uri",
    "vacuum_into",
    "vacuum_into_from_read_only",
]
SQLITE_ALLOWED = [
    "read_only_uri",
    "read_only_nul_ends_the_value",
    "memory",
    "memory_uri",
    "attach_read_only",
    "vacuum_in_memory",
]
BLIND_SPOTS = ["thread", "thread_pool", "run_in_executor"]


@pytest.fixture
def guard_kernel(sqlite_url: str, tmp_path: Path) -> Iterator[Kernel]:
    existing = tmp_path / "existing.db"
    with sqlite3.connect(existing) as conn:
        conn.execute("CREATE TABLE t (x)")
        conn.execute("INSERT INTO t VALUES (1)")
    conn.close()
    k = Kernel(sqlite_url)

    @k.tool(
        id="guard.case",
        effects=Idempotent(key=KeyDerivation.fields("how")),
        caps=Caps(),
        timeout=10,
    )
    def case(ctx: ToolContext, how: str) -> Any:
        return _guard_case(how, tmp_path / "written.db", existing)

    try:
        yield k
    finally:
        k.close()


DENIED = [
    *[(how, "file_write", "sqlite3") for how in SQLITE_DENIED],
    ("load_extension", "load_extension", "sqlite3"),
    ("setxattr", "file_write", "existing.db"),
]


@pytest.mark.parametrize(("how", "action", "target"), DENIED, ids=[d[0] for d in DENIED])
def test_guard_gaps_are_denied_and_nothing_is_written(
    guard_kernel: Kernel, tmp_path: Path, how: str, action: str, target: str
) -> None:
    out = guard_kernel.call("guard.case", {"how": how}, call_id=how)
    assert isinstance(out, Failed), out
    assert "capability denied" in out.error and "out_of_band" in out.error
    denials = guard_kernel.denials()
    assert [(d.action, d.reason.split(":")[0]) for d in denials] == [(action, "out_of_band")]
    assert target in denials[0].target
    assert not (tmp_path / "written.db").exists()


@pytest.mark.parametrize("how", SQLITE_ALLOWED)
def test_read_only_and_in_memory_sqlite_pass(
    guard_kernel: Kernel, tmp_path: Path, how: str
) -> None:
    out = guard_kernel.call("guard.case", {"how": how}, call_id=how)
    assert isinstance(out, Completed), out
    assert out.result in ([[1]], [[0]])
    assert guard_kernel.denials() == []
    assert not (tmp_path / "written.db").exists()


@pytest.mark.parametrize("how", BLIND_SPOTS)
def test_documented_blind_spots_are_blind(guard_kernel: Kernel, tmp_path: Path, how: str) -> None:
    """If one of these starts being denied, move it out of the blind spots in the docs."""
    doc = (ROOT / "docs" / "capability.md").read_text()
    assert {"thread": "threading.Thread", "thread_pool": "ThreadPoolExecutor"}.get(how, how) in doc
    out = guard_kernel.call("guard.case", {"how": how}, call_id=how)
    assert isinstance(out, Completed), out
    assert (tmp_path / "written.db").read_text() == "x"
    assert guard_kernel.denials() == []


def test_a_denial_of_an_undecodable_name_is_recorded(store_url: str, tmp_path: Path) -> None:
    """A file name that is not UTF-8 still makes a denial row the store can hold."""
    target = bytes(tmp_path / "w") + b"\xff"
    with Kernel(store_url) as k:

        @k.tool(id="w", effects=Idempotent(key=KeyDerivation.all_args()), caps=Caps(), timeout=5)
        def write(ctx: ToolContext) -> None:
            with open(target, "wb"):
                pass

        out = k.call("w", {}, call_id="c")
        assert isinstance(out, Failed) and "capability denied" in out.error, out
        [denial] = k.denials()
        assert denial.action == "file_write" and denial.target.endswith("w\\udcff")
    assert not os.path.exists(target)


def test_a_denied_sink_name_that_is_not_text_is_recorded(store_url: str) -> None:
    with Kernel(store_url) as k:

        @k.tool(id="s", effects=Idempotent(key=KeyDerivation.all_args()), caps=Caps(), timeout=5)
        def sink(ctx: ToolContext) -> None:
            ctx.sink("orders\udc80\x00")

        out = k.call("s", {}, call_id="c")
        assert isinstance(out, Failed) and "sink_not_in_caps" in out.error, out
        assert [d.target for d in k.denials()] == ["orders\\udc80\\x00"]


# 4 and 5. Arguments with no canonical UTF-8 JSON form, and the size limit in bytes.

DEEP: list[Any] = []
_node = DEEP
for _ in range(10_000):
    _node.append([])
    _node = _node[0]


def _raises(exc: Exception) -> Callable[[Mapping[str, Any]], Any]:
    def derive(args: Mapping[str, Any]) -> Any:
        raise exc

    return derive


CUSTOM_KEYS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "key.missing_field": lambda args: args["no_such_argument"],
    "key.divides_by_zero": lambda args: len(args) / 0,
    "key.raises_value_error": _raises(ValueError("bad derivation")),
    "key.returns_surrogate": lambda args: "k\udc80",
    "key.returns_huge_int": lambda args: 10**5000,
    "key.returns_deep_nesting": lambda args: DEEP,
}


@pytest.fixture(params=["call", "acall"])
def call_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def arg_kernel(store_url: str) -> Iterator[Kernel]:
    k = Kernel(store_url)

    @k.tool(id="echo", effects=Unsafe(), caps=Caps(), timeout=10)
    def echo(ctx: ToolContext, payload: Any = None, note: str = "", n: int = 0) -> Any:
        return {"ok": True}

    for tool_id, fn in CUSTOM_KEYS.items():
        k.register(
            ToolRegistration(
                id=tool_id,
                effects=Idempotent(key=KeyDerivation.custom(fn)),
                caps=Caps(),
                timeout=10,
            ),
            echo,
        )
    try:
        yield k
    finally:
        k.close()


def _call(k: Kernel, kind: str, tool: str, args: Mapping[str, Any], call_id: str) -> Any:
    if kind == "acall":
        return asyncio.run(k.acall(tool, args, call_id=call_id))
    return k.call(tool, args, call_id=call_id)


HUGE = 10**5000
# (row id, tool, args, call id, error type, the `argument` or `field` the error names)
BAD_CALLS: list[tuple[str, str, dict[str, Any], str, type[ArgumentError], str]] = [
    ("surrogate_arg", "echo", {"note": "a\udc80b"}, "c", ArgumentEncodingError, "note"),
    (
        "surrogate_nested",
        "echo",
        {"payload": {"items": ["ok", "\ud800"]}},
        "c",
        ArgumentEncodingError,
        "payload.items[1]",
    ),
    ("surrogate_key", "echo", {"payload": {"k\udc80": 1}}, "c", ArgumentEncodingError, "payload"),
    ("surrogate_call_id", "echo", {}, "c\udc80", ArgumentEncodingError, "call_id"),
    ("nul_call_id", "echo", {}, "c\x00d", ArgumentEncodingError, "call_id"),
    ("huge_int", "echo", {"n": HUGE}, "c", ArgumentEncodingError, "n"),
    (
        "huge_int_nested",
        "echo",
        {"payload": {"a": [1, HUGE]}},
        "c",
        ArgumentEncodingError,
        "payload.a[1]",
    ),
    (
        "deep_nesting",
        "echo",
        {"payload": DEEP},
        "c",
        ArgumentEncodingError,
        "payload" + "[0]" * MAX_NESTING,
    ),
    (
        "call_id_too_long",
        "echo",
        {},
        "x" * (MAX_CALL_ID_BYTES + 1),
        ArgumentTooLargeError,
        "call_id",
    ),
    (
        "call_id_too_many_bytes",
        "echo",
        {},
        "😀" * (MAX_CALL_ID_BYTES // 4 + 1),
        ArgumentTooLargeError,
        "call_id",
    ),
    ("args_too_many_bytes", "echo", {"note": "😀" * 300_000}, "c", ArgumentTooLargeError, "note"),
    ("key_missing_field", "key.missing_field", {}, "c", KeyDerivationError, "<key derivation>"),
    ("key_divides_by_zero", "key.divides_by_zero", {}, "c", KeyDerivationError, "<key derivation>"),
    ("key_raises", "key.raises_value_error", {}, "c", KeyDerivationError, "<key derivation>"),
    (
        "key_surrogate",
        "key.returns_surrogate",
        {},
        "c",
        ArgumentEncodingError,
        "<key derivation result>",
    ),
    (
        "key_huge_int",
        "key.returns_huge_int",
        {},
        "c",
        ArgumentEncodingError,
        "<key derivation result>",
    ),
    (
        "key_deep",
        "key.returns_deep_nesting",
        {},
        "c",
        ArgumentEncodingError,
        "<key derivation result>" + "[0]" * MAX_NESTING,
    ),
]


@pytest.mark.parametrize(
    ("tool", "args", "call_id", "error", "names"),
    [row[1:] for row in BAD_CALLS],
    ids=[row[0] for row in BAD_CALLS],
)
def test_bad_calls_are_refused_typed_and_nothing_is_recorded(
    arg_kernel: Kernel,
    call_kind: str,
    tool: str,
    args: dict[str, Any],
    call_id: str,
    error: type[ArgumentError],
    names: str,
) -> None:
    started = time.monotonic()
    with pytest.raises(error) as refused:
        _call(arg_kernel, call_kind, tool, args, call_id)
    assert time.monotonic() - started < 5.0  # refused up front, never retried as an outage
    data = refused.value.data
    assert data.get("argument", data.get("field")) == names, (data, str(refused.value))
    if error is KeyDerivationError:
        assert data["tool_id"] == tool and "key derivation" in str(refused.value)
    nothing_recorded(arg_kernel)


BAD_RESULTS: list[tuple[str, Any, str]] = [
    ("surrogate", {"text": "a\udc80"}, "<result>.text"),
    ("huge_int", [1, HUGE], "<result>[1]"),
    ("deep_nesting", DEEP, "<result>" + "[0]" * MAX_NESTING),
]


@pytest.mark.parametrize(
    ("value", "names"), [r[1:] for r in BAD_RESULTS], ids=[r[0] for r in BAD_RESULTS]
)
def test_a_result_with_no_canonical_form_completes_unrecorded(
    store_url: str, call_kind: str, value: Any, names: str
) -> None:
    """The effect happened: the call completes, and the log says why its result is missing."""
    with Kernel(store_url) as k:

        @k.tool(id="returns", effects=Unsafe(), caps=Caps(), timeout=10)
        def returns(ctx: ToolContext) -> Any:
            return value

        out = _call(k, call_kind, "returns", {}, "c")
        assert isinstance(out, Completed) and out.result is value, out
        intent = k.store.get_intent(out.intent_id)
        assert intent is not None and intent.state == IntentState.COMPLETED
        assert intent.result is None
        assert intent.error is not None and intent.error.startswith("result not recorded")
        assert repr(names) in intent.error


def test_size_is_counted_in_utf8_bytes(arg_kernel: Kernel, call_kind: str) -> None:
    with pytest.raises(ArgumentTooLargeError) as refused:
        _call(arg_kernel, call_kind, "echo", {"note": "😀" * 300_000}, "big")
    assert refused.value.size == len('{"note":""}') + 4 * 300_000
    assert refused.value.limit == MAX_ARGS_BYTES
    nothing_recorded(arg_kernel)
    # 250,000 emoji are 1,000,000 bytes: under the limit, recorded whole.
    out = _call(arg_kernel, call_kind, "echo", {"note": "😀" * 250_000}, "fits")
    assert isinstance(out, Completed), out
    intent = arg_kernel.store.get_intent(out.intent_id)
    assert intent is not None and len(intent.args.encode()) <= MAX_ARGS_BYTES
    assert intent.args.count("😀") == 250_000


def test_limits_themselves_are_accepted(arg_kernel: Kernel, call_kind: str) -> None:
    """The longest call id, the deepest nesting and the largest integer still record."""
    longest = secrets.token_urlsafe(MAX_CALL_ID_BYTES)[:MAX_CALL_ID_BYTES]  # incompressible
    deep: list[Any] = []
    node = deep
    for _ in range(MAX_NESTING - 1):
        node.append([])
        node = node[0]
    big = 10**4299
    out = _call(arg_kernel, call_kind, "echo", {"payload": deep, "n": big}, longest)
    assert isinstance(out, Completed), out
    intent = arg_kernel.store.get_by_call_id(longest)
    assert intent is not None and intent.state == IntentState.COMPLETED


# 6. Tool ids have a length limit at registration; the PostgreSQL store's own limits are
#    errors, not outages.


def test_tool_id_limit_is_checked_at_registration() -> None:
    ToolRegistration(id="t" * MAX_TOOL_ID_BYTES, effects=Unsafe(), caps=Caps(), timeout=1)
    for bad in ("t" * (MAX_TOOL_ID_BYTES + 1), "é" * (MAX_TOOL_ID_BYTES // 2 + 1)):
        with pytest.raises(RegistrationError, match=f"{MAX_TOOL_ID_BYTES} bytes"):
            ToolRegistration(id=bad, effects=Unsafe(), caps=Caps(), timeout=1)
    for bad in ("t\udc80", "t\x00"):
        with pytest.raises(RegistrationError, match="tool id"):
            ToolRegistration(id=bad, effects=Unsafe(), caps=Caps(), timeout=1)


def _dispatch(call_id: str) -> NewDispatch:
    now = time.time()
    return NewDispatch(
        intent_id=f"in_{secrets.token_hex(12)}",
        call_id=call_id,
        tool_id="t.tool",
        effect="unsafe",
        args="{}",
        args_hash="h",
        key=None,
        request_id=None,
        owner=Owner("w", "h", 1, 1.0),
        lease_expires_at=now + 30,
        timeout_s=1.0,
        deadline_at=now + 2,
        now=now,
    )


@pytest.mark.postgres
def test_postgres_limits_are_errors_not_outages(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from poimen.store.postgres import PostgresStore

    store = PostgresStore(postgres_url, min_size=1, max_size=1, retry_for=30.0)
    try:
        session = store._read("SELECT pg_backend_pid()")
        started = time.monotonic()
        # Random text does not compress: the unique index on call_id cannot hold it.
        with pytest.raises(StoreError) as refused:
            store.record_dispatch(_dispatch(secrets.token_urlsafe(3000)))
        assert not isinstance(refused.value, StoreUnavailableError)
        assert "index row" in str(refused.value), refused.value
        assert time.monotonic() - started < 10.0  # retry_for is 30 s: it was not retried
        assert "retrying" not in caplog.text
        # A data error (class 22) is refused the same way.
        with pytest.raises(StoreError) as refused:
            store.record_dispatch(_dispatch("nul\x00inside"))
        assert not isinstance(refused.value, StoreUnavailableError)
        # The pool kept its one session, and the store still works.
        assert store._read("SELECT pg_backend_pid()") == session
        intent, created = store.record_dispatch(_dispatch("fine"))
        assert created and intent.call_id == "fine"
    finally:
        store.close()


# 13. Registration and construction values of the wrong type.

BAD_CAPS: list[tuple[str, dict[str, Any]]] = [
    ("hosts_string", {"hosts": "example.com"}),
    ("hosts_empty_entry", {"hosts": ("",)}),
    ("hosts_not_text", {"hosts": (443,)}),
    ("hosts_url", {"hosts": ("https://example.com",)}),
    ("hosts_none", {"hosts": None}),
    ("sinks_string", {"sinks": "orders"}),
    ("sinks_empty_entry", {"sinks": ("orders", " ")}),
    ("key_header_empty", {"key_header": ""}),
    ("key_header_space", {"key_header": "Idempotency Key"}),
    ("key_header_colon", {"key_header": "Idempotency-Key:"}),
    ("key_header_not_text", {"key_header": None}),
]


@pytest.mark.parametrize("fields", [row[1] for row in BAD_CAPS], ids=[r[0] for r in BAD_CAPS])
def test_bad_caps_are_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(RegistrationError) as refused:
        Caps(**fields)
    assert refused.value.field == next(iter(fields))


def test_good_caps_are_kept() -> None:
    caps = Caps(hosts=["api.example", "[::1]:8443"], sinks=["orders"], key_header="X-Key")  # type: ignore[arg-type]
    assert caps.hosts == ("api.example", "[::1]:8443") and caps.sinks == ("orders",)
    assert hash(caps) == hash(
        Caps(hosts=("api.example", "[::1]:8443"), sinks=("orders",), key_header="X-Key")
    )


BAD_VERSIONS: list[Any] = ["x", 0, -1, True, 1.5, None]


@pytest.mark.parametrize("version", BAD_VERSIONS)
def test_key_derivation_version_must_be_a_positive_int(version: Any) -> None:
    for make in (
        lambda: KeyDerivation.fields("x", version=version),
        lambda: KeyDerivation.all_args(version=version),
        lambda: KeyDerivation.custom(lambda a: a["x"], version=version),
    ):
        with pytest.raises(RegistrationError, match="version"):
            make()


@pytest.mark.parametrize("store", [None, 42, b"sqlite:///x.db", Path("x.db")])
def test_kernel_needs_a_url_or_a_store(store: Any, tmp_path: Path) -> None:
    with pytest.raises(PoimenError, match="store must be"):
        Kernel(store)
    assert list(tmp_path.iterdir()) == []
