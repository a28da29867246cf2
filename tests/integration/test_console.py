"""The web console, served by the installed `poimen console` on 127.0.0.1, over logs made
by SIGKILLed calls: token and CSRF checks over plain HTTP, then the operator's path in a
real headless Chromium driven by Playwright. Screenshots go to artifacts/."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from poimen import IntentState
from poimen.store import open_store
from poimen.testing import EMAIL, ProviderClient, ProviderProcess
from tests.integration.operator_app import (
    HOOK,
    POIMEN,
    ROGUE,
    ROOT,
    crash,
    poimen,
    run_call,
    shadow_denial,
)

TOKEN = "console-test-token-7f3a9c1e"
SECRET = "sk-live-abcdef987654"
APP = "tests.integration.operator_app:make_kernel"
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "artifacts"
REQUIRE_BROWSER = os.environ.get("POIMEN_REQUIRE_BROWSER") == "1"


@dataclass
class Console:
    url: str
    db: str
    hook_id: str
    email_id: str

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10, **kw)

    @contextlib.contextmanager
    def logged_in(self) -> Iterator[httpx.Client]:
        with self.client() as c:
            r = c.get(f"/?token={TOKEN}")
            assert r.status_code == 303 and r.headers["location"] == "/"
            yield c

    def intent(self, intent_id: str) -> tuple[IntentState, list[Any]]:
        store = open_store(self.db, migrate=False)
        try:
            it = store.get_intent(intent_id)
            assert it is not None
            return it.state, store.events(intent_id)
        finally:
            store.close()


def hook_effects(ledger: ProviderClient) -> int:
    return sum(1 for e in ledger.entries(kind="plain") if e["body"].get("channel") == "ops")


@pytest.fixture
def console(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> Iterator[Console]:
    """Two Unsafe calls killed after their effect and recovered to INDETERMINATE, a sandbox
    denial, a capability denial, and `poimen console` serving that log."""
    args = {"channel": "ops", "api_token": SECRET, "payload": {"text": "hello"}}
    crash(tmp_path, store_url, provider.url, HOOK, args, "k-hook")
    crash(
        tmp_path, store_url, provider.url, EMAIL, {"to": "a@example.com", "subject": "x"}, "k-mail"
    )
    shadow_denial(store_url, provider.url, "k-shadow")
    assert (
        run_call(store_url, provider.url, ROGUE, {"order_id": "o-7"}, "k-rogue")["type"] == "Failed"
    )
    r = poimen("recover", "--app", APP, db=store_url, provider=provider.url)
    assert r.returncode == 0, r.stderr
    assert hook_effects(ledger) == 1
    store = open_store(store_url, migrate=False)
    try:
        hook = store.get_by_call_id("k-hook")
        mail = store.get_by_call_id("k-mail")
    finally:
        store.close()
    assert hook is not None and mail is not None
    assert hook.state == mail.state == IntentState.INDETERMINATE

    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    proc = subprocess.Popen(
        [str(POIMEN), "console", "--db", store_url, "--port", "0", "--token", TOKEN],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "poimen console printed no address"
        line = proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert m, (line, proc.poll())
        yield Console(m.group(0), store_url, hook.id, mail.id)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe:
                pipe.close()
    assert hook_effects(ledger) == 1  # whatever the console did, nothing was re-issued


def test_pages_need_the_token_and_serve_nothing_from_elsewhere(console: Console) -> None:
    with console.client() as anon:
        for path in ("/", "/intents", f"/intents/{console.hook_id}", "/audit"):
            r = anon.get(path)
            assert r.status_code == 401, path
            assert console.hook_id not in r.text and "Access token required" in r.text
            assert not re.search(r'name="csrf" value="[0-9a-f]{64}"', r.text)
        assert anon.get(f"/?token={TOKEN}x").status_code == 401
        assert anon.get("/", headers={"Authorization": "Bearer wrong-token"}).status_code == 401
        assert anon.post("/login", data={"token": "nope"}).status_code == 401
        bearer = anon.get("/", headers={"Authorization": f"Bearer {TOKEN}"})
        assert bearer.status_code == 200 and console.hook_id in bearer.text
        css = anon.get("/static/console.css")
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")

    with console.client() as c:
        r = c.get(f"/audit?token={TOKEN}&tool={EMAIL}")
        assert r.status_code == 303 and r.headers["location"] == f"/audit?tool={EMAIL}"
        cookie = r.headers["set-cookie"].lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and TOKEN not in cookie
        page = c.get("/")
        assert page.status_code == 200
        assert page.headers["content-security-policy"].startswith("default-src 'self'")
        # No CDN: every stylesheet, script and image is served by the console itself.
        refs = re.findall(r'<(?:link|script|img)[^>]+(?:href|src)="([^"]+)"', page.text)
        assert refs and all(ref.startswith("/") for ref in refs), refs
        assert c.post("/login", data={"token": TOKEN}).status_code == 303


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf" value="([0-9a-f]{64})"', html)
    assert m, "no CSRF token on the page"
    return m.group(1)


def test_state_changes_need_the_token_and_the_csrf_token(console: Console) -> None:
    target = f"/intents/{console.hook_id}/resolve"
    form = {"decision": "not_landed", "operator": "mallory", "reason": "x", "step": "confirm"}
    before = console.intent(console.hook_id)
    with console.logged_in() as c:
        csrf = csrf_of(c.get(f"/intents/{console.hook_id}").text)
        with console.client() as anon:  # a valid CSRF token but no session
            assert anon.post(target, data={**form, "csrf": csrf}).status_code == 401
        assert c.post(target, data=form).status_code == 403  # session, no CSRF token
        assert c.post(target, data={**form, "csrf": "0" * 64}).status_code == 403
        cross = c.post(target, data={**form, "csrf": csrf}, headers={"Origin": "http://evil.test"})
        assert cross.status_code == 403
        assert console.intent(console.hook_id) == before  # nothing changed, no event added

        # Invalid input is refused with the reason; still nothing changes.
        bad = c.post(target, data={**form, "decision": "landed", "result": "{nope", "csrf": csrf})
        assert bad.status_code == 400 and "not valid JSON" in bad.text
        assert c.post(target, data={**form, "operator": " ", "csrf": csrf}).status_code == 400
        review = c.post(target, data={**form, "step": "review", "csrf": csrf})
        assert review.status_code == 200 and "Confirm the resolution" in review.text
        assert console.intent(console.hook_id) == before

        done = c.post(target, data={**form, "operator": "ana", "csrf": csrf})
        assert done.status_code == 303
        state, events = console.intent(console.hook_id)
        assert state == IntentState.RESOLVED_NOT_LANDED
        assert events[-1].actor == "ana" and len(events) == len(before[1]) + 1
        again = c.post(target, data={**form, "csrf": csrf})
        assert again.status_code == 409 and "RESOLVED_NOT_LANDED" in again.text
        assert len(console.intent(console.hook_id)[1]) == len(events)
        # Logging out needs the CSRF token too, and ends the session.
        assert c.post("/logout").status_code == 403
        assert c.post("/logout", data={"csrf": csrf}).status_code == 303
        assert c.get("/").status_code == 401


# The browser.


@pytest.fixture
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        if REQUIRE_BROWSER:
            pytest.fail(f"POIMEN_REQUIRE_BROWSER=1 but {CHROMIUM} is missing")
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install chromium (CI requires it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=str(CHROMIUM),
            args=[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            yield b
        finally:
            b.close()


def click_and_load(page: Any, selector: str) -> None:
    # Assert on the page the click leads to, never on the one it leaves.
    with page.expect_navigation(wait_until="load"):
        page.click(selector)


@pytest.mark.browser
def test_operator_resolves_a_killed_unsafe_call_in_the_browser(
    console: Console, browser: Any, request: pytest.FixtureRequest
) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    tag = re.sub(r"[^a-z0-9]+", "-", request.node.callspec.id.lower())

    def shot(page: Any, name: str) -> None:
        page.screenshot(path=str(ARTIFACTS / f"console-{tag}-{name}.png"), full_page=True)

    anon = browser.new_page()
    anon.goto(console.url + "/")
    assert anon.locator("h1").inner_text() == "Access token required"
    assert console.hook_id not in anon.content()
    shot(anon, "login")
    anon.close()

    page = browser.new_page()
    page.goto(f"{console.url}/?token={TOKEN}")
    assert page.url == console.url + "/"  # the token left the address bar
    queue = page.locator("#queue")
    assert console.hook_id in queue.inner_text() and console.email_id in queue.inner_text()
    assert page.locator("#count-indeterminate").inner_text() == "2"
    shot(page, "overview")

    click_and_load(page, f"#queue a[href='/intents/{console.hook_id}']")
    assert page.url.endswith(f"/intents/{console.hook_id}")
    args = page.locator("#args").inner_text()
    assert "[redacted]" in args and SECRET not in page.content()
    assert "INDETERMINATE" in page.locator("#state").inner_text()
    shot(page, "intent")

    # A landed result that is not JSON is refused on the page; nothing changes.
    page.check("#decision-landed")
    page.fill("#result-input", "{not json")
    page.fill("#operator", "ana")
    page.fill("#reason", "checked")
    click_and_load(page, "#review")
    assert "not valid JSON" in page.locator("#error-result").inner_text()
    assert console.intent(console.hook_id)[0] == IntentState.INDETERMINATE
    shot(page, "invalid")

    page.check("#decision-not-landed")
    page.fill("#result-input", "")
    page.fill("#operator", "ana")
    page.fill("#reason", "provider log shows no request from this call")
    click_and_load(page, "#review")
    assert page.locator("#becomes").inner_text() == "RESOLVED_NOT_LANDED"
    assert console.intent(console.hook_id)[0] == IntentState.INDETERMINATE  # not yet
    shot(page, "confirm")
    click_and_load(page, "#confirm")
    assert page.locator("#resolved-banner").is_visible()
    assert "RESOLVED_NOT_LANDED" in page.locator("#state").inner_text()
    events = page.locator("#events").inner_text()
    assert "ana" in events and "provider log shows no request from this call" in events
    assert page.locator("#resolve").count() == 0  # no form: terminal, and no retry button
    shot(page, "resolved")

    state, stored = console.intent(console.hook_id)
    assert state == IntentState.RESOLVED_NOT_LANDED
    last = stored[-1]
    assert last.kind == "resolved" and last.actor == "ana"
    assert last.to_state == IntentState.RESOLVED_NOT_LANDED
    assert "provider log shows no request from this call" in (last.detail or "")

    page.goto(console.url + "/")
    assert console.hook_id not in page.locator("#queue").inner_text()
    assert page.locator("#count-indeterminate").inner_text() == "1"

    page.goto(f"{console.url}/intents?state=RESOLVED_NOT_LANDED")
    assert console.hook_id in page.locator("#intents").inner_text()
    shot(page, "intents")

    page.goto(console.url + "/audit")
    denials = page.locator("#denials").inner_text()
    assert EMAIL in denials and "shadow" in denials
    assert ROGUE in denials and "key_mismatch" in denials
    shot(page, "audit")
    page.select_option("#tool", ROGUE)
    click_and_load(page, "form.filters button")
    assert page.locator("#denials tbody tr").count() == 1
    click_and_load(page, "#denials a")  # the denied call's intent
    assert "FAILED" in page.locator("#state").inner_text()
    assert page.locator("#resolve").count() == 0
    page.goto(console.url + "/audit")
    page.select_option("#tool", HOOK)
    click_and_load(page, "form.filters button")
    assert page.locator("#no-denials").is_visible()
    page.close()


def test_without_a_token_one_is_generated_printed_and_required(store_url: str) -> None:
    assert poimen("migrate", db=store_url).returncode == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    proc = subprocess.Popen(
        [str(POIMEN), "console", "--db", store_url, "--port", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "poimen console printed nothing"
        # Printed together: once the first line is there, the rest is in the buffer or pipe.
        lines = [proc.stdout.readline() for _ in range(3)]
        m = re.search(r"open: (http://127\.0\.0\.1:\d+)/\?token=(\S+)", lines[2])
        assert m, lines
        base, token = m.groups()
        assert lines[1].strip() == f"access token: {token}" and len(token) >= 16
        with httpx.Client(base_url=base, timeout=10) as c:
            assert c.get("/").status_code == 401
            assert c.get(f"/?token={token}", follow_redirects=True).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
