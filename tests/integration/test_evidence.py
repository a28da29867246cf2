"""Evidence for the operator: an Unsafe email tool whose `evidence=` reads the provider's sent
log (poimen.testing's provider ledger, the witness). After a SIGKILL the Indeterminate call
carries the evidence in `poimen show`, the webhook and the events; the rule's suggestion is
recorded with the decision; the gathering is read-only, bounded, off the call path, and its
failures are recorded, never raised."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from poimen import (
    CallbackNotifier,
    Caps,
    Evidence,
    Fact,
    IntentState,
    Kernel,
    Notification,
    RecordedCall,
    Suggestion,
    ToolContext,
    Unsafe,
    WebhookNotifier,
)
from poimen.errors import RegistrationError
from poimen.store import open_store
from poimen.testing import ProviderClient, ProviderProcess
from tests.integration.operator_app import poimen, poimen_json
from tests.integration.outage_app import MAIL, crash_mail, register_mail
from tests.integration.test_webhook import SECRET, Receiver, receiver  # noqa: F401

APP = "tests.integration.outage_app:make_kernel"
S = IntentState


def until(check: Callable[[], Any], what: str, within: float = 60.0) -> Any:
    """Wait for the event itself, with a bound generous for a loaded machine."""
    end = time.monotonic() + within
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.02)


def sent_to(ledger: ProviderClient, to: str) -> list[dict[str, Any]]:
    return [e for e in ledger.entries(kind="plain") if e["body"].get("to") == to]


def evidence_events(k: Kernel, intent_id: str) -> list[Any]:
    return [e for e in k.store.events(intent_id) if e.kind == "evidence"]


def test_a_killed_email_call_carries_its_evidence_in_show_the_webhook_and_the_audit(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient,
    receiver: Receiver,  # noqa: F811
) -> None:
    to = "ann@example.com"
    crash_mail(tmp_path, store_url, provider.url, {"to": to, "subject": "invoice 7"}, "run-1/mail")
    [sent] = sent_to(ledger, to)  # the witness: the message went out once, then the kill
    k = Kernel(store_url, notifiers=[WebhookNotifier(receiver.url, secret=SECRET)],
               deadline_margin=0.1)
    register_mail(k, provider.url)
    with k:
        k.recover()
        intent = k.store.get_by_call_id("run-1/mail")
        assert intent is not None and intent.state == S.INDETERMINATE
        delivery = f"{intent.id}:indeterminate"
        until(lambda: receiver.accepted().get(delivery), "the webhook")
    [note] = [r.body for r in receiver.requests if r.delivery_id == delivery and r.status == 200]
    # The first notification already carries the evidence: it waited for it.
    ev = note["evidence"]
    assert ev is not None and ev["error"] is None and ev["trigger"] == "indeterminate"
    matching = [f for f in ev["facts"] if (f["data"] or {}).get("entry_id") == sent["id"]]
    assert len(matching) == 1 and matching[0]["data"]["poimen_call"] == "run-1/mail"
    assert matching[0]["link"].startswith(provider.url)
    assert ev["suggestion"] == {"landed": True, "reason": ev["suggestion"]["reason"]}
    assert "exactly one sent message" in ev["suggestion"]["reason"]

    shown = poimen_json("show", "run-1/mail", db=store_url)
    assert [f["data"]["entry_id"] for f in shown["evidence"]["facts"][1:]] == [sent["id"]]
    assert shown["suggestion"]["decision"] == "landed"
    text = poimen("show", "run-1/mail", db=store_url)
    assert "evidence (gathered" in text.stdout and "suggested: landed" in text.stdout
    assert f"message {sent['id']} to {to}" in text.stdout

    # A person decides; the audit records what was suggested and that it was followed.
    r = poimen("resolve", "run-1/mail", "--landed", "--operator", "ana", "--reason",
               "the provider's sent log has the message", db=store_url)
    assert r.returncode == 0, r.stderr
    done = poimen_json("show", "run-1/mail", db=store_url)
    decision = done["events"][-1]
    assert decision["kind"] == "resolved"
    assert decision["detail"]["suggested"] == "landed"
    assert decision["detail"]["followed_suggestion"] is True
    assert decision["detail"]["suggestion_event"] == shown["evidence"]["event_id"]
    assert done["suggestion"] is None  # decided: nothing is suggested any more
    assert len(sent_to(ledger, to)) == 1  # nothing was sent again


def test_no_message_in_a_log_read_after_the_timeout_suggests_not_landed(
    tmp_path: Path, sqlite_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    to = "bo@example.com"
    crash_mail(tmp_path, sqlite_url, provider.url, {"to": to, "subject": "x"}, "run-2/mail",
               point="mid_call", POIMEN_TEST_MAIL_TIMEOUT="0.2")
    seen: list[Notification] = []
    k = Kernel(sqlite_url, notifiers=[CallbackNotifier(seen.append, name="log")])
    register_mail(k, provider.url, timeout=0.2)
    with k:
        started = k.store.get_by_call_id("run-2/mail")
        assert started is not None
        until(lambda: time.time() > started.created_at + 0.3, "the call's timeout to pass")
        k.recover()
        intent = k.store.get_by_call_id("run-2/mail")
        assert intent is not None and intent.state == S.INDETERMINATE
        until(lambda: seen, "the notification")
        ev = json.loads(seen[0].payload)["evidence"]
        assert ev["suggestion"]["landed"] is False and len(ev["facts"]) == 1
        assert sent_to(ledger, to) == []  # the witness agrees: nothing was sent
        # The operator decides otherwise; the audit says so.
        k.resolve(intent.id, landed=True, operator="ana", reason="the recipient replied")
        detail = json.loads(k.store.events(intent.id)[-1].detail or "{}")
        assert detail["suggested"] == "not_landed" and detail["followed_suggestion"] is False


def test_the_evidence_function_can_only_read(
    sqlite_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    """Its handles deny every write, as a ReadOnly tool's do, and so does the guard for a
    client of its own: denied, recorded in the audit, and the provider never sees it."""
    out_of_band = httpx.Client(base_url=provider.url, timeout=5)

    def writes(ctx: ToolContext, call: RecordedCall) -> list[Fact]:
        facts = []
        for how, send in (
            ("through ctx.http", lambda: ctx.http.post(f"{provider.url}/plain", json={"w": 1})),
            ("out of band", lambda: out_of_band.post("/plain", json={"w": 2})),
        ):
            try:
                send()
                facts.append(Fact(f"{how}: the write went out"))
            except Exception as exc:
                facts.append(Fact(f"{how}: {type(exc).__name__}"))
        return facts

    k = Kernel(sqlite_url, notifiers=[])
    register_mail(k, provider.url, evidence=Evidence(writes))
    with k:
        out = k.call(MAIL, {"to": "c@example.com", "subject": "s", "land": False},
                     call_id="run-3/mail")
        assert out.intent_id and k.store.get_intent(out.intent_id).state == S.INDETERMINATE  # type: ignore[union-attr]
        found = k.evidence("run-3/mail", operator="ana")
        denials = [d for d in k.denials() if d.intent_id == out.intent_id]
    out_of_band.close()
    assert found is not None
    assert [f["text"] for f in found.facts] == [
        "through ctx.http: CapabilityDeniedError",
        "out of band: CapabilityDeniedError",
    ]
    assert ledger.entries(kind="plain") == []  # the witness: no write reached the provider
    assert {d.action for d in denials} == {"http", "connect"} and all(
        "read_only" in d.reason for d in denials
    )


def test_gathering_never_holds_up_the_call_recovery_or_other_notifications(
    sqlite_url: str, provider: ProviderProcess
) -> None:
    """The evidence function blocks until the test lets it go, after the call and recovery
    returned: had either waited for it, it would have run out its wait first."""
    release, order = threading.Event(), []

    def slow(ctx: ToolContext, call: RecordedCall) -> list[Fact]:
        release.wait(120)
        order.append("gathered")
        return [Fact("looked")]

    seen: list[Notification] = []
    k = Kernel(sqlite_url, notifiers=[CallbackNotifier(seen.append, name="log")])
    register_mail(k, provider.url, evidence=Evidence(slow, timeout=600))
    with k:
        out = k.call(MAIL, {"to": "d@example.com", "subject": "s", "land": False},
                     call_id="run-4/mail")
        order.append("call returned")
        k.recover()
        k.deliver_notifications()
        order.append("recovery and delivery returned")
        assert [json.loads(n.payload).get("evidence") for n in seen] == []  # waits for it
        release.set()
        until(lambda: evidence_events(k, out.intent_id), "the evidence event")
        until(lambda: seen, "the notification")
    assert order == ["call returned", "recovery and delivery returned", "gathered"]
    assert json.loads(seen[0].payload)["evidence"]["facts"][0]["text"] == "looked"


def test_a_gathering_past_its_timeout_is_recorded_as_such_and_the_notification_goes(
    sqlite_url: str, provider: ProviderProcess
) -> None:
    release, finished = threading.Event(), threading.Event()

    def stuck(ctx: ToolContext, call: RecordedCall) -> list[Fact]:
        try:
            release.wait(120)
            return [Fact("too late")]
        finally:
            finished.set()

    seen: list[Notification] = []
    k = Kernel(sqlite_url, notifiers=[CallbackNotifier(seen.append, name="log")])
    register_mail(k, provider.url, evidence=Evidence(stuck, timeout=0.3))
    with k:
        out = k.call(MAIL, {"to": "e@example.com", "subject": "s", "land": False},
                     call_id="run-5/mail")
        [event] = until(lambda: evidence_events(k, out.intent_id), "the evidence event")
        until(lambda: seen, "the notification")
        ev = json.loads(seen[0].payload)["evidence"]
        assert ev["error"].startswith("timed out after 0.3s") and ev["facts"] == []
        release.set()
        assert finished.wait(60)
        k.deliver_notifications()
        assert evidence_events(k, out.intent_id) == [event]  # its late answer is not used


def _raises(ctx: ToolContext, call: RecordedCall) -> list[Fact]:
    raise RuntimeError("the provider's log API is down")


def _text(ctx: ToolContext, call: RecordedCall) -> Any:
    return "nothing found"


def _script_link(ctx: ToolContext, call: RecordedCall) -> list[Fact]:
    return [Fact("a message", link="javascript:alert(1)")]


def _not_a_fact(ctx: ToolContext, call: RecordedCall) -> Any:
    return [{"text": "a dict"}]


def _secret(ctx: ToolContext, call: RecordedCall) -> list[Fact]:
    return [Fact("a message", link="https://u:pw@logs.example/m/1?token=abc&id=1",
                 data={"id": 1, "api_key": "sk-123"})]


def _bad_rule(call: RecordedCall, facts: Any) -> Suggestion | None:
    raise KeyError("entry_id")


@pytest.mark.parametrize(
    ("gather", "suggest", "expect"),
    [
        (_raises, None, {"error": "RuntimeError: the provider's log API is down"}),
        (_text, None, {"error": "the evidence function must return a list of Fact, not str"}),
        (_script_link, None, {"error": "fact 1: link 'javascript:alert(1)' is not an http(s) URL"}),
        (_not_a_fact, None, {"error": "fact 1 is a dict, not a Fact"}),
        (_secret, _bad_rule, {"error": None, "suggest_error": "KeyError: 'entry_id'"}),
    ],
    ids=["raises", "text", "script-link", "not-a-fact", "secret-and-a-failing-rule"],
)
def test_what_goes_wrong_in_a_gathering_is_recorded_never_raised(
    sqlite_url: str, provider: ProviderProcess, gather: Any, suggest: Any,
    expect: dict[str, Any],
) -> None:
    k = Kernel(sqlite_url, notifiers=[])
    register_mail(k, provider.url, evidence=Evidence(gather, suggest=suggest))
    with k:
        out = k.call(MAIL, {"to": "f@example.com", "subject": "s", "land": False},
                     call_id="run-6/mail")
        found = k.evidence(out.intent_id, operator="ana")
        assert found is not None and found.actor == "ana" and found.trigger == "operator"
        for key, value in expect.items():
            assert getattr(found, key) == value
        assert found.suggestion is None
        if gather is _secret:
            [fact] = found.facts
            raw = json.dumps([json.loads(e.detail or "{}") for e in k.store.events(out.intent_id)])
            assert "sk-123" not in raw and "pw@" not in raw and "token=abc" not in raw
            assert fact["data"] == {"id": 1, "api_key": "[redacted]"}
            assert fact["link"] == "https://u:[redacted]@logs.example/m/1?token=[redacted]&id=1"


def test_poimen_evidence_gathers_on_demand_as_the_operator(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    crash_mail(tmp_path, store_url, provider.url, {"to": "g@example.com", "subject": "s"},
               "run-7/mail")
    env = {"POIMEN_TEST_PROVIDER": provider.url}
    r = poimen("recover", "--app", APP, db=store_url, **env)
    assert r.returncode == 0, r.stderr
    got = poimen_json("evidence", "run-7/mail", "--app", APP, "--operator", "bob",
                      db=store_url, **env)
    [sent] = sent_to(ledger, "g@example.com")
    assert got["evidence"]["actor"] == "bob" and got["evidence"]["trigger"] == "operator"
    assert [f["data"]["entry_id"] for f in got["evidence"]["facts"][1:]] == [sent["id"]]
    assert got["suggestion"]["decision"] == "landed"
    shown = poimen_json("show", "run-7/mail", db=store_url)
    asked = [e for e in shown["events"] if e["kind"] == "evidence" and e["actor"] == "bob"]
    assert len(asked) == 1 and asked[0]["detail"]["identified_by"] == "cli"
    # Without --app there is no evidence function to run: a usage error, nothing written.
    r = poimen("evidence", "run-7/mail", db=store_url)
    assert r.returncode == 2 and "--app" in r.stderr


def test_a_bad_declaration_is_refused_at_registration(sqlite_url: str) -> None:
    def tool(ctx: ToolContext) -> None:
        return None

    with Kernel(sqlite_url, notifiers=[]) as k:
        for bad, match in (
            ("sent_log", "evidence must be an Evidence"),
            (Evidence(lambda c, r: [], timeout=0), "Evidence.timeout must be a positive"),
            (Evidence(lambda c, r: [], suggest="rule"), "Evidence.suggest must be a function"),  # type: ignore[arg-type]
        ):
            with pytest.raises(RegistrationError, match=match):
                k.tool(id="t.x", effects=Unsafe(), caps=Caps(), timeout=1,
                       evidence=bad)(tool)  # type: ignore[arg-type]
        with pytest.raises(RegistrationError, match="escalate_after must be a positive"):
            k.tool(id="t.x", effects=Unsafe(), caps=Caps(), timeout=1, escalate_after=-1)(tool)
        assert k.registered() == {}  # nothing half registered


def test_a_process_about_to_exit_finishes_the_gathering_in_flight(
    sqlite_url: str, provider: ProviderProcess
) -> None:
    """What `poimen recover` does before it closes its kernel: the delivery duty is gathering
    when the command is done; it waits for that gathering (bounded) instead of dropping it."""
    entered = threading.Event()

    def takes_a_while(ctx: ToolContext, call: RecordedCall) -> list[Fact]:
        entered.set()
        time.sleep(3)  # the gathering's own work, not a wait for something to happen
        return [Fact("looked, slowly")]

    k = Kernel(sqlite_url, notifiers=[])
    register_mail(k, provider.url, evidence=Evidence(takes_a_while, timeout=60))
    out = k.call(MAIL, {"to": "h@example.com", "subject": "s", "land": False},
                 call_id="run-8/mail")
    assert entered.wait(60)  # the delivery duty is gathering it now
    k.deliver_notifications(gather=True)
    k.close()
    store = open_store(sqlite_url, migrate=False)
    try:
        [event] = [e for e in store.events(out.intent_id) if e.kind == "evidence"]
    finally:
        store.close()
    assert json.loads(event.detail or "{}")["facts"][0]["text"] == "looked, slowly"
