"""The mutation check's list stays true to the code (docs/verification.md, "The mutation check").

The whole check takes about 25 minutes of CPU, so the suite runs it for one mutant only; what it
does check every time is that each mutant still applies: a rule whose code moved would
otherwise drop out of the check without a word.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.mutation.__main__ import ROOT, Result, apply, check
from tests.mutation.mutants import MUTANTS


def test_every_mutant_applies_once_and_names_tests_that_exist(tmp_path: Path) -> None:
    assert len(MUTANTS) >= 40
    assert len({m.id for m in MUTANTS}) == len(MUTANTS), "mutant ids repeat"
    for m in MUTANTS:
        copy = tmp_path / m.id
        target = copy / m.path
        target.parent.mkdir(parents=True)
        target.write_text((ROOT / m.path).read_text(encoding="utf-8"), encoding="utf-8")
        assert apply(m, copy) is None, m.id
        assert target.read_text(encoding="utf-8") != (ROOT / m.path).read_text(
            encoding="utf-8"
        ), m.id
        paths = [t.split("::")[0] for t in m.tests if t.startswith("tests/")]
        assert paths, f"{m.id} names no test"
        for p in paths:
            assert (ROOT / p).exists(), f"{m.id}: {p} does not exist"


@pytest.mark.timeout(600)
def test_one_mutant_is_killed_and_the_unchanged_code_passes_the_same_tests() -> None:
    m = next(m for m in MUTANTS if m.id == "unsafe-retried")
    r: Result = check(m, timeout=500)
    assert r.status == "killed", r
    assert r.killed_by.startswith("tests/unit/test_decide.py::"), r
