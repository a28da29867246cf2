"""What `poimen crashtest` found: one case per call and crash point, as a table, JSON and
JUnit XML (one test case per call and crash point, in the Jenkins/Surefire dialect that CI
systems read)."""

from __future__ import annotations

import re
import socket
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any

from poimen._core.suggest import Suggestion

POINTS = ("before", "after")
KILLED = {
    "before": "before the request left",
    "after": "after the provider applied it, before the agent recorded the answer",
}
# A case passes only when "ok".
STATUSES = ("ok", "double", "unfinished", "restart_failed", "not_reached")
_RESULT = {"ok": "ok", "double": "DOUBLE", "unfinished": "UNFINISHED",
           "restart_failed": "RESTART FAILED", "not_reached": "NOT REACHED"}


@dataclass(frozen=True, slots=True)
class Double:
    """A write whose content took effect more often than in the clean run."""

    write: str  # its content on one line
    effects: int
    clean: int
    suggestion: Suggestion | None  # without poimen: the class it needs

    def to_json(self) -> dict[str, Any]:
        return {"write": self.write, "effects": self.effects, "clean": self.clean,
                "suggestion": None if self.suggestion is None else self.suggestion.to_json()}


@dataclass(frozen=True, slots=True)
class Case:
    """One run killed at one call's crash point, then restarted."""

    number: int
    call: str
    point: str  # "before" | "after"
    status: str
    detail: str = ""
    # Effects after the restart, and in the clean run: without poimen the killed write's,
    # with poimen all calls' together.
    effects: int | None = None
    clean: int | None = None
    state: str | None = None  # with poimen: the killed call's state after recovery
    doubles: tuple[Double, ...] = ()
    unfinished: tuple[str, ...] = ()
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict[str, Any]:
        return {"case": self.number, "call": self.call, "killed": self.point,
                "status": self.status, "detail": self.detail, "effects": self.effects,
                "clean_effects": self.clean, "state": self.state,
                "doubles": [d.to_json() for d in self.doubles],
                "unfinished": list(self.unfinished), "seconds": round(self.seconds, 3)}


@dataclass
class Report:
    """The crash test of one command."""

    command: list[str]
    mode: str  # "poimen": kill points from poimen's crash points; "witness": from the witness
    calls: int = 0
    cases: list[Case] = field(default_factory=list)
    seconds: float = 0.0
    workdir: str | None = None  # kept with --keep
    tls_refused: int = 0  # HTTPS requests the witness refused (it cannot see inside TLS)
    started: float = field(default_factory=time.time)

    def ok(self) -> bool:
        """No double effect, no call left unfinished, every case run to its end."""
        return bool(self.cases) and all(c.ok for c in self.cases)

    def to_json(self) -> dict[str, Any]:
        return {"command": self.command, "mode": self.mode, "ok": self.ok(),
                "calls": self.calls, "cases": [c.to_json() for c in self.cases],
                "seconds": round(self.seconds, 3), "workdir": self.workdir,
                "tls_refused": self.tls_refused}

    def table(self) -> str:
        poimen = self.mode == "poimen"
        head = ("call", "killed", "state after recovery" if poimen else "",
                "effects, all calls" if poimen else "effects", "result")
        rows = [head]
        for c in self.cases:
            effects = "-" if c.effects is None else (
                f"{c.effects}" if c.effects == c.clean else f"{c.effects} (clean run: {c.clean})")
            rows.append((c.call, c.point, c.state or "", effects, _RESULT[c.status]))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        how = ("with poimen: each call stopped at poimen's own crash points" if poimen else
               "without poimen: each write stopped at the witness")
        lines = [f"poimen crashtest: {' '.join(self.command)}",
                 f"{how}; {_n(self.calls, 'call')}, {_n(len(self.cases), 'case')}, "
                 f"{self.seconds:.1f}s", ""]
        lines += ["  ".join(f"{cell:{w}}" for cell, w in zip(r, widths, strict=True) if w)
                  .rstrip() for r in rows]
        lines += ["", "killed  before: " + KILLED["before"], "        after:  " + KILLED["after"]]
        failing = [c for c in self.cases if not c.ok]
        if failing:
            lines += ["", "what went wrong:"]
            for c in failing:
                lines.append(f"  {c.call} killed {c.point}: {_why(c)}")
        needs = _needs(self.cases)
        if needs:
            lines += ["", "the class poimen would need for each call that took effect twice:"]
            for write, s in needs.items():
                lines += [f"  {write}", f"      {s.code}", f"      {s.why}"]
        if self.tls_refused:
            lines += ["", f"note: {self.tls_refused} HTTPS requests were refused: the witness "
                      "cannot see inside TLS; point those tools at $POIMEN_CRASHTEST_URL"]
        doubles = sum(1 for c in self.cases if c.status == "double")
        lines.append("")
        if self.ok():
            lines.append(f"ok: no call took effect twice in {len(self.cases)} cases"
                         + (", none was left unfinished" if poimen else ""))
        else:
            lines.append(f"FAILED: {len(failing)} of {len(self.cases)} cases "
                         f"({doubles} with a double effect)")
        if self.workdir:
            lines.append(f"each case's output, ledger and state are kept in {self.workdir}")
        return "\n".join(lines)

    def junit(self) -> str:
        """JUnit XML: one test case per call and crash point."""
        failures = sum(1 for c in self.cases if c.status != "ok" and c.status != "not_reached")
        errors = sum(1 for c in self.cases if c.status == "not_reached")
        common = {"tests": str(len(self.cases)), "failures": str(failures),
                  "errors": str(errors), "time": f"{self.seconds:.3f}"}
        root = ET.Element("testsuites", {"name": "poimen crashtest", **common})
        suite = ET.SubElement(root, "testsuite", {
            "name": f"poimen crashtest ({self.mode})", **common, "skipped": "0",
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.started)),
            "hostname": socket.gethostname(),
        })
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", {"name": "command", "value": _xml(" ".join(self.command))})
        for c in self.cases:
            tc = ET.SubElement(suite, "testcase", {
                "classname": f"crashtest.{self.mode}", "name": _xml(f"{c.call} killed {c.point}"),
                "time": f"{c.seconds:.3f}",
            })
            if c.status == "ok":
                continue
            tag = "error" if c.status == "not_reached" else "failure"
            el = ET.SubElement(tc, tag, {"type": c.status, "message": _xml(_why(c))})
            el.text = _xml("\n".join(
                [_why(c)] + [f"{d.write}: {d.effects} effects (clean run {d.clean})"
                             + (f"; needs {d.suggestion.code}" if d.suggestion else "")
                             for d in c.doubles]))
        ET.indent(root)
        return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode")


def _n(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _why(c: Case) -> str:
    if c.status == "double":
        return "; ".join(
            (f"it took effect {d.effects} times" if d.write == c.call else f"{d.write} took effect "
             f"{d.effects} times") + f" ({d.clean} in the clean run)" for d in c.doubles)
    if c.status == "unfinished":
        return "left unfinished after the restart (DISPATCHED): " + ", ".join(c.unfinished)
    return c.detail


def _needs(cases: list[Case]) -> dict[str, Suggestion]:
    out: dict[str, Suggestion] = {}
    for c in cases:
        for d in c.doubles:
            if d.suggestion is not None:
                out.setdefault(d.write, d.suggestion)
    return out


_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _xml(text: str) -> str:
    """XML 1.0 has no place for most control characters, even escaped."""
    return _CONTROL.sub("?", text)
