"""Bad input at the operator's side (the CLI, the console, what they print): each is refused
with a typed error or shown redacted, and nothing recorded changes (issue 24's list)."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import subprocess
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from poimen import Caps, DefiniteFailure, Kernel, ToolContext, Unsafe
from poimen._core.audit import sqlite_link
from poimen.errors import StoreError
from poimen.otel import OpenTelemetry
from tests.integration.operator_app import POIMEN, ROOT, poimen
from tests.integration.test_console import TOKEN, serve_console
from tests.integration.test_observability import add_tools

PASSWORD = "Sw0rdf1sh-secret"
FOREIGN = [
    f"mysql://agent:{PASSWORD}@db.example/agent",
    f"postgressql://agent:{PASSWORD}@db.example/agent",
    f"postgresql:/agent:{PASSWORD}@db.example/agent",
    f"host=db.example user=agent password={PASSWORD} dbname=agent",
    f"postgres//agent:{PASSWORD}@db.example/agent?sslpassword={PASSWORD}",
]


@pytest.mark.parametrize("url", FOREIGN)
def test_a_foreign_or_mistyped_store_url_is_never_printed_with_its_password(url: str) -> None:
    for args in (("status",), ("status", "--json"), ("doctor",), ("doctor", "--json")):
        r = poimen(*args, db=url)
        assert r.returncode == 3, (args, r.returncode, r.stderr)
        assert PASSWORD not in r.stdout + r.stderr, (args, r.stdout, r.stderr)
        assert "[redacted]" in r.stdout + r.stderr or "[url]" in r.stdout + r.stderr
    j = json.loads(poimen("status", "--json", db=url).stdout)
    assert j["error"]["type"] == "StoreError" and PASSWORD not in json.dumps(j)
    with pytest.raises(StoreError) as e:
        Kernel(url)
    assert PASSWORD not in str(e.value) and PASSWORD not in repr(e.value.data)
    assert "unsupported store URL" in str(e.value)


def _with_secrets(url: str) -> str:
    return url + ("&" if "?" in url else "?") + f"password={PASSWORD}&sslpassword={PASSWORD}"


def test_diff_and_its_console_page_never_show_a_logs_password(
    store_url: str, tmp_path: Path
) -> None:
    recording = _with_secrets(store_url)
    run = f"sqlite:///{tmp_path / 'run.db'}"
    for url, n in ((recording, 1), (run, 2)):
        with Kernel(url, notifiers=[], worker_id=f"d{n}") as k:
            add_tools(k)
            k.call("t.ok", {"n": n}, call_id="conv-1/ok")
    text = poimen("diff", "--recording", recording, "--run", run)
    assert text.returncode == 1, text.stderr  # they differ
    as_json = poimen("diff", "--recording", recording, "--run", run, "--json")
    assert as_json.returncode == 1, as_json.stderr
    for out in (text.stdout, as_json.stdout):
        assert PASSWORD not in out and "[redacted]" in out, out
    assert json.loads(as_json.stdout)["recording"].endswith(
        "password=[redacted]&sslpassword=[redacted]"
    )
    # The console's Diff page, to whoever may look at it.
    with serve_console(run, "--recording", recording) as base, httpx.Client(
        base_url=base, timeout=30
    ) as c:
        assert c.get(f"/diff?token={TOKEN}").status_code == 303
        page = c.get("/diff")
        assert page.status_code == 200 and "[redacted]" in page.text
        assert PASSWORD not in page.text
        bearer = httpx.get(f"{base}/diff", headers={"Authorization": f"Bearer {TOKEN}"})
        assert bearer.status_code == 200 and PASSWORD not in bearer.text


def _raw(*args: bytes | str, db: str) -> subprocess.CompletedProcess[bytes]:
    """The installed command with arguments as raw bytes, as a shell passes them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    env["POIMEN_DB"] = db
    return subprocess.run([str(POIMEN), *args], cwd=ROOT, env=env, capture_output=True,
                          timeout=120)


def test_arguments_that_are_not_utf8_are_usage_errors(store_url: str) -> None:
    with Kernel(store_url, notifiers=[]) as k:
        add_tools(k)
        boom = k.call("t.boom", {"n": 1}, call_id="u-1")
    bad = b"run-\xff\xfe"
    for args in (
        ("show", bad),
        ("intents", "--tool", bad),
        ("intents", "--call-id", bad),
        ("resolve", bad, "--landed", "--operator", "ana", "--reason", "x"),
        ("resolve", boom.intent_id, "--landed", "--operator", b"an\xe9", "--reason", "x"),
    ):
        r = _raw(*args, db=store_url)
        err = r.stderr.decode()
        assert r.returncode == 2, (args, r.returncode, err)
        assert "not valid UTF-8" in err and ("\\xff" in err or "\\xe9" in err), err
        assert err.count("\n") == 1
    with Kernel(store_url, notifiers=[]) as k:  # nothing changed
        intent = k.store.get_intent(boom.intent_id)
        assert intent is not None and intent.state == "INDETERMINATE"


def test_a_console_port_beyond_65535_is_refused(store_url: str) -> None:
    Kernel(store_url).close()
    for port in ("70000", "-1", "http"):
        r = poimen("console", "--port", port, "--token", TOKEN, db=store_url)
        assert r.returncode == 2 and "port" in r.stderr, (port, r.stderr)
        assert "listening" not in r.stdout


def test_a_junk_tls_certificate_is_refused_before_listening(
    store_url: str, tmp_path: Path
) -> None:
    Kernel(store_url).close()
    junk = tmp_path / "cert.pem"
    junk.write_text("not a certificate\n")
    for cert, key in ((junk, junk), (tmp_path / "missing.pem", junk)):
        r = poimen("console", "--port", "0", "--token", TOKEN, "--tls-cert", str(cert),
                   "--tls-key", str(key), db=store_url)
        assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
        assert "--tls-cert" in r.stderr and "listening" not in r.stdout
        assert r.stderr.count("\n") == 1, r.stderr


def test_a_malformed_multipart_body_gets_the_consoles_page_and_headers(store_url: str) -> None:
    Kernel(store_url).close()
    with serve_console(store_url) as base, httpx.Client(base_url=base, timeout=30) as c:
        assert c.get(f"/?token={TOKEN}").status_code == 303
        for path in ("/login", "/logout", "/intents/x/resolve"):
            r = c.post(path, content=b"--x\r\n", headers={"Content-Type": "multipart/form-data"})
            assert r.status_code == 400, (path, r.status_code, r.text[:200])
            assert "default-src 'self'" in r.headers["Content-Security-Policy"], path
            assert r.headers["X-Frame-Options"] == "DENY" and "Nothing was changed" in r.text


LEAKY = f"POST https://agent:{PASSWORD}@api.example/v1/send?token={PASSWORD}2 failed"


def test_tool_error_texts_are_shown_without_the_credentials_of_their_urls(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    caplog.set_level(logging.DEBUG, logger="poimen")
    with Kernel(store_url, notifiers=[], observers=[OpenTelemetry(tracer_provider=tp)]) as k:

        @k.tool(id="t.leaky", effects=Unsafe(), caps=Caps(), timeout=5)
        def leaky(ctx: ToolContext, refuse: bool) -> None:
            if refuse:
                raise DefiniteFailure(LEAKY)
            raise ConnectionError(LEAKY)

        failed = k.call("t.leaky", {"refuse": True}, call_id="leak-1")
        unknown = k.call("t.leaky", {"refuse": False}, call_id="leak-2")
    tp.shutdown()
    seen: list[str] = []
    for intent_id in (failed.intent_id, unknown.intent_id):
        for args in (("show", intent_id), ("show", intent_id, "--json")):
            r = poimen(*args, db=store_url)
            assert r.returncode == 0, r.stderr
            seen.append(r.stdout)
        listed = poimen("intents", "--json", db=store_url)
        seen.append(listed.stdout)
    assert any("api.example" in s for s in seen)  # the error is shown, its secrets are not
    with serve_console(store_url) as base, httpx.Client(base_url=base, timeout=30) as c:
        assert c.get(f"/?token={TOKEN}").status_code == 303
        for intent_id in (failed.intent_id, unknown.intent_id):
            seen.append(c.get(f"/intents/{intent_id}").text)
        seen.append(c.get("/intents").text)
    for span in exporter.get_finished_spans():
        seen.append(str(span.status.description))
        seen += [str(e.attributes) for e in span.events]
    seen += [r.getMessage() + str(getattr(r, "poimen", "")) for r in caplog.records]
    leaks = [s for s in seen if PASSWORD in s]
    assert not leaks, leaks[0][:2000]


def _crafted(tmp_path: Path, name: str, *sql: str) -> str:
    """A real log with one settled and one Indeterminate call, then changed behind poimen's
    back with `sql` (as a damaged or hostile file would be)."""
    url = f"sqlite:///{tmp_path / name}"
    with Kernel(url, notifiers=[]) as k:
        add_tools(k)
        k.call("t.ok", {"n": 1}, call_id="c/1")
        k.call("t.boom", {"n": 2}, call_id="c/2")
    conn = sqlite3.connect(tmp_path / name, isolation_level=None)
    # The chain's triggers call poimen_link on any change of an intent's state; a writer
    # behind poimen's back that has it (the function is public) gets past them.
    conn.create_function("poimen_link", -1, sqlite_link)
    try:
        for stmt in sql:
            conn.execute(stmt)
    finally:
        conn.close()
    return url


def test_a_log_whose_intents_is_a_recursive_view_is_refused_not_read_for_ever(
    tmp_path: Path,
) -> None:
    good = _crafted(tmp_path, "good.db")
    hostile = _crafted(
        tmp_path, "view.db",
        "ALTER TABLE intents RENAME TO intents_real",
        "CREATE VIEW intents AS SELECT i.* FROM intents_real i, (WITH RECURSIVE r(x) AS "
        "(SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT x FROM r)",
    )
    for args in (("status",), ("intents",), ("intents", "--call-id", "c/"), ("show", "c/1"),
                 ("diff", "--recording", hostile, "--run", good),
                 ("diff", "--recording", good, "--run", hostile)):
        r = poimen(*args, db=hostile)  # bounded by poimen()'s own timeout: never for ever
        assert r.returncode == 3, (args, r.returncode, r.stderr)
        assert "view" in r.stderr and "'intents'" in r.stderr, r.stderr
    with pytest.raises(StoreError, match="view"):
        Kernel(f"sqlite:///{tmp_path / 'replay.db'}", mode="replay", recording=hostile)


def test_verify_finds_rows_that_break_the_schemas_checks_and_types(tmp_path: Path) -> None:
    url = _crafted(
        tmp_path, "bad.db",
        "PRAGMA ignore_check_constraints = ON",
        "UPDATE intents SET state = 'LOST' WHERE call_id = 'c/1'",
        "UPDATE intents SET effect = 'magic', tool_id = X'00ff' WHERE call_id = 'c/2'",
    )
    r = poimen("verify", "--json", db=url)
    assert r.returncode == 6, (r.returncode, r.stderr)
    problems = [p["message"] for p in json.loads(r.stdout)["problems"]]
    text = " | ".join(problems)
    assert "LOST" in text or "state" in text, problems
    assert "effect" in text and "tool_id" in text, problems
    # The reading commands still answer, one line each, never exit 4.
    for args in (("status",), ("status", "--json"), ("intents",), ("intents", "--json"),
                 ("show", "c/2"), ("show", "c/2", "--json")):
        out = poimen(*args, db=url)
        assert out.returncode in (0, 3), (args, out.returncode, out.stderr)
        assert "unexpected" not in out.stderr, (args, out.stderr)
