"""``poimen``: the operator CLI over the intent log.

Exit codes: 0 ok (an empty listing too) · 1 no such intent, or refused (e.g. resolving an
intent that is not INDETERMINATE), or ``diff`` found differences, or a ``--fail-if-`` flag
held · 2 usage (bad or missing options, an --app that cannot be loaded, a console
address that cannot be listened on) · 3 the store cannot be opened, read or written ·
4 anything unforeseen (a bug here or in the loaded app) · 5 `status --fail-if-indeterminate`
found INDETERMINATE intents · 6 `verify` found a problem, or `audit verify` or
`audit verify-export` a chain that does not hold. Every failure is one line on stderr
(and with ``--json`` an error object on stdout); ``POIMEN_DEBUG=1`` adds the traceback.

A little over 600 lines on purpose: one short handler per subcommand, each reading the
options the parser (`_parser`) defined; the shared work lives in `poimen.operator`.
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

from poimen._core.effects import Transactional
from poimen._engine import transactional as _tx
from poimen._kernel import Kernel
from poimen.cli import _aids as aids
from poimen.cli import _audit as audit_cli
from poimen.cli import _render as render
from poimen.cli._parser import _parser
from poimen.errors import (
    ConsoleConfigError,
    DuplicateOperatorError,
    IntentNotFoundError,
    MissingExtraError,
    NotAwaitingApprovalError,
    NotDispatchedError,
    NotIndeterminateError,
    NotSent,
    OperatorsFileError,
    PoimenError,
    RegistrationError,
    SchemaTooNewError,
    StoreError,
    TransactionalDatabaseError,
    UnknownOperatorError,
)
from poimen.operator import _health as health
from poimen.operator import _ops as op
from poimen.operator._prune import prune
from poimen.store import Store, open_store
from poimen.store._base import Problem
from poimen.store._dialect import POSTGRES, dialect_of, same_log, sqlite_path

OK, NOT_FOUND, USAGE, STORE, UNEXPECTED, INDETERMINATE, VERIFY_FAILED = 0, 1, 2, 3, 4, 5, 6


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
    path = sqlite_path(url)
    if path is not None and not Path(path).is_file():
        raise CliError(f"no intent log at {path!r} (poimen migrate creates one)", code=STORE)
    store = open_store(url, migrate=False, readonly=readonly)
    if store.schema_version() == 0:
        store.close()
        raise CliError(
            f"{op.redact_store_url(url)} holds no poimen schema: run `poimen migrate`", code=STORE
        )
    return store


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
    if ns.older_than is not None:
        return aids.status_older(ns, store, st)
    _emit(ns, st.to_json(), lambda: render.status_text(st))
    return INDETERMINATE if ns.fail_if_indeterminate and st.indeterminate else OK


def cmd_verify(ns: argparse.Namespace) -> int:
    try:
        store = _open(_db_url(ns), readonly=True)
    except SchemaTooNewError as exc:
        v = health.Verification(
            backend=(dialect_of(_db_url(ns)) or POSTGRES).name,
            schema_version=int(exc.data["found"]),
            known_version=int(exc.data["known"]),
            checks=("schema version",),
            problems=(Problem("schema version", str(exc)),),
        )
    else:
        try:
            v = health.verify(store)
        finally:
            store.close()
    _emit(ns, v.to_json(), lambda: render.verification_text(v))
    return OK if v.ok else VERIFY_FAILED


def cmd_doctor(ns: argparse.Namespace) -> int:
    info = health.environment()
    url = ns.db or os.environ.get("POIMEN_DB")
    code = OK
    if url:
        facts: dict[str, Any] = {"url": op.redact_store_url(url)}
        try:
            store = _open(url, readonly=True)
            try:
                facts.update(health.store_facts(store))
            finally:
                store.close()
        except (StoreError, CliError) as exc:  # a report is still worth printing
            facts["error"] = f"{type(exc).__name__}: {op.redact_urls(str(exc))}"
            code = STORE
        info["store"] = facts
    else:
        info["store"] = "none given (--db URL or POIMEN_DB)"
    _emit(ns, info, lambda: render.doctor_text(info))
    return code


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
    return NOT_FOUND if ns.fail_if_empty and not rows else OK


def cmd_show(ns: argparse.Namespace, store: Store) -> int:
    d = op.show(store, ns.intent)
    _emit(ns, d.to_json(), lambda: render.detail_text(d))
    return OK


def _decider(ns: argparse.Namespace, what: str) -> op.Identity:
    """Who decides on the command line: --operator, else POIMEN_OPERATOR; the operating
    system's account that runs the command goes with it."""
    name = ns.operator if ns.operator is not None else os.environ.get("POIMEN_OPERATOR")
    if name is None or not name.strip():
        raise CliError(
            f"{what} needs the operator's name: --operator NAME or POIMEN_OPERATOR", code=USAGE
        )
    return op.Identity(name.strip(), via="cli", os_user=op.os_user())


def _by(who: op.Identity, reason: str) -> str:
    account = f" (os user {op.escape_text(who.os_user)})" if who.os_user else ""
    return f"by {op.escape_text(who.name)}{account} ({op.escape_text(reason.strip())})"


def cmd_resolve(ns: argparse.Namespace, store: Store) -> int:
    if ns.filter or ns.from_csv:
        return aids.cmd_bulk(ns, store)
    if ns.dry_run:
        raise CliError("--dry-run goes with --filter or --from-csv", code=USAGE)
    if ns.intent is None or not (ns.landed or ns.not_landed):
        raise CliError(
            "resolve needs an intent and --landed or --not-landed (or --filter/--from-csv)",
            code=USAGE,
        )
    if not ns.reason or not ns.reason.strip():
        raise CliError("resolve needs --reason: what you checked", code=USAGE)
    if ns.result is not None and not ns.landed:
        raise CliError("--result goes only with --landed", code=USAGE)
    result = None if ns.result is None else op.parse_result(ns.result)
    who = _decider(ns, "resolve")
    intent = op.find(store, ns.intent)
    done = op.resolve(
        store, intent.id, landed=ns.landed, result=result, operator=who, reason=ns.reason
    )
    _emit(
        ns,
        op.intent_summary(done),
        lambda: f"resolved {done.id}: {intent.state} -> {done.state} {_by(who, ns.reason)}",
    )
    return OK


def cmd_abandon(ns: argparse.Namespace, store: Store) -> int:
    who = _decider(ns, "abandon")
    intent = op.find(store, ns.intent)
    done = op.abandon(store, intent.id, operator=who, reason=ns.reason)
    _emit(
        ns,
        op.intent_summary(done),
        lambda: (
            f"abandoned {done.id}: {intent.state} -> {done.state} ({done.reason}) "
            f"{_by(who, ns.reason)}; "
            f"now resolve it: poimen resolve {done.id} --landed|--not-landed"
        ),
    )
    return OK


def cmd_approve(ns: argparse.Namespace, store: Store) -> int:
    approve = ns.cmd == "approve"
    who = _decider(ns, ns.cmd)
    intent = op.find(store, ns.intent)
    done = op.decide_approval(store, intent.id, approve=approve, operator=who, reason=ns.reason)
    _emit(
        ns,
        op.intent_summary(done),
        lambda: (
            f"{'approved' if approve else 'rejected'} {done.id}: {intent.state} -> "
            f"{done.state} {_by(who, ns.reason)}"
            + ("; it is dispatched once by the next kernel that resumes it" if approve else "")
        ),
    )
    return OK


def cmd_audit(ns: argparse.Namespace, store: Store) -> int:
    if getattr(ns, "audit_cmd", None):  # the chain: poimen.cli._audit
        return audit_cli.run(ns, store)
    rows = op.audit(store, tool_id=ns.tool, since=_since(ns, store), limit=ns.limit)
    _emit(
        ns,
        [op.denial_json(d) for d in rows],
        lambda: render.denials_text(rows) if rows else "no denials match",
    )
    return NOT_FOUND if ns.fail_if_found and rows else OK


def cmd_prune(ns: argparse.Namespace, store: Store) -> int:
    older = op.parse_duration(ns.older_than, "older_than")
    ttls: dict[str, float] = {}
    if ns.app:  # the tools' provider key windows: an intent inside one is kept
        kernel = load_app(ns.app)
        try:
            for tid, reg in kernel.registered().items():
                ttl = getattr(reg.effects, "key_ttl", None)
                if ttl is not None:
                    ttls[tid] = float(ttl)
        finally:
            kernel.close()
    show = ns.progress if ns.progress is not None else sys.stderr.isatty()
    bar = render.ProgressBar(0) if show else None
    report = prune(
        store,
        older_than=older,
        archive=ns.archive,
        key_ttls=ttls,
        batch=ns.batch,
        progress=bar.update if bar else None,
        allow_short=ns.allow_short_window,
    )
    if bar:
        bar.finish(report.scanned)
    _emit(
        ns,
        asdict(report),
        lambda: (
            f"pruned {report.pruned} settled intents (scanned {report.scanned}; kept "
            f"{report.kept_for_key_window} inside their key window) and {report.denials} "
            "denials of no intent"
            + (f"; archived to {op.escape_text(report.archive)}" if report.archive else "")
        ),
    )
    return OK


def _app_on_db(ns: argparse.Namespace) -> Kernel:
    """The --app kernel; refused (and closed) if --db/POIMEN_DB names another store."""
    kernel = load_app(ns.app)
    given = ns.db or os.environ.get("POIMEN_DB")
    if given and not same_log(given, kernel.store.url):
        kernel.close()
        raise CliError(
            f"--db/POIMEN_DB {op.redact_store_url(given)} is not the app's store "
            f"{op.redact_store_url(kernel.store.url)}",
            code=USAGE,
        )
    return kernel


def cmd_recover(ns: argparse.Namespace) -> int:
    kernel = _app_on_db(ns)
    try:
        show = ns.progress if ns.progress is not None else sys.stderr.isatty()
        bar: render.ProgressBar | None = None
        if show:
            total = sum(n for (_, s), n in kernel.store.counts().items() if s == "DISPATCHED")
            bar = render.ProgressBar(total)
            bar.update(0)
        report = kernel.recover(progress=bar.update if bar else None)
        if bar:
            bar.finish(report.scanned)
        kernel.deliver_notifications(gather=True)  # a one-shot process: no delivery duty
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


def cmd_undo(ns: argparse.Namespace) -> int:
    """Reverse a scope's landed calls by the app's undo tools, newest first (docs/undo.md)."""
    if not ns.dry_run and not ns.operator:
        raise CliError("undo needs --operator (who asks), or --dry-run", code=USAGE)
    who = None if not ns.operator else _decider(ns, "undo")
    kernel = _app_on_db(ns)
    try:
        report = kernel.undo(ns.scope, operator=who, reason=ns.reason, dry_run=ns.dry_run)
    finally:
        kernel.close()
    _emit(ns, report.to_json(), lambda: render.undo_text(report))
    if not report.steps:
        return NOT_FOUND
    return OK if report.complete or report.dry_run else NOT_FOUND


def cmd_migrate(ns: argparse.Namespace) -> int:
    made = _transactional_markers(ns.transactional or [])
    if made and not (ns.db or os.environ.get("POIMEN_DB")):
        _emit(ns, {"transactional": made}, lambda: "\n".join(
            f"marker table {_tx.MARKERS} ready in {u}" for u in made))
        return OK
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
        {"from": found, "to": now, **({"transactional": made} if made else {})},
        lambda: "\n".join([
            f"schema version {found} -> {now}"
            if now != found
            else f"schema is current (version {now})",
            *(f"marker table {_tx.MARKERS} ready in {u}" for u in made),
        ]),
    )
    return OK


def _transactional_markers(urls: list[str]) -> list[str]:
    """`migrate --transactional URL`: the marker table of Transactional tools, made now in each
    application database; returns their URLs as shown (password masked)."""
    made = []
    for url in urls:
        try:
            db = _tx.Database(Transactional(database=url), "")
            db.create_markers()
        except RegistrationError as exc:
            raise CliError(str(exc), code=USAGE) from exc
        except (NotSent, TransactionalDatabaseError) as exc:
            raise CliError(str(exc), code=STORE) from exc
        made.append(db.shown)
    return made


def cmd_operators(ns: argparse.Namespace) -> int:
    from poimen.operator import _identity

    if ns.action == "add":
        token = _identity.add_operator(ns.file, ns.name)
        _emit(
            ns,
            {"name": ns.name, "token": token, "file": ns.file},
            lambda: (
                f"added operator {ns.name} to {ns.file}\n"
                f"token (shown this once; give it to {ns.name} only): {token}\n"
                f"serve it with: poimen console --operators {ns.file}"
            ),
        )
    elif ns.action == "remove":
        _identity.remove_operator(ns.file, ns.name)
        _emit(
            ns,
            {"removed": ns.name, "file": ns.file},
            lambda: (
                f"removed operator {ns.name} from {ns.file}: their token no longer logs in, "
                "and their console sessions end at their next request"
            ),
        )
    else:
        names = _identity.operator_names(ns.file)
        _emit(ns, names, lambda: "\n".join(names) if names else f"no operators in {ns.file}")
    return OK


def cmd_console(ns: argparse.Namespace) -> int:
    try:
        from poimen.console import ConsoleOptions, check_setup, listen, serve
    except ImportError as exc:
        raise CliError(
            f"the console needs its extra: pip install 'poimen[console]' ({exc})", code=USAGE
        ) from exc
    token = ns.token or os.environ.get("POIMEN_CONSOLE_TOKEN") or None
    if token is not None and len(token) < 16:
        raise CliError("the console token must be at least 16 characters", code=USAGE)
    if token is not None and not ns.token and (ns.operators or ns.trust_user_header):
        raise CliError(
            "POIMEN_CONSOLE_TOKEN is set: a shared token does not go with --operators or "
            "--trust-user-header; unset it",
            code=USAGE,
        )
    if bool(ns.tls_cert) != bool(ns.tls_key):
        raise CliError("--tls-cert and --tls-key go together", code=USAGE)
    if ns.tls_cert:
        _check_tls(ns.tls_cert, ns.tls_key)
    checks: dict[str, str] = {}
    url = ns.db or os.environ.get("POIMEN_DB")
    kernel: Kernel | None = None
    if ns.app:
        kernel = load_app(ns.app)
        try:
            checks = dict(kernel.checks)
            if url and not same_log(url, kernel.store.url):
                raise CliError(
                    f"--db/POIMEN_DB {op.redact_store_url(url)} is not the app's store "
                    f"{op.redact_store_url(kernel.store.url)}",
                    code=USAGE,
                )
            url = kernel.store.url
        except BaseException:
            kernel.close()
            raise
    if not url:
        raise CliError("no database: pass --db URL, --app, or set POIMEN_DB", code=USAGE)
    options = ConsoleOptions(
        session_ttl=op.parse_duration(ns.session_ttl, "session_ttl"),
        trust_proxy=ns.trust_proxy,
        allowed_hosts=tuple(ns.allowed_host or ()),
        checks=checks,
        operators_file=ns.operators,
        user_header=ns.trust_user_header,
        proxy_is_the_only_way_in=ns.proxy_is_the_only_way_in,
        # The app's kernel stays open while the console serves: undo runs the app's tools.
        undo=None if kernel is None else kernel.undo,
        recording=ns.recording,
        metrics_token=ns.metrics_token or os.environ.get("POIMEN_METRICS_TOKEN") or None,
        **({} if kernel is None else aids.console_options(kernel)),
    )
    check_setup(ns.host, token, options)
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
        if kernel is not None:
            kernel.close()
    return OK


def _check_tls(cert: str, key: str) -> None:
    """Load the certificate and its key now, so that a bad pair is refused before the
    console says it listens."""
    import ssl

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise CliError(
            f"console: --tls-cert {cert!r} and --tls-key {key!r} cannot be used: "
            f"{getattr(exc, 'strerror', None) or exc}",
            code=USAGE,
        ) from None


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


def cmd_crashtest(ns: argparse.Namespace) -> int:
    """Kill the agent at every call's crash points; exit 1 on a double effect
    (docs/crash-testing.md)."""
    from poimen.crashtest import Answers, AnswersError, CrashTestError, Options, crashtest

    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    try:
        answers = Answers.load(ns.answers) if ns.answers else None
        show = ns.progress if ns.progress is not None else sys.stderr.isatty()
        bar: list[render.ProgressBar] = []

        def progress(done: int, total: int) -> None:
            if not bar:
                bar.append(render.ProgressBar(total, label="crashtest"))
            bar[0].update(done)

        report = crashtest(
            Options(tuple(command), jobs=ns.jobs, timeout=ns.timeout, mode=ns.mode,
                    answers=answers, keep=Path(ns.keep) if ns.keep else None),
            progress=progress if show else None,
        )
        if bar:
            bar[0].finish(len(report.cases))
    except (CrashTestError, AnswersError) as exc:
        raise CliError(str(exc), code=USAGE) from exc
    if ns.junit:
        Path(ns.junit).write_text(report.junit(), encoding="utf-8")
    _emit(ns, report.to_json(), report.table)
    return OK if report.ok() else NOT_FOUND


def cmd_scan(ns: argparse.Namespace) -> int:
    """Tools that write to the outside without an effect class; exit 1 at --fail-on."""
    from poimen.scan import ScanError, scan

    try:
        report = scan(ns.paths, exclude=ns.exclude)
    except ScanError as exc:
        raise CliError(str(exc), code=USAGE) from exc
    if ns.sarif == "-":
        print(op.safe_json(report.sarif(), indent=2))
    else:
        if ns.sarif:
            Path(ns.sarif).write_text(op.safe_json(report.sarif(), indent=2), encoding="utf-8")
        _emit(ns, report.to_json(), report.text)
    return NOT_FOUND if report.fails(ns.fail_on) else OK


_STORE_COMMANDS: dict[str, Callable[[argparse.Namespace, Store], int]] = {
    "status": cmd_status,
    "intents": cmd_intents,
    "show": cmd_show,
    "resolve": cmd_resolve,
    "abandon": cmd_abandon,
    "approve": cmd_approve,
    "reject": cmd_approve,
    "audit": cmd_audit,
    "prune": cmd_prune,
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
            **{
                k: op.redact_urls(v) if isinstance(v, str) else v
                for k, v in data.items()
                if k != "code"
            },
        }
        print(op.safe_json({"error": error}))
    return code


def _check_utf8(argv: Sequence[str]) -> None:
    """Arguments that are not valid UTF-8 reach Python as lone surrogates, which no store
    can take: refused as usage, before anything is opened."""
    for arg in argv:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(arg).decode("utf-8", "backslashreplace")
            raise CliError(f'argument "{shown[:200]}" is not valid UTF-8', code=USAGE) from None


def main(argv: Sequence[str] | None = None) -> int:
    ns: argparse.Namespace | None = None
    try:
        _check_utf8(sys.argv[1:] if argv is None else argv)
        ns = _parser().parse_args(argv)
        if ns.cmd == "audit" and getattr(ns, "audit_cmd", None) in audit_cli.OFFLINE:
            return audit_cli.run_offline(ns)
        if ns.cmd in _STORE_COMMANDS:
            store = _open(_db_url(ns), readonly=ns.cmd in _READING)
            try:
                return _STORE_COMMANDS[ns.cmd](ns, store)
            finally:
                store.close()
        if ns.cmd == "recover":
            return cmd_recover(ns)
        if ns.cmd == "evidence":
            return aids.cmd_evidence(ns)
        if ns.cmd == "undo":
            return cmd_undo(ns)
        if ns.cmd == "migrate":
            return cmd_migrate(ns)
        if ns.cmd == "diff":
            return cmd_diff(ns)
        if ns.cmd == "operators":
            return cmd_operators(ns)
        if ns.cmd == "verify":
            return cmd_verify(ns)
        if ns.cmd == "doctor":
            return cmd_doctor(ns)
        if ns.cmd == "crashtest":
            return cmd_crashtest(ns)
        if ns.cmd == "scan":
            return cmd_scan(ns)
        return cmd_console(ns)
    except CliError as exc:
        return _fail(ns, exc.code, exc, "")
    except (op.OperatorInputError, ConsoleConfigError, MissingExtraError) as exc:
        return _fail(ns, USAGE, exc, "")
    except (DuplicateOperatorError, UnknownOperatorError) as exc:
        return _fail(ns, NOT_FOUND, exc, "refused: ")
    except OperatorsFileError as exc:
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
