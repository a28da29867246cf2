"""A naive at-least-once runner: the crash drill's "without poimen" half.

It does what an agent framework's durable retry does: it journals each step before running it
and after it returns, and on restart runs every step that has no "done" record again. Its
tools know nothing of keys or request ids: the charge sends no idempotency key, the shipment
makes a new request id each time it runs. The drill kills it at the same points as poimen and
counts, in the provider's ledger, what the re-run did.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from poimen._engine import crashpoints as _crashpoints
from poimen.testing import CHARGE, EMAIL, SHIP

Tool = Callable[[dict[str, Any]], Any]


class Journal:
    """One JSON line per record, fsync'd before the step goes on, as a durable framework does."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def _append(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True) + "\n"
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def started(self, step_id: str, tool: str, args: dict[str, Any]) -> None:
        self._append({"step": step_id, "event": "started", "tool": tool, "args": args})

    def done(self, step_id: str) -> None:
        self._append({"step": step_id, "event": "done"})

    def unfinished(self) -> list[tuple[str, str, dict[str, Any]]]:
        """Started steps with no "done" record, in the order they started."""
        if not self.path.exists():
            return []
        started: dict[str, tuple[str, dict[str, Any]]] = {}
        done: set[str] = set()
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line cut short by the kill
            if r["event"] == "started":
                started[r["step"]] = (r["tool"], r["args"])
            else:
                done.add(r["step"])
        return [(s, tool, args) for s, (tool, args) in started.items() if s not in done]


def tools(client: httpx.Client) -> dict[str, Tool]:
    """The drill's three tools as a framework would write them (ids shared with poimen's)."""

    def post(path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        r = client.post(path, json=body, headers=headers or {})
        r.raise_for_status()
        return r.json()

    def charge(args: dict[str, Any]) -> Any:
        _crashpoints.hit("mid_call")
        return post("/plain", {"order_id": args["order_id"], "amount_cents": args["amount_cents"]})

    def ship(args: dict[str, Any]) -> Any:
        _crashpoints.hit("mid_call")
        return post("/requests", dict(args), {"X-Request-Id": f"rq-{uuid.uuid4().hex}"})

    def email(args: dict[str, Any]) -> Any:
        _crashpoints.hit("mid_call")
        return post("/plain", dict(args))

    return {CHARGE: charge, SHIP: ship, EMAIL: email}


def run_step(
    journal: Journal, tools: dict[str, Tool], step_id: str, tool: str, args: dict[str, Any]
) -> Any:
    journal.started(step_id, tool, args)
    result = tools[tool](args)
    _crashpoints.hit("after_effect")  # the effect landed; "done" is not yet journalled
    journal.done(step_id)
    return result


def restart(journal_path: str | os.PathLike[str], provider_url: str) -> list[str]:
    """The framework's restart: run every unfinished step again. Returns their ids."""
    journal = Journal(journal_path)
    with httpx.Client(base_url=provider_url, timeout=10) as client:
        available = tools(client)
        again = journal.unfinished()
        for step_id, tool, args in again:
            run_step(journal, available, step_id, tool, args)
    return [step_id for step_id, _, _ in again]
