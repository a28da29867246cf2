"""An Indeterminate call reaches an operator: a signed webhook with a link to the console, and
what to check for this tool.

    python examples/notify_operator.py

Offline: the webhook receiver is a small HTTP server in this process, and poimen.testing's
provider process stands in for a chat service whose connection breaks after the message went
out (docs/resolve-indeterminate.md).
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from poimen import Caps, Kernel, ToolContext, Unsafe, WebhookNotifier
from poimen.testing import ProviderProcess

received: list[dict[str, Any]] = []
arrived = threading.Event()


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        # A real receiver verifies the signature first (docs/resolve-indeterminate.md).
        received.append(json.loads(body))
        arrived.set()
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main(tmp: Path) -> None:
    os.environ.setdefault("HOOK_SECRET", secrets.token_hex(32))
    hooks = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=hooks.serve_forever, daemon=True).start()
    hook_url = f"http://127.0.0.1:{hooks.server_port}/hooks/poimen"
    url = f"sqlite:///{tmp / 'agent.db'}"
    with ProviderProcess(tmp / "ledger.db") as chat:
        kernel = Kernel(
            url,  # or postgresql://agent@db/agent
            notifiers=[WebhookNotifier(hook_url, secret=os.environ["HOOK_SECRET"],
                                       console_url="https://poimen-console.internal")],
            renotify_after=3600,  # remind every hour while an Indeterminate intent stays open
        )

        @kernel.tool(id="ops.post_hook", effects=Unsafe(), caps=Caps(hosts=("127.0.0.1",)),
                     timeout=10)
        def post_hook(ctx: ToolContext, channel: str, text: str) -> None:
            ctx.http.post(f"{chat.url}/plain", json={"channel": channel, "text": text})
            raise ConnectionResetError("the connection broke before the answer")

        kernel.describe("ops.post_hook", check="Look for the message in the channel's history.")
        with kernel:
            kernel.launch()
            out = kernel.call("ops.post_hook", {"channel": "#ops", "text": "deploy done"},
                              call_id="run-9/step-3")
            print(f"the call: {type(out).__name__}")
            kernel.deliver_notifications()
            assert arrived.wait(30), "no webhook arrived"
    hooks.shutdown()
    note = received[0]
    print(f"the webhook: {note['kind']} {note['intent']['tool_id']} {note['intent']['reason']}")
    print(f"  link: {note['intent']['link']}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(tmp))
