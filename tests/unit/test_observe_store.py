"""The seam between the store and the observers: every write a store can make is reported
or known to change no intent's state (and each call of a reported write reports it), and a
kernel without observers imports nothing of OpenTelemetry."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poimen._engine.hooks import OBSERVED_WRITES, UNOBSERVED
from poimen.store.postgres import PostgresStore
from poimen.store.sqlite import SqliteStore

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("store", [SqliteStore, PostgresStore])
def test_every_store_method_is_reported_or_known_to_change_no_state(store: type) -> None:
    names = {n for n in dir(store) if not n.startswith("_") and callable(getattr(store, n))}
    unknown = names - OBSERVED_WRITES - UNOBSERVED
    assert not unknown, (
        f"{store.__name__} has methods the observers know nothing of: {sorted(unknown)}; "
        "report them (poimen._engine.hooks, OBSERVED_WRITES) or list them in UNOBSERVED"
    )
    assert not OBSERVED_WRITES & UNOBSERVED


#: Functions that call a reported write and report nothing themselves, and why that is right.
NOT_REPORTING = {
    "protocol._claim": "a step of _retry, which reports",
    "protocol._defer": "a step of decide_steps and _retry, which report",
    "transactional._land": "run_steps reports the outcome it committed; one fenced out is the "
    "unknown outcome's fenced write that follows",
    "_ops.resolve": "Kernel.resolve reports; the CLI's and console's processes observe nothing",
    "_ops.abandon": "Kernel.abandon reports; as above",
    "_ops.decide_approval": "Kernel.approve and reject report; as above",
    "_approval.approve_edited": "approval with edited arguments: reported by no kernel (as before)",
}


def test_every_call_of_a_reported_write_reports_it() -> None:
    """Nothing wraps the store: the function that makes a reported write reports it (through
    `poimen._engine.hooks`, the observers' own hooks, or the capability layer's `denied`), or is
    known not to have to."""
    src = ROOT / "src" / "poimen"
    found: dict[str, set[str]] = {}
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        if rel.parts[0] == "store":
            continue
        for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            nodes = list(ast.walk(fn))
            writes = {
                n.attr
                for n in nodes
                if isinstance(n, ast.Attribute)
                and n.attr in OBSERVED_WRITES
                and "store" in (getattr(n.value, "id", None), getattr(n.value, "attr", None))
            }
            if not writes:
                continue
            reports = any(
                isinstance(n, ast.Attribute)
                and (
                    getattr(n.value, "id", None) == "_hooks"
                    or n.attr in ("denied", "dispatched", "settled")  # the hooks themselves
                )
                for n in nodes
            )
            found[f"{rel.stem}.{fn.name}"] = writes if not reports else set()
    silent = {name: sorted(w) for name, w in found.items() if w and name not in NOT_REPORTING}
    assert not silent, f"store writes whose events nobody reports: {silent}"
    stale = sorted(n for n in NOT_REPORTING if not found.get(n))
    assert not stale, f"NOT_REPORTING names functions that no longer need it: {stale}"


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
    # The SDK's own floor beside poimen's figures (the same span and point made by hand
    # around the same calls), and poimen's added cost set against the floor's.
    floor = rows["SDK floor: Kernel.call wrapped by hand in the same span and point"]
    assert floor["ratio"] == pytest.approx(floor["median"] / base["median"])
    added = rows["OpenTelemetry SDK observer: added per call, against the floor's"]
    assert added["ratio"] == pytest.approx(added["median"] / added["extra"]["floor_added"])
    by_hand = rows["4 async callers at FULL, each acall wrapped by hand (the SDK floor)"]
    assert by_hand["ratio_of"] == "x no observer"
    paired = rows["4 async callers at FULL, SDK observer against the floor"]
    assert paired["ratio"] == paired["median"] and paired["ratio_of"] == "x the floor's rate"
    assert len(rows) == 13
