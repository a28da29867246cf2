"""Undo from the operator's side: the installed `poimen undo` command and the console's undo
page (over HTTP and in headless Chromium), against a log and a witness provider shared with
the application's own kernel. Effects and reversals are counted in the provider's ledger."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from poimen import IntentState
from poimen.store import open_store
from poimen.testing import ProviderClient, ProviderProcess
from tests.integration import test_console
from tests.integration.operator_app import poimen
from tests.integration.test_console import TOKEN, Shot, click_and_load, csrf_of, serve_console
from tests.integration.undo_app import (
    CHARGE,
    EMAIL,
    NOTE,
    make_kernel,
    refunds,
    retractions,
)

APP = "tests.integration.undo_app:app_kernel"
S = IntentState
browser = test_console.browser  # the console tests' fixtures
shot = test_console.shot


def make_run(store_url: str, provider_url: str, scope: str = "run-1/") -> dict[str, str]:
    """A charge, an email and a note (no undo) of `scope`; their intent ids by call id."""
    with make_kernel(store_url, provider_url) as k:
        k.call(CHARGE, {"order": "o1", "cents": 100}, call_id=f"{scope}1")
        k.call(EMAIL, {"to": "bob"}, call_id=f"{scope}2")
        k.call(NOTE, {"text": "hi"}, call_id=f"{scope}3")
        found = {}
        for n in (1, 2, 3):
            it = k.store.get_by_call_id(f"{scope}{n}")
            assert it is not None
            found[it.call_id] = it.id
        return found


def reversed_(ledger: ProviderClient) -> tuple[int, int]:
    return refunds(ledger, "o1"), retractions(ledger, "bob")


def undo_cli(store_url: str, provider_url: str, *args: str, **env: str) -> Any:
    return poimen("undo", "--app", APP, *args, db=store_url, UNDO_APP_PROVIDER=provider_url,
                  **env)


def test_poimen_undo_previews_undoes_resumes_and_says_where_it_stopped(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    ids = make_run(store_url, provider.url)

    # Refused as given: nothing is changed.
    r = undo_cli(store_url, provider.url, "--scope", "run-1/")
    assert r.returncode == 2 and "--operator" in r.stderr
    r = undo_cli(store_url, provider.url, "--scope", "undo/run-1/", "--operator", "ann")
    assert r.returncode == 1 and "never undone" in r.stderr
    r = poimen("undo", "--app", APP, "--scope", "run-1/", "--operator", "ann",
               "--db", "sqlite:////nonexistent/other.db", db=store_url,
               UNDO_APP_PROVIDER=provider.url)
    assert r.returncode == 2 and "is not the app's store" in r.stderr
    r = undo_cli(store_url, provider.url, "--scope", "nothing/", "--operator", "ann")
    assert r.returncode == 1 and "no calls" in r.stdout

    # A dry run shows the plan, newest first, and changes nothing.
    r = undo_cli(store_url, provider.url, "--scope", "run-1/", "--dry-run")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("run-1/")]
    assert [ln.split()[0] for ln in lines] == ["run-1/3", "run-1/2", "run-1/1"]
    assert [ln.split()[3] for ln in lines] == ["no_undo", "to_undo", "to_undo"]
    assert "run-1/3: tool 'u.note' declares no undo" in r.stdout
    assert reversed_(ledger) == (0, 0)

    # The refund is refused by the provider: the email is retracted, then the sequence stops.
    r = undo_cli(store_url, provider.url, "--scope", "run-1/", "--operator", "ann",
                 "--reason", "order cancelled", "--json", UNDO_APP_REFUSE="refund")
    assert r.returncode == 1, r.stderr
    report = json.loads(r.stdout)
    assert report["complete"] is False and report["stopped_at"]["call_id"] == "run-1/1"
    assert "provider refused refund" in report["stopped_at"]["reason"]
    assert reversed_(ledger) == (0, 1)

    # Again, the cause gone: resumes, undoes the rest, the retraction is not sent twice.
    r = undo_cli(store_url, provider.url, "--scope", "run-1/", "--operator", "ann")
    assert r.returncode == 0, r.stderr
    assert "2 undone (1 now)" in r.stdout and "STOPPED" not in r.stdout
    assert reversed_(ledger) == (1, 1)

    # `poimen show`: the original says which undo reversed it and who asked.
    r = poimen("show", "run-1/1", db=store_url)
    assert r.returncode == 0, r.stderr
    m = re.search(r"^undone by: +(in_\w+) \(undo#2/run-1/1, u\.refund\) asked by ann", r.stdout,
                  re.M)
    assert m, r.stdout
    shown = json.loads(poimen("show", ids["run-1/1"], "--json", db=store_url).stdout)
    assert [u["undo_call_id"] for u in shown["undone_by"]] == ["undo#2/run-1/1"]
    assert shown["state"] == "COMPLETED"
    r = poimen("show", m.group(1), db=store_url)
    assert re.search(rf"^undoes: +{ids['run-1/1']} \(run-1/1, u\.charge\)", r.stdout, re.M)
    events = json.loads(poimen("show", "run-1/1", "--json", db=store_url).stdout)["events"]
    asked = [(e["kind"], e["actor"], e["detail"].get("undo_call_id")) for e in events
             if e["kind"] == "undo_requested"]
    assert asked == [("undo_requested", "ann", "undo/run-1/1"),
                     ("undo_requested", "ann", "undo#2/run-1/1")]


@contextlib.contextmanager
def console_with_app(store_url: str, provider_url: str) -> Iterator[str]:
    with serve_console(store_url, "--app", APP, POIMEN_DB=store_url,
                       UNDO_APP_PROVIDER=provider_url) as url:
        yield url


def events(store_url: str, intent_id: str) -> list[Any]:
    store = open_store(store_url, migrate=False)
    try:
        return store.events(intent_id)
    finally:
        store.close()


def test_the_console_previews_then_undoes_a_run_with_the_csrf_token(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> None:
    import httpx

    ids = make_run(store_url, provider.url)
    before = events(store_url, ids["run-1/1"])
    # Without the app's tools the console cannot undo, and offers no button.
    with serve_console(store_url) as url, httpx.Client(base_url=url, timeout=30) as c:
        assert c.get(f"/intents/{ids['run-1/1']}?token={TOKEN}").status_code == 303
        assert 'id="undo-run"' not in c.get(f"/intents/{ids['run-1/1']}").text
        r = c.get("/undo?scope=run-1/")
        assert r.status_code == 404 and "--app" in r.text

    with console_with_app(store_url, provider.url) as url, httpx.Client(
        base_url=url, timeout=60
    ) as c:
        with httpx.Client(base_url=url, timeout=30) as anon:
            assert anon.get("/undo?scope=run-1/").status_code == 401
        assert c.get(f"/?token={TOKEN}").status_code == 303
        page = c.get(f"/intents/{ids['run-1/2']}").text
        assert 'href="/undo?scope=run-1/"' in page
        preview = c.get("/undo?scope=run-1/")
        assert preview.status_code == 200 and "Nothing has changed yet" in preview.text
        assert preview.text.count('class="undo-to_undo"') == 2
        assert 'class="undo-no_undo"' in preview.text
        csrf = csrf_of(preview.text)
        form = {"scope": "run-1/", "operator": "ana", "reason": "customer cancelled"}
        assert c.post("/undo", data=form).status_code == 403
        assert c.post("/undo", data={**form, "csrf": "0" * 64}).status_code == 403
        cross = c.post("/undo", data={**form, "csrf": csrf},
                       headers={"Origin": "http://evil.test"})
        assert cross.status_code == 403
        missing = c.post("/undo", data={**form, "operator": " ", "csrf": csrf})
        assert missing.status_code == 400 and "operator" in missing.text
        assert reversed_(ledger) == (0, 0) and events(store_url, ids["run-1/1"]) == before

        done = c.post("/undo", data={**form, "csrf": csrf})
        assert done.status_code == 200 and 'id="undo-result"' in done.text
        assert "2 undone (2 now)" in done.text and reversed_(ledger) == (1, 1)
        assert 'id="confirm-undo"' not in done.text  # complete: nothing left to undo
        again = c.post("/undo", data={**form, "csrf": csrf})
        assert again.status_code == 200 and "2 undone," in again.text
        assert reversed_(ledger) == (1, 1)

        page = c.get(f"/intents/{ids['run-1/1']}").text
        assert 'class="undone-by"' in page and "undo/run-1/1" in page and "ana" in page
        kinds = [(e.kind, e.actor) for e in events(store_url, ids["run-1/1"])]
        assert kinds.count(("undone", "ana")) == 1 and ("undo_requested", "ana") in kinds


@pytest.mark.browser
def test_an_operator_undoes_a_run_from_its_page_in_the_browser(
    store_url: str, provider: ProviderProcess, ledger: ProviderClient, browser: Any, shot: Shot
) -> None:
    ids = make_run(store_url, provider.url)
    with console_with_app(store_url, provider.url) as url:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{url}/intents/{ids['run-1/3']}?token={TOKEN}")
        click_and_load(page, "#undo-run")
        assert page.locator("#undo-preview").is_visible()
        rows = page.locator("#undo-steps tbody tr")
        assert rows.locator("td.call").all_inner_texts() == ["run-1/3", "run-1/2", "run-1/1"]
        assert rows.locator("td.status").all_inner_texts() == ["no undo", "to undo", "to undo"]
        assert reversed_(ledger) == (0, 0)
        shot(page, "undo-preview")
        page.fill("#undo-operator", "ana")
        page.fill("#undo-reason", "customer cancelled the order")
        click_and_load(page, "#confirm-undo")
        assert "2 undone" in page.locator("#undo-result").inner_text()
        assert rows.locator("td.status").all_inner_texts() == ["no undo", "undone", "undone"]
        assert reversed_(ledger) == (1, 1)
        shot(page, "undo-done")
        click_and_load(page, f"#undo-steps a[href='/intents/{ids['run-1/1']}']")
        assert "undo/run-1/1" in page.locator("#summary tr.undone-by").inner_text()
        assert "ana" in page.locator("#events").inner_text()
        shot(page, "undone-intent")
        page.close()


def _how(store_url: str, intent_id: str) -> list[tuple[str, str, Any, Any]]:
    out = []
    for e in events(store_url, intent_id):
        if e.kind in ("undo_requested", "undone"):
            d = json.loads(e.detail or "{}")
            out.append((e.kind, e.actor, d.get("identified_by"), d.get("os_user")))
    return out


def test_undo_events_record_how_the_operator_was_known(
    store_url: str, provider: ProviderProcess
) -> None:
    import getpass

    import httpx

    ids = make_run(store_url, provider.url)
    r = undo_cli(store_url, provider.url, "--scope", "run-1/1", "--operator", "ann",
                 "--reason", "refund")
    assert r.returncode == 0, r.stderr
    account = getpass.getuser()
    assert _how(store_url, ids["run-1/1"]) == [
        ("undo_requested", "ann", "cli", account), ("undone", "ann", "cli", account)
    ]
    # Under the console's shared token the name is typed: recorded as such, not as verified.
    with console_with_app(store_url, provider.url) as url, httpx.Client(
        base_url=url, timeout=60
    ) as c:
        assert c.get(f"/?token={TOKEN}").status_code == 303
        csrf = csrf_of(c.get("/undo?scope=run-1/2").text)
        form = {"scope": "run-1/2", "operator": "ana", "reason": "cancelled", "csrf": csrf}
        assert c.post("/undo", data=form).status_code == 200
        shown = c.get(f"/intents/{ids['run-1/2']}").text
    assert _how(store_url, ids["run-1/2"]) == [
        ("undo_requested", "ana", "typed-name", None), ("undone", "ana", "typed-name", None)
    ]
    assert "ana (typed)" in shown
