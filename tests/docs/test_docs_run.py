"""Every code block of the documentation runs, or is a checked part of a program that runs.

The blocks of docs/**/*.md and README.md, by their fence's language:

- ``python`` whose body is ``--8<-- "examples/x.py"``: the whole example, included by MkDocs
  (pymdownx.snippets). Every ``examples/*.py`` runs here, offline, in a temporary directory
  (``examples/test_*.py`` under pytest).
- ``python`` after a line ``<!-- fragment of examples/x.py -->``: a part of that example. Its
  lines occur in the file in order and next to each other (indentation aside, and an import
  may name fewer names); a line ``...``, or one that starts ``# ...``, stands for lines of the
  file left out.
- ``python`` after ``<!-- example: examples/x.py -->``: that whole file, character for
  character (README.md: GitHub shows it without includes).
- any other ``python`` block is a complete program: it runs here as written.
- ``sh``, ``bash``, ``console``: commands a user types (in ``console``, the lines after ``$ ``).
  Each ``poimen`` command parses with the CLI's own parser, ``pip install 'poimen[x]'`` names
  extras of pyproject.toml, ``scripts/x`` and ``python examples/x.py`` exist.
- ``json`` and ``yaml`` parse; ``text`` is output or a diagram. A block without a language fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import fresh_postgres_database

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>[^\s`]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.M | re.S,
)
MARKER = re.compile(r"<!--\s*(?P<kind>fragment of|example:)\s*(?P<path>\S+)\s*-->")
INCLUDE = re.compile(r'^--8<--\s+"(?P<path>[^":]+)(?::(?P<section>[\w-]+))?"\s*$')
SHELL = {"sh", "bash", "console"}
TEXT = {"text"}
# The approval examples: a refund approved, one edited to half, one rejected, a large one
# approved by two operators; the provider's ledger took the first two, the edited one at its
# edited amount, and the large one.
REFUNDS_1_2_2_3 = (("refunds the provider took: 1", 1), ("refunds the provider took: 2", 2),
                   ("refunds the provider took: 3", 1),
                   "the provider's ledger: [{'cents': 25000, 'refund': 'o-1'}, "
                   "{'cents': 12500, 'refund': 'o-2'}, {'cents': 250000, 'refund': 'o-4'}]")
# What an example prints when it did what its page says (the provider's ledger is the witness).
# A text, or (a text, how many times exactly).
EXPECT: dict[str, tuple[str | tuple[str, int], ...]] = {
    "approval.py": ("a refund of 25.00: Completed", "a refund of 250.00: Pending (awaiting_approval)",
                    "refunds the provider took: 1", "approved by ann, then: Completed",
                    "refunds the provider took: 2"),
    "audit.py": ("verify: the audit chain holds: 3 rows up to position 3; head 3:",
                 'published: {"audit_head": {"at": ',
                 "export: the audit chain holds: 3 rows up to position 3",
                 "verify again: edited: the settled record of intent ",
                 "(COMPLETED) at chain position 3 does not match its hash",
                 "against the published head: False", "the export still: True"),
    "capability.py": ("charge through ctx.http: Completed, sent with key pk1_",
                      "charge through its own client: Failed", "denied: charge_raw",
                      "writes the provider took: 1; rows in the orders table: 1"),
    "dbos_approval.py": ("refund o-1: awaiting approval, call dbos/",
                         "approve by ann: {'cents': 25000", "edit by ann: {'cents': 12500",
                         "reject by ann: {'failed': 'rejected by ann: duplicate'}",
                         "approve by ann and bob: {'cents': 250000", *REFUNDS_1_2_2_3),
    "dbos_workflow.py": ("notify: {'sent': True", "then resolved: {'sent': True}",
                         "emails sent: 2"),
    "email_outage.py": ("the calls: 12 Indeterminate", "notified with evidence: message ",
                        "suggested: landed=True", "escalated to the pager: 12 overdue calls",
                        "would resolve 12; nothing was changed", "resolved 12 by ana",
                        "exit code 0", "resolved landed: 12"),
    "hooks.py": ("paged: send_email call run-7/step-1 is Indeterminate: unsafe_unknown_outcome",
                 "calls finished: run-7/step-1", "'indeterminate': 1"),
    "langgraph_agent.py": ('The tool said: {"sent": true', "emails sent: 1"),
    "langchain_approval.py": ("refund {'amount_cents': 25000, 'order_id': 'o-1'}: asked",
                              'approve by ann: the agent: The tool said: {"cents": 25000',
                              "An approver edited this call before it ran",
                              "reject by ann: the agent: The tool said: An operator rejected this "
                              "action, so it was not carried out: rejected by ann: duplicate. Do "
                              "not call it again unless the user asks you to.",
                              "2 distinct operators must approve, approved so far by ann",
                              'approved by ann and bob: the agent: The tool said: {"cents": 250000',
                              *REFUNDS_1_2_2_3),
    "langgraph_approval.py": ("refund {'amount_cents': 25000, 'order_id': 'o-1'}: Pending "
                              "(awaiting_approval)", "approve by ann: Completed",
                              "edit by ann: Completed", "reject by ann: Failed",
                              "refund_large: approvals {'needed': 2, 'given': ['ann']}",
                              "approved by ann and bob: Completed", *REFUNDS_1_2_2_3),
    "langgraph_pending.py": ("the thread stopped: book_courier is Pending (awaiting_deadline)",
                             "the tool node answered from the log: Completed",
                             'the agent: The tool said: {"entry_id": 1',
                             ("bookings the courier took: 1", 1)),
    "mcp_approval.py": ("refund o-1: completed", 'refund o-2: completed: {"cents": 12500',
                        "refund o-3: failed: An operator rejected this action, so it was not "
                        "carried out: rejected by ann: duplicate", "2 distinct operators must approve it; approved so "
                        "far by ann.", "refund_large o-4: completed", *REFUNDS_1_2_2_3),
    "mcp_import.py": ("crm.send_campaign: Completed", "the same call id again: Completed",
                      "crm.tag_contact    idempotent", "crm.send_campaign  unsafe",
                      "the CRM received: send_campaign {'tag': 'new'}\n"),
    "mcp_server.py": ("call it again (the answer was lost): completed",
                      "effects: 1 receipt"),
    "notify_operator.py": ("the call: Indeterminate",
                           "the webhook: indeterminate ops.post_hook unsafe_unknown_outcome",
                           "link: https://poimen-console.internal/intents/in_"),
    "openai_agents_approval.py": (
        "refund of o-1: the run stopped, ['refund'] awaiting approval",
        'approve by ann: the agent: The tool said: {"cents": 25000',
        'edit by ann: the agent: The tool said: {"cents": 12500',
        "reject by ann: the agent: The tool said: An operator rejected this action, so it was not "
        "carried out: rejected by ann",
        "refund_large: awaiting approval; bob approves",
        'approved by ann and bob: the agent: The tool said: {"cents": 250000',
        *REFUNDS_1_2_2_3,
    ),
    "openai_agents_agent.py": ("the agent: Bob knows his order shipped.", "emails sent: 1",
                               "the call in poimen's log: session-42/send_email/"),
    "openai_agents_pending.py": ("the run stopped: ['book_courier'] still Pending",
                                 'the agent: The tool said: {"entry_id": 1',
                                 ("bookings the courier took: 1", 1)),
    "postgres.py": ("api-1 calls: Completed(", "api-2 finds it in the log: Completed("),
    "pydantic_ai_agent.py": (
        "agent exit code -9; emails sent: 1",
        "Do NOT call it again",
        ("emails sent: 1", 2),
        ("emails sent: 2", 0),
        "An operator confirmed that the action took effect",
    ),
    "pydantic_ai_approval.py": (
        "refund of o-1: the run ended, ['refund'] awaiting approval",
        'approve by ann: the agent: The tool said: {"cents":25000',
        'edit by ann: the agent: The tool said: {"cents":12500',
        "reject by ann: the agent: The tool said: An operator rejected this action, so it was not "
        "carried out: rejected by ann",
        "refund_large: approvals {'needed': 2, 'given': ['ann']}",
        'approved by ann and bob: the agent: The tool said: {"cents":250000',
        *REFUNDS_1_2_2_3,
    ),
    "pydantic_ai_deferred.py": ("send_email is Indeterminate",
                                "the run resumed: Tool said: An operator confirmed",
                                "emails sent: 1"),
    "quickstart.py": ("charged: {", "charges in the provider's ledger: 1"),
    "sandbox_replay.py": (("effects in the world: 2", 3), "not carried out",
                          "1 same, 1 arguments changed, 0 tool changed",
                          '/to: "bob@example.com" -> "eve@example.com"',
                          "unsafe     send_email"),
    "temporal_approval.py": ("refund_large o-4: approvals {'given': ['ann'], 'needed': 2}",
                             "approve by ann: {'cents': 25000", "edit by ann: {'cents': 12500",
                             "reject by ann: {'failed': \"PoimenToolCallFailed",
                             "approve by ann and bob: {'cents': 250000", *REFUNDS_1_2_2_3),
    "temporal_activity.py": ("attempt 2: PoimenOutcomeUnknown", "emails sent: 1",
                             "before a decision: PoimenNotDecided",
                             "after the operator's decision: {'sent': True}"),
    "test_crash_my_tool.py": ("4 passed",),
    "transactional.py": ("first call: Completed {'ticket': 1}",
                         "the agent died after the commit (exit -9)",
                         "after recovery: Completed {'ticket': 2}",
                         "tickets in the shop's table: [(1, 'late parcel'), (2, 'wrong size')]"),
    "undo.py": ("2 undone (2 now), 1 without an undo", "{'refund_of': 'e-1'}",
                "{'cancel': 'e-2'}", "undo again: scope 'run-9/': 2 undone, 1 without"),
}
# Examples that only run under another command (a page shows `poimen crashtest -- python
# examples/x.py`): the named test runs them that way and checks what they print.
RUN_BY = {
    "shop_agent.py": "tests/crashtest/test_crashtest.py",
    "shop_agent_poimen.py": "tests/crashtest/test_crashtest.py",
}
# Nothing in an example may reach past this machine: HTTP through a proxy that does not exist.
OFFLINE = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
           "ALL_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    body: str
    marker: tuple[str, str] | None  # ("fragment of" | "example:", path)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    return [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.fullmatch(before.strip())
        body = "\n".join(line[len(m["indent"]):] for line in m["body"].splitlines())
        out.append(Block(page, text.count("\n", 0, m.start()) + 1, m["lang"], body + "\n",
                         (marker["kind"], marker["path"]) if marker else None))
    return out


ALL = [b for page in pages() for b in blocks(page)]
PYTHON = [b for b in ALL if b.lang == "python"]


def includes(block: Block) -> list[tuple[str, str | None]]:
    found = [INCLUDE.match(line.strip()) for line in block.body.splitlines() if line.strip()]
    return [(m["path"], m["section"]) for m in found if m]


def is_complete(block: Block) -> bool:
    return block.marker is None and not includes(block)


def run(cmd: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POIMEN_")} | OFFLINE
    env["PYTHONPATH"] = os.pathsep.join((str(ROOT / "src"), str(EXAMPLES)))
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# The examples run.


def example_ids() -> list[str]:
    return sorted(p.name for p in EXAMPLES.glob("*.py"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", example_ids())
def test_each_example_runs_offline(name: str, tmp_path: Path) -> None:
    if name in RUN_BY:
        assert f"examples/{name}" in (ROOT / RUN_BY[name]).read_text(encoding="utf-8")
        return
    assert name in EXPECT, f"say in EXPECT what {name} prints when it did what its page says"
    path = EXAMPLES / name
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)] if (
        name.startswith("test_")) else [sys.executable, str(path)]
    with contextlib.ExitStack() as stack:
        if name == "postgres.py":  # the one example that needs a server: a database of its own
            cmd.append(stack.enter_context(fresh_postgres_database()))
        done = run(cmd, tmp_path)
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    for expected in EXPECT[name]:
        text, times = expected if isinstance(expected, tuple) else (expected, None)
        seen = done.stdout.count(text)
        assert seen == times if times is not None else seen > 0, (
            f"{name} printed {text!r} {seen} times:\n{done.stdout}"
        )


def test_the_temporal_workflow_passes_a_workers_sandbox(tmp_path: Path) -> None:
    # No Temporal server runs here: the workflow is checked as a worker checks it before it
    # runs one (its module imported again in the sandbox, every import restricted).
    check = (
        "import asyncio, temporal_activity as m\n"
        "from temporalio import workflow\n"
        "from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner\n"
        "async def main():\n"
        "    defn = workflow._Definition.must_from_class(m.Notify)\n"
        "    SandboxedWorkflowRunner().prepare_workflow(defn)\n"
        "asyncio.run(main())\n"
        "print('sandbox ok')\n"
    )
    done = run([sys.executable, "-c", check], tmp_path, timeout=120)
    assert done.returncode == 0 and "sandbox ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", [b for b in PYTHON if is_complete(b)], ids=lambda b: b.where)
def test_each_complete_python_block_runs(block: Block, tmp_path: Path) -> None:
    program = tmp_path / "block.py"
    program.write_text(block.body, encoding="utf-8")
    done = run([sys.executable, str(program)], tmp_path)
    assert done.returncode == 0, (
        f"{block.where} does not run as written (exit {done.returncode}); include it from an "
        f"example or mark it as a fragment of one:\n{done.stderr[-3000:]}"
    )


# The parts of examples are in their examples.


IMPORT = re.compile(r"from (\S+) import ([\w, ]+)")


def same_line(part: str, line: str) -> bool:
    """A line of a fragment is the example's line; an import may name fewer of its names."""
    if part == line:
        return True
    a, b = IMPORT.fullmatch(part), IMPORT.fullmatch(line)
    return bool(a and b and a[1] == b[1]
                and {n.strip() for n in a[2].split(",")} <= {n.strip() for n in b[2].split(",")})


def missing_lines(fragment: str, source: str) -> str | None:
    """None if the fragment's lines occur in `source` in order, each run of them next to each
    other; else the first run of lines that does not."""
    lines = [s for s in (line.strip() for line in source.splitlines()) if s]
    runs: list[list[str]] = [[]]
    for line in fragment.splitlines():
        s = line.strip()
        if s == "..." or s.startswith("# ..."):
            runs.append([])
        elif s:
            runs[-1].append(s)
    at = 0
    for chunk in (r for r in runs if r):
        n = len(chunk)
        found = next((i for i in range(at, len(lines) - n + 1)
                      if all(map(same_line, chunk, lines[i : i + n]))), None)
        if found is None:
            return "\n".join(chunk)
        at = found + n
    return None


def example(block: Block, path: str) -> Path:
    target = (ROOT / path).resolve()
    assert target.parent == EXAMPLES and target.suffix == ".py", (
        f"{block.where}: {path} is not a file of examples/"
    )
    assert target.is_file(), f"{block.where}: {path} does not exist"
    return target


@pytest.mark.parametrize("block", [b for b in PYTHON if not is_complete(b)], ids=lambda b: b.where)
def test_each_python_part_is_in_its_example(block: Block) -> None:
    if block.marker is None:
        for path, section in includes(block):
            source = example(block, path).read_text(encoding="utf-8")
            if section is not None:
                assert f"--8<-- [start:{section}]" in source, f"{block.where}: no {path}:{section}"
        others = [line for line in block.body.splitlines()
                  if line.strip() and not INCLUDE.match(line.strip())]
        assert others == [], f"{block.where}: an include and code in one block"
        return
    kind, path = block.marker
    source = example(block, path).read_text(encoding="utf-8")
    if kind == "example:":
        assert block.body == source, f"{block.where} is not a copy of {path}: copy it again"
    else:
        missing = missing_lines(block.body, source)
        assert missing is None, f"{block.where}: not in {path}:\n{missing}"


def test_the_fragment_check_finds_a_changed_line() -> None:
    source = "import os\n\ndef f(x):\n    y = x + 1\n    return y\n"
    assert missing_lines("def f(x):\n    y = x + 1\n", source) is None
    assert missing_lines("import os\n...\nreturn y\n", source) is None
    assert missing_lines("def f(x):\n    y = x + 2\n", source) == "def f(x):\ny = x + 2"
    assert missing_lines("import os\nreturn y\n", source) == "import os\nreturn y"  # not adjacent
    assert missing_lines("return y\n...\nimport os\n", source) == "import os"  # out of order
    imports = "from a import b, c, d\n"
    assert missing_lines("from a import d, b\n", imports) is None
    assert missing_lines("from a import b, e\n", imports) == "from a import b, e"


# Shell blocks: what a user types is a command that exists.


def commands(block: Block) -> list[list[str]]:
    """The simple commands of a shell block: words (a leading `VAR=value` kept), without
    redirections, split at `|`, `||`, `&&` and `;`."""
    text = block.body.splitlines()
    lines: list[str] = []
    for i, line in enumerate(text):
        if block.lang == "console" and not line.startswith("$ "):
            continue  # output
        cmd = line.removeprefix("$ ") if block.lang == "console" else line
        while cmd.endswith("\\") and i + 1 < len(text):  # continued on the next line
            i += 1
            cmd = cmd[:-1] + " " + text[i].strip()
        lines.append(cmd)
    out: list[list[str]] = []
    for line in lines:
        line = re.sub(r"^(\S+\s+){5}(?=poimen )", "", line.strip())  # a crontab line
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = "#"
        words: list[str] = []
        skip = False
        for tok in [*lex, ";"]:
            if skip:
                skip = False
            elif tok in ("|", "||", "&&", ";"):
                if [w for w in words if not ENV_WORD.fullmatch(w)]:
                    out.append(words)
                words = []
            elif tok in (">", ">>", "<", "2>", "&>"):
                skip = True
            else:
                words.append(tok)
    return out


EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
# Commands of the shell's own, or a user's stand-in (a cron job's alert).
OTHER_COMMANDS = {"echo", "export", "cd", "notify-ops"}


ENV_WORD = re.compile(r"[A-Z_][A-Z0-9_]*=.*")


def command_problem(words: list[str]) -> str | None:
    from poimen.cli._parser import _parser

    env = {}
    while ENV_WORD.fullmatch(words[0]):  # `POIMEN_OPERATOR=ann poimen ...`: the CLI reads it
        key, _, value = words[0].partition("=")
        env[key] = value
        words = words[1:]
    name, args = words[0], words[1:]
    if name == "poimen":
        with pytest.MonkeyPatch.context() as mp:
            for key, value in env.items():
                mp.setenv(key, value)
            parser = _parser()
        parsers = [parser]
        for parser in parsers:  # the docs spell options out: no abbreviations
            parser.allow_abbrev = False
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    parsers.extend(action.choices.values())
        try:
            parsers[0].parse_args(args)
        except SystemExit as exc:
            return f"poimen {shlex.join(args)}: the CLI refuses it (exit {exc.code})"
        return None
    if name in ("pip", "pip3") and args[:1] == ["install"]:
        asked = [e for w in args[1:] for m in re.finditer(r"^poimen\[([^\]]+)\]$", w)
                 for e in m[1].split(",")]
        if not asked:
            return f"{shlex.join(words)}: install poimen's extras, nothing else"
        unknown = sorted(set(asked) - EXTRAS)
        return f"no extra {unknown} in pyproject.toml" if unknown else None
    if name.startswith("scripts/"):
        script = ROOT / name
        return None if script.is_file() and os.access(script, os.X_OK) else f"no {name}"
    if name in ("python", "python3"):
        return None if (ROOT / args[0]).is_file() else f"no {args[0]}"
    if name in OTHER_COMMANDS:
        return None
    return f"unknown command {name!r}"


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in SHELL], ids=lambda b: b.where)
def test_each_shell_command_exists_as_written(block: Block) -> None:
    found = commands(block)
    assert found, f"{block.where}: no command in a shell block"
    problems = [p for p in map(command_problem, found) if p]
    assert problems == [], f"{block.where}: {problems}"


def test_the_shell_reader_splits_a_cron_line() -> None:
    cron = Block(ROOT / "README.md", 1, "sh",
                 '*/5 * * * *  poimen status --db "$DB" --json > /dev/null || notify-ops\n', None)
    assert commands(cron) == [["poimen", "status", "--db", "$DB", "--json"], ["notify-ops"]]
    session = Block(ROOT / "README.md", 1, "console",
                    "$ X=1 poimen show a \\\n    --json\nout put\n$ echo $?\n", None)
    assert commands(session) == [["X=1", "poimen", "show", "a", "--json"], ["echo", "$?"]]
    assert command_problem(["poimen", "status", "--no-such-option"]) is not None
    assert command_problem(["poimen", "status", "--fail-if-indet"]) is not None  # abbreviated
    assert command_problem(["pip", "install", "poimen[no-such-extra]"]) is not None
    # An operator named by the environment, as the CLI allows; without it --operator is needed.
    abandon = ["poimen", "abandon", "in_1", "--reason", "r"]
    assert command_problem(["POIMEN_OPERATOR=ann", *abandon]) is None
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("POIMEN_OPERATOR", raising=False)
        assert command_problem(abandon) is not None


# Data blocks parse; every block says what it is.


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in ("json", "yaml")],
                         ids=lambda b: b.where)
def test_each_data_block_parses(block: Block) -> None:
    if block.lang == "json":
        json.loads(block.body)
    else:
        import yaml

        yaml.safe_load(block.body)


def test_every_block_names_its_language() -> None:
    known = {"python", "json", "yaml"} | SHELL | TEXT
    unnamed = [f"{b.where} ({b.lang or 'no language'})" for b in ALL if b.lang not in known]
    assert unnamed == [], "tag each block: python, sh, console, json, yaml or text"


def test_the_docs_have_blocks_of_every_kind() -> None:
    # The reader above must not miss blocks: a fence it cannot parse would skip a page's code.
    fences = sum(page.read_text(encoding="utf-8").count("```") for page in pages())
    assert fences == 2 * len(ALL)
    assert any(includes(b) for b in PYTHON) and any(b.marker for b in PYTHON)
