"""The flat happy path (`poimen._engine.flat`) against the generator protocol: for the same call
and the same tool behaviour, two real SQLite logs, one kernel on each path, record the same rows
and events and give the same outcome (docs/design.md §4, "The flat path")."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from poimen import (
    Caps,
    DefiniteFailure,
    Idempotent,
    IntentState,
    Kernel,
    KeyDerivation,
    Landed,
    NotLanded,
    Queryable,
    ReadOnly,
    Retry,
    ToolContext,
    Transactional,
    Unknown,
    Unsafe,
)
from poimen import events as ev
from poimen._core import decide as _decide
from poimen._engine import flat, protocol
from poimen._engine.flat import flat_call
from poimen.errors import NotSent, StoreUnavailableError
from poimen.testing import ProviderClient, ProviderProcess, provider_lookup

EFFECTS = ("idempotent", "queryable", "unsafe", "readonly")
# What the tool does on its n-th run (the last one repeats): return, refuse, never send, or
# raise anything else (an unknown outcome).
RUNS = ("returns", "definite", "not_sent", "other")
ANSWERS = {"landed": Landed({"landed": True}), "not_landed": NotLanded(), "unknown": Unknown("?")}


class Seen(ev.Observer):
    """Every event of a call, in the thread that caused it."""

    def __init__(self, side: Side) -> None:
        self.side = side

    def event(self, event: ev.KernelEvent) -> None:
        call_id = getattr(event, "call_id", None)
        if call_id is not None:
            self.side.events.setdefault(call_id, []).append(type(event).__name__)


class Side:
    """One kernel on its own log, its tools scripted by the test."""

    def __init__(self, path: Path, *, flat: bool) -> None:
        self.path = path
        self.events: dict[str, list[str]] = {}
        # A margin of 4 s: a Queryable deadline is stamped again only after a dispatch commit
        # slower than a second (a quarter of it), a matter of timing, not of the path taken.
        self.kernel = Kernel(f"sqlite:///{path}", worker_id=path.stem, notifiers=[],
                             deadline_margin=4.0, log_events=False, observers=[Seen(self)])
        self.kernel._engine.flat = flat
        self.script: dict[str, tuple[list[str], str]] = {}
        self.runs: dict[str, int] = {}
        fast = Retry(attempts=3, initial=0.001, maximum=0.002)
        k = self.kernel

        @k.tool(id="idempotent", effects=Idempotent(key=KeyDerivation.fields("n")), caps=Caps(),
                timeout=1, retry=fast)
        def idempotent(ctx: ToolContext, n: int, note: str) -> Any:
            return self._run(ctx, n)

        @k.tool(id="queryable", effects=Queryable(lookup=self._lookup), caps=Caps(), timeout=0.2,
                retry=fast)
        def queryable(ctx: ToolContext, n: int, note: str) -> Any:
            return self._run(ctx, n)

        @k.tool(id="unsafe", effects=Unsafe(), caps=Caps(), timeout=1, retry=fast)
        def unsafe(ctx: ToolContext, n: int, note: str) -> Any:
            return self._run(ctx, n)

        @k.tool(id="readonly", effects=ReadOnly(), caps=Caps(), timeout=1, retry=fast)
        def readonly(ctx: ToolContext, n: int, note: str) -> Any:
            return self._run(ctx, n)

        # The same tools, async: `acall` takes `flat_acall` or the protocol on `run_async`.
        for effect, fn in (("idempotent", idempotent), ("queryable", queryable),
                           ("unsafe", unsafe), ("readonly", readonly)):
            reg = k.registered()[effect]
            k.tool(id=f"a{effect}", effects=reg.effects, caps=Caps(), timeout=reg.timeout,
                   retry=fast)(self._async(fn))

    @staticmethod
    def _async(fn: Callable[..., Any]) -> Callable[..., Any]:
        async def run(ctx: ToolContext, n: int, note: str) -> Any:
            await asyncio.sleep(0)  # a turn of the loop, as a tool's request takes
            return fn(ctx, n, note)

        return run

    def _run(self, ctx: ToolContext, n: int) -> Any:
        runs, _ = self.script[ctx.call_id]
        i = self.runs[ctx.call_id] = self.runs.get(ctx.call_id, -1) + 1
        match runs[min(i, len(runs) - 1)]:
            case "returns":
                return {"n": n, "attempt": ctx.attempt}
            case "definite":
                raise DefiniteFailure(f"refused {n}")
            case "not_sent":
                raise NotSent("could not connect")
            case _:
                raise ConnectionResetError("reset mid-call")

    def _lookup(self, request_id: str) -> Any:
        [answer] = {a for _, a in self.script.values()}  # one call runs at a time
        return ANSWERS[answer]

    def call(self, tool: str, args: dict[str, Any], call_id: str, runs: list[str],
             answer: str) -> tuple[Any, ...]:
        self.script = {call_id: (runs, answer)}
        out = self.kernel.call(tool, args, call_id=call_id)
        return (type(out).__name__, *(v for k, v in vars_of(out).items() if k != "intent_id"))

    def acall(self, tool: str, args: dict[str, Any], call_id: str, runs: list[str],
              answer: str) -> tuple[Any, ...]:
        self.script = {call_id: (runs, answer)}
        out = asyncio.run(self.kernel.acall(f"a{tool}", args, call_id=call_id))
        return (type(out).__name__, *(v for k, v in vars_of(out).items() if k != "intent_id"))

    def rows(self, call_id: str) -> dict[str, list[Any]]:
        """What the log holds of one call, without its ids and times."""
        with sqlite3.connect(self.path) as c:
            c.row_factory = sqlite3.Row
            [intent] = c.execute("SELECT * FROM intents WHERE call_id = ?", (call_id,))
            i = intent["id"]
            return {
                "intent": [_plain(dict(intent), self.path.stem)],
                **{table: [_plain(dict(r), self.path.stem) for r in c.execute(
                    f"SELECT * FROM {table} WHERE intent_id = ? ORDER BY {order}", (i,))]
                   for table, order in (("attempts", "number"), ("events", "id"),
                                        ("outbox", "id"), ("denials", "id"))},
            }


def vars_of(out: Any) -> dict[str, Any]:
    return {k: getattr(out, k) for k in out.__slots__}


_IDS = {"id", "intent_id", "request_id", "delivery_id", "chain_hash"}


def _plain(row: dict[str, Any], worker: str) -> dict[str, Any]:
    """A row without what differs between two logs of the same steps: ids, times, hashes,
    the worker's name."""
    out = {}
    for k, v in row.items():
        if k in _IDS or k == "at" or k.endswith("_at"):
            continue
        if k in ("detail", "payload") and isinstance(v, str):
            v = _plain(json.loads(v), worker)
        out[k] = "<worker>" if v == worker else v
    return out


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Side, Side]]:
    base = tmp_path_factory.mktemp("flat")
    pair = (Side(base / "flat.db", flat=True), Side(base / "protocol.db", flat=False))
    yield pair
    for s in pair:
        s.kernel.close()


calls = iter(range(1_000_000))


def examples(n: int) -> Callable[[Callable[..., None]], Callable[..., None]]:
    # No explain phase: its tracer, beside the kernels' threads, crashed CPython 3.11 (SIGSEGV).
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])


SCRIPTS = {
    "effect": st.sampled_from(EFFECTS),
    "runs": st.lists(st.sampled_from(RUNS), min_size=1, max_size=3),
    "answer": st.sampled_from(sorted(ANSWERS)),
    "n": st.integers(-(2**40), 2**40),
}


@examples(100)
@given(note=st.text(max_size=20), **SCRIPTS)
def test_the_flat_path_records_what_the_protocol_records(
    sides: tuple[Side, Side], effect: str, runs: list[str], answer: str, n: int, note: str
) -> None:
    flat_side, protocol_side = sides
    call_id = f"c{next(calls)}"
    args = {"n": n, "note": note}
    got = flat_side.call(effect, args, call_id, runs, answer)
    want = protocol_side.call(effect, args, call_id, runs, answer)
    assert got == want
    assert flat_side.rows(call_id) == protocol_side.rows(call_id)
    assert flat_side.events.get(call_id) == protocol_side.events.get(call_id)


@examples(60)
@given(**SCRIPTS)
def test_the_async_flat_path_records_what_the_protocol_records(
    sides: tuple[Side, Side], effect: str, runs: list[str], answer: str, n: int
) -> None:
    """`acall` of an async tool: `flat_acall` against the protocol on `run_async`."""
    flat_side, protocol_side = sides
    call_id = f"c{next(calls)}"
    args = {"n": n, "note": ""}
    got = flat_side.acall(effect, args, call_id, runs, answer)
    want = protocol_side.acall(effect, args, call_id, runs, answer)
    assert got == want
    assert flat_side.rows(call_id) == protocol_side.rows(call_id)
    assert flat_side.events.get(call_id) == protocol_side.events.get(call_id)


def test_a_repeated_call_id_answers_alike_on_both_paths(sides: tuple[Side, Side]) -> None:
    """A call id in the log already is a deviation at the dispatch: the protocol answers."""
    for side in sides:
        side.call("unsafe", {"n": 1, "note": ""}, "again", ["returns"], "unknown")
    again = [s.call("unsafe", {"n": 1, "note": ""}, "again", ["other"], "unknown") for s in sides]
    assert again[0] == again[1] == ("Completed", {"n": 1, "attempt": 1})
    assert sides[0].rows("again") == sides[1].rows("again")


def test_the_flat_path_decides_with_the_protocols_own_functions() -> None:
    """As the model check holds its rules to the project's (tests/model): the flat path names
    the decision functions the protocol uses, and no others of its own."""
    assert flat.failure_is_final is _decide.failure_is_final is protocol.failure_is_final
    for shared in ("Write", "existing_steps", "fenced_out", "given", "late", "run_steps",
                   "stamp_deadline", "taken", "untried"):
        assert getattr(flat, shared) is getattr(protocol, shared)
    from poimen._engine import runners

    assert flat.invoke_sync is runners.invoke_sync  # the tool's context, its send gate
    # An async call's steps are run_async's own: what a cancelled caller finds is the same.
    for shared in ("block_async", "drive_async", "invoke_async_step"):
        assert getattr(flat, shared) is getattr(runners, shared)
    names = set(flat_call.__code__.co_names)
    assert {"failure_is_final", "invoke_sync", "late", "record_dispatch",
            "record_outcome"} <= names
    anames = set(flat.flat_acall.__code__.co_names) | set(flat._dispatched.__code__.co_names)
    assert {"failure_is_final", "invoke_async_step", "block_async", "late", "record_dispatch",
            "record_outcome", "untried"} <= anames
    # Only these are called by the flat path itself: every other rule is the protocol's.
    defined = {n for n, v in vars(flat).items() if callable(v) and getattr(v, "__module__", "")
               == flat.__name__}
    assert defined == {"flat_call", "resumed", "flat_acall", "_dispatched", "_then_taken"}


@pytest.mark.parametrize("flat_path", [True, False], ids=["flat", "protocol"])
def test_a_caller_whose_outcome_is_refused_on_its_fence_answers_what_the_log_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flat_path: bool
) -> None:
    """A live caller whose lease ran out (renewals starved) is taken over while its tool runs:
    its outcome commit is refused on the old fence and the call answers with the log's outcome,
    on both paths; the tool's own result stays on its attempt, as evidence."""
    from poimen import Indeterminate, IntentState

    monkeypatch.setattr(Kernel, "_renew", lambda self: None)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    caller = Kernel(url, notifiers=[], lease_ttl=0.3, wait_bound=0.2)
    recoverer = Kernel(url, notifiers=[], lease_ttl=0.3, wait_bound=0.2)
    caller._engine.flat = flat_path
    started, release = threading.Event(), threading.Event()

    def mail(ctx: ToolContext, to: str) -> str:
        started.set()
        assert release.wait(30)
        return "sent"

    for k in (caller, recoverer):
        k.tool(id="mail", effects=Unsafe(), caps=Caps(), timeout=0.1)(mail)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(caller.call("mail", {"to": "a"}, call_id="m")))
    try:
        t.start()
        assert started.wait(30)
        it = recoverer.store.get_by_call_id("m")
        assert it is not None
        while (it.lease_expires_at or 0) > recoverer.store.now():  # waits on the row's lease
            time.sleep(0.02)
        recoverer.recover()  # an Unsafe call whose outcome is unknown: Indeterminate
        it = recoverer.store.get_intent(it.id) or it
        assert it.state == IntentState.INDETERMINATE
        release.set()
        t.join(30)
        assert got == [Indeterminate(it.id, "unsafe_unknown_outcome")]
        [attempt] = caller.store.attempts(it.id)
        assert attempt.late_outcome == "completed"
    finally:
        release.set()
        t.join(30)
        recoverer.close()
        caller.close()


@pytest.mark.parametrize("flat_path", [True, False], ids=["flat", "protocol"])
def test_an_acall_whose_outcome_is_refused_on_its_fence_answers_what_the_log_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flat_path: bool
) -> None:
    """An async tool's call taken over by another worker while its tool runs (its lease
    taken as run out): its outcome commit is refused on its fence and `acall` answers with
    what the log says, on both paths; the tool's own result stays on its attempt."""
    from poimen import Indeterminate

    monkeypatch.setattr(Kernel, "_renew", lambda self: None)
    url = f"sqlite:///{tmp_path / 'log.db'}"
    caller = Kernel(url, notifiers=[])
    other = Kernel(url, notifiers=[])
    caller._engine.flat = flat_path
    started, release = asyncio.Event(), asyncio.Event()

    async def mail(ctx: ToolContext, to: str) -> str:
        started.set()
        await release.wait()
        return "sent"

    for k in (caller, other):
        k.tool(id="mail", effects=Unsafe(), caps=Caps(), timeout=30)(mail)

    async def run() -> Any:
        task = asyncio.create_task(caller.acall("mail", {"to": "a"}, call_id="m"))
        await started.wait()
        it = other.store.get_by_call_id("m")
        assert it is not None  # its lease as if run out, then a recovery pass takes it
        assert await asyncio.to_thread(other.store.seize, it.id, it.fence, it.lease_expires_at)
        await asyncio.to_thread(other.recover)  # unknown outcome, Unsafe: Indeterminate
        release.set()
        return await task

    try:
        out = asyncio.run(run())
        it = other.store.get_by_call_id("m")
        assert it is not None and it.state == IntentState.INDETERMINATE
        assert out == Indeterminate(it.id, "unsafe_unknown_outcome")
        [attempt] = caller.store.attempts(it.id)
        assert attempt.late_outcome == "completed"
    finally:
        other.close()
        caller.close()


# Deviations the property test does not script, each run on both paths and compared: an
# interrupt from the tool after its write, the log closed under a running tool, an identical
# call coalesced in its scope, an async tool's timeout; effects counted by the provider's ledger.


def _path_kernel(url: str, flat_path: bool, **kw: Any) -> Kernel:
    k = Kernel(url, notifiers=[], log_events=False, **kw)
    k._engine.flat = flat_path
    return k


def _state(k: Kernel, call_id: str) -> tuple[Any, ...]:
    """The intent's state, reason, attempts, and whether this kernel still holds it."""
    it = k.store.get_by_call_id(call_id)
    assert it is not None
    return it.state, it.reason, it.attempts, it.id in k._engine.holds


def _charge(k: Kernel, url: str, after: Callable[[], Any]) -> None:
    """An Idempotent tool whose keyed write lands, then `after()` decides how it ends."""

    @k.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("order")),
            caps=Caps(hosts=(url.split("//")[1],)), timeout=1)
    def charge(ctx: ToolContext, order: str) -> Any:
        ctx.http.post(f"{url}/keyed", json={"order": order}).raise_for_status()
        return after()


def _interrupt() -> Any:
    raise KeyboardInterrupt


def test_an_interrupt_after_the_tools_write_leaves_the_same_log_on_both_paths(
    tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    """KeyboardInterrupt out of the tool after its write: it reaches the caller, the intent
    stays DISPATCHED and is no longer held (its lease runs out), and recovery completes it
    under the same key: one effect."""

    def one(flat_path: bool) -> tuple[Any, ...]:
        url = f"sqlite:///{tmp_path / f'{flat_path}.db'}"
        with _path_kernel(url, flat_path, lease_ttl=0.3) as k:
            _charge(k, provider.url, _interrupt)
            with pytest.raises(KeyboardInterrupt):
                k.call("charge", {"order": f"o-{flat_path}"}, call_id="c")
            left = _state(k, "c")
        with _path_kernel(url, True, lease_ttl=0.3) as r:
            _charge(r, provider.url, lambda: "recovered")
            it = r.store.get_by_call_id("c")
            assert it is not None
            while (it.lease_expires_at or 0) > r.store.now():  # waits on the row's lease
                time.sleep(0.02)
            r.recover()
            return left, _state(r, "c")

    seen = [one(True), one(False)]
    assert seen[0] == seen[1]
    assert seen[0][0] == (IntentState.DISPATCHED, None, 1, False)
    assert seen[0][1][0] == IntentState.COMPLETED
    assert ledger.count(kind="keyed") == 2  # one effect per path's order


def test_the_log_closed_under_a_running_tool_leaves_the_same_log_on_both_paths(
    tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    """The outcome commit fails (the store was closed while the tool ran): the error reaches
    the caller, the hold is released, and the intent stays DISPATCHED on both paths."""

    def one(flat_path: bool) -> tuple[Any, ...]:
        url = f"sqlite:///{tmp_path / f'{flat_path}.db'}"
        k = _path_kernel(url, flat_path)
        _charge(k, provider.url, k.store.close)
        with pytest.raises(StoreUnavailableError):
            k.call("charge", {"order": f"o-{flat_path}"}, call_id="c")
        held = k._engine.holds.ids()
        k.close()
        with _path_kernel(url, True) as reader:
            return held, _state(reader, "c")

    seen = [one(True), one(False)]
    assert seen[0] == seen[1]
    assert seen[0] == ([], (IntentState.DISPATCHED, None, 1, False))
    assert ledger.count(kind="keyed") == 2


def test_an_identical_call_in_its_scope_is_coalesced_alike_on_both_paths(
    tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    """A second call id for an identical call in the same scope, while the first runs: not
    dispatched again, answered Pending, then with the first's outcome (issue 22)."""

    def one(flat_path: bool) -> tuple[Any, ...]:
        url = f"sqlite:///{tmp_path / f'{flat_path}.db'}"
        started, release = threading.Event(), threading.Event()
        runs: list[str] = []
        args = {"to": f"a-{flat_path}"}
        with _path_kernel(url, flat_path, wait_bound=0.2) as k:

            @k.tool(id="mail", effects=Unsafe(), caps=Caps(hosts=(provider.url.split("//")[1],)),
                    timeout=5)
            def mail(ctx: ToolContext, to: str) -> Any:
                runs.append(ctx.call_id)
                started.set()
                assert release.wait(30)
                return ctx.http.post(f"{provider.url}/plain", json={"to": to}).json()

            got: list[Any] = []
            t = threading.Thread(
                target=lambda: got.append(k.call("mail", args, call_id="s/1", scope="s")))
            t.start()
            try:
                assert started.wait(30)
                second = k.call("mail", args, call_id="s/2", scope="s")
            finally:
                release.set()
                t.join(30)
            again = k.call("mail", args, call_id="s/2", scope="s")
            return (second, type(got[0]).__name__, second.intent_id == got[0].intent_id,
                    again == got[0], runs)

    seen = [one(True), one(False)]
    assert [s[1:] for s in seen] == [("Completed", True, True, ["s/1"])] * 2
    assert [s[0].reason for s in seen] == ["in_flight"] * 2
    assert ledger.count(kind="plain") == 2


def test_an_async_tools_timeout_in_a_sync_call_is_settled_alike_on_both_paths(
    tmp_path: Path, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    """An async Queryable tool whose request landed and whose answer never came within its
    timeout: an unknown outcome the lookup settles, on both paths, with one effect each."""

    def one(flat_path: bool) -> tuple[Any, ...]:
        url = f"sqlite:///{tmp_path / f'{flat_path}.db'}"
        client = httpx.Client(base_url=provider.url, timeout=10)
        with _path_kernel(url, flat_path, deadline_margin=0.05) as k:
            k.on_close(client.close)

            @k.tool(id="ship", effects=Queryable(lookup=provider_lookup(provider.url, client)),
                    caps=Caps(hosts=(provider.url.split("//")[1],)), timeout=0.3)
            async def ship(ctx: ToolContext, order: str) -> Any:
                assert ctx.request_id is not None
                client.post("/requests", json={"order": order},
                            headers={"X-Request-Id": ctx.request_id}).raise_for_status()
                await asyncio.sleep(5)

            out = k.call("ship", {"order": f"o-{flat_path}"}, call_id="q")
            return type(out).__name__, _state(k, "q")

    seen = [one(True), one(False)]
    assert seen[0] == seen[1] == (
        "Completed", (IntentState.COMPLETED, "landed_by_lookup", 1, False))
    assert ledger.count(kind="request") == 2


@pytest.mark.parametrize("setup", ["sqlite-own", "sqlite-other"])
@pytest.mark.parametrize("ending", ["returns", "refused", "raises", "interrupted"])
def test_a_transactional_call_is_settled_alike_on_both_paths(
    tmp_path: Path, setup: str, ending: str
) -> None:
    """A Transactional tool's write, then an ending: on the log's own database (its outcome
    commits with the write: the flat path hands it to the protocol) and on another one, the
    same answer, row, events and witness rows on both paths."""
    from tests.integration.transactional_app import databases, rows

    def one(flat_path: bool) -> tuple[Any, ...]:
        base = tmp_path / str(flat_path)
        base.mkdir()
        with databases(setup, base) as (log, app):
            side = Side.__new__(Side)
            side.events = {}
            k = Kernel(log, notifiers=[], log_events=False, observers=[Seen(side)])
            k._engine.flat = flat_path

            @k.tool(id="note", effects=Transactional(database=app), caps=Caps(), timeout=5)
            def note(ctx: ToolContext, text: str) -> Any:
                ctx.tx.execute("INSERT INTO notes (call_id, text) VALUES (?, ?)",
                               (ctx.call_id, text))
                match ending:
                    case "refused":
                        raise DefiniteFailure("refused")
                    case "raises":
                        raise ConnectionResetError("reset")
                    case "interrupted":
                        raise KeyboardInterrupt
                return {"attempt": ctx.attempt}

            try:
                out: Any = k.call("note", {"text": "t"}, call_id="n")
            except KeyboardInterrupt:
                out = "interrupted"
            state = _state(k, "n")
            k.close()
            answer = out if isinstance(out, str) else type(out).__name__
            return answer, state, rows(app, "n"), side.events.get("n")

    seen = [one(True), one(False)]
    assert seen[0] == seen[1]
