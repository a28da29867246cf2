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


def test_every_public_name_has_a_docstring() -> None:
    import inspect

    import poimen
    import poimen.call_ids
    import poimen.errors
    import poimen.events
    import poimen.operator
    import poimen.otel
    import poimen.testing
    import poimen.webhooks

    missing = []
    for mod in (poimen, poimen.errors, poimen.call_ids, poimen.testing, poimen.operator,
                poimen.webhooks, poimen.events, poimen.otel):
        names = getattr(mod, "__all__", None) or [n for n in vars(mod) if not n.startswith("_")]
        for name in names:
            obj = getattr(mod, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if not (obj.__doc__ or "").strip():
                missing.append(f"{mod.__name__}.{name}")
            if inspect.isclass(obj):
                for attr, value in vars(obj).items():
                    if attr.startswith("_"):
                        continue
                    # An override documented by the method it overrides counts.
                    documented = (inspect.getdoc(getattr(obj, attr)) or "").strip()
                    if (inspect.isfunction(value) or isinstance(value, property)) and not documented:
                        missing.append(f"{mod.__name__}.{name}.{attr}")
    assert missing == []
