"""The webhook notifier against a real HTTP receiver on 127.0.0.1 that checks the signature
with the Standard Webhooks library (the outside witness); the calls behind the notifications
were SIGKILLed mid-call."""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from poimen import IntentState, Kernel, LogNotifier, WebhookNotifier
from poimen.errors import PoimenError
from poimen.store import open_store
from poimen.testing import (
    EMAIL,
    ProviderClient,
    ProviderProcess,
    kill_at_pause,
    register_test_tools,
)
from tests.contract.test_store_contract import dispatch, raw
from tests.integration.operator_app import POIMEN, ROOT, crash, register_ops

SECRET = "whsec_" + base64.b64encode(b"poimen-test-secret-4f1d").decode()
APP = "tests.integration.operator_app:make_kernel"


@dataclass
class Delivery:
    delivery_id: str
    body: dict[str, Any]
    status: int
    signature_ok: bool


@dataclass
class Receiver:
    """Answers 401 to a bad signature, 500 to the first `fail_first` tries of each delivery
    id, 200 otherwise; remembers every request."""

    secret: str
    fail_first: int = 0
    requests: list[Delivery] = field(default_factory=list)
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def accepted(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.requests:
            if d.status == 200:
                out[d.delivery_id] = out.get(d.delivery_id, 0) + 1
        return out

    def handle(self, headers: Any, raw: bytes) -> int:
        try:
            Webhook(self.secret).verify(raw, dict(headers.items()))
            ok = True
        except WebhookVerificationError:
            ok = False
        did = headers.get("webhook-id", "")
        with self.lock:
            tries = sum(1 for d in self.requests if d.delivery_id == did)
            status = 401 if not ok else 500 if tries < self.fail_first else 200
            self.requests.append(Delivery(did, json.loads(raw), status, ok))
        return status


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rec = Receiver(SECRET)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            status = rec.handle(self.headers, raw)
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    rec.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/poimen"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield rec
    server.shutdown()
    server.server_close()


def kernel_for(store_url: str, provider_url: str, notifier: WebhookNotifier, **kw: Any) -> Kernel:
    k = Kernel(store_url, notifiers=[notifier], deadline_margin=0.1, **kw)
    register_test_tools(k, provider_url, timeout=0.5)
    register_ops(k, provider_url)
    return k


def emails(ledger: ProviderClient, to: str) -> int:
    return sum(1 for e in ledger.entries(kind="plain") if e["body"].get("to") == to)


def test_signed_notification_describes_the_intent(
    tmp_path: Path,
    store_url: str,
    provider: ProviderProcess,
    ledger: ProviderClient,
    receiver: Receiver,
) -> None:
    crash(tmp_path, store_url, provider.url, EMAIL, {"to": "a@example.com", "subject": "s"}, "w1")
    hook = WebhookNotifier(receiver.url, secret=SECRET, console_url="http://127.0.0.1:8470/")
    with kernel_for(store_url, provider.url, hook) as k:
        report = k.recover()
        assert report.indeterminate == 1
        intent = k.store.get_by_call_id("w1")
        assert intent is not None and intent.state == IntentState.INDETERMINATE
        [note] = k.store.notifications(intent.id)
        assert note.delivered_at is not None and note.attempts == 1
    [d] = receiver.requests
    assert d.signature_ok and d.status == 200
    assert d.delivery_id == f"{intent.id}:indeterminate" == d.body["delivery_id"]
    assert d.body["kind"] == "indeterminate"
    body = d.body["intent"]
    assert body["id"] == intent.id and body["call_id"] == "w1"
    assert body["tool_id"] == EMAIL and body["effect"] == "unsafe"
    assert body["reason"] == "unsafe_unknown_outcome"
    assert 0 <= body["age_s"] < 120
    assert body["link"] == f"http://127.0.0.1:8470/intents/{intent.id}"
    # Notified, never retried: the provider saw the one email the killed call sent.
    assert emails(ledger, "a@example.com") == 1


def test_a_wrong_signature_is_refused_and_stays_in_the_outbox(
    tmp_path: Path, store_url: str, provider: ProviderProcess, receiver: Receiver
) -> None:
    crash(tmp_path, store_url, provider.url, EMAIL, {"to": "b@example.com", "subject": "s"}, "w2")
    hook = WebhookNotifier(receiver.url, secret="not-the-shared-secret")
    with kernel_for(store_url, provider.url, hook) as k:
        k.recover()
        intent = k.store.get_by_call_id("w2")
        assert intent is not None
        [note] = k.store.notifications(intent.id)
    assert [(d.status, d.signature_ok) for d in receiver.requests] == [(401, False)]
    assert note.delivered_at is None and note.attempts == 1
    assert note.last_error is not None and "401" in note.last_error


def test_receiver_failing_twice_gets_each_delivery_once(
    tmp_path: Path, store_url: str, provider: ProviderProcess, receiver: Receiver
) -> None:
    receiver.fail_first = 2
    crash(tmp_path, store_url, provider.url, EMAIL, {"to": "c@example.com", "subject": "s"}, "w3")
    crash(tmp_path, store_url, provider.url, EMAIL, {"to": "d@example.com", "subject": "s"}, "w4")
    hook = WebhookNotifier(receiver.url, secret=SECRET)
    with kernel_for(store_url, provider.url, hook) as k:
        k.recover()
        ids = {k.store.get_by_call_id(c).id for c in ("w3", "w4")}  # type: ignore[union-attr]
        end = time.monotonic() + 20  # back-off: 1s, then 2s
        while len(receiver.accepted()) < 2:
            assert time.monotonic() < end, receiver.requests
            time.sleep(0.1)
            k.deliver_notifications()
        for _ in range(3):  # delivered rows are never sent again
            k.deliver_notifications()
        notes = [n for i in ids for n in k.store.notifications(i)]
    expected = {f"{i}:indeterminate" for i in ids}
    assert receiver.accepted() == dict.fromkeys(expected, 1)
    by_id: dict[str, list[int]] = {}
    for d in receiver.requests:
        assert d.signature_ok
        by_id.setdefault(d.delivery_id, []).append(d.status)
    assert by_id == {key: [500, 500, 200] for key in expected}
    assert all(n.delivered_at is not None and n.attempts == 3 for n in notes)


def test_kill_between_state_change_and_delivery_still_delivers_after_restart(
    tmp_path: Path,
    store_url: str,
    provider: ProviderProcess,
    ledger: ProviderClient,
    receiver: Receiver,
) -> None:
    crash(tmp_path, store_url, provider.url, EMAIL, {"to": "e@example.com", "subject": "s"}, "w5")
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    env.update(
        POIMEN_DB=store_url,
        POIMEN_TEST_PROVIDER=provider.url,
        POIMEN_TEST_WEBHOOK=receiver.url,
        POIMEN_TEST_WEBHOOK_SECRET=SECRET,
    )
    pause = tmp_path / "pause-notify"
    # `poimen recover` marks the intent INDETERMINATE (outbox row in the same commit) and is
    # SIGKILLed before it delivers.
    proc = subprocess.Popen(
        [str(POIMEN), "recover", "--app", APP],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "POIMEN_PAUSE_AT": "before_notify", "POIMEN_PAUSE_FILE": str(pause)},
    )
    assert kill_at_pause(proc, pause) == "before_notify"
    assert receiver.requests == []
    shown = subprocess.run(
        [str(POIMEN), "show", "w5", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    detail = json.loads(shown.stdout)
    assert detail["state"] == "INDETERMINATE"
    [note] = detail["notifications"]
    assert note["delivered_at"] is None

    restart = subprocess.run(
        [str(POIMEN), "recover", "--app", APP, "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert restart.returncode == 0, restart.stderr
    assert json.loads(restart.stdout)["scanned"] == 0  # nothing left to recover, only to send
    assert receiver.accepted() == {f"{detail['id']}:indeterminate": 1}
    assert receiver.requests[0].body["intent"]["reason"] == "unsafe_unknown_outcome"
    assert emails(ledger, "e@example.com") == 1


def test_still_open_indeterminate_intents_are_renotified_until_resolved(
    tmp_path: Path, store_url: str, provider: ProviderProcess, receiver: Receiver
) -> None:
    crash(tmp_path, store_url, provider.url, EMAIL, {"to": "f@example.com", "subject": "s"}, "w6")
    hook = WebhookNotifier(receiver.url, secret=SECRET)
    with kernel_for(store_url, provider.url, hook, renotify_after=0.4) as k:
        k.recover()
        intent = k.store.get_by_call_id("w6")
        assert intent is not None
        assert list(receiver.accepted()) == [f"{intent.id}:indeterminate"]
        k.deliver_notifications()  # too soon: no reminder yet
        assert len(receiver.requests) == 1
        time.sleep(0.5)
        k.deliver_notifications()
        first = f"{intent.id}:indeterminate_reminder:1"
        assert list(receiver.accepted()) == [f"{intent.id}:indeterminate", first]
        reminder = receiver.requests[-1].body
        assert reminder["kind"] == "indeterminate_reminder" and reminder["reminder"] == 1
        assert reminder["intent"]["id"] == intent.id
        time.sleep(0.5)
        k.deliver_notifications()
        assert f"{intent.id}:indeterminate_reminder:2" in receiver.accepted()
        k.resolve(intent.id, landed=False, operator="ana", reason="bounced, checked the MTA")
        sent = len(receiver.requests)
        time.sleep(0.5)
        k.deliver_notifications()
        assert len(receiver.requests) == sent  # resolved: no more reminders


# Secrets in webhook URLs, and who delivers what.

HOOK_PATH = "/hooks/T0123/B0456/XyZsecretPart"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_webhook_url_is_never_shown_or_stored_whole(
    tmp_path: Path,
    store_url: str,
    provider: ProviderProcess,
    receiver: Receiver,
    caplog: pytest.LogCaptureFixture,
) -> None:
    crash(tmp_path, store_url, provider.url, EMAIL, {"to": "g@example.com", "subject": "s"}, "w7")
    port = closed_port()
    url = f"http://127.0.0.1:{port}{HOOK_PATH}?token=tok-777"
    shown = f"http://127.0.0.1:{port}/…"
    hook = WebhookNotifier(url, secret=SECRET, name="ops-hook")
    with (
        caplog.at_level(logging.WARNING, logger="poimen"),
        kernel_for(store_url, provider.url, hook) as k,
    ):
        k.recover()
        intent = k.store.get_by_call_id("w7")
        assert intent is not None
        [note] = k.store.notifications(intent.id)
    assert note.delivered_at is None and note.last_error is not None
    assert shown in note.last_error and "unreachable" in note.last_error
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert shown in logged
    for secret in ("XyZsecretPart", "tok-777", "T0123"):
        assert secret not in note.last_error and secret not in logged

    # The same recipient at a new address (so, the same name): a receiver that answers 500,
    # behind a path that is its credential.
    receiver.fail_first = 99
    secret_url = receiver.url + "/XyZsecretPart?token=tok-777"
    assert WebhookNotifier(secret_url, secret=SECRET).name == "webhook:" + secret_url.split("/")[2]
    hook = WebhookNotifier(secret_url, secret=SECRET, name="ops-hook")
    while time.time() <= note.next_attempt_at:  # due again after its back-off
        time.sleep(0.05)
    with kernel_for(store_url, provider.url, hook) as k:
        assert k.deliver_notifications() == 0
        [note] = k.store.notifications(intent.id)
    assert note.last_error is not None and "answered 500" in note.last_error
    assert "XyZsecretPart" not in note.last_error and "/…" in note.last_error

    # A row written by an older poimen with the whole URL in it is shown redacted.
    old_error = f"webhook https://hooks.slack.com/services{HOOK_PATH} unreachable"
    raw(store_url, "UPDATE outbox SET last_error = ? WHERE intent_id = ?", (old_error, intent.id))
    raw(store_url, "UPDATE deliveries SET last_error = ?", (old_error,))
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    for args in (["show", "w7"], ["show", "w7", "--json"]):
        out = subprocess.run(
            [str(POIMEN), *args],
            cwd=ROOT,
            env={**env, "POIMEN_DB": store_url},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "https://hooks.slack.com/" in out and "XyZsecretPart" not in out, out


class Counting:
    """A notifier that counts what it was given and can be told to fail."""

    def __init__(self, name: str, *, fail: int = 0) -> None:
        self.name = name
        self.fail = fail
        self.seen: list[str] = []

    def notify(self, notification: Any) -> None:
        self.seen.append(notification.delivery_id)
        if self.fail > 0:
            self.fail -= 1
            raise RuntimeError(f"{self.name} is down")


def test_a_kernel_delivers_only_to_its_own_notifiers(
    tmp_path: Path, store_url: str, provider: ProviderProcess, receiver: Receiver
) -> None:
    receiver.fail_first = 1
    crash(tmp_path, store_url, provider.url, EMAIL, {"to": "h@example.com", "subject": "s"}, "w8")
    with kernel_for(store_url, provider.url, WebhookNotifier(receiver.url, secret=SECRET)) as k:
        k.recover()  # the row is written for this webhook; its first try fails
        intent = k.store.get_by_call_id("w8")
        assert intent is not None
        assert [d.status for d in receiver.requests] == [500]
        [note] = k.store.notifications(intent.id)
    while time.time() <= note.next_attempt_at:  # due again after its back-off
        time.sleep(0.05)

    # Kernels without that webhook deliver nothing and mark nothing.
    for notifiers in ([], [LogNotifier()], [Counting("audit-log")]):
        with Kernel(store_url, notifiers=notifiers) as other:
            assert other.deliver_notifications() == 0
            [note] = other.store.notifications(intent.id)
            assert note.delivered_at is None, notifiers
    assert [d.status for d in receiver.requests] == [500]

    # The webhook's own kernel delivers it, after the back-off.
    with kernel_for(store_url, provider.url, WebhookNotifier(receiver.url, secret=SECRET)) as k:
        end = time.monotonic() + 20
        while not receiver.accepted():
            assert time.monotonic() < end, receiver.requests
            k.deliver_notifications()
            time.sleep(0.1)
        [note] = k.store.notifications(intent.id)
    assert note.delivered_at is not None
    assert receiver.accepted() == {f"{intent.id}:indeterminate": 1}


def test_each_notifier_gets_each_notification_once_however_the_others_fare(
    tmp_path: Path, store_url: str, provider: ProviderProcess
) -> None:
    crash(tmp_path, store_url, provider.url, EMAIL, {"to": "i@example.com", "subject": "s"}, "w9")
    steady, flaky = Counting("steady"), Counting("flaky", fail=1)
    k = Kernel(store_url, notifiers=[steady, flaky], deadline_margin=0.1, lookup_backoff=0.05)
    register_test_tools(k, provider.url, timeout=0.5)
    with k:
        k.recover()
        intent = k.store.get_by_call_id("w9")
        assert intent is not None
        did = f"{intent.id}:indeterminate"
        assert steady.seen == [did] and flaky.seen == [did]
        [note] = k.store.notifications(intent.id)
        assert note.delivered_at is None  # flaky has not accepted it yet
        end = time.monotonic() + 20
        while len(flaky.seen) < 2:
            assert time.monotonic() < end
            k.deliver_notifications()
            time.sleep(0.1)
        k.deliver_notifications()
        [note] = k.store.notifications(intent.id)
        assert note.delivered_at is not None
    assert steady.seen == [did]  # not sent again because another notifier failed
    assert flaky.seen == [did, did]
    with pytest.raises(PoimenError, match="flaky"):
        Kernel(store_url, notifiers=[Counting("flaky"), Counting("flaky")])


def test_a_kernel_without_notifiers_leaves_its_notes_to_any_that_has_some(
    tmp_path: Path, store_url: str, provider: ProviderProcess, receiver: Receiver
) -> None:
    crash(tmp_path, store_url, provider.url, EMAIL, {"to": "j@example.com", "subject": "s"}, "w10")
    quiet = Kernel(store_url, notifiers=[], deadline_margin=0.1)
    register_test_tools(quiet, provider.url, timeout=0.5)
    with quiet:
        assert quiet.recover().indeterminate == 1
        intent = quiet.store.get_by_call_id("w10")
        assert intent is not None
        [note] = quiet.store.notifications(intent.id)
        assert note.delivered_at is None
    with kernel_for(store_url, provider.url, WebhookNotifier(receiver.url, secret=SECRET)) as k:
        assert k.deliver_notifications() == 1
        [note] = k.store.notifications(intent.id)
    assert note.delivered_at is not None
    assert receiver.accepted() == {f"{intent.id}:indeterminate": 1}


def test_an_abandoned_call_is_notified_like_any_indeterminate_one(
    store_url: str, receiver: Receiver
) -> None:
    from tests.integration.operator_app import poimen

    store = open_store(store_url)
    try:
        by_cli = dispatch(store, "run-1/stuck", effect="unsafe")
        by_kernel = dispatch(store, "run-2/stuck", effect="unsafe")
    finally:
        store.close()
    # The command line has no notifiers: its note is for any kernel's.
    r = poimen("abandon", by_cli, "--operator", "ana", "--reason", "host h1 is gone", db=store_url)
    assert r.returncode == 0, r.stderr
    hook = WebhookNotifier(receiver.url, secret=SECRET)
    with Kernel(store_url, notifiers=[hook]) as k:
        assert k.deliver_notifications() == 1
        k.abandon(by_kernel, operator="bo", reason="host h2 is gone")
        give_up = time.monotonic() + 60  # the kernel's delivery duty sends it, soon
        while len(receiver.accepted()) < 2:
            assert time.monotonic() < give_up, receiver.requests
            k.deliver_notifications()
            time.sleep(0.05)
        for iid in (by_cli, by_kernel):
            [note] = k.store.notifications(iid)
            assert note.kind == "indeterminate" and note.delivered_at is not None
    assert receiver.accepted() == {f"{by_cli}:indeterminate": 1, f"{by_kernel}:indeterminate": 1}
    for d in receiver.requests:
        assert d.signature_ok and d.body["kind"] == "indeterminate"
        assert d.body["intent"]["reason"] == "abandoned_by_operator"
        assert d.body["intent"]["id"] in (by_cli, by_kernel)
