"""A module of an optional extra, imported without it, names the extra to install. Each runs
in a child process where the extra's packages cannot be imported (``sys.modules[name] = None``
makes Python refuse them, as if they were not installed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.operator_app import ROOT

CHILD = """
import sys
for name in sys.argv[2:]:
    sys.modules[name] = None
from poimen.errors import MissingExtraError
try:
    __import__(sys.argv[1])
except MissingExtraError as exc:
    assert isinstance(exc, ImportError), type(exc).__mro__
    print(f"extra={exc.extra} {exc}")
else:
    print("imported")
"""

CASES = [
    ("poimen.integrations.mcp", ("mcp",), "mcp"),
    ("poimen.integrations.mcp", ("jsonschema",), "mcp"),
    ("poimen.integrations.dbos", ("dbos",), "dbos"),
    ("poimen.integrations.temporal", ("temporalio",), "temporal"),
    ("poimen.integrations.langgraph", ("langchain_core",), "langgraph"),
    ("poimen.integrations.openai_agents", ("agents",), "openai-agents"),
    ("poimen.integrations.pydantic_ai", ("pydantic_ai",), "pydantic-ai"),
    ("poimen.console", ("starlette",), "console"),
    ("poimen.console", ("jinja2",), "console"),
    ("poimen.otel", ("opentelemetry",), "otel"),
]


@pytest.mark.parametrize(("module", "blocked", "extra"), CASES, ids=[c[1][0] for c in CASES])
def test_a_module_imported_without_its_extra_names_the_extra(
    module: str, blocked: tuple[str, ...], extra: str
) -> None:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, module, *blocked],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    line = r.stdout.strip()
    assert line.startswith(f"extra={extra} {module} needs the extra {extra}: "), line
    assert f"pip install 'poimen[{extra}]'" in line
    assert blocked[0] in line  # what could not be imported, for the case it is not the extra


def test_each_module_imports_with_its_extra() -> None:
    # The same child, nothing blocked: the refusal above is about the missing package alone.
    for module in sorted({c[0] for c in CASES}):
        r = subprocess.run(
            [sys.executable, "-c", CHILD, module], cwd=ROOT, capture_output=True, text=True,
            timeout=120,
        )
        assert r.stdout.strip() == "imported", (module, r.stdout, r.stderr[-2000:])
