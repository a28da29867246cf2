"""The seam between the store and the observers: every write a store can make is reported
or known to change no intent's state, and a kernel without observers imports nothing of
OpenTelemetry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poimen._observed_store import OBSERVED_WRITES, UNOBSERVED, ObservedStore
from poimen.store.postgres import PostgresStore
from poimen.store.sqlite import SqliteStore

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("store", [SqliteStore, PostgresStore])
def test_every_store_method_is_reported_or_known_to_change_no_state(store: type) -> None:
    names = {n for n in dir(store) if not n.startswith("_") and callable(getattr(store, n))}
    unknown = names - OBSERVED_WRITES - UNOBSERVED
    assert not unknown, (
        f"{store.__name__} has methods the observers know nothing of: {sorted(unknown)}; "
        "report them in poimen._observed_store.ObservedStore or list them in UNOBSERVED"
    )
    assert not OBSERVED_WRITES & UNOBSERVED
    for name in OBSERVED_WRITES & names:
        # Defined by the wrapper itself (the async forms are set per store), not passed on.
        assert name in vars(ObservedStore) or name in ObservedStore.__annotations__, name


def test_a_kernel_without_observers_imports_nothing_of_opentelemetry(tmp_path: Path) -> None:
    code = f"""
import json, sys
from poimen import Caps, Kernel, Unsafe
k = Kernel("sqlite:///{tmp_path / 'x.db'}", notifiers=[])
@k.tool(id="t", effects=Unsafe(), caps=Caps(), timeout=5)
def t(ctx, n: int) -> int:
    return n
out = k.call("t", {{"n": 1}}, call_id="c")
k.recover()
k.close()
print(json.dumps([type(out).__name__, sorted(m for m in sys.modules if "opentelemetry" in m)]))
"""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == ["Completed", []]


def test_the_observability_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "observe.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    r = subprocess.run(
        [sys.executable, "-m", "bench.observe", "--quick", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(out.read_text())}
    base = rows["Kernel.call, no observer"]
    sdk = rows["Kernel.call, OpenTelemetry observer, SDK tracer + meter"]
    assert base["ratio"] is None and sdk["ratio_of"] == "x no observer"
    assert sdk["ratio"] == pytest.approx(sdk["median"] / base["median"])
    assert len(rows) == 6
