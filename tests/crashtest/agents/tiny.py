"""Small agents for `poimen crashtest`'s edge cases.

    python -m tests.crashtest.agents.tiny BEHAVIOUR

one: a single POST; proxy-keyed: a POST to another host through the proxy, with a
new Idempotency-Key per attempt; random: a POST whose body changes every run; fail: exits 4; nothing: makes
no write; restart-fails: its restart exits 3; https: an HTTPS request (refused by the witness),
then a POST; overlap: each killed run waits (bounded) until another case's run is running too,
and notes whether it saw one; unfinished: a poimen call whose restart neither recovers nor
calls again; hang: each case's run waits before its write until it is killed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import uuid
from pathlib import Path

import httpx

from poimen import Caps, Kernel, ToolContext, Unsafe

URL = os.environ.get("POIMEN_CRASHTEST_URL", "")
STATE = Path(os.environ.get("POIMEN_CRASHTEST_DIR", "."))
FIRST = not (STATE / "started").exists()


def post(body: dict[str, object]) -> None:
    httpx.post(f"{URL}/v1/ping", json=body, timeout=30).raise_for_status()


def overlap() -> None:
    shared = Path(os.environ["TINY_SHARED"])
    if FIRST and os.environ["POIMEN_CRASHTEST_CASE"] != "clean":
        (shared / os.environ["POIMEN_CRASHTEST_CASE"]).touch()
        end = time.monotonic() + 30
        while time.monotonic() < end:
            if len(list(shared.iterdir())) > 1:
                (shared / f"saw-{os.environ['POIMEN_CRASHTEST_CASE']}").touch()
                break
            time.sleep(0.05)
    post({"n": 1})


def unfinished() -> None:
    kernel = Kernel(os.environ["POIMEN_DB"], notifiers=[])

    @kernel.tool(id="ping", effects=Unsafe(), caps=Caps(hosts=(URL[len("http://"):],)), timeout=5)
    def ping(ctx: ToolContext) -> object:
        return ctx.http.post(f"{URL}/v1/ping", json={"n": 1}).json()

    with kernel:
        if FIRST:  # the restart leaves the killed call as it found it
            kernel.call("ping", {}, call_id="ping-1")


def main(behaviour: str) -> int:
    first = FIRST
    (STATE / "started").touch()
    if behaviour == "one":
        post({"n": 1})
    elif behaviour == "proxy-keyed":  # a real provider's address, reached through HTTP_PROXY
        httpx.post("http://payments.example.test/v1/charges", json={"amount_cents": 1200},
                   headers={"Idempotency-Key": uuid.uuid4().hex}, timeout=30).raise_for_status()
    elif behaviour == "random":
        post({"n": uuid.uuid4().hex})
    elif behaviour == "fail":
        print("the agent cannot start", file=sys.stderr)
        return 4
    elif behaviour == "restart-fails":
        if not first:
            print("state from the killed run confuses me", file=sys.stderr)
            return 3
        post({"n": 1})
    elif behaviour == "https":
        with contextlib.suppress(httpx.HTTPError):  # the witness refuses it
            httpx.get("https://api.example.test/v1/status", timeout=30)
        post({"n": 1})
    elif behaviour == "hang":  # a case's runs stop before their write, until killed
        if os.environ["POIMEN_CRASHTEST_CASE"] != "clean":
            (Path(os.environ["TINY_SHARED"]) / str(os.getpid())).touch()
            time.sleep(3600)
        post({"n": 1})
    elif behaviour == "overlap":
        overlap()
    elif behaviour == "unfinished":
        unfinished()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
