"""The web console (extra ``poimen[console]``): the Indeterminate queue, resolve with a
reason, abandon a call whose worker is gone, find by call id, intent history, the denial
audit, per-tool counts."""

from __future__ import annotations

import ipaddress
import secrets
import socket
import sys

from poimen.console._app import ConsoleOptions, create_app
from poimen.store._base import Store

__all__ = ["ConsoleOptions", "create_app", "listen", "serve"]


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port` (0 picks a free port); OSError when it cannot be."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)  # connections made after the address is printed wait in the backlog
    except OSError:
        sock.close()
        raise
    return sock


def serve(
    store: Store,
    *,
    sock: socket.socket,
    host: str,
    token: str | None = None,
    options: ConsoleOptions | None = None,
    tls: tuple[str, str] | None = None,
) -> None:
    """Serve the console on `sock` (from `listen`) until interrupted. Without a token one is
    generated and printed. `tls` is (certificate file, key file) to serve HTTPS."""
    import uvicorn

    options = options or ConsoleOptions()
    generated = token is None
    token = token or secrets.token_urlsafe(24)
    if host not in ("0.0.0.0", "::", ""):
        options = options.with_hosts(host, f"[{host}]") if ":" in host else options.with_hosts(host)
    app = create_app(store, token=token, options=options)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if sock.family == socket.AF_INET6 else host
    base = f"{'https' if tls else 'http'}://{shown}:{bound}"
    if not _loopback(host):
        print(
            f"poimen console: WARNING: listening on {host}, beyond this machine; the token "
            "travels in plain HTTP unless TLS (--tls-cert, or a TLS proxy) fronts the console",
            file=sys.stderr,
        )
    print(f"poimen console listening on {base}/", flush=True)
    if generated:
        print(f"access token: {token}\nopen: {base}/?token={token}", flush=True)
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        # Forwarded headers are believed only with --trust-proxy, by the app itself.
        proxy_headers=False,
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
    )
    uvicorn.Server(config).run(sockets=[sock])
