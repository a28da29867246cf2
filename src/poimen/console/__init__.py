"""The web console (extra ``poimen[console]``): the Indeterminate queue, resolve with a
reason, abandon a call whose worker is gone, find by call id, intent history, the denial
audit, per-tool counts.

Who is deciding: each operator's own token (``--operators FILE``), or a name set by a trusted
proxy (``--trust-user-header``); with the shared token alone, a name typed into the form."""

from __future__ import annotations

import ipaddress
import secrets
import socket
import sys

from poimen.errors import ConsoleConfigError, MissingExtraError
from poimen.operator._identity import read_operators

try:
    from poimen.console._app import create_app
    from poimen.console._session import ConsoleOptions, check_modes
except ImportError as exc:  # the extra is missing: say which one
    raise MissingExtraError.of("poimen.console", "console", exc) from exc
from poimen.store._base import Store

__all__ = ["ConsoleOptions", "check_setup", "create_app", "listen", "serve"]


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_setup(host: str, token: str | None, options: ConsoleOptions) -> None:
    """Refuse (`ConsoleConfigError`) what must not start: a user header believed from
    anyone who can reach a non-local address, unless the operator says only the proxy can."""
    check_modes(token, options)
    if options.operators_file:
        read_operators(options.operators_file)  # unreadable or malformed: said before listening
    if options.user_header and not _loopback(host) and not options.proxy_is_the_only_way_in:
        raise ConsoleConfigError(
            f"--trust-user-header on {host}: anyone who reaches this address can send "
            f"{options.user_header} and be whoever they name. Bind to 127.0.0.1 behind the "
            "proxy, or, if nothing but the proxy can reach the console, say so with "
            "--proxy-is-the-only-way-in",
            host=host,
        )


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
    """Serve the console on `sock` (from `listen`) until interrupted. With neither an
    operators file nor a user header the console has one shared token: without a `token`
    one is generated and printed. `tls` is (certificate file, key file) to serve HTTPS."""
    import uvicorn

    options = options or ConsoleOptions()
    check_setup(host, token, options)
    shared = not (options.operators_file or options.user_header)
    generated = shared and token is None
    if shared:
        token = token or secrets.token_urlsafe(24)
    if host not in ("0.0.0.0", "::", ""):
        options = options.with_hosts(host, f"[{host}]") if ":" in host else options.with_hosts(host)
    app = create_app(store, token=token, options=options)
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if sock.family == socket.AF_INET6 else host
    base = f"{'https' if tls else 'http'}://{shown}:{bound}"
    if not _loopback(host):
        print(
            f"poimen console: WARNING: listening on {host}, beyond this machine; tokens and "
            "sessions travel in plain HTTP unless TLS (--tls-cert, or a TLS proxy) fronts the "
            "console",
            file=sys.stderr,
        )
    print(f"poimen console listening on {base}/", flush=True)
    if generated:
        print(f"access token: {token}\nopen: {base}/?token={token}", flush=True)
    if shared:
        print(
            "poimen console: WARNING: one shared token, so decisions are attributed to the "
            "names typed into the forms, which nobody checks. Give each operator a token of "
            "their own: poimen operators add NAME --file FILE, then poimen console "
            "--operators FILE",
            file=sys.stderr,
            flush=True,
        )
    elif options.operators_file:
        print(
            f"operators from {options.operators_file}; add one with: poimen operators add NAME "
            f"--file {options.operators_file}",
            flush=True,
        )
    else:
        print(f"operators are named by the proxy's {options.user_header} header", flush=True)
    if options.metrics_token is not None:
        print(f"metrics: {base}/metrics with the metrics token as a Bearer token", flush=True)
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
