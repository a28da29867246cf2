"""The operator path's pure rules: what `poimen show` redacts, how `--since` and results parse,
and the webhook signature a receiver checks."""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac

import pytest

from poimen._notify import sign, verify_signature
from poimen._operator import (
    REDACTED,
    OperatorInputError,
    parse_result,
    parse_since,
    parse_state,
    redact,
)


@pytest.mark.parametrize(
    "name",
    [
        "password",
        "db_password",
        "PASSWD",
        "passphrase",
        "client_secret",
        "api_token",
        "access-token",
        "max_tokens",
        "api_key",
        "apiKey",
        "X-API-KEY",
        "Authorization",
        "authorisation",
        "credentials",
        "private_key",
        "privateKey",
        "cookie",
        "session_id",
    ],
)
def test_secret_names_are_redacted_at_any_depth(name: str) -> None:
    data = {"to": "a@example.com", name: "s3cret", "nested": [{"ok": 1, name: {"deep": "x"}}]}
    assert redact(data) == {
        "to": "a@example.com",
        name: REDACTED,
        "nested": [{"ok": 1, name: REDACTED}],
    }


@pytest.mark.parametrize("name", ["to", "subject", "amount_cents", "author", "passenger", "tok"])
def test_other_names_are_shown(name: str) -> None:
    assert redact({name: "v", "list": [name]}) == {name: "v", "list": [name]}


def test_since_accepts_durations_iso_times_and_epoch_seconds() -> None:
    now = 1_800_000_000.0
    assert parse_since("15m", now) == now - 900
    assert parse_since("2h", now) == now - 7200
    assert parse_since("1.5d", now) == now - 129_600
    assert parse_since("1700000000", now) == 1_700_000_000
    assert (
        parse_since("2026-01-02T03:04:05Z", now)
        == dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC).timestamp()
    )
    # No zone means UTC, not the operator's local time.
    assert parse_since("2026-01-02", now) == dt.datetime(2026, 1, 2, tzinfo=dt.UTC).timestamp()
    for bad in ("yesterday", "15 minutes", "nan", "inf", ""):
        with pytest.raises(OperatorInputError, match="since"):
            parse_since(bad, now)


def test_state_and_result_parsing() -> None:
    assert parse_state(" indeterminate ") == "INDETERMINATE"
    with pytest.raises(OperatorInputError, match="LOST"):
        parse_state("LOST")
    assert parse_result('{"id": 5, "ok": true}') == {"id": 5, "ok": True}
    for bad in ("{bad", "NaN", '{"x": Infinity}', ""):
        with pytest.raises(OperatorInputError, match="result"):
            parse_result(bad)


def test_signature_is_hmac_sha256_over_timestamp_dot_body() -> None:
    body = b'{"kind":"indeterminate"}'
    expected = hmac.new(b"k", b"1800000000." + body, hashlib.sha256).hexdigest()
    assert sign("k", "1800000000", body) == "sha256=" + expected
    sig = sign("k", "1800000000", body)
    assert verify_signature("k", "1800000000", body, sig, now=1_800_000_100)
    assert not verify_signature("k", "1800000000", body + b" ", sig, now=1_800_000_100)
    assert not verify_signature("other", "1800000000", body, sig, now=1_800_000_100)
    assert not verify_signature("k", "1800000000", body, sig, now=1_800_001_000)  # replayed
