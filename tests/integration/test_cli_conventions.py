"""The `poimen` command behaves as command-line tools are expected to: --version, python -m,
a description and examples under each subcommand's --help, required options shown as
required, empty listings exit 0 (with --fail-if-... flags for scripts), usage errors exit 2."""

from __future__ import annotations

import importlib.metadata
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from poimen import Kernel
from poimen.cli._help import _ABOUT
from poimen.cli._parser import _parser
from tests.integration.operator_app import ROOT, poimen
from tests.integration.test_retention import filled


def test_version_and_python_dash_m() -> None:
    version = importlib.metadata.version("poimen")
    r = poimen("--version")
    assert (r.returncode, r.stdout.strip()) == (0, f"poimen {version}"), r.stderr
    m = subprocess.run(
        [sys.executable, "-m", "poimen", "--version"], cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )
    assert (m.returncode, m.stdout.strip()) == (0, f"poimen {version}"), m.stderr
    usage = subprocess.run(
        [sys.executable, "-m", "poimen"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert usage.returncode == 2 and "COMMAND" in usage.stderr


def _subcommands() -> list[str]:
    sub = next(a for a in _parser()._actions if a.dest == "cmd")
    return sorted(sub.choices)  # type: ignore[arg-type]


def _actions(name: str) -> list[str]:
    """A subcommand's own subcommands (`poimen audit verify`), as "audit verify"."""
    sub = next(a for a in _parser()._actions if a.dest == "cmd")
    parser = sub.choices[name]  # type: ignore[index]
    found = [a for a in parser._actions if a.dest == "audit_cmd"]
    return sorted(f"{name} {n}" for a in found for n in a.choices)  # type: ignore[union-attr]


@pytest.mark.parametrize("name", _subcommands() + _actions("audit"))
def test_every_subcommand_helps_with_a_description_and_examples(name: str) -> None:
    assert name in _ABOUT, f"cli/_help.py _ABOUT says nothing of {name!r}"
    r = poimen(*name.split(), "--help")
    assert r.returncode == 0, r.stderr
    _usage, _, rest = r.stdout.partition("\n\n")
    description = rest.split("\n\n")[0]
    assert len(description) > 40 and not description.startswith(("positional", "options")), (
        r.stdout
    )
    examples = r.stdout.split("examples:\n", 1)[1].splitlines()
    assert examples and all(e.startswith(f"  poimen {name}") for e in examples), r.stdout


@pytest.mark.parametrize("name", ["resolve", "abandon", "approve", "reject"])
def test_the_operator_is_shown_required_unless_the_environment_names_one(
    name: str, store_url: str
) -> None:
    r = poimen(name, "--help")
    usage = " ".join(r.stdout.split("\n\n")[0].split())
    if name == "resolve":  # `resolve --filter ... --dry-run` decides nothing: no operator
        assert "[--operator OPERATOR]" in usage, usage
        assert "not for --dry-run" in " ".join(r.stdout.split()), r.stdout
    else:
        assert "--operator OPERATOR" in usage and "[--operator" not in usage, usage
    Kernel(store_url).close()  # resolve checks the operator once it has the log to decide in
    missing = poimen(name, "x", "--reason", "checked", *(["--landed"] if name == "resolve" else []),
                     db=store_url)
    assert missing.returncode == 2 and "--operator" in missing.stderr, missing.stderr
    given = poimen(name, "--help", POIMEN_OPERATOR="ana")
    assert "[--operator OPERATOR]" in " ".join(given.stdout.split()), given.stdout


def test_empty_listings_exit_0_and_the_fail_flags_say_otherwise(
    store_url: str, tmp_path: Path
) -> None:
    Kernel(store_url).close()  # an empty, healthy log
    for args in (("intents",), ("intents", "--call-id", "nope/"), ("audit",)):
        r = poimen(*args, db=store_url)
        assert r.returncode == 0 and "match" in r.stdout, (args, r.stdout, r.stderr)
        j = poimen(*args, "--json", db=store_url)
        assert j.returncode == 0 and json.loads(j.stdout) == [], (args, j.stdout)
    assert poimen("intents", "--fail-if-empty", db=store_url).returncode == 1
    assert poimen("audit", "--fail-if-found", db=store_url).returncode == 0
    ops = tmp_path / "ops.tokens"
    ops.write_text("")
    r = poimen("operators", "list", "--file", str(ops))
    assert r.returncode == 0 and "no operators" in r.stdout, r.stderr

    k, _ = filled(store_url)  # one denial, some intents
    k.close()
    assert poimen("audit", "--fail-if-found", db=store_url).returncode == 1
    assert poimen("intents", "--fail-if-empty", db=store_url).returncode == 0


def test_prune_into_a_missing_folder_is_a_usage_error_and_prunes_nothing(
    store_url: str, tmp_path: Path
) -> None:
    k, _ = filled(store_url)
    before = len(k.store.list_intents(limit=1000))
    k.close()
    archive = tmp_path / "no" / "such" / "folder" / "a.jsonl"
    r = poimen("prune", "--older-than", "30d", "--archive", str(archive), db=store_url)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "archive" in r.stderr and "nothing was pruned" in r.stderr
    with Kernel(store_url) as k2:
        assert len(k2.store.list_intents(limit=1000)) == before


def test_the_prune_archive_is_made_owner_only(store_url: str, tmp_path: Path) -> None:
    k, _ = filled(store_url)
    k.close()
    archive = tmp_path / "a.jsonl"
    old = os.umask(0o022)
    try:
        r = poimen("prune", "--older-than", "30d", "--archive", str(archive), db=store_url)
    finally:
        os.umask(old)
    assert r.returncode == 0, r.stderr
    assert "hunter2" not in r.stdout
    assert stat.S_IMODE(archive.stat().st_mode) == 0o600


@pytest.mark.parametrize("batch", ["0", "10001", str(10**23)])
def test_a_prune_batch_out_of_bounds_is_a_usage_error(store_url: str, batch: str) -> None:
    k, _ = filled(store_url)
    before = len(k.store.list_intents(limit=1000))
    k.close()
    r = poimen("prune", "--older-than", "30d", "--batch", batch, db=store_url)
    assert r.returncode == 2 and "batch must be a whole number from 1 to 10000" in r.stderr, (
        r.returncode, r.stderr,
    )
    with Kernel(store_url) as k2:
        assert len(k2.store.list_intents(limit=1000)) == before
