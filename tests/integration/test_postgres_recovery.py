"""Many processes, one PostgreSQL intent log: racing recoverers, recovery across hosts, and a
stalled worker whose late outcome is refused (issue 4, acceptance 2-4).

Orphans are made for real: a child process dispatches the calls, holds each at a crash point
(`poimen.testing.spawn_held_calls`) and is SIGKILLed. Effects are counted in the provider's ledger.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from poimen.store import Store
from poimen.testing import (
    CHARGE,
    EMAIL,
    SHIP,
    ProviderClient,
    held_call,
    spawn_held_calls,
)

pytestmark = pytest.mark.postgres


@pytest.fixture
def store(postgres_store: Store) -> Store:
    return postgres_store


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    return env


def plain_effects(ledger: ProviderClient) -> dict[str, int]:
    """Unsafe effects in the ledger, by recipient."""
    counts: dict[str, int] = {}
    for e in ledger.entries(kind="plain"):
        counts[e["body"]["to"]] = counts.get(e["body"]["to"], 0) + 1
    return counts


def hold_and_kill(
    url: str, provider_url: str, ledger: ProviderClient, count: int, tmp: Path, **options: Any
) -> dict[str, int]:
    """Dispatch `count` calls in a child, hold each at its crash point, SIGKILL the child.

    Returns the Unsafe effects that landed before the kill: recovery must add none."""
    ready = tmp / "ready.json"
    proc = spawn_held_calls(url, provider_url, count, ready, **options)
    deadline = time.monotonic() + 300  # a bound for a broken child only: we wait on `ready`
    while not ready.exists():
        if proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"holding child exited {proc.returncode}:\n{err[-3000:]}")
        assert time.monotonic() < deadline, "holding child never got all calls in flight"
        time.sleep(0.02)
    assert json.loads(ready.read_text())["held"] == count
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=10)
    time.sleep(0.2)  # let the provider finish a write it had already received
    return plain_effects(ledger)


def recoverers(
    url: str, provider_url: str, n: int, *, host: str | None = None, timeout: float = 2.0
) -> list[dict[str, Any]]:
    """`n` recovery processes started at once; each runs one pass. Returns their reports.
    `timeout` is their tools' (and lookups') HTTP timeout."""
    procs = []
    for i in range(n):
        cmd = [
            sys.executable,
            "-m",
            "poimen.testing",
            "recover",
            "--db",
            url,
            "--provider",
            provider_url,
            "--timeout",
            str(timeout),
            "--worker-id",
            f"recoverer-{i}",
        ]
        if host:
            cmd += ["--host", host]
        procs.append(
            subprocess.Popen(
                cmd, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def settle_stragglers(
    url: str, provider_url: str, store: Store, host: str | None = None, timeout: float = 2.0
) -> None:
    """Intents a pass deferred (a lookup before a deadline, or one that met a provider timeout
    on a loaded machine) are finished by later passes, each run once they are due. Never more
    than three."""
    for _ in range(3):
        unfinished = store.list_unfinished(after_id="", limit=100_000)
        if not unfinished:
            return
        # A takeover moves a Queryable deadline to now + timeout (what the stopped owner sent
        # may still land) and defers "not landed" until then: wait for the rows' own times.
        due = max(i.next_check_at or 0.0 for i in unfinished)
        time.sleep(max(0.0, due - store.now() + 0.05))
        recoverers(url, provider_url, 1, host=host, timeout=timeout)


def wait_past_deadlines(store: Store) -> None:
    # A Queryable "not landed" answer is trusted only after the call's deadline.
    latest = max(i.deadline_at or 0.0 for i in store.list_intents(limit=100_000))
    time.sleep(max(0.0, latest - store.now() + 0.05))


def check_ledger(
    store: Store, ledger: ProviderClient, prefix: str, count: int, landed: dict[str, int]
) -> None:
    """Every call settled by its class, counted against the provider's own ledger."""
    plain = plain_effects(ledger)
    keyed: dict[str, int] = {}
    for e in ledger.entries(kind="keyed"):
        keyed[e["key"]] = keyed.get(e["key"], 0) + 1
    requests: dict[str, int] = {}
    for e in ledger.entries(kind="request"):
        requests[e["request_id"]] = requests.get(e["request_id"], 0) + 1
    problems: list[str] = []
    for i in range(count):
        call_id, tool, args, point = held_call(prefix, i)
        it = store.get_by_call_id(call_id)
        assert it is not None, f"{call_id} was never recorded"
        if tool == CHARGE:
            got = (it.state.value, keyed.get(it.key or "", 0))
            want = ("COMPLETED", 1)
        elif tool == SHIP:
            got = (it.state.value, requests.get(it.request_id or "", 0))
            want = ("COMPLETED", 1)
        else:
            # Never re-issued: the ledger holds what landed before the kill, and nothing
            # can have landed from a call held before its effect.
            got = (it.state.value, plain.get(args["to"], 0))
            want = ("INDETERMINATE", landed.get(args["to"], 0))
            if point != "after_effect" and landed.get(args["to"], 0):
                problems.append(f"{call_id}: an effect landed from a call held at {point}")
            kinds = [e.kind for e in store.events(it.id)]
            notes = store.notifications(it.id)
            if kinds.count("indeterminate") != 1 or len(notes) != 1:
                problems.append(
                    f"{call_id}: {kinds.count('indeterminate')} indeterminate "
                    f"events, {len(notes)} notifications"
                )
        if got != want:
            problems.append(f"{call_id} ({tool} held at {point}): {got}, want {want}")
    assert not problems, "\n".join(problems[:30])
    assert sum(landed.values()) > 0, "no Unsafe effect landed before the kill: nothing tested"


def test_four_recoverers_race_over_a_thousand_orphans(
    postgres_url: str, store: Store, provider: Any, ledger: ProviderClient, tmp_path: Path
) -> None:
    count = 1000
    # Timeouts far above any request's time on a loaded machine: a SHIP call held after its
    # effect must have had its request answered, not timed out, for its lookup to find it.
    # The deadlines they set are waited for below, not guessed.
    timeout = 30.0
    landed = hold_and_kill(
        postgres_url, provider.url, ledger, count, tmp_path, prefix="race", timeout=timeout
    )
    assert len(store.list_unfinished(after_id="", limit=count + 1)) == count
    wait_past_deadlines(store)
    started = time.monotonic()
    recoverers(postgres_url, provider.url, 4, timeout=timeout)
    took = time.monotonic() - started
    settle_stragglers(postgres_url, provider.url, store, timeout=timeout)
    assert store.list_unfinished(after_id="", limit=10) == []
    check_ledger(store, ledger, "race", count, landed)
    # One resolution per intent in the history, and the work really was shared.
    retried_by: dict[str, int] = {}
    for i in range(count):
        _, tool, _, point = held_call("race", i)
        it = store.get_by_call_id(held_call("race", i)[0])
        assert it is not None
        events = store.events(it.id)
        kinds = [e.kind for e in events]
        if tool == EMAIL:
            continue
        if tool == SHIP and point == "after_effect":
            assert kinds.count("landed_by_lookup") == 1 and "retry" not in kinds, kinds
        else:
            # A second retry only ever follows an attempt whose outcome was unknown.
            assert kinds.count("retry") == 1 + kinds.count("outcome_unknown"), kinds
            assert kinds.count("completed") == 1, kinds
            actor = next(e.actor for e in events if e.kind == "retry")
            retried_by[actor] = retried_by.get(actor, 0) + 1
    assert len(retried_by) >= 2, f"one recoverer did everything: {retried_by} in {took:.1f}s"
