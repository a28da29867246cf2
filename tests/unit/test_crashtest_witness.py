"""The witness of `poimen crashtest`: what it records, what it deduplicates, where it stops."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from poimen.crashtest import Answers, AnswersError, Witness
from poimen.crashtest._witness import Hold, signature


@pytest.fixture
def witness(tmp_path: Path) -> Iterator[Witness]:
    with Witness(tmp_path / "ledger.db") as w:
        yield w


def test_a_key_seen_before_is_not_a_new_effect_a_new_key_is(witness: Witness) -> None:
    for key in ("k1", "k1", "k2"):
        r = httpx.post(f"{witness.url}/v1/charges", json={"amount": 5},
                       headers={"Idempotency-Key": key})
        assert r.status_code == 200
    sig = signature("POST", "/v1/charges", {"amount": 5})
    assert witness.effects() == {sig: 2}
    assert [w.key for w in witness.writes()] == ["k1", "k1", "k2"]


def test_reads_are_answered_and_never_effects(witness: Witness) -> None:
    assert httpx.get(f"{witness.url}/v1/charges/1").json() == {"ok": True}
    assert witness.effects() == {}


def test_a_plain_client_reaches_it_through_the_proxy_with_the_real_address(
    witness: Witness,
) -> None:
    with httpx.Client(proxy=witness.url) as http:
        http.put("http://api.example.test/v1/items/7?x=1", json={"n": 1}).raise_for_status()
        http.post(f"{witness.url}/own", json={"n": 2}).raise_for_status()  # its own address
    assert [w.target for w in witness.writes()] == ["http://api.example.test/v1/items/7?x=1",
                                                    "/own"]


def test_https_through_the_proxy_is_refused(witness: Witness) -> None:
    with httpx.Client(proxy=witness.url) as http, pytest.raises(httpx.ProxyError):
        http.post("https://api.example.test/v1/charges", json={})
    assert witness.tls_refused == 1 and witness.effects() == {}


@pytest.mark.parametrize(("when", "applied"), [("before", 0), ("after", 1)])
def test_a_hold_stops_at_the_nth_write_of_that_content(
    witness: Witness, when: str, applied: int
) -> None:
    sig = signature("POST", "/mail", {"to": "a"})
    witness.arm(Hold(sig, 2, when))
    assert httpx.post(f"{witness.url}/mail", json={"to": "a"}).status_code == 200
    assert not witness.reached.is_set()
    errors: list[BaseException] = []

    def second() -> None:
        try:
            httpx.post(f"{witness.url}/mail", json={"to": "a"}, timeout=60)
        except httpx.HTTPError as exc:
            errors.append(exc)

    t = threading.Thread(target=second)
    t.start()
    assert witness.reached.wait(30)
    assert witness.effects() == {sig: 1 + applied}
    witness.stop()  # releases the held request without an answer
    t.join(30)
    assert errors and not t.is_alive()


def test_a_request_id_can_be_looked_up(witness: Witness) -> None:
    httpx.post(f"{witness.url}/ship", json={"to": "x"}, headers={"X-Request-Id": "rq-1"})
    found = httpx.get(f"{witness.url}/_witness/requests/rq-1")
    assert found.status_code == 200 and found.json()["body"] == {"to": "x"}
    assert httpx.get(f"{witness.url}/_witness/requests/rq-2").status_code == 404


def test_a_chunked_body_is_read_whole(witness: Witness) -> None:
    httpx.post(f"{witness.url}/c", content=iter([b'{"a":', b" 1}"])).raise_for_status()
    assert witness.writes()[0].body == {"a": 1}


def test_answers_come_from_the_first_matching_rule(tmp_path: Path) -> None:
    path = tmp_path / "answers.json"
    path.write_text('{"rules": [{"method": "POST", "path": "/v1/charges*", "status": 201, '
                    '"body": {"id": "ch_1"}}]}', encoding="utf-8")
    with Witness(tmp_path / "l.db", Answers.load(path)) as w:
        r = httpx.post(f"{w.url}/v1/charges/x", json={})
        assert (r.status_code, r.json()) == (201, {"id": "ch_1"})
        assert httpx.post(f"{w.url}/other", json={}).json() == {"ok": True, "id": "w-2"}


@pytest.mark.parametrize("text", ["[", '{"rules": 3}', '{"rules": [{"path": "/", "status": 99}]}',
                                  '{"rules": [{"status": 200}]}'])
def test_a_bad_answers_file_is_refused_by_name(tmp_path: Path, text: str) -> None:
    path = tmp_path / "answers.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(AnswersError, match="answers file"):
        Answers.load(path)
