"""`poimen crashtest` against real agents (plain Python, PydanticAI with FunctionModel, LangGraph
with a scripted chat model), each without poimen and with it: real child processes, SIGKILLed
process groups, restarts. The witness's ledger (read here from the kept files with sqlite3, not
through the report) is the judge: the report must name exactly the doubles the ledger holds.

junit-10.xsd beside this file is the Jenkins xunit plugin's JUnit schema (MIT, its header kept),
taken from pytest 9.2.0's source distribution on PyPI (testing/example_scripts/junit-10.xsd):
no installable package ships it."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import xmlschema

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
JUNIT = xmlschema.XMLSchema(str(Path(__file__).with_name("junit-10.xsd")))
AGENTS = {
    "plain": ([PY, "-m", "tests.crashtest.agents.plain_shop", "naive"],
              [PY, "-m", "tests.crashtest.agents.plain_shop", "poimen"]),
    "pydantic-ai": ([PY, "examples/shop_agent.py"], [PY, "examples/shop_agent_poimen.py"]),
    "langgraph": ([PY, "-m", "tests.crashtest.agents.langgraph_shop", "naive"],
                  [PY, "-m", "tests.crashtest.agents.langgraph_shop", "poimen"]),
}
pytestmark = pytest.mark.timeout(600)


def run_crashtest(keep: Path, command: list[str], *options: str,
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "poimen.cli", "crashtest", "--keep", str(keep), *options, "--", *command],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )


def ledger(path: Path) -> Counter[str]:
    """What the witness applied, straight from its ledger: content -> times."""
    with sqlite3.connect(path) as db:
        return Counter(body for (body,) in db.execute("SELECT body FROM entries"))


def ledger_doubles(keep: Path, case: int, point: str) -> dict[str, int]:
    clean = ledger(keep / "clean" / "ledger.db")
    seen = ledger(keep / f"case-{case}-{point}" / "ledger.db")
    return {body: n for body, n in seen.items() if n > max(clean[body], 1)}


def label(body: str) -> str:
    from poimen.crashtest._witness import label as shown

    return shown(body)


def crashtest_agent(request: Any, factory: pytest.TempPathFactory, poimen: bool
                    ) -> tuple[Any, ...]:
    tmp = factory.mktemp(f"{'poimen' if poimen else 'naive'}-{request.param}")
    r = run_crashtest(tmp / "keep", AGENTS[request.param][poimen], "--json", "-j", "2",
                      "--junit", str(tmp / "junit.xml"))
    return request.param, r, tmp


@pytest.fixture(scope="module", params=sorted(AGENTS))
def naive(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    return crashtest_agent(request, tmp_path_factory, poimen=False)


@pytest.fixture(scope="module", params=sorted(AGENTS))
def with_poimen(request: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ...]:
    return crashtest_agent(request, tmp_path_factory, poimen=True)


def test_without_poimen_it_reports_the_doubles_the_witness_ledger_holds(
    naive: tuple[Any, ...],
) -> None:
    agent, r, tmp = naive
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    assert report["mode"] == "witness" and report["ok"] is False
    assert report["calls"] == 2 and len(report["cases"]) == 4
    for case in report["cases"]:
        found = ledger_doubles(tmp / "keep", case["case"], case["killed"])
        assert {d["write"]: d["effects"] for d in case["doubles"]} == {
            label(body): n for body, n in found.items()}, (agent, case)
        assert case["status"] == ("double" if found else "ok")
        # Killed after the provider applied it: the restart sends it again, each time.
        assert case["effects"] == (2 if case["killed"] == "after" else 1), (agent, case)
    needs = {d["write"].split()[1].rsplit("/", 1)[-1]: d["suggestion"]["effect"]
             for c in report["cases"] for d in c["doubles"]}
    assert needs == {"charges": "Idempotent",  # it sent a key, a new one per attempt
                     "messages": "Unsafe"}
    if agent == "pydantic-ai":  # the agent `poimen scan` reads too: the same suggestion
        from poimen.scan import scan

        [charge] = [t for t in scan([ROOT / "examples/shop_agent.py"]).findings
                    if t.name == "charge"]
        assert charge.suggestion is not None
        assert {d["suggestion"]["code"] for c in report["cases"] for d in c["doubles"]
                if "/charges" in d["write"]} == {charge.suggestion.code}
    valid_junit(report, tmp / "junit.xml")


def test_with_poimen_the_same_agent_doubles_nothing_and_leaves_nothing_unfinished(
    with_poimen: tuple[Any, ...],
) -> None:
    agent, r, tmp = with_poimen
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["mode"] == "poimen" and report["ok"] is True and len(report["cases"]) == 4
    for case in report["cases"]:
        assert ledger_doubles(tmp / "keep", case["case"], case["killed"]) == {}, (agent, case)
        assert case["doubles"] == [] and case["unfinished"] == []
        tool = case["call"].split()[0]
        # The charge is sent again under its key (or not at all); the receipt never again.
        assert case["state"] == ("COMPLETED" if tool == "charge" else "INDETERMINATE"), case
    charge = [c for c in report["cases"] if c["call"].startswith("charge")]
    for case in charge:
        entries = ledger(tmp / "keep" / f"case-{case['case']}-{case['killed']}" / "ledger.db")
        assert sorted(entries.values()) == [1, 1]  # one charge, one receipt
    valid_junit(report, tmp / "junit.xml")


def valid_junit(report: dict[str, Any], path: Path) -> None:
    """Valid against the Jenkins JUnit schema, one test case per call and crash point."""
    xml = path.read_text(encoding="utf-8")
    JUNIT.validate(xml)
    [suite] = JUNIT.to_dict(xml)["testsuite"]
    assert len(suite["testcase"]) == len(report["cases"])
    failing = sum(1 for c in report["cases"] if c["status"] != "ok")
    assert int(suite["@failures"]) + int(suite["@errors"]) == failing
    assert sum("failure" in tc for tc in suite["testcase"]) == failing


def tiny(behaviour: str) -> list[str]:
    return [PY, "-m", "tests.crashtest.agents.tiny", behaviour]


def test_the_table_names_the_class_each_double_needs(tmp_path: Path) -> None:
    r = run_crashtest(tmp_path / "keep", tiny("proxy-keyed"))
    assert r.returncode == 1
    # A real provider's address, reached through HTTP_PROXY, is seen at the witness.
    row = 'POST http://payments.example.test/v1/charges {"amount_cents":1200}'
    assert f"{row}  after   2 (clean run: 1)  DOUBLE" in r.stdout
    assert f"{row}  before  1                 ok" in r.stdout
    assert 'Idempotent(key=KeyDerivation.fields("amount_cents"))' in r.stdout
    assert "FAILED: 1 of 2 cases (1 with a double effect)" in r.stdout
    assert "crashtest [" not in r.stderr  # no progress bar off a terminal


def test_a_call_the_runs_do_not_repeat_is_reported_not_reached(tmp_path: Path) -> None:
    r = run_crashtest(tmp_path / "keep", tiny("random"), "--json", "--junit",
                      str(tmp_path / "j.xml"))
    assert r.returncode == 1
    cases = json.loads(r.stdout)["cases"]
    assert {c["status"] for c in cases} == {"not_reached"}
    assert "deterministic" in cases[0]["detail"]
    xml = (tmp_path / "j.xml").read_text(encoding="utf-8")
    JUNIT.validate(xml)
    assert xml.count("<error ") == 2


def test_a_restart_that_fails_is_a_failed_case(tmp_path: Path) -> None:
    r = run_crashtest(tmp_path / "keep", tiny("restart-fails"), "--json")
    assert r.returncode == 1
    cases = json.loads(r.stdout)["cases"]
    assert {c["status"] for c in cases} == {"restart_failed"}
    assert "exited 3" in cases[0]["detail"] and "confuses me" in cases[0]["detail"]


def test_a_poimen_call_left_dispatched_after_the_restart_fails_the_case(tmp_path: Path) -> None:
    r = run_crashtest(tmp_path / "keep", tiny("unfinished"), "--json")
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    assert report["mode"] == "poimen"
    assert [(c["status"], c["unfinished"]) for c in report["cases"]] == [
        ("unfinished", ["ping-1"])] * 2


@pytest.mark.parametrize(("behaviour", "message"), [
    ("fail", "the command exited 4 in its clean run; nothing to crash-test (stderr: the agent "
     "cannot start)"),
    ("nothing", "the clean run made no write at the witness"),
])
def test_a_command_that_cannot_be_crash_tested_is_a_usage_error(
    tmp_path: Path, behaviour: str, message: str
) -> None:
    r = run_crashtest(tmp_path / "keep", tiny(behaviour))
    assert r.returncode == 2
    assert r.stderr.startswith(f"poimen: {message}") and r.stderr.count("\n") == 1
    assert r.stdout == ""


def test_no_command_and_a_used_keep_directory_are_usage_errors(tmp_path: Path) -> None:
    r = subprocess.run([PY, "-m", "poimen.cli", "crashtest"], cwd=ROOT, capture_output=True,
                       text=True)
    assert (r.returncode, r.stderr) == (2, "poimen: no command: poimen crashtest [options] -- "
                                        "COMMAND ...\n")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").touch()
    r = run_crashtest(tmp_path / "used", tiny("one"))
    assert r.returncode == 2 and "is not empty" in r.stderr


def test_https_is_refused_at_the_witness_and_reported(tmp_path: Path) -> None:
    r = run_crashtest(tmp_path / "keep", tiny("https"))
    assert r.returncode == 1  # the plain POST doubles
    assert "HTTPS requests were refused" in r.stdout


def test_cases_run_in_parallel_with_j(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    env = dict(os.environ, TINY_SHARED=str(shared))
    r = run_crashtest(tmp_path / "keep", tiny("overlap"), "-j", "2", env=env)
    assert r.returncode == 1, r.stderr
    assert any(p.name.startswith("saw-") for p in shared.iterdir())


def test_the_progress_bar_shows_on_a_terminal(tmp_path: Path) -> None:
    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(
            [PY, "-m", "poimen.cli", "crashtest", "--", *tiny("one")], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=follower, text=True, timeout=300)
        os.close(follower)
        follower = -1
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert proc.returncode == 1
    assert b"crashtest [" in shown and b"2/2 100%" in shown


def test_interrupted_it_stops_the_runs_it_started(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    env = dict(os.environ, TINY_SHARED=str(shared))
    # SIGINT as a terminal delivers it: a suite run in the background (a non-interactive
    # shell's `&`) hands its children SIGINT ignored, and a program keeps that.
    proc = subprocess.Popen([PY, "-m", "poimen.cli", "crashtest", "--timeout", "3000",
                             "--", *tiny("hang")], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        end = time.monotonic() + 120
        while not list(shared.iterdir()):  # a case's run is up, in a session of its own
            assert proc.poll() is None and time.monotonic() < end, proc.communicate()
            time.sleep(0.05)
        [pid] = [int(p.name) for p in shared.iterdir()]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
        end = time.monotonic() + 60
        while Path(f"/proc/{pid}").exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert not Path(f"/proc/{pid}").exists()
    finally:  # a failure here leaves nothing running
        proc.kill()
        proc.communicate()
        for p in shared.iterdir():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(p.name), signal.SIGKILL)
