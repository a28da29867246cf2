"""The installed `poimen` command, run as a subprocess against logs made by real crashed calls.

Every database here was written by child processes SIGKILLed mid-call; effects are counted
in the provider's ledger, never taken from poimen's own log alone.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from poimen.store._base import latest_version
from poimen.testing import EMAIL, SHIP, ProviderClient, ProviderProcess
from tests.integration.operator_app import (
    HOOK,
    ROGUE,
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
    assert nothing.returncode == 1 and "no intents match" in nothing.stdout
    assert scene.cli("intents", "--since", "2999-01-01").returncode == 1
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
    assert none.returncode == 1 and "no denials match" in none.stdout
    assert scene.cli("audit", "--since", "2999-01-01T00:00:00Z").returncode == 1
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
    assert poimen("intents", db=store_url).returncode == 1
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
