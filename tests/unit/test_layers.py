"""The package's layers, as docs/design.md §13 orders them, hold: no module imports a layer
above its own (`TYPE_CHECKING` imports included), and no import cycle spans two folders.

The layers are the module map's sections, lowest first; a module's layer is the section of its
row. Every import of a `poimen` module is read from the source (ast), not from a running
interpreter, so an import inside a function counts as well.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tests.unit.test_module_map import DESIGN, PACKAGE, _section


@dataclass(frozen=True, slots=True)
class Import:
    importer: str  # path under src/poimen/
    line: int
    imported: str  # path under src/poimen/
    name: str  # as written

    def __str__(self) -> str:
        return f"src/poimen/{self.importer}:{self.line} imports {self.name}"


def layers() -> tuple[list[str], dict[str, int]]:
    """The module map's sections (lowest first) and each listed module's index among them."""
    titles: list[str] = []
    rank: dict[str, int] = {}
    for line in _section(DESIGN.read_text(encoding="utf-8"), "13. Module map").splitlines():
        if line.startswith("**"):
            titles.append(line.split("**")[1])
        elif line.startswith("|") and titles:
            first = line.strip("|").split("|")[0]
            for part in first.split("`")[1::2]:
                if part.endswith(".py"):
                    rank[part] = len(titles) - 1
    return titles, rank


def _file(dotted: str) -> str | None:
    """The file under src/poimen/ of a module named ``poimen.a.b``, if there is one."""
    rel = Path(*dotted.split(".")[1:])
    if (PACKAGE / rel).with_suffix(".py").is_file():
        return rel.with_suffix(".py").as_posix()
    if (PACKAGE / rel / "__init__.py").is_file():
        return (rel / "__init__.py").as_posix()
    return None


def imports() -> list[Import]:
    """Every import of a poimen module in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        package = ["poimen", *path.relative_to(PACKAGE).parent.parts]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [(a.name, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importer's own package up
                    up = package[: len(package) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from poimen.a import b` imports the module poimen.a.b if there is one.
                targets = [
                    (f"{base}.{a.name}" if _file(f"{base}.{a.name}") else base, f"{base}.{a.name}")
                    for a in node.names
                ]
            else:
                continue
            for dotted, written in targets:
                if dotted == "poimen" or dotted.startswith("poimen."):
                    target = _file(dotted)
                    assert target is not None, f"src/poimen/{rel}: no module {dotted}"
                    found.append(Import(rel, node.lineno, target, written))
    return found


def _rank(module: str, rank: dict[str, int]) -> int:
    """A module's layer; a folder's `__init__.py` that only describes it: its modules'."""
    if module in rank:
        return rank[module]
    folder = module.rsplit("/", 1)[0] + "/"
    inside = {r for m, r in rank.items() if m.startswith(folder)}
    assert len(inside) == 1, f"{module} is in no layer of docs/design.md's module map"
    return inside.pop()


def upward(found: list[Import], rank: dict[str, int]) -> list[Import]:
    return [i for i in found if _rank(i.imported, rank) > _rank(i.importer, rank)]


def test_no_module_imports_a_layer_above_its_own() -> None:
    titles, rank = layers()
    found = upward(imports(), rank)
    up = [
        f"{i} (layer {titles[_rank(i.imported, rank)]!r} is above "
        f"{titles[_rank(i.importer, rank)]!r})"
        for i in found
    ]
    assert not up, "upward imports:\n" + "\n".join(up)


def _node(module: str) -> str:
    """A folder of the package, or a module of its own for one at the top."""
    return module.split("/", 1)[0] + "/" if "/" in module else module


def test_no_import_cycle_spans_two_folders() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for i in imports():
        if _node(i.importer) != _node(i.imported):
            graph[_node(i.importer)].add(_node(i.imported))
    # Tarjan's strongly connected components, over a graph of a few dozen nodes.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 and any(c.endswith("/") for c in component):
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles that span folders: {cycles}"


def test_every_layer_is_a_section_of_the_map() -> None:
    titles, rank = layers()
    assert titles[:2] == ["Errors", "Pure rules"], titles
    assert len(set(rank.values())) == len(titles), "a section of the module map lists nothing"
