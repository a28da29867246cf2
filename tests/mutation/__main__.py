"""The mutation check of poimen's safety rules: `scripts/mutate` (docs/verification.md).

Each mutant in `mutants.py` is the smallest change that breaks one rule. For each, a copy of
`src/` and `verification/` gets the change, and the tests that guard the rule run against the
copy; the mutant must make them fail ("killed"). The table says which test killed it; a
survivor fails the run. Before any mutant, the same tests run against the unchanged copy and must pass, so a
kill always means the change was seen.

    python -m tests.mutation [--only ID[,ID]] [--list] [--json FILE] [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.mutation.mutants import MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Result:
    id: str
    rule: str
    status: str  # killed | SURVIVED | NOT APPLIED | baseline failed
    killed_by: str
    seconds: float


def _copy(dest: Path) -> Path:
    """A copy of what a mutant may change: `src/` and `verification/` under `dest`."""
    for tree in ("src", "verification"):
        shutil.copytree(ROOT / tree, dest / tree,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def apply(m: Mutant, copy: Path) -> str | None:
    """Apply the mutant to the copy; None, or why it does not apply."""
    path = copy / m.path
    text = path.read_text(encoding="utf-8")
    n = text.count(m.find)
    if n != 1:
        return f"the text to change occurs {n} times in {m.file}, not once"
    path.write_text(text.replace(m.find, m.replace), encoding="utf-8")
    return None


def run_tests(m: Mutant, copy: Path, timeout: float) -> tuple[bool, str]:
    """Run the mutant's tests against the copy; (passed, the first failing test)."""
    # The copy's verification/ and src/ come before the repository's (whose tests/ run).
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([str(copy), str(copy / "src"), str(ROOT)]))
    env.pop("PYTEST_ADDOPTS", None)
    # Nothing may put the repository (its verification/) before the copy: not `-m` (-P), not
    # pytest's own insertion of the tests' root (append: it is on the path already).
    cmd = [sys.executable, "-P", "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "-p", "no:randomly", "--import-mode=append", "--timeout", "300", *m.tests]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "(timed out: counted as killed)"
    if r.returncode == 0:
        return True, ""
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", r.stdout, re.M)
    return False, failed[0] if failed else f"pytest exit {r.returncode}"


def check(m: Mutant, timeout: float) -> Result:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"poimen-mutant-{m.id}-") as tmp:
        copy = _copy(Path(tmp))
        ok, first = run_tests(m, copy, timeout)
        if not ok:
            return Result(m.id, m.rule, "baseline failed", first, time.monotonic() - t0)
        why = apply(m, copy)
        if why is not None:
            return Result(m.id, m.rule, "NOT APPLIED", why, time.monotonic() - t0)
        ok, first = run_tests(m, copy, timeout)
    status = "SURVIVED" if ok else "killed"
    return Result(m.id, m.rule, status, first, time.monotonic() - t0)


def table(results: list[Result]) -> str:
    w = max(len(r.id) for r in results)
    lines = [f"{'mutant':<{w}}  {'status':<15}  killed by / why   (rule)"]
    for r in results:
        lines.append(f"{r.id:<{w}}  {r.status:<15}  {r.killed_by}   ({r.rule}; {r.seconds:.0f}s)")
    killed = sum(r.status == "killed" for r in results)
    lines.append(f"{killed}/{len(results)} killed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/mutate")
    p.add_argument("--only", help="comma-separated mutant ids")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--json", help="write the results as JSON here")
    p.add_argument("--jobs", type=int, default=1, help="mutants checked side by side")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per test run")
    ns = p.parse_args(argv)
    chosen = MUTANTS
    if ns.only:
        want = set(ns.only.split(","))
        chosen = [m for m in MUTANTS if m.id in want]
        unknown = want - {m.id for m in chosen}
        if unknown:
            p.error(f"no such mutants: {', '.join(sorted(unknown))}")
    if ns.list:
        for m in chosen:
            print(f"{m.id}: {m.rule}  [{m.file}]")
        return 0
    with ThreadPoolExecutor(max(1, ns.jobs)) as pool:
        results = list(pool.map(lambda m: check(m, ns.timeout), chosen))
    print(table(results))
    if ns.json:
        Path(ns.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0 if all(r.status == "killed" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
