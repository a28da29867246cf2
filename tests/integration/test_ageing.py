"""Calls waiting for a person too long: a tool's `escalate_after` re-notifies an Indeterminate
or awaiting-approval call, once, to the kernel's notifiers and its escalation line; the
metrics and `poimen status --older-than` report the same ages. Time is the store's clock,
moved by the test (no sleeps)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from poimen import (
    CallbackNotifier,
    Caps,
    Evidence,
    Fact,
    IntentState,
    Kernel,
    Notification,
    ToolContext,
    Unsafe,
)
from poimen.operator import _metrics
from poimen.store import open_store
from poimen.testing import ProviderProcess
from tests.integration.operator_app import poimen
from tests.integration.outage_app import MAIL, register_mail

S = IntentState
REFUND = "billing.refund"


class Clock:
    """The store's clock, moved by the test."""

    def __init__(self, start: float) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t


def until(check: Callable[[], Any], what: str, within: float = 60.0) -> Any:
    end = time.monotonic() + within
    while not (got := check()):
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.02)
    return got


def kinds(seen: list[Notification]) -> list[tuple[str, str]]:
    return [(n.kind, n.intent_id) for n in seen]


def aged_kernel(
    url: str, provider: str, clock: Clock, primary: list[Notification],
    pager: list[Notification],
) -> Kernel:
    store = open_store(url)
    store.now = clock  # type: ignore[method-assign]
    k = Kernel(store, notifiers=[CallbackNotifier(primary.append, name="ops")],
               escalate_to=[CallbackNotifier(pager.append, name="pager")])
    register_mail(k, provider, escalate_after=3600,
                  evidence=Evidence(lambda ctx, call: [Fact("the sent log has nothing")]))

    @k.tool(id=REFUND, effects=Unsafe(), caps=Caps(), timeout=5, requires_approval=True,
            escalate_after=600)
    def refund(ctx: ToolContext, order: str) -> None:
        return None

    return k


def test_overdue_calls_are_renotified_and_escalated_once_by_the_store_clock(
    store_url: str, provider: ProviderProcess
) -> None:
    clock = Clock(time.time())
    t0 = clock.t
    primary: list[Notification] = []
    pager: list[Notification] = []
    with aged_kernel(store_url, provider.url, clock, primary, pager) as k:
        mail = k.call(MAIL, {"to": "a@example.com", "subject": "s", "land": False},
                      call_id="old/mail")
        refund = k.call(REFUND, {"order": "o-1"}, call_id="old/refund")
        assert k.store.get_intent(mail.intent_id).state == S.INDETERMINATE  # type: ignore[union-attr]
        assert k.store.get_intent(refund.intent_id).state == S.AWAITING_APPROVAL  # type: ignore[union-attr]
        until(lambda: len(primary) == 2, "the first notifications")
        assert sorted(kinds(primary)) == sorted(
            [("indeterminate", mail.intent_id), ("approval_requested", refund.intent_id)]
        )

        clock.t = t0 + 599  # not yet: the refund's threshold is 600 s
        k.deliver_notifications()
        assert len(primary) == 2 and pager == []

        clock.t = t0 + 660  # past it (scans run at most every 60 s of the store's clock)
        k.deliver_notifications()
        assert kinds(primary)[2:] == kinds(pager) == [("overdue", refund.intent_id)]
        note = json.loads(pager[0].payload)
        assert note["state"] == "AWAITING_APPROVAL" and note["escalate_after_s"] == 600
        assert note["age_s"] == 660

        clock.t = t0 + 3600  # the email's threshold: escalated with its evidence
        k.deliver_notifications()
        assert kinds(pager) == [("overdue", refund.intent_id), ("overdue", mail.intent_id)]
        late = json.loads(pager[1].payload)
        assert late["evidence"]["facts"][0]["text"] == "the sent log has nothing"

        # Once per call, however long it stays open; a decided call is never escalated.
        other = k.call(MAIL, {"to": "b@example.com", "subject": "s", "land": False},
                       call_id="new/mail")
        k.resolve(other.intent_id, landed=False, operator="ana", reason="bounced")
        for step in (7200, 7300, 20_000):
            clock.t = t0 + step
            k.deliver_notifications()
        assert kinds(pager) == [("overdue", refund.intent_id), ("overdue", mail.intent_id)]
        assert [kind for kind, _ in kinds(primary)].count("overdue") == 2

        # The metrics read the same ages, per tool, from the store's clock.
        families = {f.name: f for f in _metrics.store_families(k.store, _metrics.DenialCounter())}
        assert families["poimen_indeterminate_oldest_seconds"].samples == (
            ({"tool": MAIL}, 20_000.0),
        )
        assert families["poimen_approval_oldest_seconds"].samples == (
            ({"tool": REFUND}, 20_000.0),
        )


def test_status_older_than_lists_what_waits_for_a_person_for_scripts(
    store_url: str, provider: ProviderProcess
) -> None:
    clock = Clock(time.time() - 2 * 3600)  # made two hours ago
    primary: list[Notification] = []
    with aged_kernel(store_url, provider.url, clock, primary, []) as k:
        mail = k.call(MAIL, {"to": "c@example.com", "subject": "s", "land": False},
                      call_id="c/mail")
        refund = k.call(REFUND, {"order": "o-2"}, call_id="c/refund")
        done = k.call(MAIL, {"to": "d@example.com", "subject": "s", "land": False},
                      call_id="c/done")
        k.resolve(done.intent_id, landed=True, operator="ana", reason="seen")
    r = poimen("status", "--older-than", "1h", "--json", db=store_url)
    assert r.returncode == 5, r.stderr
    listed = json.loads(r.stdout)["older_than"]
    assert listed["seconds"] == 3600
    assert [i["id"] for i in listed["intents"]] == [mail.intent_id, refund.intent_id]
    assert all(i["age_s"] >= 7200 for i in listed["intents"])
    text = poimen("status", "--older-than", "90m", db=store_url)
    assert text.returncode == 5 and "waiting for a person longer than 1h30m: 2" in text.stdout
    calm = poimen("status", "--older-than", "3h", db=store_url)
    assert calm.returncode == 0 and "longer than 3h00m: 0" in calm.stdout
    bad = poimen("status", "--older-than", "soon", db=store_url)
    assert bad.returncode == 2 and "older_than 'soon' is not a positive duration" in bad.stderr
