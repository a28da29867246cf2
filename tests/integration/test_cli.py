"""The installed `poimen` command, run as a subprocess against logs made by real crashed calls.

Every database here was written by child processes SIGKILLed mid-call; effects are counted
in the provider's ledger, never taken from poimen's own log alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import re
import shutil
import socket
import sqlite3
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from poimen import IntentState
from poimen.errors import NotDispatchedError
from poimen.operator import _ops as op
from poimen.store import open_store
from poimen.store._base import latest_version
from poimen.testing import EMAIL, SHIP, ProviderClient, ProviderProcess
from tests.contract.test_store_contract import dispatch, note
from tests.integration.operator_app import (
    HOOK,
    POIMEN,
    ROGUE,
    ROOT,
    crash,
    poimen,
    poimen_json,
    run_call,
    shadow_denial,
    spawn,
)

APP = "tests.integration.operator_app:make_kernel"
SECRET = "sk-live-0123456789abcdef"
HOOK_ARGS = {
    "channel": "ops",
    "api_token": SECRET,
    "payload": {"text": "deploy done", "password": "hunter2"},
}


def hook_effects(ledger: ProviderClient, channel: str = "ops") -> int:
    return sum(1 for e in ledger.entries(kind="plain") if e["body"].get("channel") == channel)


@dataclass
class Scene:
    db: str
    provider: str
    hook_pid: int
    hook2_pid: int

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return poimen(*args, db=self.db, provider=self.provider)

    def json(self, *args: str) -> Any:
        return poimen_json(*args, db=self.db, POIMEN_TEST_PROVIDER=self.provider)

    def intent(self, ident: str) -> dict[str, Any]:
        data: dict[str, Any] = self.json("show", ident)
        return data


@pytest.fixture
def scene(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> Scene:
    """Two Unsafe calls killed after their effect, one completed call, a sandbox denial and a
    capability denial (an Idempotent tool that set its own key)."""
    assert poimen("migrate", db=store_url).returncode == 0
    hook_pid = crash(tmp_path, store_url, provider.url, HOOK, HOOK_ARGS, "c-hook")
    hook2_pid = crash(
        tmp_path, store_url, provider.url, HOOK, {**HOOK_ARGS, "channel": "ops2"}, "c-hook-2"
    )
    assert (
        run_call(
            store_url, provider.url, SHIP, {"order_id": "o-1", "address": "1 Main St"}, "c-ship"
        )["type"]
        == "Completed"
    )
    shadow_denial(store_url, provider.url, "c-shadow")
    rogue = run_call(store_url, provider.url, ROGUE, {"order_id": "o-5"}, "c-rogue")
    assert rogue["type"] == "Failed"  # its self-keyed write was denied, so it never happened
    assert ledger.count(kind="keyed") == 0
    assert hook_effects(ledger) == 1 and hook_effects(ledger, "ops2") == 1
    return Scene(store_url, provider.url, hook_pid, hook2_pid)


def test_recover_status_list_and_show_a_killed_unsafe_call(
    scene: Scene, ledger: ProviderClient
) -> None:
    before = scene.json("status")
    assert before["unfinished"] == 2 and before["indeterminate"] == 0
    assert before["by_tool"][SHIP] == {"COMPLETED": 1}
    listed = scene.json("intents", "--state", "DISPATCHED")
    assert sorted(i["call_id"] for i in listed) == ["c-hook", "c-hook-2"]

    # Recovery needs the registrations: without --app it is a usage error and does nothing.
    r = scene.cli("recover")
    assert r.returncode == 2 and "--app" in r.stderr
    assert scene.json("status")["unfinished"] == 2

    r = scene.cli("recover", "--app", APP, "--progress", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["scanned"] == 2 and report["indeterminate"] == 2
    assert "2/2 100%" in r.stderr
    # Unsafe is never re-issued: the provider still saw each effect once.
    assert hook_effects(ledger) == 1 and hook_effects(ledger, "ops2") == 1

    st = scene.json("status")
    assert st["indeterminate"] == 2 and st["unfinished"] == 0 and st["total"] == 4
    assert st["by_state"]["INDETERMINATE"] == 2 and st["by_tool"][HOOK] == {"INDETERMINATE": 2}
    oldest = st["oldest_indeterminate"]
    assert oldest["call_id"] == "c-hook" and oldest["reason"] == "unsafe_unknown_outcome"
    text = scene.cli("status")
    assert text.returncode == 0
    assert f"oldest INDETERMINATE: {oldest['id']}" in text.stdout
    assert "2 INDETERMINATE" in text.stdout

    rows = scene.json("intents", "--state", "indeterminate", "--tool", HOOK, "--since", "1h")
    assert [i["call_id"] for i in rows] == ["c-hook", "c-hook-2"]
    assert all(i["reason"] == "unsafe_unknown_outcome" for i in rows)
    table = scene.cli("intents", "--state", "INDETERMINATE")
    assert table.returncode == 0 and oldest["id"] in table.stdout
    nothing = scene.cli("intents", "--tool", "no.such.tool")
    assert nothing.returncode == 0 and "no intents match" in nothing.stdout
    assert scene.cli("intents", "--since", "2999-01-01", "--fail-if-empty").returncode == 1
    bad = scene.cli("intents", "--state", "LOST")
    assert bad.returncode == 2 and "LOST" in bad.stderr

    shown = scene.intent("c-hook")
    assert shown["id"] == oldest["id"] and shown["state"] == "INDETERMINATE"
    assert shown["args"] == {
        "channel": "ops",
        "api_token": "[redacted]",
        "payload": {"text": "deploy done", "password": "[redacted]"},
    }
    [attempt] = shown["attempts"]
    assert attempt["owner"]["pid"] == scene.hook_pid and attempt["outcome"] is None
    assert [e["kind"] for e in shown["events"]] == ["dispatched", "indeterminate"]
    assert shown["events"][1]["detail"]["reason"] == "unsafe_unknown_outcome"
    assert [n["delivery_id"] for n in shown["notifications"]] == [f"{shown['id']}:indeterminate"]
    human = scene.cli("show", shown["id"])
    assert human.returncode == 0
    assert SECRET not in human.stdout and "hunter2" not in human.stdout
    assert "[redacted]" in human.stdout and f"pid {scene.hook_pid}" in human.stdout
    assert "poimen resolve" in human.stdout
    missing = scene.cli("show", "in_nope")
    assert missing.returncode == 1 and "in_nope" in missing.stderr


def test_resolve_only_from_indeterminate_and_never_retries(
    scene: Scene, ledger: ProviderClient
) -> None:
    assert scene.cli("recover", "--app", APP).returncode == 0
    hook = scene.intent("c-hook")
    ship = scene.intent("c-ship")

    # A COMPLETED intent is refused with the reason, and nothing changes.
    r = scene.cli("resolve", "c-ship", "--not-landed", "--operator", "ana", "--reason", "x")
    assert r.returncode == 1
    assert "refused" in r.stderr and "COMPLETED" in r.stderr and "INDETERMINATE" in r.stderr
    refused = json.loads(
        scene.cli(
            "resolve", "c-ship", "--landed", "--operator", "ana", "--reason", "x", "--json"
        ).stdout
    )
    assert refused["error"]["type"] == "NotIndeterminateError"
    assert refused["error"]["state"] == "COMPLETED"
    after = scene.intent("c-ship")
    assert {**after, "age_s": 0} == {**ship, "age_s": 0}

    # Usage errors: exit 2, the intent untouched.
    usage = [
        ["resolve", "c-hook", "--not-landed", "--reason", "x"],  # no operator
        ["resolve", "c-hook", "--not-landed", "--operator", "ana"],  # no reason
        ["resolve", "c-hook", "--operator", "ana", "--reason", "x"],  # no decision
        ["resolve", "c-hook", "--landed", "--not-landed", "--operator", "ana", "--reason", "x"],
        ["resolve", "c-hook", "--not-landed", "--result", "{}", "--operator", "a", "--reason", "x"],
        ["resolve", "c-hook", "--landed", "--result", "{bad", "--operator", "a", "--reason", "x"],
        ["resolve", "c-hook", "--landed", "--result", "NaN", "--operator", "a", "--reason", "x"],
        ["resolve", "c-hook", "--landed", "--operator", "  ", "--reason", "x"],
    ]
    for args in usage:
        r = scene.cli(*args)
        assert r.returncode == 2, (args, r.stderr)
    assert scene.intent("c-hook")["state"] == "INDETERMINATE"
    assert len(scene.intent("c-hook")["events"]) == 2
    assert (
        scene.cli("resolve", "in_nope", "--landed", "--operator", "a", "--reason", "x").returncode
        == 1
    )

    done = scene.json(
        "resolve",
        "c-hook",
        "--not-landed",
        "--operator",
        "ana",
        "--reason",
        "provider dashboard shows no message",
    )
    assert done["id"] == hook["id"] and done["state"] == "RESOLVED_NOT_LANDED"
    shown = scene.intent(hook["id"])
    last = shown["events"][-1]
    assert last["kind"] == "resolved" and last["actor"] == "ana"
    assert last["from_state"] == "INDETERMINATE" and last["to_state"] == "RESOLVED_NOT_LANDED"
    assert last["detail"]["reason"] == "provider dashboard shows no message"

    again = scene.cli("resolve", "c-hook", "--landed", "--operator", "bo", "--reason", "oops")
    assert again.returncode == 1 and "RESOLVED_NOT_LANDED" in again.stderr

    landed = scene.cli(
        "resolve",
        "c-hook-2",
        "--landed",
        "--operator",
        "bo",
        "--reason",
        "receipt found",
        "--result",
        '{"message_id": "m-9", "token": "tk-1"}',
    )
    assert landed.returncode == 0, landed.stderr
    assert "RESOLVED_LANDED" in landed.stdout
    shown2 = scene.intent("c-hook-2")
    assert shown2["state"] == "RESOLVED_LANDED"
    assert shown2["result"] == {"message_id": "m-9", "token": "[redacted]"}
    assert "tk-1" not in scene.cli("show", "c-hook-2").stdout

    # No retry path anywhere: another recovery pass finds nothing, the provider saw one each.
    report = json.loads(scene.cli("recover", "--app", APP, "--json").stdout)
    assert report["scanned"] == 0
    assert hook_effects(ledger) == 1 and hook_effects(ledger, "ops2") == 1
    assert [len(scene.intent(c)["attempts"]) for c in ("c-hook", "c-hook-2")] == [1, 1]
    assert scene.json("status")["by_state"]["INDETERMINATE"] == 0


def test_audit_lists_capability_and_sandbox_denials(scene: Scene, ledger: ProviderClient) -> None:
    rows = scene.json("audit")
    assert [d["tool_id"] for d in rows] == [EMAIL, ROGUE]
    shadow, keyed = rows
    assert shadow["target"] == "c-shadow" and "shadow" in shadow["reason"]
    assert shadow["intent_id"] is None  # denied before anything was recorded
    rogue = scene.intent("c-rogue")
    assert keyed["intent_id"] == rogue["id"] and keyed["attempt"] == 1
    assert keyed["action"] == "http" and keyed["target"].startswith("POST http://127.0.0.1:")
    assert keyed["reason"].startswith("key_mismatch")
    assert rogue["state"] == "FAILED" and ledger.count(kind="keyed") == 0
    assert scene.json("audit", "--tool", ROGUE, "--since", "10m") == [keyed]
    assert scene.json("audit", "--tool", EMAIL) == [shadow]
    text = scene.cli("audit")
    assert text.returncode == 0 and "unsafe tool in shadow mode" in text.stdout
    assert rogue["id"] in text.stdout and "key_mismatch" in text.stdout
    # A FAILED intent is not an operator's to decide either.
    refused = scene.cli("resolve", "c-rogue", "--landed", "--operator", "a", "--reason", "x")
    assert refused.returncode == 1 and "FAILED" in refused.stderr
    none = scene.cli("audit", "--tool", SHIP)
    assert none.returncode == 0 and "no denials match" in none.stdout
    assert scene.cli("audit", "--since", "2999-01-01T00:00:00Z").returncode == 0
    assert scene.cli("audit", "--since", "yesterday-ish").returncode == 2


def test_recover_a_backlog_with_a_progress_bar(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    n = 40
    pause = tmp_path / "pause-many"
    proc = spawn(
        store_url,
        provider.url,
        [
            "call-many",
            "--tool",
            HOOK,
            "--args",
            json.dumps(HOOK_ARGS),
            "--n",
            str(n),
            "--prefix",
            "bulk",
        ],
        POIMEN_PAUSE_AT="after_effect",
        POIMEN_PAUSE_FILE=str(pause),
    )
    end = time.monotonic() + 300  # a bound for a broken child only: the loop waits on the ledger
    while hook_effects(ledger) < n:  # every effect landed: all n threads wait at the pause
        assert proc.poll() is None, proc.communicate()
        if time.monotonic() > end:
            proc.kill()
            pytest.fail(
                f"{hook_effects(ledger)}/{n} effects landed: {proc.communicate()[1][-2000:]}"
            )
        time.sleep(0.05)
    proc.kill()
    proc.communicate(timeout=10)
    assert poimen_json("status", db=store_url)["unfinished"] == n

    r = poimen("recover", "--app", APP, "--progress", db=store_url, provider=provider.url)
    assert r.returncode == 0, r.stderr
    assert f"{n}/{n} 100%" in r.stderr and "recover [" in r.stderr
    assert f"scanned {n}: 0 completed, 0 failed, {n} indeterminate" in r.stdout
    st = poimen_json("status", db=store_url)
    assert st["indeterminate"] == n and st["unfinished"] == 0
    assert hook_effects(ledger) == n
    quiet = poimen("recover", "--app", APP, "--no-progress", db=store_url, provider=provider.url)
    assert quiet.returncode == 0 and "recover [" not in quiet.stderr


def test_database_selection_migrate_and_exit_codes(tmp_path: Path, store_url: str) -> None:
    r = poimen("status")
    assert r.returncode == 2 and "POIMEN_DB" in r.stderr
    missing = poimen("status", "--db", f"sqlite:///{tmp_path / 'absent.db'}")
    assert missing.returncode == 3 and "migrate" in missing.stderr
    assert not (tmp_path / "absent.db").exists()  # reading never creates a log
    assert poimen("frobnicate", db=store_url).returncode == 2
    short = poimen("console", "--token", "short", db=store_url)
    assert short.returncode == 2 and "16 characters" in short.stderr

    latest = latest_version("sqlite" if store_url.startswith("sqlite") else "postgres")
    first = poimen_json("migrate", db=store_url)
    assert first == {"from": 0, "to": latest}
    # --db before or after the command; it wins over POIMEN_DB.
    again = poimen("--db", store_url, "migrate", "--json", db="sqlite:////nonexistent/x.db")
    assert again.returncode == 0 and json.loads(again.stdout) == {"from": latest, "to": latest}
    st = poimen_json("status", "--db", store_url)
    assert st["total"] == 0 and st["oldest_indeterminate"] is None
    assert poimen("intents", "--fail-if-empty", db=store_url).returncode == 1
    # The app's kernel names its store; a different --db is refused, not silently ignored.
    other = poimen(
        "recover",
        "--app",
        APP,
        "--db",
        f"sqlite:///{tmp_path / 'other.db'}",
        db=store_url,
        provider="http://127.0.0.1:9",
    )
    assert other.returncode == 2 and "is not the app's store" in other.stderr


# Hostile input: recorded text, huge numbers, broken apps, busy ports.

SPOOF_ID = "run-9/step-1\nstate: COMPLETED"
BIDI_ID = "run-9/step-2\u202egnp.exe\x85\x1b[2J"


def hostile_log(url: str) -> dict[str, str]:
    """A migrated log holding call ids with a newline, a bidi override and C1/C0 controls."""
    store = open_store(url)
    try:
        spoof = dispatch(store, SPOOF_ID, effect="unsafe")
        store.mark_indeterminate(spoof, 1, "unsafe_unknown_outcome", note(spoof), store.now())
        bidi = dispatch(store, BIDI_ID, effect="unsafe")
        store.record_denial(
            tool_id="t.tool",
            intent_id=bidi,
            attempt=1,
            action="http",
            target="POST http://x/\u202e\ny",
            reason="key_mismatch",
            now=store.now(),
        )
    finally:
        store.close()
    return {"spoof": spoof, "bidi": bidi}


def one_line(text: str) -> str:
    assert text.count("\n") == 1 and text.endswith("\n"), text
    assert "Traceback" not in text
    return text


def test_recorded_text_cannot_spoof_the_output(store_url: str) -> None:
    ids = hostile_log(store_url)
    shown = poimen("show", ids["spoof"], db=store_url)
    assert shown.returncode == 0, shown.stderr
    states = [line for line in shown.stdout.splitlines() if line.startswith("state")]
    assert states == ["state:       INDETERMINATE (unsafe_unknown_outcome)"]
    assert "run-9/step-1\\nstate: COMPLETED" in shown.stdout
    for out in (shown.stdout, poimen("show", ids["bidi"], db=store_url).stdout):
        assert all(c.isprintable() for line in out.splitlines() for c in line), out
    listed = poimen("intents", db=store_url)
    assert listed.returncode == 0
    assert len(listed.stdout.splitlines()) == 3  # a header and one line per intent
    assert "\\u202e" in listed.stdout and "\\x85" in listed.stdout and "\\x1b" in listed.stdout
    audit = poimen("audit", db=store_url)
    assert audit.returncode == 0 and len(audit.stdout.splitlines()) == 2

    for args in (("intents",), ("show", ids["bidi"]), ("audit",), ("status",)):
        r = poimen(*args, "--json", db=store_url)
        assert r.returncode == 0, r.stderr
        assert all(c.isprintable() or c in "\n " for c in r.stdout), args
        assert "\\u202e" in r.stdout or args == ("status",)
    rows = json.loads(poimen("intents", "--json", db=store_url).stdout)
    assert sorted(i["call_id"] for i in rows) == sorted([SPOOF_ID, BIDI_ID])  # same data

    missing = poimen("show", "nope\nstate: RESOLVED_LANDED\u202e", db=store_url)
    assert missing.returncode == 1
    line = one_line(missing.stderr)
    assert "\u202e" not in line and "\\u202e" in line


def test_event_details_are_redacted_in_json_and_text(store_url: str) -> None:
    """An event's detail, whoever wrote it, shows no value under a secret name, nested or in
    a recorded result."""
    detail = {
        "api_token": SECRET,
        "nested": [{"password": "hunter2"}],
        "result": json.dumps({"token": "tk-1"}),
    }
    store = open_store(store_url)
    try:
        iid = dispatch(store, "c-secret")
        assert store.record_event(iid, "noted", actor="t", detail=detail, now=store.now())
    finally:
        store.close()
    shown = poimen_json("show", iid, db=store_url)
    [noted] = [e for e in shown["events"] if e["kind"] == "noted"]
    assert noted["detail"] == {
        "api_token": "[redacted]",
        "nested": [{"password": "[redacted]"}],
        "result": {"token": "[redacted]"},
    }
    human = poimen("show", iid, db=store_url)
    assert human.returncode == 0 and "noted" in human.stdout
    for out in (json.dumps(shown), human.stdout):
        assert SECRET not in out and "hunter2" not in out and "tk-1" not in out


def test_bad_numbers_and_deep_results_are_usage_errors(store_url: str) -> None:
    ids = hostile_log(store_url)
    for args in (
        ("intents", "--limit", "100000000000000000000"),
        ("intents", "--limit", "0"),
        ("audit", "--limit", "-5"),
        ("intents", "--call-id", "run-9/", "--limit", str(10**30)),
    ):
        r = poimen(*args, db=store_url)
        assert r.returncode == 2, (args, r.stderr)
        assert "limit" in one_line(r.stderr)
        j = poimen(*args, "--json", db=store_url)
        assert j.returncode == 2 and json.loads(j.stdout)["error"]["field"] == "limit"
    for deep in ("[" * 100_000, "[" * 3000 + "]" * 3000):
        r = poimen(
            "resolve",
            ids["spoof"],
            "--landed",
            "--result",
            deep,
            "--operator",
            "a",
            "--reason",
            "x",
            db=store_url,
        )
        assert r.returncode == 2 and "nested deeper" in one_line(r.stderr)
    assert poimen_json("show", ids["spoof"], db=store_url)["state"] == "INDETERMINATE"


def test_a_broken_app_or_console_address_is_one_line_with_its_exit_code(
    tmp_path: Path, store_url: str
) -> None:
    assert poimen("migrate", db=store_url).returncode == 0
    apps = tmp_path / "apps"
    apps.mkdir()
    (apps / "bad_import.py").write_text('raise RuntimeError("boom at import")\n')
    (apps / "bad_factory.py").write_text("def make():\n    raise RuntimeError('boom in factory')\n")
    (apps / "bad_recover.py").write_text(
        "import os\nfrom poimen import Kernel\n\n"
        "class Broken(Kernel):\n"
        "    def recover(self, **kw):\n        raise ZeroDivisionError('bug in the app')\n\n"
        "def make():\n    return Broken(os.environ['POIMEN_DB'], notifiers=[])\n"
    )
    env = {"PYTHONPATH": str(apps)}
    for spec, words in (
        ("bad_import:k", ("bad_import", "boom at import")),
        ("bad_factory:make", ("bad_factory:make", "boom in factory")),
    ):
        r = poimen("recover", "--app", spec, db=store_url, **env)
        assert r.returncode == 2, r.stderr
        line = one_line(r.stderr)
        assert all(w in line for w in words), line
        j = poimen("recover", "--app", spec, "--json", db=store_url, **env)
        assert j.returncode == 2 and "boom" in json.loads(j.stdout)["error"]["message"]
    # Anything unforeseen: one line, exit 4, and the traceback only when asked for.
    r = poimen("recover", "--app", "bad_recover:make", db=store_url, **env)
    assert r.returncode == 4 and "ZeroDivisionError: bug in the app" in one_line(r.stderr)
    j = poimen("recover", "--app", "bad_recover:make", "--json", db=store_url, **env)
    assert j.returncode == 4 and json.loads(j.stdout)["error"]["type"] == "ZeroDivisionError"
    debug = poimen("recover", "--app", "bad_recover:make", db=store_url, POIMEN_DEBUG="1", **env)
    assert debug.returncode == 4 and "Traceback" in debug.stderr

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = poimen("console", "--port", str(port), "--token", "t" * 20, db=store_url)
        assert r.returncode == 2 and f"127.0.0.1:{port}" in one_line(r.stderr)
    r = poimen("console", "--host", "no-such-host.invalid", "--token", "t" * 20, db=store_url)
    assert r.returncode == 2 and "no-such-host.invalid" in one_line(r.stderr)


# Reading commands never write.


def _ro_runner() -> list[str]:
    """A prefix that runs a command with its first argument's directory mounted read-only,
    so that even root cannot write there; empty where mount namespaces are not allowed."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return []
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True
    )
    if probe.returncode != 0:
        return []
    script = 'd="$1"; shift; mount --bind "$d" "$d" && mount -o remount,bind,ro "$d" && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "ro"]


def _snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("journal", ["wal", "delete"])
def test_reading_commands_leave_a_read_only_copy_untouched(tmp_path: Path, journal: str) -> None:
    src = tmp_path / "src.db"
    ids = hostile_log(f"sqlite:///{src}")
    conn = sqlite3.connect(src)
    conn.execute(f"PRAGMA journal_mode={journal}")
    conn.close()
    folder = tmp_path / "ro"
    folder.mkdir()
    shutil.copy(src, folder / "copy.db")
    (folder / "copy.db").chmod(0o444)
    folder.chmod(0o555)
    before = _snapshot(folder)
    prefix = _ro_runner()
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    env["POIMEN_DB"] = f"sqlite:///{folder / 'copy.db'}"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [*prefix, str(folder), str(POIMEN), *args] if prefix else [str(POIMEN), *args]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)

    try:
        st = run("status", "--json")
        assert st.returncode == 0, st.stderr
        assert json.loads(st.stdout)["indeterminate"] == 1
        for args in (("intents",), ("show", ids["spoof"]), ("audit",), ("status",)):
            r = run(*args)
            assert r.returncode == 0, (args, r.stderr)
        # A write is refused as the store's error, and nothing changes.
        w = run("resolve", ids["spoof"], "--not-landed", "--operator", "a", "--reason", "x")
        if prefix:
            assert w.returncode == 3 and "read" in one_line(w.stderr).lower()
        assert _snapshot(folder) == before
    finally:
        folder.chmod(0o755)


# Operator tools: find by call id, abandon a call whose worker is gone.


def test_find_intents_by_call_id_newest_first(store_url: str) -> None:
    store = open_store(store_url)
    try:
        ids = [dispatch(store, f"run-9/step-{n}") for n in range(3)]
        other = dispatch(store, "run-90/step-0")
        exact = dispatch(store, "run-9")
    finally:
        store.close()
    rows = poimen_json("intents", "--call-id", "run-9/", db=store_url)
    assert [r["id"] for r in rows] == ids[::-1]  # newest first, "run-90/..." left out
    everything = poimen_json("intents", "--call-id", "run-9", db=store_url)
    assert {r["id"] for r in everything} == {*ids, other, exact}
    assert [r["id"] for r in poimen_json("intents", "--call-id", "run-9/step-1", db=store_url)] == [
        ids[1]
    ]
    assert len(poimen_json("intents", "--call-id", "run-9/", "--limit", "2", db=store_url)) == 2
    text = poimen("intents", "--call-id", "run-9/step-2", db=store_url)
    assert text.returncode == 0 and ids[2] in text.stdout
    none = poimen("intents", "--call-id", "run-8/", db=store_url)
    assert none.returncode == 0 and "no intents match" in none.stdout
    mixed = poimen("intents", "--call-id", "run-9/", "--state", "DISPATCHED", db=store_url)
    assert mixed.returncode == 2 and "--call-id" in one_line(mixed.stderr)
    assert "no intents match" in poimen("intents", "--call-id", "%", db=store_url).stdout


def test_abandon_a_dispatched_intent_then_resolve_it(store_url: str) -> None:
    store = open_store(store_url)
    try:
        stuck = dispatch(store, "run-3/stuck", effect="unsafe")
        done = dispatch(store, "run-3/done")
        assert store.record_outcome(
            done, 1, IntentState.COMPLETED, result="1", error=None, now=store.now()
        )
    finally:
        store.close()
    for args in (
        ("abandon", stuck, "--operator", "ana"),
        ("abandon", stuck, "--reason", "x"),
        ("abandon", stuck, "--operator", " ", "--reason", "x"),
    ):
        assert poimen(*args, db=store_url).returncode == 2, args
    refused = poimen("abandon", done, "--operator", "ana", "--reason", "x", db=store_url)
    assert refused.returncode == 1 and "COMPLETED" in one_line(refused.stderr)
    assert (
        poimen("abandon", "in_nope", "--operator", "a", "--reason", "x", db=store_url).returncode
        == 1
    )

    out = poimen_json(
        "abandon", "run-3/stuck", "--operator", "ana", "--reason", "host h1 is gone", db=store_url
    )
    assert out["state"] == "INDETERMINATE" and out["reason"] == "abandoned_by_operator"
    assert out["fence"] == 2
    shown = poimen_json("show", stuck, db=store_url)
    last = shown["events"][-1]
    assert (last["kind"], last["actor"], last["from_state"], last["to_state"]) == (
        "abandoned",
        "ana",
        "DISPATCHED",
        "INDETERMINATE",
    )
    assert last["detail"]["reason"] == "host h1 is gone" and last["detail"]["owner"] == "worker-a"
    again = poimen("abandon", stuck, "--operator", "bo", "--reason", "x", db=store_url)
    assert again.returncode == 1 and "INDETERMINATE" in again.stderr

    # The worker comes back after all: its outcome is evidence only, never applied.
    store = open_store(store_url)
    try:
        assert not store.record_outcome(
            stuck, 1, IntentState.COMPLETED, result='{"sent": true}', error=None, now=store.now()
        )
        [attempt] = store.attempts(stuck)
        assert attempt.late_outcome == "completed"
        it = store.get_intent(stuck)
        assert it is not None and it.state == IntentState.INDETERMINATE
    finally:
        store.close()
    r = poimen(
        "resolve", stuck, "--landed", "--operator", "ana", "--reason", "late evidence", db=store_url
    )
    assert r.returncode == 0, r.stderr
    assert poimen_json("show", stuck, db=store_url)["state"] == "RESOLVED_LANDED"


def race_abandon(store: Any, target: str, n: int) -> list[str]:
    """`n` operators abandon `target` at the same moment; what each got."""
    gate = threading.Barrier(n)
    outcomes: list[str] = []
    lock = threading.Lock()

    def go(name: str) -> None:
        gate.wait()
        try:
            op.abandon(store, target, operator=name, reason="gone")
            result = f"won:{name}"
        except NotDispatchedError:
            result = "refused"
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=go, args=(f"op{i}",)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def test_two_operators_abandoning_at_once_exactly_one_wins(store_url: str) -> None:
    store = open_store(store_url)
    try:
        for n in range(5):
            target = dispatch(store, f"race/{n}", effect="unsafe")
            outcomes = race_abandon(store, target, 4)
            winners = [o for o in outcomes if o.startswith("won:")]
            assert len(winners) == 1 and outcomes.count("refused") == 3, outcomes
            events = [e for e in store.events(target) if e.kind == "abandoned"]
            assert [f"won:{e.actor}" for e in events] == winners
            it = store.get_intent(target)
            assert it is not None and it.fence == 2 and it.state == IntentState.INDETERMINATE
    finally:
        store.close()


# Operator identity.

TOKEN_OF = re.compile(r"\b(ann\.[A-Za-z0-9_-]{43})\b")


def test_operators_are_added_listed_and_removed_and_the_file_never_holds_a_token(
    tmp_path: Path,
) -> None:
    path = tmp_path / "operators"
    f = str(path)
    missing = poimen("operators", "list", "--file", f)
    assert missing.returncode == 2 and "no operators file" in one_line(missing.stderr)

    added = poimen("operators", "add", "ann", "--file", f)  # no --db: the file is all it needs
    assert added.returncode == 0, added.stderr
    tokens = TOKEN_OF.findall(added.stdout)
    assert len(tokens) == 1, added.stdout  # shown once
    ann = tokens[0]
    assert "poimen console --operators" in added.stdout
    bob = poimen_json("operators", "add", "bob", "--file", f)
    assert bob["name"] == "bob" and bob["token"].startswith("bob.") and bob["file"] == f
    text = path.read_text()
    assert ann not in text and bob["token"] not in text
    assert ann.split(".")[1] not in text and bob["token"].split(".")[1] not in text
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)

    again = poimen("operators", "add", "ann", "--file", f)
    assert again.returncode == 1 and "already" in one_line(again.stderr)
    assert TOKEN_OF.search(again.stdout) is None and path.read_text() == text
    bad = poimen("operators", "add", "ann smith", "--file", f)
    assert bad.returncode == 2 and "name" in one_line(bad.stderr)

    listed = poimen("operators", "list", "--file", f)
    assert listed.returncode == 0 and listed.stdout == "ann\nbob\n"
    assert poimen_json("operators", "list", "--file", f) == ["ann", "bob"]

    assert poimen("operators", "remove", "ann", "--file", f).returncode == 0
    assert poimen("operators", "list", "--file", f).stdout == "bob\n"
    gone = poimen("operators", "remove", "ann", "--file", f)
    assert gone.returncode == 1 and "ann" in one_line(gone.stderr)
    assert poimen("operators", "remove", "bob", "--file", f).returncode == 0
    empty = poimen("operators", "list", "--file", f)
    assert empty.returncode == 0 and "no operators" in empty.stdout


def test_cli_decisions_record_the_given_name_and_the_os_account(store_url: str) -> None:
    store = open_store(store_url)
    try:
        first, second = (dispatch(store, f"run-5/{n}", effect="unsafe") for n in range(2))
        stuck = dispatch(store, "run-5/stuck", effect="unsafe")
        for iid in (first, second):
            assert store.mark_indeterminate(iid, 1, "unsafe_unknown_outcome", note(iid), 1.0)
    finally:
        store.close()
    account = pwd.getpwuid(os.getuid()).pw_name

    nobody = poimen("resolve", first, "--not-landed", "--reason", "x", db=store_url)
    assert nobody.returncode == 2 and "POIMEN_OPERATOR" in one_line(nobody.stderr)
    r = poimen(
        "resolve", first, "--not-landed", "--reason", "checked", db=store_url, POIMEN_OPERATOR="ann"
    )
    assert r.returncode == 0, r.stderr
    assert f"by ann (os user {account})" in r.stdout
    r = poimen(
        "resolve",
        second,
        "--landed",
        "--operator",
        "bo",
        "--reason",
        "seen",
        db=store_url,
        POIMEN_OPERATOR="ann",
    )
    assert r.returncode == 0, r.stderr  # --operator wins over the environment
    r = poimen("abandon", stuck, "--reason", "host gone", db=store_url, POIMEN_OPERATOR="ann")
    assert r.returncode == 0, r.stderr

    for iid, kind, name in (
        (first, "resolved", "ann"),
        (second, "resolved", "bo"),
        (stuck, "abandoned", "ann"),
    ):
        last = poimen_json("show", iid, db=store_url)["events"][-1]
        assert (last["kind"], last["actor"]) == (kind, name)
        assert last["detail"]["operator"] == name and last["detail"]["os_user"] == account
        assert last["detail"]["identified_by"] == "cli"
    shown = poimen("show", first, db=store_url).stdout
    assert f"ann (cli, os user {account})" in shown
