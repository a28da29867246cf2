"""The supervisor of `poimen crashtest`: a clean run to learn the calls, then one case per call
and crash point, each a run SIGKILLed there (its whole process group) and restarted with the
same command and environment, judged by the witness's ledger (and, with poimen, its log).

Every run gets a fresh state directory shared by a case's killed run and its restart
(``$POIMEN_CRASHTEST_DIR``, with ``POIMEN_DB`` a SQLite log in it) and a witness of its own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from poimen._core import suggest as _suggest
from poimen.crashtest._report import POINTS, Case, Double, Report
from poimen.crashtest._witness import Answers, Hold, Witness, Write, label
from poimen.errors import PoimenError

# Where a case stops a poimen call: "before" the request left, the intent recorded as
# dispatched; "after" the tool returned, its outcome not yet committed.
KERNEL_POINTS: Final = {"before": "after_dispatch_commit", "after": "after_effect"}
_CRASH_VARS: Final = ("POIMEN_CRASH_AT", "POIMEN_PAUSE_AT", "POIMEN_PAUSE_FILE",
                      "POIMEN_CRASH_CALL")
_LOCAL: Final = "127.0.0.1,localhost,::1"


class CrashTestError(PoimenError):
    """The command cannot be crash-tested as given."""


@dataclass(frozen=True, slots=True)
class Options:
    """What to run and how (`poimen crashtest`'s options)."""

    command: tuple[str, ...]
    jobs: int = 1
    timeout: float = 120.0  # per run
    mode: str = "auto"  # auto | poimen | witness
    answers: Answers | None = None
    keep: Path | None = None
    env: Mapping[str, str] | None = None  # default: this process's environment
    cwd: Path | None = None


@dataclass(frozen=True, slots=True)
class _Call:
    label: str
    point: str
    hold: Hold | None = None  # without poimen: the write to stop at
    call_id: str | None = None  # with poimen: the call to stop


@dataclass(frozen=True, slots=True)
class _Clean:
    writes: list[Write]
    effects: Counter[str]
    intents: list[Any]


def crashtest(options: Options, progress: Callable[[int, int], None] | None = None) -> Report:
    """Run the crash test; the report says what doubled and (with poimen) what was left
    unfinished."""
    if not options.command:
        raise CrashTestError("no command: poimen crashtest [options] -- COMMAND ...")
    if options.jobs < 1:
        raise CrashTestError(f"-j must be at least 1, got {options.jobs}")
    if options.timeout <= 0:
        raise CrashTestError(f"--timeout must be positive, got {options.timeout}")
    if options.mode not in ("auto", "poimen", "witness"):
        raise CrashTestError(f"unknown mode {options.mode!r}: auto, poimen or witness")
    started = time.monotonic()
    if options.keep is not None:
        base = options.keep.absolute()
        if base.exists() and any(base.iterdir()):
            raise CrashTestError(f"--keep {str(base)!r} is not empty: give a new directory")
        base.mkdir(parents=True, exist_ok=True)
    else:
        base = Path(tempfile.mkdtemp(prefix="poimen-crashtest-"))
    try:
        report = _crashtest(options, base, progress)
    finally:
        if options.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    report.seconds = time.monotonic() - started
    report.workdir = None if options.keep is None else str(base)
    return report


def _crashtest(options: Options, base: Path, progress: Callable[[int, int], None] | None
               ) -> Report:
    clean = _clean_run(options, base / "clean")
    poimen = options.mode == "poimen" or (options.mode == "auto" and bool(clean.intents))
    if poimen and not clean.intents:
        raise CrashTestError("--mode poimen, but the clean run left no call in the log at "
                             "POIMEN_DB: does the agent open its Kernel on POIMEN_DB?")
    calls: list[_Call] = []
    if poimen:
        for intent in clean.intents:
            calls += [_Call(f"{intent.tool_id} ({intent.call_id})", p, call_id=intent.call_id)
                      for p in POINTS]
    else:
        if not clean.writes:
            raise CrashTestError(
                "the clean run made no write at the witness: point the agent's tools at "
                "$POIMEN_CRASHTEST_URL, or at plain http:// URLs (HTTP_PROXY is set)")
        seen: Counter[str] = Counter()
        for w in clean.writes:
            seen[w.signature] += 1
            calls += [_Call(label(w.signature), p, hold=Hold(w.signature, seen[w.signature], p))
                      for p in POINTS]
    report = Report(list(options.command), "poimen" if poimen else "witness",
                    calls=len(calls) // len(POINTS))
    if progress is not None:
        progress(0, len(calls))
    pool = concurrent.futures.ThreadPoolExecutor(options.jobs)
    try:
        futures = [pool.submit(_case, options, base / f"case-{n}-{c.point}", n, c, clean)
                   for n, c in enumerate(calls, 1)]
        for f in concurrent.futures.as_completed(futures):
            case, refused = f.result()
            report.cases.append(case)
            report.tls_refused += refused
            if progress is not None:
                progress(len(report.cases), len(calls))
    except BaseException:  # Ctrl-C: the runs are in sessions of their own, so stop them here
        pool.shutdown(wait=False, cancel_futures=True)
        _kill_all(stop=True)
        raise
    pool.shutdown()
    report.cases.sort(key=lambda c: c.number)
    return report


def _env(options: Options, witness: Witness, state: Path, case: str) -> dict[str, str]:
    env = {k: v for k, v in (options.env or os.environ).items() if k not in _CRASH_VARS}
    env.update({
        "POIMEN_CRASHTEST_URL": witness.url,
        "POIMEN_CRASHTEST_DIR": str(state),
        "POIMEN_CRASHTEST_CASE": case,
        "POIMEN_DB": f"sqlite:///{state / 'poimen.db'}",
    })
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[name] = env[name.lower()] = witness.url
    env["NO_PROXY"] = env["no_proxy"] = _LOCAL
    return env


_live: set[subprocess.Popen[bytes]] = set()
_live_lock = threading.Lock()
_stopping = threading.Event()  # interrupted: no new run starts


def _spawn(options: Options, env: Mapping[str, str], out: Path) -> subprocess.Popen[bytes]:
    with open(f"{out}.out", "wb") as stdout, open(f"{out}.err", "wb") as stderr:
        try:
            proc = subprocess.Popen(
                list(options.command), env=dict(env), cwd=options.cwd, stdin=subprocess.DEVNULL,
                stdout=stdout, stderr=stderr, start_new_session=True,  # its own process group
            )
        except OSError as exc:
            raise CrashTestError(f"cannot run {options.command[0]!r}: {exc}") from exc
    with _live_lock:
        _live.add(proc)
        stopping = _stopping.is_set()
    if stopping:
        _kill_group(proc)
        raise CrashTestError("interrupted")
    return proc


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the run's whole process group (what it started too), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    with _live_lock:
        _live.discard(proc)


def _kill_all(*, stop: bool) -> None:
    with _live_lock:
        if stop:
            _stopping.set()
        procs = list(_live)
    for proc in procs:
        _kill_group(proc)


def _wait(proc: subprocess.Popen[bytes], reached: Callable[[], bool], bound: float) -> str:
    """"reached", "exited" (before reaching), or "timeout"."""
    end = time.monotonic() + bound
    while True:
        if reached():
            return "reached"
        if proc.poll() is not None:
            return "reached" if reached() else "exited"
        if time.monotonic() > end:
            return "timeout"
        time.sleep(0.01)


def _finish(options: Options, env: Mapping[str, str], out: Path) -> tuple[int | None, str]:
    """Run to its end: (exit status, or None on timeout; the tail of its stderr)."""
    proc = _spawn(options, env, out)
    try:
        proc.wait(timeout=options.timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    _kill_group(proc)  # nothing it started outlives the run
    return code, _tail(Path(f"{out}.err"))


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def _clean_run(options: Options, state: Path) -> _Clean:
    state.mkdir(parents=True)
    with Witness(state / "ledger.db", options.answers) as witness:
        code, err = _finish(options, _env(options, witness, state, "clean"), state / "run")
        if code != 0:
            what = "did not finish" if code is None else f"exited {code}"
            raise CrashTestError(
                f"the command {what} in its clean run; nothing to crash-test"
                + (f" (stderr: {err})" if err else ""))
        return _Clean(witness.writes(), witness.effects(), _log(state))


def _log(state: Path) -> list[Any]:
    """The calls in the run's poimen log, oldest first; none without a log."""
    path = state / "poimen.db"
    if not path.is_file():
        return []
    from poimen.store import open_store

    store = open_store(f"sqlite:///{path}", migrate=False, readonly=True)
    try:
        if store.schema_version() == 0:
            return []
        return list(store.list_intents(state=None, tool_id=None, since=None, limit=100_000))
    finally:
        store.close()


def _case(options: Options, state: Path, number: int, call: _Call, clean: _Clean
          ) -> tuple[Case, int]:
    started = time.monotonic()
    state.mkdir(parents=True)
    with Witness(state / "ledger.db", options.answers) as witness:
        env = _env(options, witness, state, state.name)
        killed_env = dict(env)
        marker = state / "paused"
        if call.hold is not None:
            witness.arm(call.hold)
            reached: Callable[[], bool] = witness.reached.is_set
        else:
            assert call.call_id is not None
            killed_env |= {"POIMEN_PAUSE_AT": KERNEL_POINTS[call.point],
                           "POIMEN_PAUSE_FILE": str(marker), "POIMEN_CRASH_CALL": call.call_id}
            reached = marker.exists
        proc = _spawn(options, killed_env, state / "killed")
        how = _wait(proc, reached, options.timeout)
        _kill_group(proc)
        base = Case(number, call.label, call.point, "ok")

        def done(**kw: Any) -> tuple[Case, int]:
            from dataclasses import replace

            return replace(base, seconds=time.monotonic() - started, **kw), witness.tls_refused

        if how != "reached":
            what = ("ran to its end without reaching it" if how == "exited"
                    else f"did not reach it within {options.timeout:g}s")
            return done(status="not_reached", detail=f"the run {what}: is the agent "
                        "deterministic (the same calls with the same arguments every run)?")
        code, err = _finish(options, env, state / "restart")
        if code != 0:
            what = "did not finish" if code is None else f"exited {code}"
            return done(status="restart_failed", detail=f"the restart {what}"
                        + (f" (stderr: {err})" if err else ""))
        effects = witness.effects()
        doubles = _doubles(effects, clean.effects, witness.writes(),
                           suggest=call.hold is not None)
        if call.hold is not None:
            sig = call.hold.signature
            kw: dict[str, Any] = {"effects": effects[sig], "clean": clean.effects[sig]}
        else:
            intents = _log(state)
            states = {i.call_id: i.state.value for i in intents}
            kw = {"state": states.get(call.call_id, "not in the log"),
                  "effects": sum(effects.values()), "clean": sum(clean.effects.values()),
                  "unfinished": tuple(
                i.call_id for i in intents if i.state.value == "DISPATCHED")}
        status = "double" if doubles else "unfinished" if kw.get("unfinished") else "ok"
        return done(status=status, doubles=doubles, **kw)


def _doubles(effects: Counter[str], clean: Counter[str], writes: Sequence[Write], *,
             suggest: bool) -> tuple[Double, ...]:
    """The writes whose content took effect more often than in the clean run (a content the
    clean run did not have: more than once)."""
    out = []
    for sig, n in sorted(effects.items()):
        if n <= max(clean[sig], 1):
            continue
        same = [w for w in writes if w.signature == sig]
        out.append(Double(label(sig), n, clean[sig], _suggestion(same) if suggest else None))
    return tuple(out)


def _suggestion(writes: Sequence[Write]) -> _suggest.Suggestion:
    first = writes[0]
    # In the order the body was sent, mostly the tool's parameters' (what `poimen scan` names).
    fields = list(first.body) if isinstance(first.body, dict) else []
    return _suggest.for_http(first.method, fields,
                             has_key=any(w.key for w in writes),
                             has_request_id=any(w.request_id for w in writes))
