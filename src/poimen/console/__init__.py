"""The web console (extra ``poimen[console]``): the Indeterminate queue, resolve with a
reason, intent history, the denial audit, per-tool counts."""

from __future__ import annotations

import ipaddress
import secrets
import socket
import sys

from poimen.console._app import create_app
from poimen.store._base import Store

__all__ = ["create_app", "serve"]


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(
    store: Store, *, host: str = "127.0.0.1", port: int = 8470, token: str | None = None
) -> None:
    """Serve the console until interrupted. Without a token one is generated and printed."""
    import uvicorn

    generated = token is None
    token = token or secrets.token_urlsafe(24)
    app = create_app(store, token=token)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # connections made after the address is printed wait in the backlog
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    base = f"http://{shown}:{bound}"
    if not _loopback(host):
        print(
            f"poimen console: WARNING: listening on {host}, beyond this machine; the token "
            "travels in plain HTTP unless a TLS proxy fronts the console",
            file=sys.stderr,
        )
    print(f"poimen console listening on {base}/", flush=True)
    if generated:
        print(f"access token: {token}\nopen: {base}/?token={token}", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])
