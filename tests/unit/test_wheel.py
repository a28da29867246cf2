"""The wheel holds the library and `poimen.testing`, and none of poimen's own verification: the
kill soak and the model check live in verification/ at the repository root (docs/design.md,
the module map), which nothing in the package imports.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "poimen"


@pytest.mark.timeout(300)
def test_the_wheel_holds_testing_and_no_soak_or_model_check(tmp_path: Path) -> None:
    # The build backend itself (hatchling, from pyproject.toml) decides what goes in.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, text=True, timeout=240,
    )
    (wheel,) = tmp_path.glob("poimen-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    modules = [n for n in names if n.endswith(".py")]
    assert "poimen/__init__.py" in modules
    for name in ("__init__", "__main__", "_provider", "_provider_client", "_faults", "_naive"):
        assert f"poimen/testing/{name}.py" in modules, name
    verification = [n for n in modules if "soak" in n or "model/" in n or "verification" in n]
    assert not verification, verification
    assert {n.split("/")[0] for n in modules} == {"poimen"}, sorted(modules)


def test_nothing_in_the_package_imports_verification() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] == "verification"]
    assert not found, found
