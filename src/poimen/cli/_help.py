"""Each subcommand's ``--help``: what it does, at more length than the command list, and
examples to copy."""

from __future__ import annotations

import argparse

#: A subcommand missing here fails tests/integration/test_cli_conventions.py.
_ABOUT: dict[str, tuple[str, tuple[str, ...]]] = {
    "status": (
        "Counts by state and tool, the oldest INDETERMINATE intent, unfinished intents and "
        "undelivered notifications. Exit 0, or 5 with --fail-if-indeterminate when any intent "
        "waits for an operator.",
        ("poimen status --db sqlite:///var/lib/agent/agent.db",
         "poimen status --fail-if-indeterminate   # in cron: alert on exit 5"),
    ),
    "intents": (
        "List intents, oldest first, filtered by state, tool and age; or find them by call-id "
        "prefix, newest first. An empty list exits 0 (--fail-if-empty: 1).",
        ("poimen intents --state INDETERMINATE", "poimen intents --tool ops.post_hook --since 2h",
         "poimen intents --call-id run-9/"),
    ),
    "show": (
        "One intent by intent id or call id: its arguments and result (secrets redacted), key "
        "or request id, attempts with their owners, events and notifications.",
        ("poimen show in_18ecb9c69b00a385316f789db0", "poimen show run-9/step-3 --json"),
    ),
    "resolve": (
        "Decide an INDETERMINATE intent after checking the world: --landed (the effect "
        "happened) or --not-landed. Terminal and audited; nothing is ever retried.",
        ('poimen resolve in_18ec... --landed --operator ana --reason "message is in #ops"',
         'poimen resolve run-9/step-3 --not-landed --operator ana --reason "no charge found"'),
    ),
    "abandon": (
        "Give up on a DISPATCHED intent whose worker will not come back: it becomes "
        "INDETERMINATE (abandoned), to resolve as usual. Audited.",
        ('poimen abandon in_18ec... --operator ana --reason "host decommissioned"',),
    ),
    "approve": (
        "Approve a call AWAITING_APPROVAL: the next kernel that resumes it dispatches it once, "
        "by its effect class. Audited.",
        ('poimen approve run-9/refund --operator ana --reason "customer confirmed"',),
    ),
    "reject": (
        "Reject a call AWAITING_APPROVAL: it becomes FAILED and nothing is sent. Audited.",
        ('poimen reject run-9/refund --operator ana --reason "duplicate request"',),
    ),
    "audit": (
        "The capability and sandbox denials: what a tool tried to write and why it was "
        "refused. An empty list exits 0 (--fail-if-found: 1 when there is any). With an "
        "action, the log's tamper-evident chain (docs/audit.md): verify, head, export, "
        "verify-export, keygen.",
        ("poimen audit --since 1d", "poimen audit --tool ops.post_hook --fail-if-found",
         "poimen audit verify"),
    ),
    "audit verify": (
        "Walk the log's hash chain and name the first row edited, deleted, inserted or "
        "reordered since it was written. With --head, a head published earlier must be a link "
        "of the chain, or the whole chain was rewritten. Read only; exit 6 on a finding.",
        ("poimen audit verify --db sqlite:///var/lib/agent/agent.db",
         "poimen audit verify --head 1842:9f2c...   # the head your cron job published"),
    ),
    "audit head": (
        "Print the chain's head (position and hash) to keep outside the log: a rewrite of the "
        "whole chain is caught by `audit verify --head` against it. Exit 1 if the log has no "
        "chain.",
        ("poimen audit head", "poimen audit head --json >> heads.jsonl"),
    ),
    "audit export": (
        "Write the chain as JSON Lines signed with an Ed25519 key, for an auditor to check "
        "offline. A chain that does not hold is not exported (exit 6). Needs poimen[audit].",
        ("poimen audit export --sign audit.key --out audit-2025-06.jsonl",),
    ),
    "audit verify-export": (
        "Check a signed export with the signer's public key, without the log: the signature "
        "over every byte, then the chain it carries. Exit 6 when either fails. Needs "
        "poimen[audit].",
        ("poimen audit verify-export audit-2025-06.jsonl --public-key audit.key.pub",),
    ),
    "audit keygen": (
        "Make an Ed25519 key pair for signing exports: the private key (owner-only) and "
        "KEYFILE.pub to hand to auditors. Never overwrites a file. Needs poimen[audit].",
        ("poimen audit keygen --out audit.key",),
    ),
    "recover": (
        "Run one recovery pass now, with the application's tool registrations (loaded from "
        "--app, imported from the current directory).",
        ("poimen recover --app myagent.tools:kernel",),
    ),
    "undo": (
        "Reverse the landed calls of a scope (a call-id prefix) by their undo tools, newest "
        "first; --dry-run shows the plan and changes nothing.",
        ("poimen undo --scope run-9/ --app myagent.tools:kernel --dry-run",
         'poimen undo --scope run-9/ --app myagent.tools:kernel --operator ana --reason "bad run"'),
    ),
    "migrate": (
        "Create the schema, or upgrade it to this poimen's version. No other command changes "
        "the schema. --transactional URL makes the marker table Transactional tools commit "
        "with, in that application database (they make it on first use otherwise).",
        ("poimen migrate --db postgresql://agent@db/agent",
         "poimen migrate --transactional postgresql://app@db/shop"),
    ),
    "prune": (
        "Remove settled intents and their history last changed longer ago than the window, a "
        "batch per transaction; with --archive each batch is appended (mode 0600) and synced "
        "first.",
        ("poimen prune --older-than 30d", "poimen prune --older-than 90d --archive pruned.jsonl",
         "poimen prune --older-than 30d --app myagent.tools:kernel  # keep key windows"),
    ),
    "verify": (
        "Check the log: integrity, schema version, constraints and triggers, rows that break "
        "them, unfinished intents whose owner is gone. Read only; exit 6 on a problem.",
        ("poimen verify --db sqlite:///var/lib/agent/agent.db",),
    ),
    "doctor": (
        "What a bug report needs: versions, platform, the store (secrets redacted) and its "
        "settings.",
        ("poimen doctor --json",),
    ),
    "console": (
        "Serve the web console: the Indeterminate queue, resolve and abandon with a reason, "
        "the audit, the diff of two runs.",
        ("poimen console --operators ops.tokens",
         "poimen console --host 0.0.0.0 --tls-cert cert.pem --tls-key key.pem --operators "
         "ops.tokens"),
    ),
    "diff": (
        "Compare two runs call by call: the same, arguments changed, tool changed, only in "
        "one. Exit 1 when they differ.",
        ("poimen diff --recording sqlite:///recorded.db --run sqlite:///replay.db",
         "poimen diff --recording sqlite:///agent.db --scope conv-41/ --run-scope conv-42/"),
    ),
    "crashtest": (
        "Run an agent's command once cleanly, then again for every tool call and crash point "
        "(before its request leaves, after the provider applied it), killing the whole process "
        "group there and restarting the same command. A provider stand-in counts every write in "
        "its own ledger; exit 1 when a write took effect twice or a call was left unfinished.",
        ("poimen crashtest -- python agent.py",
         "poimen crashtest -j 2 --junit crashtest.xml -- python -m myagent --scripted"),
    ),
    "scan": (
        "Read an agent's code (PydanticAI, OpenAI Agents SDK, LangChain/LangGraph, MCP, CrewAI) "
        "and list the tools that write to the outside without a poimen effect class, with the "
        "class each needs. Exit 1 on a finding at --fail-on or worse.",
        ("poimen scan src/", "poimen scan agent/ --sarif poimen.sarif --fail-on warning"),
    ),
    "evidence": (
        "Run a tool's evidence function for one INDETERMINATE call now (it runs by itself when "
        "the call becomes INDETERMINATE): the facts an operator needs to decide, recorded as "
        "an event and printed, never a decision. Needs the application (--app).",
        ("poimen evidence run-9/mail --app myagent.app:kernel",
         "poimen evidence in_18ec... --app myagent.app:kernel --json"),
    ),
    "operators": (
        "The console's operators file: each operator's own token, stored hashed.",
        ("poimen operators add ana --file ops.tokens", "poimen operators list --file ops.tokens"),
    ),
}


def explain(parser: argparse.ArgumentParser, name: str) -> None:
    about = _ABOUT.get(name)
    if about is None:
        return
    text, examples = about
    parser.description = text
    parser.epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
