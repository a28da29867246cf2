"""The Python form of trybuild: snippets that must fail `mypy --strict`, with the message."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HEADER = """\
from poimen import (
    Caps, Idempotent, KeyDerivation, Queryable, ToolRegistration, Transactional, Unsafe,
)
"""

CASES = {
    "idempotent_without_key": (
        "Idempotent()",
        r'Missing named argument "key" for "Idempotent"',
    ),
    "queryable_without_lookup": (
        "Queryable()",
        r'Missing named argument "lookup" for "Queryable"',
    ),
    "transactional_without_database": (
        "Transactional()",
        r'Missing named argument "database" for "Transactional"',
    ),
    "registration_without_effects": (
        'ToolRegistration(id="t", caps=Caps(), timeout=1.0)',
        r'Missing named argument "effects" for "ToolRegistration"',
    ),
    "effects_not_a_class": (
        'ToolRegistration(id="t", effects="idempotent", caps=Caps(), timeout=1.0)',
        r'Argument "effects" to "ToolRegistration" has incompatible type "str"',
    ),
}

PASSES = """\
def lookup(request_id: str) -> "NotLanded":
    return NotLanded()

from poimen import NotLanded
regs = [
    ToolRegistration(id="a", effects=Idempotent(key=KeyDerivation.fields("x")), caps=Caps(),
                     timeout=1.0),
    ToolRegistration(id="b", effects=Queryable(lookup=lookup), caps=Caps(), timeout=1.0),
    ToolRegistration(id="c", effects=Unsafe(), caps=Caps(), timeout=1.0),
    ToolRegistration(id="d", effects=Transactional(database="sqlite:///app.db"), caps=Caps(),
                     timeout=1.0),
]
"""


def _mypy(tmp_path: Path, name: str, body: str) -> subprocess.CompletedProcess[str]:
    src = tmp_path / f"{name}.py"
    src.write_text(HEADER + textwrap.dedent(body) + "\n")
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir",
         str(tmp_path / ".mypy_cache"), "--config-file", "/dev/null", str(src)],
        capture_output=True, text=True, timeout=300,
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_snippet_fails_mypy_strict_naming_the_field(tmp_path: Path, name: str) -> None:
    snippet, expected = CASES[name]
    result = _mypy(tmp_path, name, f"x = {snippet}\n")
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(expected, result.stdout), result.stdout
    # Exactly one error: the test cannot pass because of an unrelated failure.
    assert result.stdout.count(": error:") == 1, result.stdout


def test_well_formed_registrations_pass_mypy_strict(tmp_path: Path) -> None:
    result = _mypy(tmp_path, "passes", PASSES)
    assert result.returncode == 0, result.stdout + result.stderr


TYPED_TOOL = """\
from poimen import Kernel, ToolContext

kernel = Kernel("sqlite:///typed.db")

@kernel.tool(id="charge", effects=Idempotent(key=KeyDerivation.fields("order_id")), caps=Caps(),
             timeout=1.0)
def charge(ctx: ToolContext, order_id: str, amount_cents: int) -> dict[str, int]:
    return {"cents": amount_cents}
"""


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ('charge.call("c1", order_idd="o", amount_cents=1)', r'Unexpected keyword argument "order_idd"'),
        ('charge.call("c1", order_id="o", amount_cents="1")', r'Argument "amount_cents" .* "str"'),
        ('charge.call(order_id="o", amount_cents=1)', r"Too few arguments|Missing positional"),
    ],
)
def test_a_typed_call_is_checked_against_the_tools_signature(
    tmp_path: Path, call: str, expected: str
) -> None:
    result = _mypy(tmp_path, "typed_bad", TYPED_TOOL + f"out = {call}\n")
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(expected, result.stdout), result.stdout
    assert result.stdout.count(": error:") == 1, result.stdout


def test_a_typed_call_and_the_function_itself_pass(tmp_path: Path) -> None:
    body = TYPED_TOOL + (
        "from poimen import Outcome\n"
        'out: Outcome = charge.call("c1", order_id="o", amount_cents=1)\n'
        "def direct(ctx: ToolContext) -> dict[str, int]:\n"
        '    return charge(ctx, order_id="o", amount_cents=1)\n'
    )
    result = _mypy(tmp_path, "typed_ok", body)
    assert result.returncode == 0, result.stdout + result.stderr
