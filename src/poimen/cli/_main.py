"""``poimen``: the operator CLI over the intent log.

Exit codes: 0 ok · 1 nothing found, or refused (e.g. resolving an intent that is not
INDETERMINATE), or ``diff`` found differences · 2 usage (bad or missing options, an --app that cannot be loaded, a console
address that cannot be listened on) · 3 the store cannot be opened, read or written ·
4 anything unforeseen (a bug here or in the loaded app). Every failure is one line on stderr
(and with ``--json`` an error object on stdout); ``POIMEN_DEBUG=1`` adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from poimen import _operator as op
from poimen._kernel import Kernel
from poimen.cli import _render as render
from poimen.errors import (
    IntentNotFoundError,
    NotAwaitingApprovalError,
    NotDispatchedError,
    NotIndeterminateError,
    PoimenError,
    StoreError,
)
from poimen.store import Store, open_store

OK, NOT_FOUND, USAGE, STORE, UNEXPECTED = 0, 1, 2, 3, 4


class CliError(PoimenError):
    """The command cannot run as given."""

    def __init__(self, message: str, *, code: int) -> None:
        super().__init__(message, code=code)
        self.code = code


# Opening the store.


def _db_url(ns: argparse.Namespace) -> str:
    url = ns.db or os.environ.get("POIMEN_DB")
    if not url:
        raise CliError("no database: pass --db URL or set POIMEN_DB", code=USAGE)
    return str(url)


def _open(url: str, *, readonly: bool = False) -> Store:
    """Open an existing log without migrating it: reading never changes the schema, and a
    reading command opens it read-only, so it never writes to the log at all."""
    if url.startswith("sqlite:///"):
        path = url[len("sqlite:///") :]
        if not Path(path).is_file():
            raise CliError(f"no intent log at {path!r} (poimen migrate creates one)", code=STORE)
    store = open_store(url, migrate=False, readonly=readonly)
    if store.schema_version() == 0:
        store.close()
        raise CliError(f"{url} holds no poimen schema: run `poimen migrate`", code=STORE)
    return store


def _same_store(a: str, b: str) -> bool:
    if a.startswith("sqlite:///") and b.startswith("sqlite:///"):
        return os.path.realpath(a[10:]) == os.path.realpath(b[10:])
    return a == b


def load_app(spec: str) -> Kernel:
    """``module:attr``: a Kernel, or a callable returning one, with the tools registered."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CliError(f"--app {spec!r} must look like module:kernel", code=USAGE)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the app's own code runs here: whatever it raises
        raise CliError(
            f"--app: cannot import {module_name!r}: {type(exc).__name__}: {exc}", code=USAGE
        ) from exc
    obj = getattr(module, attr, None)
    if obj is None:
        raise CliError(f"--app: {module_name!r} has no attribute {attr!r}", code=USAGE)
    if not isinstance(obj, Kernel) and callable(obj):
        try:
            obj = obj()
        except StoreError:
            raise
        except Exception as exc:
            raise CliError(
                f"--app {spec!r} raised {type(exc).__name__}: {exc}", code=USAGE
            ) from exc
    if not isinstance(obj, Kernel):
        raise CliError(f"--app {spec!r} is a {type(obj).__name__}, not a poimen Kernel", code=USAGE)
    return obj


# Output.


def _emit(ns: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    if ns.json:
        print(op.safe_json(data, indent=2))
    else:
        print(op.escape_lines(text()))


# Commands.


def cmd_status(ns: argparse.Namespace, store: Store) -> int:
    st = op.status(store)
    _emit(ns, st.to_json(), lambda: render.status_text(st))
    return OK


def _since(ns: argparse.Namespace, store: Store) -> float | None:
    return None if ns.since is None else op.parse_since(ns.since, store.now())


def cmd_intents(ns: argparse.Namespace, store: Store) -> int:
    if ns.call_id is not None:
        if ns.state or ns.tool or ns.since:
            raise CliError("--call-id searches alone: drop --state, --tool and --since", code=USAGE)
        rows = op.search(store, ns.call_id, limit=ns.limit)
    else:
        rows = op.list_intents(
            store,
            state=None if ns.state is None else op.parse_state(ns.state),
            tool_id=ns.tool,
            since=_since(ns, store),
            limit=ns.limit,
        )
    _emit(
        ns,
        [op.intent_summary(i) for i in rows],
        lambda: render.intents_text(rows) if rows else "no intents match",
    )
    return OK if rows else NOT_FOUND


def cmd_show(ns: argparse.Namespace, store: Store) -> int:
    d = op.show(store, ns.intent)
    _emit(ns, d.to_json(), lambda: render.detail_text(d))
    return OK


def cmd_resolve(ns: argparse.Namespace, store: Store) -> int:
    if ns.result is not None and not ns.landed:
        raise CliError("--result goes only with --landed", code=USAGE)
    result = None if ns.result is None else op.parse_result(ns.result)
    intent = op.find(store, ns.intent)
    done = op.resolve(
        store, intent.id, landed=ns.landed, result=result, operator=ns.operator, reason=ns.reason
    )
    _emit(
        ns,
        op.intent_summary(done),
        lambda: (
            f"resolved {done.id}: {intent.state} -> {done.state} by "
            f"{op.escape_text(ns.operator.strip())} ({op.escape_text(ns.reason.strip())})"
        ),
    )
    return OK


def cmd_abandon(ns: argparse.Namespace, store: Store) -> int:
    intent = op.find(store, ns.intent)
    done = op.abandon(store, intent.id, operator=ns.operator, reason=ns.reason)
    _emit(
        ns,
        op.intent_summary(done),
        lambda: (
            f"abandoned {done.id}: {intent.state} -> {done.state} ({done.reason}) by "
            f"{op.escape_text(ns.operator.strip())} ({op.escape_text(ns.reason.strip())}); "
            f"now resolve it: poimen resolve {done.id} --landed|--not-landed"
        ),
    )
    return OK


def cmd_approve(ns: argparse.Namespace, store: Store) -> int:
    intent = op.find(store, ns.intent)
    approve = ns.cmd == "approve"
    done = op.decide_approval(
        store, intent.id, approve=approve, operator=ns.operator, reason=ns.reason
    )
    _emit(
        ns,
        op.intent_summary(done),
        lambda: (
            f"{'approved' if approve else 'rejected'} {done.id}: {intent.state} -> "
            f"{done.state} by {op.escape_text(ns.operator.strip())} "
            f"({op.escape_text(ns.reason.strip())})"
            + ("; it is dispatched once by the next kernel that resumes it" if approve else "")
        ),
    )
    return OK


def cmd_audit(ns: argparse.Namespace, store: Store) -> int:
    rows = op.audit(store, tool_id=ns.tool, since=_since(ns, store), limit=ns.limit)
    _emit(
        ns,
        [op.denial_json(d) for d in rows],
        lambda: render.denials_text(rows) if rows else "no denials match",
    )
    return OK if rows else NOT_FOUND


def cmd_recover(ns: argparse.Namespace) -> int:
    kernel = load_app(ns.app)
    try:
        given = ns.db or os.environ.get("POIMEN_DB")
        if given and not _same_store(given, kernel.store.url):
            raise CliError(
                f"--db/POIMEN_DB {given} is not the app's store {kernel.store.url}", code=USAGE
            )
        show = ns.progress if ns.progress is not None else sys.stderr.isatty()
        bar: render.ProgressBar | None = None
        if show:
            total = sum(n for (_, s), n in kernel.store.counts().items() if s == "DISPATCHED")
            bar = render.ProgressBar(total)
            bar.update(0)
        report = kernel.recover(progress=bar.update if bar else None)
        if bar:
            bar.finish(report.scanned)
    finally:
        kernel.close()
    data = asdict(report)

    def text() -> str:
        lines = [
            f"scanned {report.scanned}: {report.completed} completed, {report.failed} failed, "
            f"{report.indeterminate} indeterminate, {report.pending} pending, "
            f"{report.busy} busy (live owner), {report.lost_race} taken by another recoverer"
        ]
        if report.unregistered:
            lines.append(
                f"{len(report.unregistered)} belong to tools the app does not register and stay "
                f"DISPATCHED: {', '.join(report.unregistered[:10])}"
            )
        if report.corrupt:
            lines.append(f"{len(report.corrupt)} corrupt rows skipped: {', '.join(report.corrupt)}")
        return "\n".join(lines)

    _emit(ns, data, text)
    return OK


def cmd_migrate(ns: argparse.Namespace) -> int:
    url = _db_url(ns)
    before = open_store(url, migrate=False)
    try:
        found = before.schema_version()
    finally:
        before.close()
    store = open_store(url)
    try:
        now = store.schema_version()
    finally:
        store.close()
    _emit(
        ns,
        {"from": found, "to": now},
        lambda: (
            f"schema version {found} -> {now}"
            if now != found
            else f"schema is current (version {now})"
        ),
    )
    return OK


def cmd_console(ns: argparse.Namespace) -> int:
    try:
        from poimen.console import ConsoleOptions, listen, serve
    except ImportError as exc:
        raise CliError(
            f"the console needs its extra: pip install 'poimen[console]' ({exc})", code=USAGE
        ) from exc
    token = ns.token or os.environ.get("POIMEN_CONSOLE_TOKEN") or None
    if token is not None and len(token) < 16:
        raise CliError("the console token must be at least 16 characters", code=USAGE)
    if bool(ns.tls_cert) != bool(ns.tls_key):
        raise CliError("--tls-cert and --tls-key go together", code=USAGE)
    checks: dict[str, str] = {}
    url = ns.db or os.environ.get("POIMEN_DB")
    if ns.app:
        kernel = load_app(ns.app)
        try:
            checks = dict(kernel.checks)
            if url and not _same_store(url, kernel.store.url):
                raise CliError(
                    f"--db/POIMEN_DB {url} is not the app's store {kernel.store.url}", code=USAGE
                )
            url = kernel.store.url
        finally:
            kernel.close()
    if not url:
        raise CliError("no database: pass --db URL, --app, or set POIMEN_DB", code=USAGE)
    options = ConsoleOptions(
        session_ttl=op.parse_duration(ns.session_ttl, "session_ttl"),
        trust_proxy=ns.trust_proxy,
        allowed_hosts=tuple(ns.allowed_host or ()),
        checks=checks,
        recording=ns.recording,
    )
    if ns.recording:  # refused now, not on the first visit of the diff page
        _open(ns.recording, readonly=True).close()
    try:
        sock = listen(ns.host, ns.port)
    except OSError as exc:
        raise CliError(f"console: cannot listen on {ns.host}:{ns.port}: {exc}", code=USAGE) from exc
    store = _open(url)
    try:
        serve(
            store,
            sock=sock,
            host=ns.host,
            token=token,
            options=options,
            tls=(ns.tls_cert, ns.tls_key) if ns.tls_cert else None,
        )
    finally:
        store.close()
    return OK


def cmd_diff(ns: argparse.Namespace) -> int:
    """Two runs' calls side by side: exit 0 when they made the same calls, 1 when not."""
    from poimen.sandbox import diff

    run_url = ns.run or ns.db or os.environ.get("POIMEN_DB")
    if not run_url:
        raise CliError("no run to compare: pass --run URL (or --db, or set POIMEN_DB)", code=USAGE)
    recording = _open(ns.recording, readonly=True)
    try:
        run = _open(run_url, readonly=True)
        try:
            d = diff(recording, run, scope=ns.scope, run_scope=ns.run_scope)
        finally:
            run.close()
    finally:
        recording.close()
    _emit(ns, d.to_json(), lambda: d.text(all_calls=ns.all))
    return NOT_FOUND if d.differences else OK


def _diff_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    s = sub.add_parser(
        "diff",
        parents=[common],
        help="compare two runs call by call: same, arguments changed, only in one (exit 1 if "
        "they differ)",
    )
    s.add_argument("--recording", required=True, help="log URL of the recorded run (read only)")
    s.add_argument("--run", help="log URL of the run to compare (default: --db or POIMEN_DB)")
    s.add_argument("--scope", help="call-id prefix of the run to compare, e.g. conv-42/")
    s.add_argument("--run-scope", help="the run's call-id prefix when it differs from --scope")
    s.add_argument("--all", action="store_true", help="list the calls that are the same too")


# The parser.


def _parser() -> argparse.ArgumentParser:
    # Global options are accepted before or after the command; SUPPRESS keeps a
    # subcommand's unset option from overwriting one given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--db",
        default=argparse.SUPPRESS,
        help="store URL: sqlite:///path or postgresql://... (or POIMEN_DB)",
    )
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    p = argparse.ArgumentParser(
        prog="poimen",
        description="Operate the poimen intent log: status, find, Indeterminate intents, abandon, audit, "
        "recovery.",
        epilog="exit codes: 0 ok, 1 nothing found or refused, 2 usage, 3 store unavailable, "
        "4 unexpected error",
    )
    p.add_argument("--db", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", default=False, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    sub.add_parser(
        "status",
        parents=[common],
        help="counts by state and tool, oldest Indeterminate, unfinished intents",
    )

    s = sub.add_parser("intents", parents=[common], help="list intents, oldest first")
    s.add_argument("--state", help="DISPATCHED, COMPLETED, FAILED, INDETERMINATE, ...")
    s.add_argument("--tool", help="tool id")
    s.add_argument("--since", help="15m, 2h, 7d, an ISO 8601 time, or epoch seconds")
    s.add_argument(
        "--call-id", help="find by call id: the intents whose call id starts with it, newest first"
    )
    s.add_argument("--limit", type=int, default=100)

    s = sub.add_parser(
        "show", parents=[common], help="one intent: arguments (secrets redacted), attempts, events"
    )
    s.add_argument("intent", help="intent id or call id")

    s = sub.add_parser(
        "resolve", parents=[common], help="decide an INDETERMINATE intent (never retries it)"
    )
    s.add_argument("intent", help="intent id or call id")
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--landed", action="store_true", help="the effect happened")
    g.add_argument("--not-landed", action="store_true", help="the effect did not happen")
    s.add_argument("--result", help="JSON result of a landed call (optional)")
    s.add_argument("--operator", required=True, help="who decides")
    s.add_argument("--reason", required=True, help="why: what you checked")

    s = sub.add_parser(
        "abandon",
        parents=[common],
        help="give up on a DISPATCHED intent whose worker is gone: it becomes INDETERMINATE",
    )
    s.add_argument("intent", help="intent id or call id")
    s.add_argument("--operator", required=True, help="who decides")
    s.add_argument("--reason", required=True, help="why: how you know the worker is gone")

    for name, what in (
        ("approve", "approve a call AWAITING_APPROVAL: it is then dispatched once"),
        ("reject", "reject a call AWAITING_APPROVAL: it fails, nothing is sent"),
    ):
        s = sub.add_parser(name, parents=[common], help=what)
        s.add_argument("intent", help="intent id or call id")
        s.add_argument("--operator", required=True, help="who decides")
        s.add_argument("--reason", required=True, help="why")

    s = sub.add_parser("audit", parents=[common], help="capability and sandbox denials")
    s.add_argument("--tool", help="tool id")
    s.add_argument("--since", help="15m, 2h, 7d, an ISO 8601 time, or epoch seconds")
    s.add_argument("--limit", type=int, default=1000)

    s = sub.add_parser("recover", parents=[common], help="run one recovery pass now")
    s.add_argument(
        "--app", required=True, help="module:kernel of the application (its tool registrations)"
    )
    s.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )

    sub.add_parser("migrate", parents=[common], help="create or upgrade the schema")

    s = sub.add_parser("console", parents=[common], help="serve the web console")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8470, help="port (0 picks a free one)")
    s.add_argument(
        "--token", help="access token (or POIMEN_CONSOLE_TOKEN; default: generated and printed)"
    )
    s.add_argument(
        "--app",
        help="module:kernel of the application, to show each tool's what-to-check text",
    )
    s.add_argument(
        "--session-ttl", default="12h", help="how long a login lasts (default 12h; 90s, 15m, 7d)"
    )
    s.add_argument(
        "--allowed-host",
        action="append",
        metavar="HOST",
        help="a host name the console is reached by, besides the bind address and localhost "
        "(repeatable)",
    )
    s.add_argument(
        "--trust-proxy",
        action="store_true",
        help="believe X-Forwarded-Proto/-For: only behind a TLS proxy that sets them",
    )
    s.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    s.add_argument("--tls-key", help="the private key of --tls-cert (PEM)")
    s.add_argument("--recording", help="log URL the Diff page compares this log with (read only)")
    _diff_parser(sub, common)
    return p


_STORE_COMMANDS: dict[str, Callable[[argparse.Namespace, Store], int]] = {
    "status": cmd_status,
    "intents": cmd_intents,
    "show": cmd_show,
    "resolve": cmd_resolve,
    "abandon": cmd_abandon,
    "approve": cmd_approve,
    "reject": cmd_approve,
    "audit": cmd_audit,
}
_READING = frozenset({"status", "intents", "show", "audit"})


def _fail(ns: argparse.Namespace | None, code: int, exc: BaseException, prefix: str) -> int:
    message = op.redact_urls(str(exc))
    if os.environ.get("POIMEN_DEBUG") == "1":
        traceback.print_exception(exc, file=sys.stderr)
    print(op.escape_text(f"poimen: {prefix}{message}"), file=sys.stderr)
    if ns is not None and getattr(ns, "json", False):
        data = getattr(exc, "data", {})
        error = {
            "type": type(exc).__name__,
            "message": message,
            **{k: v for k, v in data.items() if k != "code"},
        }
        print(op.safe_json({"error": error}))
    return code


def main(argv: Sequence[str] | None = None) -> int:
    ns: argparse.Namespace | None = None
    try:
        ns = _parser().parse_args(argv)
        if ns.cmd in _STORE_COMMANDS:
            store = _open(_db_url(ns), readonly=ns.cmd in _READING)
            try:
                return _STORE_COMMANDS[ns.cmd](ns, store)
            finally:
                store.close()
        if ns.cmd == "recover":
            return cmd_recover(ns)
        if ns.cmd == "migrate":
            return cmd_migrate(ns)
        if ns.cmd == "diff":
            return cmd_diff(ns)
        return cmd_console(ns)
    except CliError as exc:
        return _fail(ns, exc.code, exc, "")
    except op.OperatorInputError as exc:
        return _fail(ns, USAGE, exc, "")
    except IntentNotFoundError as exc:
        return _fail(ns, NOT_FOUND, exc, "")
    except (NotIndeterminateError, NotDispatchedError, NotAwaitingApprovalError) as exc:
        return _fail(ns, NOT_FOUND, exc, "refused: ")
    except StoreError as exc:
        return _fail(ns, STORE, exc, "store: ")
    except PoimenError as exc:
        return _fail(ns, NOT_FOUND, exc, "refused: ")
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `poimen show X | head`: the reader left; that is not an error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK
    except Exception as exc:  # one line, never a traceback, unless POIMEN_DEBUG=1 asks
        return _fail(ns, UNEXPECTED, exc, f"unexpected error: {type(exc).__name__}: ")
