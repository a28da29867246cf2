"""`poimen scan`: walk the paths, find the tools, and report those that write to the outside
without a poimen effect class, as text, JSON or SARIF 2.1.0 (GitHub code scanning)."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from poimen.errors import PoimenError
from poimen.operator._health import _version
from poimen.scan._finder import Tool, find_tools

_SKIP_DIRS = frozenset({".git", ".hg", ".svn", ".venv", "venv", "env", "node_modules",
                        "__pycache__", "site-packages", ".tox", ".nox", ".mypy_cache",
                        ".ruff_cache", ".pytest_cache", "build", "dist"})
_LEVELS = {"error": 2, "warning": 1}
RULES = (
    ("POIMEN001", "unguarded-tool-write", "error",
     "A tool writes to the outside without a poimen effect class",
     "Killed between its effect and the agent recording the answer, the tool is run again on "
     "restart and the effect happens twice. Register it with poimen under the effect class the "
     "finding suggests (docs/crash-testing.md)."),
    ("POIMEN002", "possible-unguarded-tool-write", "warning",
     "A tool may write to the outside without a poimen effect class",
     "A call in the tool looks like a write by its name (the scan cannot tell its receiver). "
     "If it is one, register the tool with poimen under the suggested effect class."),
)


class ScanError(PoimenError):
    """A path to scan does not exist."""


@dataclass
class ScanReport:
    """The tools found, and the files that could not be read."""

    files: int = 0
    tools: list[Tool] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why)

    @property
    def findings(self) -> list[Tool]:
        """Tools that write to the outside without poimen, in path and line order."""
        return [t for t in self.tools if t.level is not None]

    def fails(self, fail_on: str) -> bool:
        """Whether a finding at `fail_on` ("error", "warning") or worse exists; "never": no."""
        if fail_on == "never":
            return False
        return any(_LEVELS[t.level or ""] >= _LEVELS[fail_on] for t in self.findings)

    def to_json(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "findings": [_tool_json(t) for t in self.findings],
            "tools": [_tool_json(t) for t in self.tools],
            "skipped": [{"path": p, "why": w} for p, w in self.skipped],
        }

    def text(self) -> str:
        lines = []
        for t in self.findings:
            assert t.suggestion is not None
            lines.append(f"{t.path}:{t.line}: {t.level}: tool {t.name} ({t.framework}) writes "
                         "to the outside without a poimen effect class")
            for w in t.writes:
                via = f" (in {w.via})" if w.via else ""
                lines.append(f"    line {w.line}: {w.what}{via}")
            lines += [f"    suggest: {t.suggestion.code}", f"      {t.suggestion.why}"]
        errors = sum(1 for t in self.findings if t.level == "error")
        under = sum(1 for t in self.tools if t.under_poimen)
        reads = sum(1 for t in self.tools if not t.under_poimen and not t.writes)
        lines.append(
            f"{_n(len(self.tools), 'tool')} in {_n(self.files, 'file')}: {len(self.findings)} "
            f"write to the outside without poimen ({_n(errors, 'error')}, "
            f"{_n(len(self.findings) - errors, 'warning')}), {under} under poimen, "
            f"{reads} read-only")
        lines += [f"skipped {p}: {w}" for p, w in self.skipped]
        return "\n".join(lines)

    def sarif(self) -> dict[str, Any]:
        """SARIF 2.1.0: one result per finding, its writes as related locations."""
        rules = [{
            "id": rid, "name": name, "shortDescription": {"text": short},
            "fullDescription": {"text": full}, "help": {"text": full},
            "defaultConfiguration": {"level": level},
        } for rid, name, level, short, full in RULES]
        results = []
        for t in self.findings:
            assert t.suggestion is not None
            index = 0 if t.level == "error" else 1
            results.append({
                "ruleId": RULES[index][0], "ruleIndex": index, "level": t.level,
                "message": {"text": f"Tool {t.name} ({t.framework}) writes to the outside "
                            f"({', '.join(sorted({w.what for w in t.writes}))}) without a "
                            f"poimen effect class. Suggested: {t.suggestion.code}: "
                            f"{t.suggestion.why}"},
                "locations": [_location(t.path, t.line, t.column)],
                "relatedLocations": [
                    {"id": i, **_location(t.path, w.line, w.column),
                     "message": {"text": w.what + (f" (in {w.via})" if w.via else "")}}
                    for i, w in enumerate(t.writes)],
                "properties": {"framework": t.framework, "tool": t.name,
                               "suggestedEffect": t.suggestion.effect},
            })
        notes = [{"level": "warning", "message": {"text": f"skipped {p}: {w}"}}
                 for p, w in self.skipped]
        return {
            "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
            "version": "2.1.0",
            "runs": [{
                "tool": {"driver": {"name": "poimen scan", "version": _version("poimen") or "unknown",
                                    "rules": rules}},
                "originalUriBaseIds": {"%SRCROOT%": {"uri": Path.cwd().as_uri() + "/"}},
                "invocations": [{"executionSuccessful": True,
                                 "toolExecutionNotifications": notes}],
                "columnKind": "unicodeCodePoints",
                "results": results,
            }],
        }


def _n(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _location(path: str, line: int, column: int) -> dict[str, Any]:
    return {"physicalLocation": {
        "artifactLocation": {"uri": path, "uriBaseId": "%SRCROOT%"},
        "region": {"startLine": line, "startColumn": column},
    }}


def _tool_json(t: Tool) -> dict[str, Any]:
    return {
        "path": t.path, "line": t.line, "name": t.name, "framework": t.framework,
        "under_poimen": t.under_poimen, "level": t.level,
        "writes": [{"line": w.line, "what": w.what, "level": w.level, "via": w.via}
                   for w in t.writes],
        "suggestion": None if t.suggestion is None or t.level is None
        else t.suggestion.to_json(),
    }


def scan(paths: Sequence[str | os.PathLike[str]], *, exclude: Iterable[str] = ()) -> ScanReport:
    """Scan files and directories (recursively, `*.py`); `exclude` globs skip paths."""
    patterns = list(exclude)
    report = ScanReport()
    for path in _files(paths, patterns):
        shown = _shown(path)
        try:
            source = path.read_text(encoding="utf-8")
            tools = find_tools(shown, source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError) as exc:
            report.skipped.append((shown, f"{type(exc).__name__}: {exc}"))
            continue
        report.files += 1
        report.tools += tools
    return report


def _files(paths: Sequence[str | os.PathLike[str]], patterns: list[str]) -> Iterator[Path]:
    seen: set[Path] = set()
    for given in paths:
        root = Path(given)
        if not root.exists():
            raise ScanError(f"no such file or directory: {str(given)!r}")
        found = [root] if root.is_file() else sorted(_walk(root, patterns))
        for f in found:
            if f.resolve() not in seen and not _excluded(f, patterns):
                seen.add(f.resolve())
                yield f


def _walk(root: Path, patterns: list[str]) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")
                             and not _excluded(Path(dirpath, d), patterns))
        for name in filenames:
            if name.endswith(".py"):
                yield Path(dirpath, name)


def _excluded(path: Path, patterns: list[str]) -> bool:
    text = path.as_posix()
    return any(fnmatch.fnmatch(text, p) or fnmatch.fnmatch(path.name, p) for p in patterns)


def _shown(path: Path) -> str:
    """Relative to the working directory where it is under it (as code scanning wants)."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.resolve().as_posix()
