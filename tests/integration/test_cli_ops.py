"""The operations a cron job or a support ticket needs, through the installed `poimen`
command: `status --fail-if-indeterminate`, `verify`, `doctor`. The logs are made by real
calls in child processes, crashed with SIGKILL where a test needs an unfinished intent."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from poimen.store import open_store
from poimen.store._base import latest_version
from poimen.testing import EMAIL, SHIP, ProviderClient, ProviderProcess
from tests.integration.operator_app import ROOT, crash, poimen, run_call

APP = "tests.integration.operator_app:make_kernel"


def cli(db: str, *args: str, **env: str) -> tuple[int, str, str]:
    r = poimen(*args, db=db, **env)
    return r.returncode, r.stdout, r.stderr


def cli_json(db: str, *args: str, **env: str) -> tuple[int, Any]:
    code, out, err = cli(db, *args, "--json", **env)
    assert out, err
    return code, json.loads(out)


def made_log(db: str, provider: ProviderProcess) -> str:
    """A log made by `poimen migrate` and one completed call; returns `db`."""
    assert cli(db, "migrate")[0] == 0
    out = run_call(db, provider.url, SHIP, {"order_id": "o-1", "address": "1 Main St"}, "c-ship")
    assert out["type"] == "Completed"
    return db


def sqlite_file(db: str) -> Path:
    return Path(db[len("sqlite:///") :])


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# status --fail-if-indeterminate


def test_status_fails_only_when_something_is_indeterminate(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    made_log(store_url, provider)
    assert cli(store_url, "status", "--fail-if-indeterminate")[0] == 0
    crash(tmp_path, store_url, provider.url, EMAIL, {"to": "a@example.com", "subject": "x"}, "c-1")
    # DISPATCHED is not INDETERMINATE (yet): no alert.
    assert cli(store_url, "status", "--fail-if-indeterminate")[0] == 0
    assert cli(store_url, "recover", "--app", APP, POIMEN_TEST_PROVIDER=provider.url)[0] == 0
    assert ledger.count(kind="plain") == 1

    code, out, err = cli(store_url, "status", "--fail-if-indeterminate")
    assert code == 5 and err == ""
    assert "1 INDETERMINATE" in out  # the status is printed all the same
    code, st = cli_json(store_url, "status", "--fail-if-indeterminate")
    assert code == 5 and st["indeterminate"] == 1
    assert cli(store_url, "status")[0] == 0  # without the flag: a report, not an alert

    code, _, _ = cli(
        store_url, "resolve", "c-1", "--not-landed", "--operator", "ana", "--reason", "checked"
    )
    assert code == 0
    assert cli(store_url, "status", "--fail-if-indeterminate")[0] == 0


# verify


def test_verify_a_sound_log_and_lists_what_a_dead_owner_left(
    tmp_path: Path, store_url: str, provider: ProviderProcess
) -> None:
    made_log(store_url, provider)
    code, out, _ = cli(store_url, "verify")
    assert code == 0, out
    assert out.rstrip().endswith("ok")
    backend = "sqlite" if store_url.startswith("sqlite") else "postgres"
    code, v = cli_json(store_url, "verify")
    assert code == 0 and v["ok"] is True and v["problems"] == [] and v["orphans"] == []
    assert v["backend"] == backend
    assert v["schema_version"] == v["known_version"] == latest_version(backend)

    pid = crash(tmp_path, store_url, provider.url, EMAIL, {"to": "b@x.org", "subject": "x"}, "c-2")
    code, v = cli_json(store_url, "verify")
    assert code == 6 and v["ok"] is False and v["problems"] == []
    [orphan] = v["orphans"]
    assert orphan["call_id"] == "c-2" and orphan["owner"]["pid"] == pid
    assert f"pid {pid}" in orphan["why"] and "gone from this host" in orphan["why"]
    code, out, _ = cli(store_url, "verify")
    assert code == 6 and "c-2" in out and "poimen recover" in out and "verify FAILED" in out

    assert cli(store_url, "recover", "--app", APP, POIMEN_TEST_PROVIDER=provider.url)[0] == 0
    assert cli(store_url, "verify")[0] == 0  # INDETERMINATE is settled, not orphaned


def test_verify_waits_for_the_lease_of_an_owner_on_another_host(
    store_url: str, provider: ProviderProcess, tmp_path: Path
) -> None:
    """Elsewhere a pid says nothing: an owner on another host is orphaned only once its
    lease has expired."""
    import signal
    import subprocess

    from poimen.testing import kill_at_pause
    from tests.integration.operator_app import child_env

    assert cli(store_url, "migrate")[0] == 0
    pause = tmp_path / "pause"
    env = child_env(store_url, provider.url, POIMEN_PAUSE_AT="after_effect",
                    POIMEN_PAUSE_FILE=str(pause))
    proc = subprocess.Popen(
        [sys.executable, "-m", "poimen.testing", "call", "--db", store_url, "--provider",
         provider.url, "--tool", EMAIL, "--call-id", "far-1", "--args",
         json.dumps({"to": "far@example.com", "subject": "x"}), "--host", "far-away/boot",
         "--lease-ttl", "3", "--timeout", "0.5"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    kill_at_pause(proc, pause)
    assert proc.returncode == -signal.SIGKILL
    store = open_store(store_url, migrate=False, readonly=True)
    try:
        intent = store.get_by_call_id("far-1")
        assert intent is not None and intent.lease_expires_at is not None
        if store.now() < intent.lease_expires_at - 0.5:  # a loaded machine may be past it
            code, v = cli_json(store_url, "verify")
            if store.now() < intent.lease_expires_at:
                assert code == 0 and v["orphans"] == []
        while store.now() <= intent.lease_expires_at:
            time.sleep(0.05)
    finally:
        store.close()
    code, v = cli_json(store_url, "verify")
    assert code == 6
    [orphan] = v["orphans"]
    assert orphan["call_id"] == "far-1" and "lease" in orphan["why"]
    assert "far-away/boot" in orphan["why"]


def test_verify_finds_damage_in_a_sqlite_log_and_changes_nothing(
    tmp_path: Path, provider: ProviderProcess
) -> None:
    db = made_log(f"sqlite:///{tmp_path / 'intents.db'}", provider)
    path = sqlite_file(db)

    conn = sqlite3.connect(path)  # a hand that edits the file behind poimen's back
    conn.execute("PRAGMA foreign_keys=OFF")
    conn.execute(
        "INSERT INTO attempts (intent_id, number, fence, started_at) VALUES ('in_gone', 1, 1, 0)"
    )
    conn.execute("DROP TRIGGER events_append_only_u")
    conn.commit()
    conn.close()
    before = digest(path)
    code, v = cli_json(db, "verify")
    assert code == 6
    found = {(p["check"], p["message"]) for p in v["problems"]}
    assert ("foreign_key_check", "attempts row 2 points at no intents row") in found or any(
        c == "foreign_key_check" and "points at no intents row" in m for c, m in found
    )
    assert ("schema objects", "the trigger events_append_only_u is missing") in found
    assert ("dangling rows", "1 attempts without their intent") in found
    assert digest(path) == before

    # A damaged page: SQLite's own integrity check reports it.
    conn = sqlite3.connect(path)
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    root = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'denials_tool'").fetchone()
    conn.execute("PRAGMA journal_mode=DELETE")  # everything in the main file
    conn.close()
    with open(path, "r+b") as f:
        f.seek((root[0] - 1) * page_size)
        f.write(b"\xff" * 64)
    code, v = cli_json(db, "verify")
    assert code == 6
    assert any(p["check"] == "integrity_check" for p in v["problems"]), v
    code, out, _ = cli(db, "verify")
    assert code == 6 and "PROBLEM (integrity_check)" in out


@pytest.mark.postgres
def test_verify_finds_missing_constraints_and_disabled_triggers_in_postgres(
    postgres_url: str, provider: ProviderProcess
) -> None:
    import psycopg

    made_log(postgres_url, provider)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE attempts DROP CONSTRAINT attempts_intent_id_fkey")
        conn.execute(
            "INSERT INTO attempts (intent_id, number, fence, started_at) "
            "VALUES ('in_gone', 1, 1, 0)"
        )
        conn.execute("ALTER TABLE events DISABLE TRIGGER events_append_only")
        conn.execute(
            "ALTER TABLE outbox ADD CONSTRAINT outbox_delivery_id_key2 UNIQUE (delivery_id)"
        )
        conn.execute("ALTER TABLE intents DROP CONSTRAINT intents_state_check")
        conn.execute(
            "ALTER TABLE intents ADD CONSTRAINT intents_state_check CHECK (state <> '') NOT VALID"
        )
    code, v = cli_json(postgres_url, "verify")
    assert code == 6
    found = {(p["check"], p["message"]) for p in v["problems"]}
    assert found == {
        ("constraints", "the constraint attempts_intent_id_fkey is missing"),
        ("constraints", "the constraint intents_state_check is NOT VALID"),
        ("triggers", "the append-only trigger events_append_only is disabled"),
        ("dangling rows", "1 attempts without their intent"),
    }


def test_verify_reports_a_schema_newer_than_this_poimen(
    store_url: str, provider: ProviderProcess
) -> None:
    made_log(store_url, provider)
    if store_url.startswith("sqlite"):
        conn: Any = sqlite3.connect(sqlite_file(store_url))
        conn.execute("INSERT INTO poimen_schema VALUES (99, 0)")
        conn.commit()
        conn.close()
    else:
        import psycopg

        with psycopg.connect(store_url, autocommit=True) as pg:
            pg.execute("INSERT INTO poimen_schema VALUES (99, 0)")
    code, v = cli_json(store_url, "verify")
    assert code == 6 and v["schema_version"] == 99
    [problem] = v["problems"]
    assert problem["check"] == "schema version" and "upgrade poimen" in problem["message"]


def test_reading_commands_on_a_missing_log_are_store_errors(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'nothing.db'}"
    for command in ("verify", "status"):
        code, _, err = cli(db, command)
        assert code == 3 and "no intent log" in err
    assert not (tmp_path / "nothing.db").exists()


# doctor


def test_doctor_reports_versions_settings_and_the_store_without_secrets(
    tmp_path: Path, provider: ProviderProcess
) -> None:
    db = made_log(f"sqlite:///{tmp_path / 'intents.db'}", provider)
    before = digest(sqlite_file(db))
    token = "console-token-0123456789"
    hook = "https://hooks.example/services/T0/B0/hook-secret-9"
    code, d = cli_json(db, "doctor", POIMEN_CONSOLE_TOKEN=token, POIMEN_HOOK=hook)
    assert code == 0
    assert d["poimen"] == importlib.metadata.version("poimen")
    assert d["sqlite_library"] == sqlite3.sqlite_version
    assert d["python"].endswith(".".join(map(str, sys.version_info[:3])))
    assert d["psycopg"] == importlib.metadata.version("psycopg")
    assert d["platform"] and d["host"]
    assert d["settings"] == {
        "POIMEN_CONSOLE_TOKEN": "[redacted]",
        "POIMEN_DB": db,
        "POIMEN_HOOK": "https://hooks.example/…",
    }
    store = d["store"]
    assert store["url"] == db and store["schema_version"] == latest_version("sqlite")
    assert store["journal_mode"] == "wal" and store["filesystem"]["network_or_fuse"] is False
    assert digest(sqlite_file(db)) == before
    code, out, _ = cli(db, "doctor", POIMEN_CONSOLE_TOKEN=token)
    assert code == 0 and token not in out
    assert f"url: {db}" in out and "schema_version: " in out and "sqlite_library: " in out


@pytest.mark.postgres
def test_doctor_redacts_postgres_passwords_and_tokens(postgres_url: str) -> None:
    assert cli(postgres_url, "migrate")[0] == 0
    parts = urlsplit(postgres_url)
    # The test server trusts every connection: the password is ignored, but must not show.
    secret_url = urlunsplit(
        parts._replace(
            netloc=f"postgres:pw-hunter2@{parts.hostname}:{parts.port}",
            query="sslpassword=pw-key-7&application_name=doc&options=-cstatement_timeout%3D0",
        )
    )
    code, d = cli_json(secret_url, "doctor")
    assert code == 0, d
    assert "pw-" not in json.dumps(d)
    assert d["store"]["url"].startswith(f"postgresql://postgres:[redacted]@{parts.hostname}:")
    assert "sslpassword=[redacted]&application_name=doc" in d["store"]["url"]
    assert d["settings"]["POIMEN_DB"] == d["store"]["url"]
    assert d["store"]["schema_version"] == latest_version("postgres")
    assert d["store"]["server_version"] and d["store"]["current_schema"] == "public"


@pytest.mark.postgres
def test_no_command_prints_a_store_password(postgres_url: str, tmp_path: Path) -> None:
    """An empty database, an app on another store: the messages name the store, redacted."""
    parts = urlsplit(postgres_url)
    secret_url = urlunsplit(
        parts._replace(netloc=f"postgres:pw-hunter2@{parts.hostname}:{parts.port}")
    )
    for args in (["status"], ["verify"], ["doctor"], ["intents"]):
        r = poimen(*args, "--json", db=secret_url)
        assert r.returncode == 3, (args, r.stderr)
        assert "pw-hunter2" not in r.stdout + r.stderr, (args, r.stdout, r.stderr)
        assert "postgres:[redacted]@" in r.stdout + r.stderr
    # The app's store is another one than --db names.
    app_db = f"sqlite:///{tmp_path / 'app.db'}"
    r = poimen("recover", "--app", APP, "--db", secret_url, "--json", db=app_db,
               POIMEN_TEST_PROVIDER="http://127.0.0.1:9")
    assert r.returncode == 2 and "is not the app's store" in r.stderr
    assert "pw-hunter2" not in r.stdout + r.stderr


def test_doctor_still_reports_when_the_store_cannot_be_opened(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'absent.db'}"
    code, d = cli_json(db, "doctor")
    assert code == 3
    assert d["poimen"] and "no intent log" in d["store"]["error"]
    code, out, _ = cli(db, "doctor")
    assert code == 3 and "sqlite_library: " in out and "error: " in out
    r = poimen("doctor")  # no store at all: the environment alone
    assert r.returncode == 0 and "none given" in r.stdout
