"""The `poimen` command's parser: every subcommand and its options (the commands themselves
are in `poimen.cli._main`)."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from typing import Any, NoReturn

from poimen.cli._help import explain


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, like every other failure of the command; --help has the rest."""

    def error(self, message: str) -> NoReturn:
        if "--operator" in message and "required" in message:
            message += " (or set POIMEN_OPERATOR)"
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _port(text: str) -> int:
    """A TCP port, 0 to 65535 (0: any free one); the socket would take 70000 as 4464."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is not from 0 to 65535")
    return port


def _version() -> str:
    try:
        return importlib.metadata.version("poimen")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not installed
        return "unknown"


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


def _agent_parsers(sub: Any) -> None:
    """`crashtest` and `scan`: checks of an agent's own code, not of a log."""
    json_opt = argparse.ArgumentParser(add_help=False)
    json_opt.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    s = sub.add_parser(
        "crashtest",
        parents=[json_opt],
        help="run an agent, kill it at every tool call before and after its effect, restart it, "
        "and report what took effect twice (exit 1 if anything did)",
        usage="poimen crashtest [options] -- COMMAND [ARG ...]",
    )
    s.add_argument("-j", "--jobs", type=int, default=1, help="cases run at once (default 1)")
    s.add_argument("--junit", metavar="FILE", help="write JUnit XML: one test case per call "
                   "and crash point")
    s.add_argument("--timeout", type=float, default=120.0,
                   help="seconds one run of the command may take (default 120)")
    s.add_argument("--mode", choices=("auto", "poimen", "witness"), default="auto",
                   help="where the kill points come from: poimen's crash points, or the witness "
                   "(default: poimen when the clean run left calls in POIMEN_DB)")
    s.add_argument("--answers", metavar="FILE", help="JSON rules for the witness's answers "
                   "(default: 200 {\"ok\": true, \"id\": ...})")
    s.add_argument("--keep", metavar="DIR", help="keep every run's output, ledger and state in "
                   "DIR (a new or empty directory)")
    s.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    s.add_argument("command", nargs=argparse.REMAINDER, help="the agent's command, after --")

    s = sub.add_parser(
        "scan",
        parents=[json_opt],
        help="find agent tools that write to the outside without a poimen effect class",
    )
    s.add_argument("paths", nargs="+", metavar="PATH", help="a Python file or a directory")
    s.add_argument("--sarif", metavar="FILE", help="write SARIF 2.1.0 for code scanning "
                   "(- for standard output)")
    s.add_argument("--fail-on", choices=("error", "warning", "never"), default="error",
                   help="exit 1 when a finding of this level or worse is found (default error)")
    s.add_argument("--exclude", action="append", metavar="GLOB", default=[],
                   help="skip files or directories matching GLOB (repeatable)")


def _aid_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    """What helps an operator decide: `evidence`, bulk `resolve`, `status --older-than`
    (docs/email-outage.md)."""
    s = sub.add_parser(
        "evidence",
        parents=[common],
        help="gather a call's evidence now with its tool's evidence function (facts, never a "
        "decision); recorded in its events",
    )
    s.add_argument("intent", help="intent id or call id")
    s.add_argument(
        "--app", required=True, help="module:kernel of the application (its evidence functions)"
    )
    s.add_argument("--operator", help="who asks (or POIMEN_OPERATOR; default: the os account)")

    r = sub.choices["resolve"]
    r.add_argument(
        "--filter",
        action="append",
        metavar="TERMS",
        help="resolve every INDETERMINATE intent matching tool=T,reason=R,call_id=PREFIX,"
        "created<TIME,created>TIME (TIME: 2h ago, ISO 8601, epoch) in one batch",
    )
    r.add_argument(
        "--from-csv",
        metavar="FILE",
        help="resolve the calls a CSV names (intent_id, call_id, request_id or key, and "
        "outcome landed|not_landed; optional result) in one batch",
    )
    r.add_argument(
        "--dry-run", action="store_true", help="with --filter or --from-csv: list what would "
        "change, change nothing"
    )

    sub.choices["status"].add_argument(
        "--older-than",
        metavar="DURATION",
        help="list the calls waiting for a person (INDETERMINATE, AWAITING_APPROVAL) created "
        "longer ago than this (90s, 15m, 2h, 7d); exit 5 when there is one",
    )


def _audit_parsers(audit: argparse.ArgumentParser, common: argparse.ArgumentParser) -> None:
    """`poimen audit ACTION`: the audit chain (docs/audit.md). Without an action, `audit`
    lists the denials as before."""
    sub: Any = audit.add_subparsers(dest="audit_cmd", required=False, metavar="[ACTION]")
    s = sub.add_parser(
        "verify", parents=[common],
        help="walk the chain; name the first row edited, deleted, inserted or reordered "
        "(exit 6)",
    )
    s.add_argument(
        "--head", metavar="SEQ:HASH",
        help="a head published earlier (poimen audit head): it must be a link of this chain, "
        "or the chain was rewritten",
    )
    s.add_argument(
        "--archive", action="append", default=[], metavar="FILE",
        help="a prune archive (poimen prune --archive): its rows must be the links the chain "
        "removed (repeatable)",
    )
    s = sub.add_parser("head", parents=[common], help="the chain's head, to publish elsewhere")
    s = sub.add_parser(
        "export", parents=[common], help="write the chain as signed JSON Lines (Ed25519)"
    )
    s.add_argument("--sign", required=True, metavar="KEYFILE",
                   help="the Ed25519 private key (PEM) to sign with (poimen audit keygen)")
    s.add_argument("--out", metavar="FILE", help="write here, a new file (default: stdout)")
    s = sub.add_parser(
        "verify-export", parents=[common],
        help="check a signed export offline with the signer's public key (exit 6)",
    )
    s.add_argument("file", help="the export (JSON Lines)")
    s.add_argument("--public-key", required=True, metavar="KEY",
                   help="the signer's public key (PEM)")
    s = sub.add_parser(
        "keygen", parents=[common],
        help="make an Ed25519 key pair for signing exports: KEYFILE and KEYFILE.pub",
    )
    s.add_argument("--out", required=True, metavar="KEYFILE",
                   help="the private key's file (made owner-only; never overwritten)")
    for name, parser in sub.choices.items():
        explain(parser, f"audit {name}")


# The parser.

_OPERATOR_HELP = (
    "who decides (required, unless POIMEN_OPERATOR names them); the operating system's "
    "account running the command is recorded with it"
)


def _operator_option(s: argparse.ArgumentParser) -> None:
    # Required as the usage line shows it, unless the environment already names the operator.
    s.add_argument(
        "--operator", required=not os.environ.get("POIMEN_OPERATOR", "").strip(),
        help=_OPERATOR_HELP,
    )


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
    p = _Parser(
        prog="poimen",
        description="Operate the poimen intent log: status, find, Indeterminate intents, abandon, audit, "
        "recovery, undo.",
        epilog="exit codes: 0 ok (an empty listing too), 1 no such intent, refused, the runs "
        "differ (diff) or a --fail-if-... flag held, 2 usage, 3 store unavailable, "
        "4 unexpected error, 5 INDETERMINATE intents (status --fail-if-indeterminate), or calls "
        "waiting longer (status --older-than), "
        "6 verify found a problem, or audit verify or verify-export a chain that does not hold",
    )
    p.add_argument("--version", action="version", version=f"poimen {_version()}")
    p.add_argument("--db", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", default=False, help=argparse.SUPPRESS)
    sub: Any = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sub.add_parser(
        "status",
        parents=[common],
        help="counts by state and tool, oldest Indeterminate, unfinished intents",
    )
    s.add_argument(
        "--fail-if-indeterminate",
        action="store_true",
        help="exit 5 when any intent is INDETERMINATE (for cron jobs and alerts)",
    )

    s = sub.add_parser("intents", parents=[common], help="list intents, oldest first")
    s.add_argument("--state", help="DISPATCHED, COMPLETED, FAILED, INDETERMINATE, ...")
    s.add_argument("--tool", help="tool id")
    s.add_argument("--since", help="15m, 2h, 7d, an ISO 8601 time, or epoch seconds")
    s.add_argument(
        "--call-id", help="find by call id: the intents whose call id starts with it, newest first"
    )
    s.add_argument("--limit", type=int, default=100)
    s.add_argument(
        "--fail-if-empty", action="store_true", help="exit 1 when no intent matches (for scripts)"
    )

    s = sub.add_parser(
        "show", parents=[common], help="one intent: arguments (secrets redacted), attempts, events"
    )
    s.add_argument("intent", help="intent id or call id")

    s = sub.add_parser(
        "resolve", parents=[common], help="decide an INDETERMINATE intent (never retries it)"
    )
    s.add_argument("intent", nargs="?", help="intent id or call id (or --filter, --from-csv)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--landed", action="store_true", help="the effect happened")
    g.add_argument("--not-landed", action="store_true", help="the effect did not happen")
    s.add_argument("--result", help="JSON result of a landed call (optional)")
    s.add_argument("--operator", help=_OPERATOR_HELP + "; not for --dry-run")
    s.add_argument("--reason", help="why: what you checked (required to decide)")

    s = sub.add_parser(
        "abandon",
        parents=[common],
        help="give up on a DISPATCHED intent whose worker is gone: it becomes INDETERMINATE",
    )
    s.add_argument("intent", help="intent id or call id")
    _operator_option(s)
    s.add_argument("--reason", required=True, help="why: how you know the worker is gone")

    for name, what in (
        ("approve", "approve a call AWAITING_APPROVAL: it is then dispatched once"),
        ("reject", "reject a call AWAITING_APPROVAL: it fails, nothing is sent"),
    ):
        s = sub.add_parser(name, parents=[common], help=what)
        s.add_argument("intent", help="intent id or call id")
        _operator_option(s)
        s.add_argument("--reason", required=True, help="why")

    s = sub.add_parser(
        "audit",
        parents=[common],
        help="capability and sandbox denials; the tamper-evident chain (audit verify, export, "
        "verify-export, keygen, head)",
    )
    s.add_argument("--tool", help="tool id")
    s.add_argument("--since", help="15m, 2h, 7d, an ISO 8601 time, or epoch seconds")
    s.add_argument("--limit", type=int, default=1000)
    s.add_argument(
        "--fail-if-found",
        action="store_true",
        help="exit 1 when any denial matches (for cron jobs and alerts)",
    )
    _audit_parsers(s, common)

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

    s = sub.add_parser(
        "undo",
        parents=[common],
        help="reverse the landed calls of a scope (call-id prefix) by their undo tools, "
        "newest first",
    )
    s.add_argument("--scope", required=True, help="call-id prefix, e.g. run-9/")
    s.add_argument(
        "--app", required=True, help="module:kernel of the application (its undo tools)"
    )
    s.add_argument("--operator", help="who asks (recorded); required unless --dry-run")
    s.add_argument("--reason", help="why (recorded)")
    s.add_argument(
        "--dry-run", action="store_true", help="only show what would be undone; change nothing"
    )

    s = sub.add_parser("migrate", parents=[common], help="create or upgrade the schema")
    s.add_argument(
        "--transactional",
        action="append",
        metavar="URL",
        help="also make the marker table of Transactional tools in this application "
        "database (sqlite:///path or postgresql://...); may be repeated",
    )

    s = sub.add_parser(
        "prune", parents=[common], help="remove settled intents and their history past a window"
    )
    s.add_argument("--older-than", required=True, help="the window: 30d, 12h (at least 7d)")
    s.add_argument("--archive", help="append what is removed to this JSON Lines file first")
    s.add_argument("--app", help="module:kernel: keep intents inside their tools' key windows")
    s.add_argument("--batch", type=int, default=500, help="intents per transaction (500)")
    s.add_argument(
        "--allow-short-window",
        action="store_true",
        help="allow a window under 7 days (a re-used call id may then run again)",
    )
    s.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress on stderr (default: when stderr is a terminal)",
    )
    sub.add_parser(
        "verify",
        parents=[common],
        help="check the log: integrity, schema, constraints, unfinished intents whose owner is "
        "gone (exit 6 on a problem)",
    )
    sub.add_parser(
        "doctor",
        parents=[common],
        help="versions, platform, the store (secrets redacted) and its settings, for a bug report",
    )

    s = sub.add_parser("console", parents=[common], help="serve the web console")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=_port, default=8470, help="port (0 picks a free one)")
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
    s.add_argument(
        "--operators",
        metavar="FILE",
        help="each operator logs in with their own token (poimen operators add NAME --file "
        "FILE), and decisions carry their name",
    )
    s.add_argument(
        "--trust-user-header",
        metavar="HEADER",
        help="take the operator's name from this header set by the authenticating proxy "
        "(e.g. X-Forwarded-User); needs --trust-proxy",
    )
    s.add_argument(
        "--metrics-token",
        metavar="TOKEN",
        help="serve /metrics (Prometheus text) to requests with 'Authorization: Bearer TOKEN' "
        "(or POIMEN_METRICS_TOKEN); at least 16 characters, not the console token",
    )
    s.add_argument(
        "--proxy-is-the-only-way-in",
        action="store_true",
        help="allow --trust-user-header on an address beyond this machine: only when nothing "
        "but the proxy can reach the console, since anyone who can sends the header",
    )

    _diff_parser(sub, common)
    _agent_parsers(sub)
    _aid_parsers(sub, common)

    s = sub.add_parser("operators", help="the console's operators file: add, remove, list")
    ops: Any = s.add_subparsers(dest="action", required=True, metavar="ACTION")
    json_only = argparse.ArgumentParser(add_help=False)
    json_only.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    json_only.add_argument("--file", required=True, help="the operators file")
    o = ops.add_parser(
        "add", parents=[json_only], help="add an operator and print their new token, once"
    )
    o.add_argument("name", help="letters, digits and ._@- (at most 64)")
    o = ops.add_parser(
        "remove", parents=[json_only], help="remove an operator: their sessions end too"
    )
    o.add_argument("name")
    ops.add_parser("list", parents=[json_only], help="the operators' names")
    for name, parser in sub.choices.items():
        explain(parser, name)
    return p
