"""The console's help for the operator, in real headless Chromium: a killed email call's
evidence (with its link) and the suggested answer pre-selected, a person confirming it;
overdue badges; *Resolve many* from a filter and from a CSV built from the provider's sent
log, previewed, then applied in one audited batch. And the same checks as any decision:
session, CSRF, Origin."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from poimen import IntentState
from poimen._core.intents import Intent
from poimen.testing import ProviderClient, ProviderProcess
from tests.integration.operator_app import poimen, poimen_json
from tests.integration.outage_app import crash_mail
from tests.integration.test_bulk_resolve import outage, sent_calls, states
from tests.integration.test_console import (  # noqa: F401
    TOKEN,
    Shot,
    browser,
    click_and_load,
    csrf_of,
    serve_console,
    shot,
)

S = IntentState
APP = "tests.integration.outage_app:make_kernel"


@dataclass
class Outage:
    db: str
    url: str
    mail_id: str
    old: list[Intent]  # made two hours ago: overdue, and what the filter takes
    recent: list[Intent]  # resolved from the CSV

    @contextlib.contextmanager
    def client(self) -> Iterator[httpx.Client]:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            assert c.get(f"/?token={TOKEN}").status_code == 303
            yield c


@pytest.fixture
def scene(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> Iterator[Outage]:
    crash_mail(tmp_path, store_url, provider.url, {"to": "ann@example.com", "subject": "inv"},
               "run-1/mail")
    env = {"POIMEN_TEST_PROVIDER": provider.url}
    r = poimen("recover", "--app", APP, db=store_url, **env)  # gathers the evidence too
    assert r.returncode == 0, r.stderr
    old = outage(store_url, provider.url, 20, prefix="old", now=time.time() - 7200)
    recent = outage(store_url, provider.url, 10, prefix="csv")
    mail = poimen_json("show", "run-1/mail", db=store_url)
    assert mail["state"] == "INDETERMINATE" and mail["suggestion"]["decision"] == "landed"
    with serve_console(store_url, "--app", APP, POIMEN_DB=store_url,
                       POIMEN_TEST_ESCALATE_AFTER="3600", **env) as url:
        yield Outage(store_url, url, mail["id"], old, recent)


@pytest.mark.browser
def test_the_operator_sees_evidence_confirms_its_suggestion_and_resolves_an_outage(
    scene: Outage, browser: Any, shot: Shot, ledger: ProviderClient,  # noqa: F811
) -> None:
    page = browser.new_page()
    page.goto(f"{scene.url}/?token={TOKEN}")
    # Overdue: the outage's calls are older than the tool's escalate_after (1h).
    assert page.locator("#count-overdue").inner_text() == "20"
    assert page.locator("#queue .badge.overdue").count() == 20
    shot(page, "aids-overview")

    click_and_load(page, f"#queue a[href='/intents/{scene.mail_id}']")
    [sent] = [e for e in ledger.entries(kind="plain") if e["body"]["to"] == "ann@example.com"]
    facts = page.locator("#facts").inner_text()
    assert f"message {sent['id']} to ann@example.com" in facts
    link = page.locator(f"#facts a[href$='#entry-{sent['id']}']")
    assert link.count() == 1 and link.get_attribute("rel") == "noopener noreferrer"
    assert "exactly one sent message" in page.locator("#suggestion").inner_text()
    assert page.is_checked("#decision-landed") and not page.is_checked("#decision-not-landed")
    assert "exactly one sent message" in page.locator("#reason").input_value()
    shot(page, "aids-evidence")

    click_and_load(page, "#gather")  # on request: a new gathering, as the operator
    assert page.locator("#evidence-banner").is_visible()
    assert "on request" in page.locator("#evidence-meta").inner_text()

    page.fill("#operator", "ana")
    click_and_load(page, "#review")
    assert "you follow it" in page.locator("#confirm-suggestion").inner_text()
    click_and_load(page, "#confirm")
    assert "RESOLVED_LANDED" in page.locator("#state").inner_text()
    detail = poimen_json("show", scene.mail_id, db=scene.db)["events"][-1]["detail"]
    assert detail["suggested"] == "landed" and detail["followed_suggestion"] is True
    assert detail["operator"] == "ana" and detail["identified_by"] == "typed-name"

    # Resolve many, by a filter: the old calls, previewed, then one batch.
    page.goto(scene.url + "/")
    click_and_load(page, "#resolve-many")
    page.fill("#many-call-id", "old/")
    page.fill("#many-before", "1h")
    page.check("#many-not-landed")
    click_and_load(page, "#preview-batch")
    assert page.locator("#preview tbody tr").count() == 20
    assert {s for s, _ in states(scene.db, scene.old).values()} == {S.INDETERMINATE}
    shot(page, "aids-preview")
    page.fill("#many-operator", "ana")
    page.fill("#many-reason", "the provider was down; its log has none of these")
    click_and_load(page, "#confirm-batch")
    batch = page.locator("#batch-id").inner_text()
    assert page.locator("#batch-resolved tbody tr").count() == 20
    shot(page, "aids-batch")
    for _, (state, events) in states(scene.db, scene.old).items():
        assert state == S.RESOLVED_NOT_LANDED
        assert json.loads(events[0].detail or "{}")["batch"] == batch

    # From a CSV built from the provider's sent log (the witness), pasted.
    landed = sent_calls(ledger)
    rows = ["call_id,outcome"] + [
        f"{i.call_id},{'landed' if i.call_id in landed else 'not_landed'}" for i in scene.recent
    ]
    page.goto(scene.url + "/resolve-many")
    page.fill("#many-csv", "\n".join(rows))
    click_and_load(page, "#preview-batch")
    decisions = page.locator("#preview td.decision").all_inner_texts()
    assert decisions.count("landed") == 5 and decisions.count("not landed") == 5
    page.fill("#many-operator", "ana")
    page.fill("#many-reason", "matched with the sent log export")
    click_and_load(page, "#confirm-batch")
    assert page.locator("#batch-resolved tbody tr").count() == 10
    for call_id, (state, _) in states(scene.db, scene.recent).items():
        assert state == (S.RESOLVED_LANDED if call_id in landed else S.RESOLVED_NOT_LANDED)
    page.goto(scene.url + "/")
    assert page.locator("#queue-empty").is_visible()
    page.close()


def test_bulk_resolve_and_evidence_need_the_session_csrf_and_origin(scene: Outage) -> None:
    ids = [i.id for i in scene.old]
    plan = "".join(f"{i},not_landed,\n" for i in ids)
    form = {"step": "confirm", "plan": plan, "source": "forged", "operator": "mallory",
            "reason": "x"}
    before = states(scene.db, scene.old)
    events = len(poimen_json("show", scene.mail_id, db=scene.db)["events"])
    with httpx.Client(base_url=scene.url, timeout=30) as anon:
        assert anon.post("/resolve-many", data=form).status_code == 401
        assert anon.post(f"/intents/{scene.mail_id}/evidence").status_code == 401
    with scene.client() as c:
        csrf = csrf_of(c.get("/resolve-many").text)
        assert c.post("/resolve-many", data=form).status_code == 403
        assert c.post("/resolve-many", data={**form, "csrf": "0" * 64}).status_code == 403
        cross = c.post("/resolve-many", data={**form, "csrf": csrf},
                       headers={"Origin": "http://evil.test"})
        assert cross.status_code == 403
        assert c.post(f"/intents/{scene.mail_id}/evidence").status_code == 403
        assert c.post(f"/intents/{scene.mail_id}/evidence", data={"csrf": csrf},
                      headers={"Origin": "http://evil.test"}).status_code == 403
        assert states(scene.db, scene.old) == before
        assert len(poimen_json("show", scene.mail_id, db=scene.db)["events"]) == events
        # Bad input: a plain 4xx naming it, nothing changed.
        bad = c.post("/resolve-many", data={"csrf": csrf, "step": "preview",
                                            "call_id": "old/", "created_before": "soon",
                                            "decision": "landed"})
        assert bad.status_code == 400 and "not a duration" in bad.text
        both = c.post("/resolve-many", data={"csrf": csrf, "step": "preview", "tool": "mail.send",
                                             "decision": "landed", "csv": "call_id,outcome\n"})
        assert both.status_code == 400 and "not both" in both.text
        forged = c.post("/resolve-many", data={**form, "csrf": csrf, "plan": "x,maybe,\n"})
        assert forged.status_code == 400 and "not one the preview made" in forged.text
        no_reason = c.post("/resolve-many", data={**form, "csrf": csrf, "reason": " "})
        assert no_reason.status_code == 400 and "a reason is required" in no_reason.text
        assert states(scene.db, scene.old) == before
        # With all of it, the batch is made, audited under the typed name.
        done = c.post("/resolve-many", data={**form, "csrf": csrf})
        assert done.status_code == 200 and "resolved 20" in done.text
    for _, (state, [event]) in states(scene.db, scene.old).items():
        detail = json.loads(event.detail or "{}")
        assert state == S.RESOLVED_NOT_LANDED and event.actor == "mallory"
        assert detail["identified_by"] == "typed-name" and detail["batch_size"] == 20
