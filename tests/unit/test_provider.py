"""The effect-counting provider, exercised as a real separate process."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from poimen.testing._provider import ProviderClient, ProviderProcess


@pytest.fixture
def ledger_path(tmp_path: Path) -> Path:
    return tmp_path / "provider-ledger.sqlite"


@pytest.fixture
def provider(ledger_path: Path) -> Iterator[ProviderProcess]:
    with ProviderProcess(ledger_path) as proc:
        yield proc


@pytest.fixture
def client(provider: ProviderProcess) -> Iterator[ProviderClient]:
    with ProviderClient(provider.url) as c:
        yield c


# --------------------------------------------------------------------------- keyed


def test_same_key_different_content_is_one_effect(client: ProviderClient) -> None:
    first = client.keyed_write("k-1", {"amount": 10})
    second = client.keyed_write("k-1", {"amount": 99})

    assert first.status_code == 201
    assert first.json() == {"entry_id": first.json()["entry_id"], "duplicate": False, "key": "k-1"}
    assert second.status_code == 200
    assert second.json()["duplicate"] is True
    assert second.json()["content_differs"] is True
    assert second.json()["entry_id"] == first.json()["entry_id"]
    assert client.count(kind="keyed") == 1
    # The original content is what stays recorded.
    assert client.entries(key="k-1")[0]["body"] == {"amount": 10}


def test_same_key_same_content_is_duplicate_without_difference(client: ProviderClient) -> None:
    client.keyed_write("k-1", {"amount": 10, "to": "a"})
    again = client.keyed_write("k-1", {"to": "a", "amount": 10})  # key order must not matter

    assert again.status_code == 200
    assert again.json()["duplicate"] is True
    assert again.json()["content_differs"] is False
    assert client.count(kind="keyed") == 1


def test_same_content_different_keys_is_two_effects(client: ProviderClient) -> None:
    # The false-pass check: a ledger that deduplicated on content would report 1 here.
    body = {"amount": 10, "to": "alice"}
    a = client.keyed_write("k-a", body)
    b = client.keyed_write("k-b", body)

    assert (a.status_code, b.status_code) == (201, 201)
    assert a.json()["duplicate"] is False
    assert b.json()["duplicate"] is False
    assert a.json()["entry_id"] != b.json()["entry_id"]
    assert client.count(kind="keyed") == 2


def test_a_key_window_forgets_a_key_from_its_first_write(client: ProviderClient) -> None:
    client.set_key_ttl(0.5)
    first = client.keyed_write("k-1", {"amount": 10})
    assert client.keyed_write("k-1", {"amount": 10}).json()["duplicate"] is True
    at = client.entries(key="k-1")[0]["at"]
    while time.time() - at <= 0.6:  # the provider's clock: the same machine's
        time.sleep(0.05)
    late = client.keyed_write("k-1", {"amount": 10})
    assert late.status_code == 201 and late.json()["entry_id"] != first.json()["entry_id"]
    assert client.count(kind="keyed") == 2  # forgotten: a second effect
    client.set_key_ttl(None)
    assert client.keyed_write("k-1", {"amount": 10}).json()["duplicate"] is True
    for bad in (0, -1, True, "1"):
        with pytest.raises(httpx.HTTPStatusError):
            client.set_key_ttl(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", [None, ""])
def test_missing_or_empty_key_is_rejected_and_not_recorded(
    client: ProviderClient, key: str | None
) -> None:
    response = client.keyed_write(key, {"amount": 10})

    assert response.status_code == 400
    assert "Idempotency-Key" in response.json()["error"]
    assert client.count() == 0


# --------------------------------------------------------------------------- requests


def test_request_writes_are_not_deduplicated(client: ProviderClient) -> None:
    first = client.request_write("req-1", {"n": 1})
    second = client.request_write("req-1", {"n": 1})

    assert (first.status_code, second.status_code) == (201, 201)
    assert first.json()["request_id"] == "req-1"
    assert first.json()["entry_id"] != second.json()["entry_id"]
    assert client.count(kind="request", request_id="req-1") == 2


def test_request_write_requires_request_id(provider: ProviderProcess) -> None:
    response = httpx.post(f"{provider.url}/requests", json={"n": 1})

    assert response.status_code == 400
    assert "X-Request-Id" in response.json()["error"]


def test_truthful_lookup_reports_landed_and_missing(client: ProviderClient) -> None:
    written = client.request_write("req/with slash", {"n": 7}).json()

    landed = client.lookup("req/with slash")
    missing = client.lookup("req-never-sent")

    assert landed.status_code == 200
    assert landed.json() == {"landed": True, "entry_id": written["entry_id"], "body": {"n": 7}}
    assert missing.status_code == 404
    assert missing.json() == {"landed": False}


@pytest.mark.parametrize(
    ("mode", "status", "payload"),
    [
        ("landed", 200, {"landed": True, "entry_id": None}),
        ("never_arrived", 404, {"landed": False}),
        ("error", 503, {"error": "lookup unavailable"}),
    ],
)
def test_lookup_modes_from_cli(
    ledger_path: Path, mode: str, status: int, payload: dict[str, object]
) -> None:
    with ProviderProcess(ledger_path, lookup_mode=mode) as proc, ProviderClient(proc.url) as c:
        # A real row exists, so "never_arrived" and "error" are lying on purpose.
        c.request_write("req-1", {"n": 1})
        for request_id in ("req-1", "req-absent"):
            response = c.lookup(request_id)
            assert response.status_code == status
            assert response.json() == payload


def test_lookup_mode_switch_at_runtime(client: ProviderClient) -> None:
    client.request_write("req-1", {"n": 1})
    assert client.lookup("req-1").json()["landed"] is True

    client.set_lookup_mode("never_arrived")
    assert client.lookup("req-1").status_code == 404

    client.set_lookup_mode("error")
    assert client.lookup("req-1").status_code == 503

    client.set_lookup_mode("landed")
    assert client.lookup("req-absent").json() == {"landed": True, "entry_id": None}

    client.set_lookup_mode("truthful")
    assert client.lookup("req-absent").status_code == 404
    assert client.lookup("req-1").status_code == 200


def test_unknown_lookup_mode_is_rejected(client: ProviderClient) -> None:
    with pytest.raises(httpx.HTTPStatusError) as excinfo:
        client.set_lookup_mode("sometimes")

    assert excinfo.value.response.status_code == 400
    # The previous mode is still in force.
    assert client.lookup("req-absent").status_code == 404


def test_unknown_lookup_mode_is_rejected_at_construction(ledger_path: Path) -> None:
    with pytest.raises(ValueError, match="sometimes"):
        ProviderProcess(ledger_path, lookup_mode="sometimes")


# --------------------------------------------------------------------------- plain & misc


def test_plain_writes_are_not_deduplicated(client: ProviderClient) -> None:
    a = client.plain_write({"n": 1})
    b = client.plain_write({"n": 1})

    assert (a.status_code, b.status_code) == (201, 201)
    assert a.json()["entry_id"] != b.json()["entry_id"]
    assert client.count(kind="plain") == 2


def test_ledger_filters_and_entry_shape(client: ProviderClient) -> None:
    client.keyed_write("k-1", {"x": 1})
    client.request_write("req-1", {"x": 2})
    client.plain_write({"x": 3})

    assert client.count() == 3
    assert [e["kind"] for e in client.entries()] == ["keyed", "request", "plain"]
    (entry,) = client.entries(kind="request", request_id="req-1")
    assert set(entry) == {"id", "kind", "key", "request_id", "body", "at"}
    assert entry["body"] == {"x": 2}
    assert entry["key"] is None
    assert client.count(key="k-2") == 0


def test_unknown_ledger_filter_is_rejected(provider: ProviderProcess) -> None:
    response = httpx.get(f"{provider.url}/ledger", params={"knd": "plain"})

    assert response.status_code == 400
    assert "knd" in response.json()["error"]


def test_bad_json_is_rejected_and_not_recorded(
    client: ProviderClient, provider: ProviderProcess
) -> None:
    response = httpx.post(
        f"{provider.url}/plain",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )

    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]
    assert client.count() == 0


def test_unknown_path_is_json_404(provider: ProviderProcess) -> None:
    response = httpx.get(f"{provider.url}/nope")

    assert response.status_code == 404
    assert "/nope" in response.json()["error"]


def test_write_delay_applies_before_the_write(client: ProviderClient) -> None:
    client.set_delay(0.3)
    started = time.monotonic()
    client.plain_write({"n": 1})
    elapsed = time.monotonic() - started
    client.set_delay(0)

    assert elapsed >= 0.3
    assert client.count(kind="plain") == 1


def test_write_lands_even_when_the_client_gives_up(
    client: ProviderClient, provider: ProviderProcess
) -> None:
    # The crash window the provider exists to expose: the caller never sees the reply.
    client.set_delay(0.5)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{provider.url}/plain", json={"n": 1}, timeout=0.1)
    deadline = time.monotonic() + 5
    while client.count(kind="plain") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)

    assert client.count(kind="plain") == 1


# --------------------------------------------------------------------------- process


def test_ledger_survives_restart(ledger_path: Path) -> None:
    with ProviderProcess(ledger_path) as first, ProviderClient(first.url) as c:
        c.keyed_write("k-1", {"n": 1})
        c.request_write("req-1", {"n": 2})
        c.plain_write({"n": 3})
        first_pid = first.pid
    assert first.returncode == 0  # SIGTERM is a clean exit

    with ProviderProcess(ledger_path) as second, ProviderClient(second.url) as c:
        assert second.pid != first_pid
        assert c.count() == 3
        # Key dedup is durable: the restarted provider still knows the key.
        again = c.keyed_write("k-1", {"n": 1})
        assert again.json()["duplicate"] is True
        assert c.lookup("req-1").json()["landed"] is True
        assert c.count() == 3


def test_provider_is_a_separate_process(provider: ProviderProcess) -> None:
    health = httpx.get(f"{provider.url}/health")

    assert health.status_code == 200
    assert health.json()["ok"] is True
    assert provider.pid != os.getpid()
    # The process answering HTTP is the child we spawned, not this one.
    assert health.json()["pid"] == provider.pid


def test_start_failure_reports_child_stderr(tmp_path: Path) -> None:
    # A directory cannot be opened as an SQLite database, so the child dies at startup.
    proc = ProviderProcess(tmp_path)

    with pytest.raises(RuntimeError, match="exited with status") as excinfo:
        proc.start()

    assert "sqlite3" in str(excinfo.value)


def test_the_provider_starts_where_warnings_are_errors(
    ledger_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `python -m poimen.testing._provider` warned (module run twice) once `poimen.testing`
    # imported it; with warnings as errors, as many CIs set them, it never started.
    monkeypatch.setenv("PYTHONWARNINGS", "error")
    with ProviderProcess(ledger_path) as p, ProviderClient(p.url) as c:
        assert c.count() == 0
