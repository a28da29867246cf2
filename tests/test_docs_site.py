"""The documentation site builds in strict mode (MkDocs Material + mkdocstrings): a broken
link, an unknown page or a docstring the API reference cannot render fails the build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    page = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    for name in ("Kernel", "Idempotent", "ToolContext", "Indeterminate"):
        assert name in page
