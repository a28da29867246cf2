"""The audit chain under concurrent writers, on each backend: threads of one kernel and
separate processes, each writing calls, events and denials at once, leave one linear chain
that verifies, with every row linked exactly once (the rows themselves are the witness).
And a log written before the chain joins it when it is migrated."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from poimen import Kernel
from poimen._core.audit import GENESIS, link
from poimen.audit import verify
from poimen.store import open_store
from tests.contract.test_migrations import write_log_before
from tests.contract.test_store_contract import raw
from tests.integration.operator_app import ROOT
from tests.integration.test_audit_chain import TERMINAL, app, links

CALLS = 12

# One writer process: calls of both kinds, an event on each settled call, a denial.
CHILD = """
import sys
from tests.integration.test_audit_chain import app
url, name, calls = sys.argv[1], sys.argv[2], int(sys.argv[3])
k = app(url)
for i in range(calls):
    out = k.call("add", {"n": i}, call_id=f"{name}/{i}")
    k.store.record_event(out.intent_id, "seen", actor=name, detail={"i": i}, now=k.store.now())
    if i % 4 == 0:
        k.call("post", {"n": i}, call_id=f"{name}/post/{i}")
k.store.record_denial(tool_id="add", intent_id=None, attempt=None, action="http",
                      target="x", reason=name, now=k.store.now())
k.close()
"""


def writes(k: Kernel, name: str, calls: int) -> None:
    for i in range(calls):
        out = k.call("add", {"n": i}, call_id=f"{name}/{i}")
        k.store.record_event(out.intent_id, "seen", actor=name, detail={"i": i},
                             now=k.store.now())
        if i % 4 == 0:
            k.call("post", {"n": i}, call_id=f"{name}/post/{i}")
    k.store.record_denial(tool_id="add", intent_id=None, attempt=None, action="http",
                          target="x", reason=name, now=k.store.now())


def one_linear_chain(url: str, writers: int) -> None:
    """The rows written by `writers` writers form positions 1..N, each once, each link the
    hash of the one before: the count of rows is the witness."""
    events = raw(url, "SELECT COUNT(*) FROM events")[0][0]
    denials = raw(url, "SELECT COUNT(*) FROM denials")[0][0]
    settled = raw(url, f"SELECT COUNT(*) FROM intents WHERE state IN {TERMINAL}")[0][0]
    assert settled == writers * CALLS and denials == writers
    assert events >= writers * CALLS  # `seen`, and the histories the Unsafe calls wrote
    rows = links(url)
    assert [x.seq for x in rows] == list(range(1, events + denials + settled + 1))
    prev = GENESIS
    for x in rows:
        assert link(prev, x.kind, x.values) == x.hash
        prev = x.hash
    store = open_store(url)
    try:
        report = verify(store)
        assert report.ok and report.rows == len(rows), report.line()
        assert store.audit_head().hash == prev  # type: ignore[attr-defined]
    finally:
        store.close()


def test_threads_of_one_kernel_keep_one_chain(store_url: str) -> None:
    k = app(store_url)
    try:
        threads = [threading.Thread(target=writes, args=(k, f"t{n}", CALLS)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads)
    finally:
        k.close()
    one_linear_chain(store_url, 8)


def test_processes_keep_one_chain(store_url: str) -> None:
    app(store_url).close()  # migrated once, before the writers start
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]))
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, store_url, f"p{n}", str(CALLS)],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for n in range(4)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    one_linear_chain(store_url, 4)


def test_a_log_written_before_the_chain_joins_it_when_migrated(store_url: str) -> None:
    write_log_before(store_url, 10)  # versions 1 to 9, with rows of every table
    before = raw(store_url, "SELECT COUNT(*) FROM events")[0][0]
    store = open_store(store_url)
    try:
        report = verify(store)
        assert report.ok, report.line()
        settled = raw(store_url, f"SELECT COUNT(*) FROM intents WHERE state IN {TERMINAL}")
        denials = raw(store_url, "SELECT COUNT(*) FROM denials")[0][0]
        assert report.rows == before + settled[0][0] + denials > 0
    finally:
        store.close()
    # Oldest first: the sealed rows follow their times.
    times = [x.values[2 if x.kind == "event" else 1 if x.kind == "denial" else 24]
             for x in links(store_url)]
    assert times == sorted(times)
