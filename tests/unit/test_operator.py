"""The operator path's pure rules: what `poimen show` redacts, how `--since` and results parse,
and the webhook signature a receiver checks."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import re
import stat
import threading
import time
from pathlib import Path

import pytest

from poimen._engine.notify import new_secret, sign, verify, verify_signature
from poimen.errors import (
    DuplicateOperatorError,
    OperatorsFileError,
    PoimenError,
    UnknownOperatorError,
)
from poimen.operator import _ops as op
from poimen.operator._identity import (
    Operators,
    add_operator,
    operator_names,
    read_operators,
    remove_operator,
    verify_token,
)
from poimen.operator._ops import (
    REDACTED,
    OperatorInputError,
    escape_text,
    parse_result,
    parse_since,
    parse_state,
    redact,
    redact_store_url,
    redact_url,
    redact_urls,
    safe_json,
)
from poimen.store import open_store
from tests.contract.test_store_contract import dispatch, note


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


def test_signature_is_standard_webhooks_v1_over_id_dot_timestamp_dot_body() -> None:
    body = b'{"kind":"indeterminate"}'
    mac = hmac.new(b"k", b"in_1:indeterminate.1800000000." + body, hashlib.sha256).digest()
    sig = sign("k", "in_1:indeterminate", "1800000000", body)
    assert sig == "v1," + base64.b64encode(mac).decode()
    ok = {"webhook-id": "in_1:indeterminate", "webhook-timestamp": "1800000000"}
    assert verify("k", {**ok, "webhook-signature": sig}, body, now=1_800_000_100)
    # Header names in any case; several signatures (a secret being rotated), one matching.
    upper = {k.upper(): v for k, v in ok.items()}
    assert verify("k", {**upper, "Webhook-Signature": f"v1,AAAA {sig}"}, body, now=1_800_000_100)
    assert not verify("k", {**ok, "webhook-signature": sig}, body + b" ", now=1_800_000_100)
    assert not verify("other", {**ok, "webhook-signature": sig}, body, now=1_800_000_100)
    other_id = {**ok, "webhook-id": "in_2:indeterminate", "webhook-signature": sig}
    assert not verify("k", other_id, body, now=1_800_000_100)
    assert not verify("k", {**ok, "webhook-signature": sig}, body, now=1_800_001_000)  # replayed
    assert not verify("k", ok, body, now=1_800_000_100)  # no signature header


def test_the_standard_webhooks_library_verifies_what_poimen_signs() -> None:
    # The outside witness: the reference library receivers use, not poimen's own check.
    from standardwebhooks import Webhook, WebhookVerificationError

    body = b'{"kind":"indeterminate"}'
    ts = str(int(time.time()))
    for secret, theirs in ((new_secret(), None), ("plain text secret", b"plain text secret")):
        headers = {
            "webhook-id": "in_9:indeterminate",
            "webhook-timestamp": ts,
            "webhook-signature": sign(secret, "in_9:indeterminate", ts, body),
        }
        key = secret if theirs is None else theirs
        assert Webhook(key).verify(body, headers) == {"kind": "indeterminate"}
        with pytest.raises(WebhookVerificationError):
            Webhook(key).verify(body + b" ", headers)
        assert verify(secret, headers, body)
    with pytest.raises(PoimenError, match="base64"):
        sign("whsec_not base64!", "i", ts, body)


def test_a_hostile_timestamp_is_a_plain_no() -> None:
    body = b"{}"
    sig = sign("k", "i", "1800000000", body)
    # Python refuses to convert a 5,000-digit string to int: that must be "no", not a crash.
    assert not verify_signature("k", "i", "9" * 5000, body, sig, now=1_800_000_000)
    assert not verify_signature("k", "i", "1" + "0" * 4999, body, sig, now=1_800_000_000)
    for bad in ("", "-5", "1e9", "\uff11\uff18\uff10\uff10", " 1800000000", "1800000000\n"):
        assert not verify_signature("k", "i", bad, body, sig, now=1_800_000_000)


def test_a_timestamp_from_the_future_is_refused_beyond_the_tolerance() -> None:
    body = b"{}"
    ahead = "1800000400"
    sig = sign("k", "i", ahead, body)
    assert not verify_signature("k", "i", ahead, body, sig, now=1_800_000_000)  # 400s ahead
    assert verify_signature("k", "i", ahead, body, sig, now=1_800_000_200)  # 200s ahead: within


def test_a_deeply_nested_result_is_refused_as_input() -> None:
    for text in ("[" * 100_000, "[" * 5000 + "]" * 5000, '{"a":' * 3000 + "1" + "}" * 3000):
        with pytest.raises(OperatorInputError, match="nested"):
            parse_result(text)
    deep_ok = "[" * 50 + "]" * 50
    assert parse_result(deep_ok) is not None


def test_recorded_text_cannot_fake_lines_or_reorder_the_terminal() -> None:
    hostile = "run-9/step-1\nstate: COMPLETED\r\x1b[2J\x85\u202egnp.exe\u2066x\u2069\u2028\t"
    shown = escape_text(hostile)
    assert "\n" not in shown and "\r" not in shown and "\t" not in shown
    assert all(c.isprintable() for c in shown)
    for raw, esc in (("\n", "\\n"), ("\x1b", "\\x1b"), ("\x85", "\\x85"), ("\u202e", "\\u202e")):
        assert raw not in shown and esc in shown
    assert escape_text("naïve — 東京 ok") == "naïve — 東京 ok"  # printable text is kept


def test_json_output_escapes_c0_c1_and_bidi_controls() -> None:
    value = {"call_id": "a\x85b\u202ec\u2066d\U000e0041e\u2028f", "name": "naïve 東京"}
    text = safe_json(value, indent=2)
    assert json.loads(text) == value  # still the same data
    assert all(c.isprintable() or c in "\n " for c in text)
    assert "\\u0085" in text and "\\u202e" in text and "\\udb40\\udc41" in text
    assert "naïve 東京" in text  # printable non-ASCII stays readable


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://hooks.slack.com/services/T0/B0/XyZsecret", "https://hooks.slack.com/…"),
        ("https://ops.example/hook?token=abc123", "https://ops.example/…"),
        ("https://user:pw@ops.example:8443/x", "https://ops.example:8443/…"),
        ("http://127.0.0.1:9000", "http://127.0.0.1:9000"),
        ("https://ops.example/", "https://ops.example/"),
    ],
)
def test_urls_are_shown_with_scheme_and_host_only(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    text = f"webhook {url} unreachable: connection refused ({url})"
    out = redact_urls(text)
    assert out == f"webhook {shown} unreachable: connection refused ({shown})"
    for secret in ("XyZsecret", "abc123", "pw@"):
        assert secret not in out


# Operator identity: the operators file and what a decision records.

TOKEN_LINE = re.compile(r"^([^:]+):scrypt\$n=16384,r=8,p=1\$([0-9a-f]{32})\$([0-9a-f]{64})$")


def test_operator_tokens_are_stored_only_as_salted_scrypt_hashes(tmp_path: Path) -> None:
    path = tmp_path / "operators"
    ann, bob = add_operator(path, "ann"), add_operator(path, "bob")
    text = path.read_text()
    lines = text.splitlines()
    assert len(lines) == 2
    matched = [TOKEN_LINE.match(line) for line in lines]
    assert all(matched) and [m.group(1) for m in matched if m] == ["ann", "bob"]
    salts = {m.group(2) for m in matched if m}
    assert len(salts) == 2  # a salt per line: equal tokens would still hash apart
    for token in (ann, bob):
        secret = token.rpartition(".")[2]
        assert len(secret) >= 40 and token not in text and secret not in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    stored = read_operators(path)
    assert verify_token(ann, stored["ann"]) and not verify_token(bob, stored["ann"])
    assert not verify_token(ann + "x", stored["ann"]) and not verify_token("", stored["ann"])
    # The hash is the one documented: anyone can check a line with the stdlib alone.
    m = matched[0]
    assert m is not None
    digest = hashlib.scrypt(
        ann.encode(), salt=bytes.fromhex(m.group(2)), n=16384, r=8, p=1, dklen=32
    )
    assert digest.hex() == m.group(3)


def test_operators_are_added_once_listed_by_name_and_removed(tmp_path: Path) -> None:
    path = tmp_path / "ops" / "operators"
    with pytest.raises(OperatorsFileError, match="no operators file"):
        operator_names(path)
    path.parent.mkdir()
    add_operator(path, "ann")
    with pytest.raises(DuplicateOperatorError, match="ann"):
        add_operator(path, "ann")
    for bad in ("", "a:b", "a b", "x" * 65, "ann\n", "-ann", "é"):
        with pytest.raises(OperatorInputError, match="name"):
            add_operator(path, bad)
    add_operator(path, "bob.smith@ops")
    assert operator_names(path) == ["ann", "bob.smith@ops"]
    with pytest.raises(UnknownOperatorError, match="carl"):
        remove_operator(path, "carl")
    remove_operator(path, "ann")
    assert operator_names(path) == ["bob.smith@ops"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_malformed_operators_file_is_refused_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "operators"
    add_operator(path, "ann")
    good = path.read_text()
    for bad in (
        "bob:plaintext-token\n",
        "bob:scrypt$n=16384,r=8,p=1$zz$00\n",
        "bob\n",
        "bob:scrypt$n=99999999999,r=8,p=1$" + "00" * 16 + "$" + "00" * 32 + "\n",
    ):
        path.write_text(good + "# a comment\n\n" + bad)
        with pytest.raises(OperatorsFileError) as info:
            read_operators(path)
        assert info.value.data["line"] == 4, bad
    path.write_text(good + good)
    with pytest.raises(OperatorsFileError, match="twice"):
        read_operators(path)


def test_a_login_names_its_operator_and_ends_when_the_operator_is_removed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "operators"
    ann, bob = add_operator(path, "ann"), add_operator(path, "bob")
    ops = Operators(path)
    a, b = ops.login(ann), ops.login(bob)
    assert a is not None and b is not None and (a.name, b.name) == ("ann", "bob")
    assert ops.login("ann." + "x" * 43) is None and ops.login("nobody.x") is None
    assert ops.login(bob.replace("bob.", "ann.")) is None  # a token is its operator's alone
    assert ops.holds(a) and ops.holds(b)
    remove_operator(path, "ann")
    assert not ops.holds(a) and ops.holds(b) and ops.login(ann) is None
    # Added again: a new token, and the old login does not come back with the name.
    ann2 = add_operator(path, "ann")
    assert not ops.holds(a) and ops.login(ann) is None
    a2 = ops.login(ann2)
    assert a2 is not None and a2.name == "ann" and ops.holds(a2)
    path.unlink()  # gone: nobody gets in, nobody stays in
    assert not ops.holds(a2) and ops.login(bob) is None


def test_a_decision_records_who_made_it_and_how_poimen_knows(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'intents.db'}")
    try:
        ids = [dispatch(store, f"run/{n}", effect="unsafe") for n in range(3)]
        for iid in ids[:2]:
            assert store.mark_indeterminate(iid, 1, "unsafe_unknown_outcome", note(iid), 1.0)
        op.resolve(
            store,
            ids[0],
            landed=False,
            operator=op.Identity("ann", via="cli", os_user="ops1"),
            reason="checked",
        )
        op.resolve(store, ids[1], landed=True, operator=" bo ", reason="seen")
        op.abandon(store, ids[2], operator=op.Identity("carl", via="proxy-header"), reason="gone")
        details = [json.loads(store.events(i)[-1].detail or "{}") for i in ids]
        actors = [store.events(i)[-1].actor for i in ids]
    finally:
        store.close()
    assert actors == ["ann", "bo", "carl"]
    assert details[0]["operator"] == "ann" and details[0]["os_user"] == "ops1"
    assert details[0]["identified_by"] == "cli" and details[0]["reason"] == "checked"
    assert "identified_by" not in details[1] and details[1]["operator"] == "bo"
    assert details[2]["identified_by"] == "proxy-header" and "os_user" not in details[2]
    with pytest.raises(OperatorInputError, match="operator"):
        op.Identity(" ", via="cli")
    with pytest.raises(OperatorInputError, match="via"):
        op.Identity("ann", via="guess")


def test_operators_added_at_once_are_all_kept_and_a_name_only_once(tmp_path: Path) -> None:
    path = tmp_path / "operators"
    gate = threading.Barrier(6)
    got: list[str] = []

    def add(name: str) -> None:
        gate.wait()
        try:
            add_operator(path, name)
            got.append(f"added {name}")
        except DuplicateOperatorError:
            got.append("refused")

    threads = [threading.Thread(target=add, args=(n,)) for n in ("a1", "a2", "a3", *["dup"] * 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == ["added a1", "added a2", "added a3", "added dup", "refused", "refused"]
    assert sorted(operator_names(path)) == ["a1", "a2", "a3", "dup"]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("sqlite:////var/lib/agent/intents.db", "sqlite:////var/lib/agent/intents.db"),
        ("sqlite:///rel/a b.db", "sqlite:///rel/a b.db"),
        ("postgresql://agent@db:5432/agent", "postgresql://agent@db:5432/agent"),
        ("postgresql://agent:pw-1@db/agent", "postgresql://agent:[redacted]@db/agent"),
        (
            "postgres://a:pw-2@db/x?sslpassword=pw-3&application_name=app&api_key=pw-4",
            "postgres://a:[redacted]@db/x?sslpassword=[redacted]&application_name=app"
            "&api_key=[redacted]",
        ),
        ("postgresql://a:p%40w-5@db/x?password=pw-6", "postgresql://a:[redacted]@db/x?password=[redacted]"),
    ],
)
def test_store_urls_keep_everything_but_their_secrets(url: str, shown: str) -> None:
    assert redact_store_url(url) == shown
    assert redact_store_url(shown) == shown  # redacting twice changes nothing
    out = redact_urls(f"cannot open {url}: refused ({url}).")
    assert out == f"cannot open {shown}: refused ({shown})."
    assert "pw-" not in out
