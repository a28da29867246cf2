"""Hooks and an observer: a page when a call becomes Indeterminate, counts of every event.

    python examples/hooks.py

Offline: the email tool's connection breaks after the request went out, so its outcome is
unknown and, being Unsafe, the call is Indeterminate (docs/observability.md).
"""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

from poimen import Caps, Kernel, ToolContext, Unsafe
from poimen.events import CallFinishedEvent, IndeterminateEvent, KernelEvent, Observer


class Pager:
    """Stands in for a paging service."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, text: str) -> None:
        self.sent.append(text)


pager = Pager()
stats: collections.Counter[str] = collections.Counter()
finished: list[str] = []


class Counter(Observer):
    def event(self, event: KernelEvent) -> None:
        stats[event.kind] += 1


def main(url: str) -> None:
    kernel = Kernel(url, observers=[Counter()])

    @kernel.tool(id="send_email", effects=Unsafe(), caps=Caps(), timeout=10)
    def send_email(ctx: ToolContext, to: str) -> None:
        raise ConnectionResetError("the connection broke after the request was sent")

    def page_on_call(event: IndeterminateEvent) -> None:
        pager.send(f"{event.tool_id} call {event.call_id} is Indeterminate: {event.reason}")

    kernel.on(IndeterminateEvent, page_on_call)

    @kernel.on(CallFinishedEvent)          # or as a decorator
    def count(event: CallFinishedEvent) -> None:
        finished.append(event.call_id)

    with kernel:
        kernel.launch()
        kernel.call("send_email", {"to": "bob@example.com"}, call_id="run-7/step-1")
    # Hooks run on the kernel's own thread; close() runs those still queued.
    print("paged:", *pager.sent)
    print("calls finished:", *finished)
    print("events seen by the observer:", dict(sorted(stats.items())))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(f"sqlite:///{Path(tmp) / 'agent.db'}")
