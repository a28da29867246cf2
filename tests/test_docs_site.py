"""The documentation site builds in strict mode (MkDocs Material + mkdocstrings): a broken
link, an unknown page or a docstring the API reference cannot render fails the build."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_the_docs_site_builds_strict(site: Path) -> None:
    page = (site / "reference" / "api" / "index.html").read_text()
    for name in ("Kernel", "Idempotent", "ToolContext", "Indeterminate"):
        assert name in page


def headings(page: str) -> set[str]:
    return set(re.findall(r'<h[1-6] id="([^"]+)"', page))


def test_the_api_reference_renders_every_public_name(site: Path) -> None:
    import poimen

    api = headings((site / "reference" / "api" / "index.html").read_text())
    assert {f"poimen.{name}" for name in poimen.__all__} <= api
    assert "poimen.__all__" not in api  # the list itself is not an entry
    store = headings((site / "reference" / "store" / "index.html").read_text())
    assert {"poimen.store.open_store", "poimen.store.SqliteStore",
            "poimen.store.postgres.PostgresStore"} <= store
    import poimen.sandbox

    sandbox = headings((site / "reference" / "sandbox" / "index.html").read_text())
    top = {h for h in sandbox if h.count(".") == 2}  # not the members' members
    assert top == {f"poimen.sandbox.{name}" for name in poimen.sandbox.__all__}


def test_each_kernel_parameter_is_a_row_of_its_table(site: Path) -> None:
    import inspect

    from poimen import Kernel

    page = (site / "reference" / "api" / "index.html").read_text()
    start = page.index('id="poimen.Kernel"')
    end = re.compile(r'<h[1-3] id="').search(page, start + 1)
    section = page[start : end.start() if end else len(page)]
    table = section[section.index("<table") : section.index("</table>")]
    rows = re.findall(r"<tr[^>]*>\s*<td>\s*<code>(\w+)</code>\s*</td>", table)
    assert rows == [p for p in inspect.signature(Kernel.__init__).parameters if p != "self"]


def test_args_sections_name_the_parameters_of_their_callable() -> None:
    # An Args section that names a parameter the code does not have (or leaves one out) is
    # a reference that lies.
    import inspect

    import griffe

    import poimen
    import poimen.sandbox
    import poimen.store
    import poimen.store.postgres

    checked, wrong = 0, []
    public = [(m, m.__all__) for m in (poimen, poimen.sandbox, poimen.store)]
    for mod, names in [*public, (poimen.store.postgres, ["PostgresStore"])]:
        for name in names:
            obj = getattr(mod, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            sections = griffe.Docstring(doc).parse("google", warnings=False)
            documented = [p.name for s in sections if s.kind.value == "parameters" for p in s.value]
            if not documented:
                continue
            checked += 1
            target = obj.__init__ if inspect.isclass(obj) else obj
            actual = [p for p in inspect.signature(target).parameters
                      if p not in ("self", "args", "kwargs", "options")]
            if documented != actual:
                wrong.append(f"{mod.__name__}.{name}: {documented} != {actual}")
    assert checked >= 1 and wrong == []


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
