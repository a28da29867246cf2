"""Signing in to the console: a login another site starts is refused (in a real headless
Chromium, which sends what browsers send), failed tokens are rate limited before they cost a
scrypt hash, and a trusted proxy's user keeps one server-side session."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from poimen import Kernel
from poimen.console._session import COOKIE, LOGIN_BURST, LOGIN_REFILL_S
from tests.integration import test_console
from tests.integration.operator_app import poimen_json
from tests.integration.test_console import TOKEN, serve_console

browser = test_console.browser  # the console tests' fixture
USER = "X-Forwarded-User"


@pytest.fixture
def log(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'intents.db'}"
    Kernel(url).close()
    return url


class _Attacker(ThreadingHTTPServer):
    """Another origin (another port) serving the page it is given."""

    page = ""


class _Page(BaseHTTPRequestHandler):
    server: _Attacker

    def do_GET(self) -> None:
        body = self.server.page.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def attacker() -> Iterator[_Attacker]:
    srv = _Attacker(("127.0.0.1", 0), _Page)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _signed_in(context: Any) -> bool:
    return any(c["name"] == COOKIE for c in context.cookies())


@pytest.mark.browser
def test_a_login_another_site_starts_is_refused_in_the_browser(
    log: str, browser: Any, attacker: _Attacker
) -> None:
    evil = f"http://127.0.0.1:{attacker.server_address[1]}/"
    with serve_console(log) as url:
        # A form on another site posting the attacker's token to /login.
        attacker.page = (
            f'<form method="post" action="{url}/login"><input name="token" value="{TOKEN}">'
            "</form><script>document.forms[0].submit()</script>"
        )
        ctx = browser.new_context()
        page = ctx.new_page()
        with page.expect_navigation(url=f"{url}/login"):
            page.goto(evil)
        assert "did not come from the console" in page.content()
        assert not _signed_in(ctx)
        # A link on another site carrying ?token=.
        attacker.page = f'<a id="go" href="{url}/?token={TOKEN}">open</a>'
        page.goto(evil)
        with page.expect_navigation(url=f"{url}/?token={TOKEN}"):
            page.click("#go")
        assert "did not come from the console" in page.content()
        assert not _signed_in(ctx)
        # The same link opened by the operator (typed or pasted) signs in.
        page.goto(f"{url}/?token={TOKEN}")
        assert _signed_in(ctx) and page.url == f"{url}/"
        ctx.close()
        # And the console's own login form.
        ctx = browser.new_context()
        page = ctx.new_page()
        page.goto(f"{url}/login")
        page.fill('input[name="token"]', TOKEN)
        with page.expect_navigation():
            page.click('button[type="submit"], input[type="submit"]')
        assert _signed_in(ctx)
        ctx.close()


def test_failed_operator_tokens_are_rate_limited_before_their_hash(
    log: str, tmp_path: Path
) -> None:
    ops = tmp_path / "ops"
    token = poimen_json("operators", "add", "ann", "--file", str(ops))["token"]
    with serve_console(log, "--operators", str(ops), token=None) as url, httpx.Client(
        base_url=url, timeout=60
    ) as c:
        started = time.monotonic()
        statuses = [
            c.post("/login", data={"token": f"ann.wrong{i}"}).status_code for i in range(60)
        ]
        elapsed = time.monotonic() - started
        assert set(statuses) == {401, 429}, statuses
        # No more tries went to scrypt than the burst and what refilled meanwhile.
        assert statuses.count(401) <= LOGIN_BURST + elapsed / LOGIN_REFILL_S + 1, statuses
        limited = c.post("/login", data={"token": token})  # even the right one, for now
        assert limited.status_code == 429 and limited.headers["Retry-After"] == "60"
        assert "default-src 'self'" in limited.headers["Content-Security-Policy"]
        bearer = c.get("/", headers={"Authorization": "Bearer ann.wrong"})
        assert bearer.status_code == 401


def test_a_trusted_proxys_user_keeps_one_session(log: str) -> None:
    with serve_console(log, "--trust-proxy", "--trust-user-header", USER, token=None) as url:
        ids = set()
        for _ in range(30):  # each a request without the cookie, as a script would send
            r = httpx.get(f"{url}/", headers={USER: "carol"}, timeout=30)
            assert r.status_code == 200
            ids.add(r.cookies[COOKIE])
        assert len(ids) == 1
        dave = httpx.get(f"{url}/", headers={USER: "dave"}, timeout=30)
        assert dave.cookies[COOKIE] not in ids
