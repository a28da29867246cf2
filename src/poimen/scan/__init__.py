"""`poimen scan PATH`: the agent tools in a code base that write to the outside without a
poimen effect class, each with the class it needs (docs/crash-testing.md).

- `_finder`: the static analysis of one module (Python `ast`).
- `_report`: walking the paths; text, JSON and SARIF 2.1.0.
"""

from poimen.scan._finder import Tool, Write, find_tools
from poimen.scan._report import RULES, ScanError, ScanReport, scan

__all__ = ["RULES", "ScanError", "ScanReport", "Tool", "Write", "find_tools", "scan"]
