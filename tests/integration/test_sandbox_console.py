"""The console's intent diff page, served by the installed `poimen console --recording`: a
replay's divergences with their effect class, secrets hidden, recorded text escaped; and in
a real headless Chromium."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from poimen import Kernel
from poimen.testing import CHARGE, EMAIL, SHIP, ProviderProcess, register_test_tools
from tests.integration.test_console import TOKEN, Shot, browser, serve_console, shot

__all__ = ["browser", "shot"]  # fixtures used here

HOSTILE = "<script>alert(1)</script>\u202e"


@pytest.fixture
def logs(store_url: str, tmp_path: Path, provider: ProviderProcess) -> tuple[str, str]:
    """A recorded run of conv-1 (a charge, an email, a shipment) and a replay of a changed
    agent that emails someone else, skips the shipment and charges another order."""
    with Kernel(store_url, notifiers=[]) as live:
        register_test_tools(live, provider.url)
        live.call(CHARGE, {"order_id": "o-1", "amount_cents": 100}, call_id="conv-1/charge")
        live.call(EMAIL, {"to": "bob@example.com", "subject": "hi"}, call_id="conv-1/email")
        live.call(SHIP, {"order_id": "o-1", "address": "1 Main St"}, call_id="conv-1/ship")
    replay = f"sqlite:///{tmp_path / 'replay.db'}"
    with Kernel(replay, mode="replay", recording=store_url, on_divergence="record",
                notifiers=[]) as k:
        register_test_tools(k, provider.url)
        k.call(CHARGE, {"order_id": "o-1", "amount_cents": 100}, call_id="conv-1/charge")
        k.call(EMAIL, {"to": HOSTILE, "subject": "hi"}, call_id="conv-1/email")
        k.call(CHARGE, {"order_id": "o-2", "amount_cents": 5},
               call_id="conv-1/charge-2")
    return store_url, replay


def test_the_diff_page_shows_each_difference_with_its_effect_class(
    logs: tuple[str, str], browser: Any, shot: Shot
) -> None:
    recording, replay = logs
    with serve_console(replay, "--recording", recording) as url, httpx.Client(
        base_url=url, timeout=10
    ) as c:
        assert c.get("/diff").status_code == 401  # a page like any other: login first
        assert c.get(f"/diff?token={TOKEN}").status_code == 303
        r = c.get("/diff", params={"scope": "conv-1/"})
        assert r.status_code == 200, r.text
        page = r.text
        assert "<script>alert" not in page and "&lt;script&gt;" in page
        assert "\u202e" not in page  # a bidi override shown as an escape, never applied
        rows = page.split('<tr class="diff-')[1:]
        kinds = [row.split('"', 1)[0] for row in rows]
        assert kinds == ["arguments_changed", "only_in_recording", "only_in_run"]
        email, ship, charge2 = rows
        assert "unsafe" in email and "/to" in email and "bob@example.com" in email
        assert "queryable" in ship and "COMPLETED" in ship
        assert "idempotent" in charge2 and "not_in_recording" in charge2
        assert 'id="diff-counts"' in page

        ro = browser.new_page()
        ro.goto(f"{url}/diff?token={TOKEN}&scope=conv-1/")
        table = ro.locator("#diff")
        assert table.locator("tr.diff-arguments_changed").count() == 1
        assert "unsafe" in table.inner_text()
        shot(ro, "diff")
        ro.close()

        # Without --recording the page compares two runs of the console's own log.
    with serve_console(recording) as url, httpx.Client(base_url=url, timeout=10) as c:
        c.get(f"/diff?token={TOKEN}")
        assert 'id="pick-runs"' in c.get("/diff").text
        same = c.get("/diff", params={"scope": "conv-1/", "run_scope": "conv-1/"})
        assert 'id="pick-runs"' in same.text
        other = c.get("/diff", params={"scope": "conv-1/", "run_scope": "conv-2/"})
        assert other.status_code == 200 and other.text.count('<tr class="diff-only_in_recording"') == 3
