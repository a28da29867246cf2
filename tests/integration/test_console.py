"""The web console, served by the installed `poimen console` on 127.0.0.1, over logs made
by SIGKILLed calls: token and CSRF checks over plain HTTP, then the operator's path in a
real headless Chromium driven by Playwright. Screenshots go to artifacts/."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
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
    HOOK_CHECK,
    POIMEN,
    ROGUE,
    ROOT,
    crash,
    poimen,
    poimen_json,
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
    stuck_id: str

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


@contextlib.contextmanager
def serve_console(
    db: str, *args: str, token: str | None = TOKEN, **env_extra: str
) -> Iterator[str]:
    """`poimen console --port 0` on `db` with `args` (and `--token`, unless None); yields
    its base URL on 127.0.0.1, whatever address it binds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")}
    env.update(env_extra)
    given = ["--token", token] if token is not None else []
    proc = subprocess.Popen(
        [str(POIMEN), "console", "--db", db, "--port", "0", *given, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "poimen console printed no address"
        line = proc.stdout.readline()
        m = re.search(r"(https?)://(?:127\.0\.0\.1|0\.0\.0\.0):(\d+)", line)
        assert m, (line, proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
        yield f"{m.group(1)}://127.0.0.1:{m.group(2)}"
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


@dataclass
class Scene:
    db: str
    provider: str
    hook_id: str
    email_id: str
    stuck_id: str

    def console(self, url: str) -> Console:
        return Console(url, self.db, self.hook_id, self.email_id, self.stuck_id)

    def serve(
        self, *args: str, token: str | None = TOKEN
    ) -> contextlib.AbstractContextManager[str]:
        env = {"POIMEN_DB": self.db, "POIMEN_TEST_PROVIDER": self.provider}
        return serve_console(self.db, "--app", APP, *args, token=token, **env)


@pytest.fixture
def scene(
    tmp_path: Path, store_url: str, provider: ProviderProcess, ledger: ProviderClient
) -> Iterator[Scene]:
    """Two Unsafe calls of run-7 killed after their effect and recovered to INDETERMINATE, a
    third killed after recovery ran (still DISPATCHED, its worker gone), a sandbox denial and
    a capability denial."""
    args = {"channel": "ops", "api_token": SECRET, "payload": {"text": "hello"}}
    crash(tmp_path, store_url, provider.url, HOOK, args, "run-7/k-hook")
    crash(
        tmp_path,
        store_url,
        provider.url,
        EMAIL,
        {"to": "a@example.com", "subject": "x"},
        "run-7/k-mail",
    )
    shadow_denial(store_url, provider.url, "k-shadow")
    assert (
        run_call(store_url, provider.url, ROGUE, {"order_id": "o-7"}, "k-rogue")["type"] == "Failed"
    )
    r = poimen("recover", "--app", APP, db=store_url, provider=provider.url)
    assert r.returncode == 0, r.stderr
    stuck_args = {"channel": "ops2", "api_token": SECRET, "payload": {"text": "stuck"}}
    crash(tmp_path, store_url, provider.url, HOOK, stuck_args, "run-7/k-stuck")
    assert hook_effects(ledger) == 1
    store = open_store(store_url, migrate=False)
    try:
        hook = store.get_by_call_id("run-7/k-hook")
        mail = store.get_by_call_id("run-7/k-mail")
        stuck = store.get_by_call_id("run-7/k-stuck")
    finally:
        store.close()
    assert hook is not None and mail is not None and stuck is not None
    assert hook.state == mail.state == IntentState.INDETERMINATE
    assert stuck.state == IntentState.DISPATCHED
    yield Scene(store_url, provider.url, hook.id, mail.id, stuck.id)
    assert hook_effects(ledger) == 1  # whatever the console did, nothing was re-issued


@pytest.fixture
def console(scene: Scene) -> Iterator[Console]:
    """`poimen console --app --token` serving the scene's log."""
    with scene.serve() as url:
        yield scene.console(url)


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

        # Under the shared token the typed name decides: a user header is believed only
        # when the console is told to (--trust-user-header).
        spoof = {"X-Forwarded-User": "mallory"}
        done = c.post(target, data={**form, "operator": "ana", "csrf": csrf}, headers=spoof)
        assert done.status_code == 303
        state, events = console.intent(console.hook_id)
        assert state == IntentState.RESOLVED_NOT_LANDED
        assert events[-1].actor == "ana" and len(events) == len(before[1]) + 1
        detail = json.loads(events[-1].detail or "{}")
        assert detail["operator"] == "ana" and detail["identified_by"] == "typed-name"
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


Shot = Callable[[Any, str], None]


@pytest.fixture
def shot(request: pytest.FixtureRequest) -> Shot:
    """Saves a full-page screenshot to artifacts/, named after the test's backend."""
    ARTIFACTS.mkdir(exist_ok=True)
    tag = re.sub(r"[^a-z0-9]+", "-", request.node.callspec.id.lower())

    def take(page: Any, name: str) -> None:
        page.screenshot(path=str(ARTIFACTS / f"console-{tag}-{name}.png"), full_page=True)

    return take


def click_and_load(page: Any, selector: str) -> None:
    # Assert on the page the click leads to, never on the one it leaves.
    with page.expect_navigation(wait_until="load"):
        page.click(selector)


@pytest.mark.browser
def test_operator_resolves_a_killed_unsafe_call_in_the_browser(
    console: Console, browser: Any, shot: Shot
) -> None:
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


LINES_OF = """(sel) => Array.from(document.querySelectorAll(sel)).map((el) => {
    const r = document.createRange(); r.selectNodeContents(el);
    return new Set(Array.from(r.getClientRects()).map((b) => Math.round(b.top))).size; })"""


@pytest.mark.browser
def test_operator_finds_abandons_and_resolves_a_stuck_call_in_the_browser(
    console: Console, browser: Any, shot: Shot
) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{console.url}/?token={TOKEN}")

    # Find the run by its call-id prefix from the search box on every page: newest first.
    page.fill("#find-call-id", "run-7/")
    with page.expect_navigation(wait_until="load"):
        page.press("#find-call-id", "Enter")
    found = page.locator("#intents tbody tr td.call").all_inner_texts()
    assert found == ["run-7/k-stuck", "run-7/k-mail", "run-7/k-hook"]
    assert page.evaluate(LINES_OF, "#intents td.time") == [1, 1, 1]  # dates on one line
    shot(page, "search-1280")

    page.goto(f"{console.url}/intents")
    assert set(page.evaluate(LINES_OF, "#intents td.time")) == {1}
    assert set(page.evaluate(LINES_OF, "#intents td.id")) == {1}
    shot(page, "intents-1280")

    # The stuck call: its run, what to check, and the abandon form.
    page.goto(f"{console.url}/intents/{console.stuck_id}")
    assert "DISPATCHED" in page.locator("#state").inner_text()
    run = page.locator("#run").inner_text()
    assert "run-7/k-hook" in run and "run-7/k-mail" in run and "run-7/k-stuck" not in run
    assert HOOK_CHECK in page.locator("#what-to-check").inner_text()
    assert page.locator("#resolve").count() == 0
    page.fill("#abandon-operator", "ana")
    page.fill("#abandon-reason", "host h1 was decommissioned at 04:50")
    click_and_load(page, "#review-abandon")
    assert "abandoned_by_operator" in page.locator("#becomes").inner_text()
    assert page.locator("#lease").inner_text()
    assert console.intent(console.stuck_id)[0] == IntentState.DISPATCHED  # not yet
    shot(page, "abandon-confirm")
    click_and_load(page, "#confirm-abandon")
    assert page.locator("#abandoned-banner").is_visible()
    assert "INDETERMINATE" in page.locator("#state").inner_text()
    assert "abandoned_by_operator" in page.locator("#state").inner_text()
    events = page.locator("#events").inner_text()
    assert "abandoned" in events and "host h1 was decommissioned at 04:50" in events
    assert page.locator("#abandon").count() == 0
    assert HOOK_CHECK in page.locator("#resolve #what-to-check").inner_text()
    shot(page, "abandoned")
    state, stored = console.intent(console.stuck_id)
    assert state == IntentState.INDETERMINATE
    assert stored[-1].kind == "abandoned" and stored[-1].actor == "ana"

    # Then resolved as usual.
    page.check("#decision-not-landed")
    page.fill("#operator", "ana")
    page.fill("#reason", "no message in ops2 after 04:50")
    click_and_load(page, "#review")
    click_and_load(page, "#confirm")
    assert "RESOLVED_NOT_LANDED" in page.locator("#state").inner_text()
    assert console.intent(console.stuck_id)[0] == IntentState.RESOLVED_NOT_LANDED

    # A page that does not exist is a page of the console.
    page.goto(f"{console.url}/no/such/page")
    assert page.locator("h1").inner_text() == "Not found"
    assert page.locator("header.top nav").is_visible()
    shot(page, "404")

    # Phone width: nothing wider than the screen; wide tables scroll inside themselves.
    page.set_viewport_size({"width": 375, "height": 800})
    for path, name in (("/intents", "intents-375"), (f"/intents/{console.hook_id}", "intent-375")):
        page.goto(console.url + path)
        assert page.evaluate("document.documentElement.scrollWidth") <= 375, path
        box = page.locator("#find-call-id").bounding_box()
        assert box is not None and box["x"] + box["width"] <= 375
        shot(page, name)
    assert page.locator("header.top nav a").first.is_visible()
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
        _, err = proc.communicate(timeout=10)
    # One shared token: the operator is told that names are only typed, and how to do better.
    assert "typed" in err and "poimen operators add NAME --file FILE" in err


# Hostile requests, sessions, hosts, TLS.


def clean_refusal(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("text/html")
    assert '<link rel="stylesheet" href="/static/console.css">' in r.text
    assert "Traceback" not in r.text


def test_hostile_requests_get_a_clean_4xx_never_a_500(console: Console) -> None:
    with console.client() as anon:
        # A cookie that is not ASCII: no login needed to send it.
        r = anon.get("/", headers={"Cookie": "poimen_console=s\xe9ssion\u2603".encode()})
        clean_refusal(r, 401)
        r = anon.get("/nowhere/at/all")
        clean_refusal(r, 404)
        assert "Not found" in r.text and "/nowhere/at/all" in r.text
    before = console.intent(console.hook_id)
    target = f"/intents/{console.hook_id}/resolve"
    form = {"decision": "landed", "operator": "ana", "reason": "x", "step": "review"}
    with console.logged_in() as c:
        page = c.get(f"/intents/{console.hook_id}")
        csrf = csrf_of(page.text)
        for bad in ("\u00e9" * 64, "\u2603", "x" * 100_000):
            r = c.post(target, data={**form, "csrf": bad})
            clean_refusal(r, 403)
        for limit in ("1e20", "100000000000000000000", "-1", "0", "\u0661\u0662"):
            clean_refusal(c.get("/intents", params={"limit": limit}), 400)
        assert c.get("/intents", params={"limit": "5"}).status_code == 200
        for deep in ("[" * 100_000, "[" * 3000 + "]" * 3000, '{"a":' * 2000 + "1" + "}" * 2000):
            r = c.post(target, data={**form, "result": deep, "csrf": csrf})
            assert r.status_code == 400, r.text[:300]
            assert "nested deeper" in r.text
        clean_refusal(c.get("/intents/in_nope"), 404)
        clean_refusal(c.get("/intents/"), 404)  # no slash redirect
        clean_refusal(c.post("/intents", data={"x": "1"}), 405)
    assert console.intent(console.hook_id) == before


def session_cookie(r: httpx.Response) -> tuple[str, str]:
    header = r.headers["set-cookie"]
    m = re.match(r"poimen_console=([^;]+);(.*)", header)
    assert m, header
    return m.group(1), m.group(2).lower()


def test_sessions_are_random_expire_and_end_at_logout(store_url: str) -> None:
    assert poimen("migrate", db=store_url).returncode == 0
    ttl = 5.0
    with serve_console(store_url, "--session-ttl", f"{ttl:g}s") as url:
        cookies = []
        for _ in range(2):
            with httpx.Client(base_url=url, timeout=10) as c:
                r = c.post("/login", data={"token": TOKEN})
                assert r.status_code == 303
                value, attrs = session_cookie(r)
                assert TOKEN not in value and len(value) >= 32
                assert "httponly" in attrs and "samesite=strict" in attrs
                assert f"max-age={int(ttl)}" in attrs and "secure" not in attrs
                cookies.append(value)
        assert cookies[0] != cookies[1]  # a new random id for every login

        # Logging out ends the session on the server: the old cookie is worth nothing.
        with httpx.Client(base_url=url, timeout=10) as c:
            c.cookies.set("poimen_console", cookies[0])
            page = c.get("/")
            assert page.status_code == 200
            assert c.post("/logout", data={"csrf": csrf_of(page.text)}).status_code == 303
        with httpx.Client(base_url=url, timeout=10) as replay:
            replay.cookies.set("poimen_console", cookies[0])
            clean_refusal(replay.get("/"), 401)

        # A session expires by itself, on the server (the cookie is sent regardless of its
        # Max-Age, as a client keeping it too long would).
        with httpx.Client(base_url=url, timeout=10) as c:
            started = time.monotonic()
            value, _ = session_cookie(c.post("/login", data={"token": TOKEN}))
            sent = {"Cookie": f"poimen_console={value}"}
            first = c.get("/", headers=sent)
            if time.monotonic() - started < ttl - 1:  # a stalled machine may be past it
                assert first.status_code == 200
            while (r := c.get("/", headers=sent)).status_code == 200:
                assert time.monotonic() - started < ttl + 60
                time.sleep(0.2)
            assert r.status_code == 401 and time.monotonic() - started >= ttl


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_the_cookie_is_secure_over_tls_or_behind_a_trusted_proxy(
    tmp_path: Path, store_url: str
) -> None:
    assert poimen("migrate", db=store_url).returncode == 0
    cert, key = self_signed(tmp_path)
    with serve_console(store_url, "--tls-cert", str(cert), "--tls-key", str(key)) as url:
        assert url.startswith("https://")
        with httpx.Client(base_url=url, timeout=10, verify=False) as c:
            r = c.get(f"/?token={TOKEN}")
            assert r.status_code == 303 and "secure" in session_cookie(r)[1]
            page = c.get("/")
            assert page.status_code == 200
            # The browser's own origin over TLS passes the same-origin check.
            done = c.post("/logout", data={"csrf": csrf_of(page.text)}, headers={"Origin": url})
            assert done.status_code == 303

    https = {"X-Forwarded-Proto": "https"}
    with serve_console(store_url) as url, httpx.Client(base_url=url, timeout=10) as c:
        r = c.get(f"/?token={TOKEN}", headers=https)
        assert r.status_code == 303 and "secure" not in session_cookie(r)[1]  # not believed
    with (
        serve_console(store_url, "--trust-proxy") as url,
        httpx.Client(base_url=url, timeout=10) as c,
    ):
        r = c.get(f"/?token={TOKEN}", headers=https)
        assert r.status_code == 303 and "secure" in session_cookie(r)[1]
        assert c.get(f"/?token={TOKEN}").status_code == 303  # plain requests still work


def test_hosts_are_checked_and_no_redirect_carries_the_token(store_url: str) -> None:
    assert poimen("migrate", db=store_url).returncode == 0
    with serve_console(store_url, "--allowed-host", "console.example") as url:
        port = url.rsplit(":", 1)[1]
        with httpx.Client(base_url=url, timeout=10) as c:
            for path in (f"/intents/?token={TOKEN}", f"/?token={TOKEN}", "/login"):
                r = c.get(path, headers={"Host": f"evil.example:{port}"})
                assert r.status_code == 400, (path, r.status_code, r.headers)
                assert "location" not in r.headers and TOKEN not in r.text
            for host in (f"console.example:{port}", f"localhost:{port}", f"127.0.0.1:{port}"):
                r = c.get(f"/audit?token={TOKEN}&tool=x", headers={"Host": host})
                assert r.status_code == 303 and r.headers["location"] == "/audit?tool=x", host
            slash = c.get(f"/intents/?token={TOKEN}")
            assert slash.status_code in (303, 404)
            assert TOKEN not in slash.headers.get("location", "")
            assert not slash.headers.get("location", "/").startswith(("http", "//"))
            sneaky = c.get(f"//evil.example/?token={TOKEN}")
            assert not sneaky.headers.get("location", "/").startswith(("http", "//"))


# Operator identity: each operator's own token, or the name a trusted proxy gives.


@dataclass
class Team:
    console: Console
    file: Path
    tokens: dict[str, str]

    @contextlib.contextmanager
    def login(self, name: str) -> Iterator[httpx.Client]:
        with self.console.client() as c:
            r = c.post("/login", data={"token": self.tokens[name]})
            assert r.status_code == 303, r.text[:300]
            yield c


@pytest.fixture
def team(tmp_path: Path, scene: Scene) -> Iterator[Team]:
    """`poimen console --operators FILE` with operators ann and bob, over the scene."""
    path = tmp_path / "operators"
    tokens = {
        name: poimen_json("operators", "add", name, "--file", str(path))["token"]
        for name in ("ann", "bob")
    }
    with scene.serve("--operators", str(path), token=None) as url:
        yield Team(scene.console(url), path, tokens)


def me_of(html: str) -> str | None:
    m = re.search(r'<span class="me" id="me"[^>]*>([^<]*)</span>', html)
    return m.group(1) if m else None


def decide(c: httpx.Client, intent_id: str, action: str, **form: str) -> httpx.Response:
    csrf = csrf_of(c.get(f"/intents/{intent_id}").text)
    data = {"reason": "checked", "step": "confirm", "csrf": csrf, **form}
    return c.post(f"/intents/{intent_id}/{action}", data=data)


def last_event(db: str, intent_id: str) -> tuple[str, str, dict[str, Any]]:
    ev = poimen_json("show", intent_id, db=db)["events"][-1]
    return ev["kind"], ev["actor"], ev["detail"]


def test_each_operator_decides_as_themselves_with_their_own_token(team: Team) -> None:
    c, ann, bob = team.console, team.tokens["ann"], team.tokens["bob"]
    with c.client() as anon:
        page = anon.get("/")
        assert page.status_code == 401 and "your own operator token" in page.text
        for bad in (TOKEN, "ann.wrong", ann + "x", ann.replace("ann.", "bob."), ann[:-1], ""):
            assert anon.get("/", params={"token": bad}).status_code == 401, bad
            assert anon.post("/login", data={"token": bad}).status_code == 401, bad
            if bad:  # an empty one is no header at all
                assert anon.get("/", headers={"Authorization": f"Bearer {bad}"}).status_code == 401
        bearer = anon.get("/", headers={"Authorization": f"Bearer {ann}"})
        assert bearer.status_code == 200 and me_of(bearer.text) == "ann"

    with team.login("ann") as a, team.login("bob") as b:
        page = a.get(f"/intents/{c.hook_id}")
        assert me_of(page.text) == "ann"
        assert (
            'name="operator"' not in page.text and "Recorded as <strong>ann</strong>" in page.text
        )
        # A name slipped into the form changes nothing: the session says who decides.
        review = decide(
            a, c.hook_id, "resolve", decision="not_landed", step="review", operator="mallory"
        )
        assert review.status_code == 200 and "mallory" not in review.text
        assert (
            decide(a, c.hook_id, "resolve", decision="not_landed", operator="mallory").status_code
            == 303
        )
        assert decide(b, c.email_id, "resolve", decision="landed").status_code == 303
        assert decide(b, c.stuck_id, "abandon").status_code == 303

        for intent_id, kind, name in (
            (c.hook_id, "resolved", "ann"),
            (c.email_id, "resolved", "bob"),
            (c.stuck_id, "abandoned", "bob"),
        ):
            got_kind, actor, detail = last_event(c.db, intent_id)
            assert (got_kind, actor, detail["operator"]) == (kind, name, name)
            assert detail["identified_by"] == "operator-token"
        events = b.get(f"/intents/{c.hook_id}").text
        assert "ann (own token)" in events and "mallory" not in events

        # bob is removed: his session ends at its next request, his token at its next login.
        assert poimen("operators", "remove", "bob", "--file", str(team.file)).returncode == 0
        gone = b.get("/")
        assert gone.status_code == 401 and "Access token required" in gone.text
        assert b.post("/login", data={"token": bob}).status_code == 401
        assert a.get("/").status_code == 200  # ann stays
        # Added again, bob has a new token; the old one stays dead.
        again = poimen_json("operators", "add", "bob", "--file", str(team.file))["token"]
        assert b.post("/login", data={"token": bob}).status_code == 401
        assert b.post("/login", data={"token": again}).status_code == 303
        assert me_of(b.get("/").text) == "bob"


@pytest.mark.browser
def test_two_operators_resolve_in_the_browser_each_as_themselves(
    team: Team, browser: Any, shot: Shot
) -> None:
    c = team.console
    pages = {}
    for name in ("ann", "bob"):
        page = browser.new_context().new_page()  # a browser each: their own cookies
        page.goto(c.url + "/")
        assert page.locator("h1").inner_text() == "Access token required"
        page.fill("#token", team.tokens[name])
        click_and_load(page, "form.stack button")
        assert page.locator("#me").inner_text() == name
        pages[name] = page
    shot(pages["ann"], "operator-overview")

    for name, intent_id, decision in (
        ("ann", c.hook_id, "#decision-not-landed"),
        ("bob", c.email_id, "#decision-landed"),
    ):
        page = pages[name]
        page.goto(f"{c.url}/intents/{intent_id}")
        assert page.locator("#operator").count() == 0  # nothing to type: the login says who
        assert page.locator("#deciding-as").inner_text() == f"Recorded as {name}."
        page.check(decision)
        page.fill("#reason", f"{name} checked the provider")
        click_and_load(page, "#review")
        assert page.locator("#confirm-operator").inner_text() == name
        shot(page, f"operator-confirm-{name}")
        click_and_load(page, "#confirm")
        assert "RESOLVED" in page.locator("#state").inner_text()
        assert f"{name} (own token)" in page.locator("#events").inner_text()

    # Each sees who decided which.
    pages["ann"].goto(f"{c.url}/intents/{c.email_id}")
    assert "bob (own token)" in pages["ann"].locator("#events tr.event-resolved").inner_text()
    pages["bob"].goto(f"{c.url}/intents/{c.hook_id}")
    assert "ann (own token)" in pages["bob"].locator("#events tr.event-resolved").inner_text()
    shot(pages["bob"], "operator-who-resolved")
    assert last_event(c.db, c.hook_id)[1] == "ann" and last_event(c.db, c.email_id)[1] == "bob"

    assert poimen("operators", "remove", "bob", "--file", str(team.file)).returncode == 0
    pages["bob"].reload()
    assert pages["bob"].locator("h1").inner_text() == "Access token required"
    pages["ann"].reload()
    assert pages["ann"].locator("#me").inner_text() == "ann"
    for page in pages.values():
        page.context.close()


USER = "X-Forwarded-User"


def test_a_trusted_proxy_header_names_the_operator(scene: Scene) -> None:
    with scene.serve("--trust-proxy", "--trust-user-header", USER, token=None) as url:
        c = scene.console(url)
        with c.client() as anon:
            page = anon.get("/")
            assert page.status_code == 401 and "Not identified" in page.text and USER in page.text
            assert 'name="token"' not in page.text
            assert anon.get("/", params={"token": TOKEN}).status_code == 401
            assert anon.post("/login", data={"token": TOKEN}).status_code == 401
            two = anon.get("/", headers=[(USER, "carol"), (USER, "dave")])
            assert two.status_code == 401  # two names: none believed
            assert anon.get("/", headers={USER: "x" * 201}).status_code == 401  # not a name

        with c.client(headers={USER: "carol"}) as carol:
            page = carol.get(f"/intents/{c.hook_id}")
            assert page.status_code == 200 and me_of(page.text) == "carol"
            assert 'name="operator"' not in page.text
            r = decide(carol, c.hook_id, "resolve", decision="not_landed", operator="mallory")
            assert r.status_code == 303
            assert last_event(c.db, c.hook_id)[:2] == ("resolved", "carol")
            assert last_event(c.db, c.hook_id)[2]["identified_by"] == "proxy-header"
            csrf = csrf_of(carol.get(f"/intents/{c.email_id}").text)
            cookies = dict(carol.cookies)

        # carol's session is carol's: the same cookie under another name is not let in as her.
        with c.client(headers={USER: "dave"}, cookies=cookies) as dave:
            target = f"/intents/{c.email_id}/resolve"
            data = {"decision": "landed", "reason": "x", "step": "confirm", "csrf": csrf}
            assert dave.post(target, data=data).status_code == 403
            assert me_of(dave.get("/").text) == "dave"
        assert c.intent(c.email_id)[0] == IntentState.INDETERMINATE
        # A proxy sends a name as UTF-8 bytes.
        with c.client(headers={USER: "jürgen".encode()}) as jurgen:
            assert me_of(jurgen.get("/").text) == "jürgen"


def test_a_user_header_is_refused_where_anyone_could_send_it(
    tmp_path: Path, store_url: str
) -> None:
    assert poimen("migrate", db=store_url).returncode == 0
    ops = tmp_path / "operators"
    poimen("operators", "add", "ann", "--file", str(ops))
    header = ["--trust-user-header", USER]
    refused = {
        "needs --trust-proxy": [*header],
        "--proxy-is-the-only-way-in": ["--trust-proxy", *header, "--host", "0.0.0.0"],
        "do not go together": ["--operators", str(ops), "--trust-proxy", *header],
        "does not go with": ["--operators", str(ops), "--token", TOKEN],
        "no operators file": ["--operators", str(tmp_path / "nope")],
        "not a header name": ["--trust-proxy", "--trust-user-header", "X User"],
    }
    for words, args in refused.items():
        r = poimen("console", "--port", "0", *args, db=store_url)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert words in r.stderr and r.stderr.count("\n") == 1, (words, r.stderr)
        assert "listening" not in r.stdout
    env_token = poimen(
        "console",
        "--port",
        "0",
        "--operators",
        str(ops),
        db=store_url,
        POIMEN_CONSOLE_TOKEN=TOKEN,
    )
    assert env_token.returncode == 2 and "POIMEN_CONSOLE_TOKEN" in env_token.stderr

    # Told that only the proxy can reach it, the console listens beyond this machine.
    with (
        serve_console(
            store_url,
            "--host",
            "0.0.0.0",
            "--trust-proxy",
            *header,
            "--proxy-is-the-only-way-in",
            token=None,
        ) as url,
        httpx.Client(base_url=url, timeout=10) as c,
    ):
        assert c.get("/").status_code == 401
        r = c.get("/", headers={USER: "carol"})
        assert r.status_code == 200 and me_of(r.text) == "carol"
