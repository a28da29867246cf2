"""The package and verification/ are `mypy --strict` clean (config in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# A cold mypy run over the package takes minutes on a loaded 2-core machine: the suite's
# 120 s default is sized for single steps, not for a whole type check.
@pytest.mark.timeout(600)
def test_src_is_mypy_strict_clean(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout
