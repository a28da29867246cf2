"""No module of the package, `verification/` or `bench/` reaches into the private attributes of
`Kernel`, `Runtime` or `Engine` from outside their own modules (issue 21): undo, observation, the
registry of kernels are handed the engine (or what they need); OpenTelemetry, the integrations,
the soak and the benchmarks ask `poimen._runtime.engine_of` for it. The tests may reach in.

Read from the source (ast). A reach is ``<expression>._name`` where ``_name`` is one of those
classes' private members and the expression is neither ``self``/``cls`` nor an imported module
or a name an import bound (``poimen._engine`` is a package, ``m._emit`` a function of the module
imported as ``m``). A module whose own classes define a private
of the same name (``_observe.Observation._engine``) may use it, except on a receiver named or
annotated as a kernel, runtime or engine. A lower layer is handed what it needs (the engine,
`_engine/workers.py`'s `Live`), never a `Protocol` of a kernel's privates: a private declared
in one counts as the module's own, and would hide its reaches from this scan.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "poimen"
OWNERS = {
    "Kernel": PACKAGE / "_kernel.py",
    "Runtime": PACKAGE / "_runtime.py",
    "Engine": PACKAGE / "_engine" / "engine.py",
}
SUSPECT = ("kernel", "runtime", "engine")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def class_privates(tree: ast.Module, only: str | None = None) -> set[str]:
    """The private members the module's classes (or the one named `only`) define: methods,
    class-level annotations, and ``self._x = ...`` in their methods."""
    found: set[str] = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        if only is not None and cls.name != only:
            continue
        for node in ast.walk(cls):
            match node:
                case ast.FunctionDef(name=name) | ast.AsyncFunctionDef(name=name):
                    found.add(name)
                case ast.AnnAssign(target=ast.Name(id=name)):
                    found.add(name)
                case ast.Attribute(value=ast.Name(id="self"), attr=name, ctx=ast.Store()):
                    found.add(name)
    return {n for n in found if _private(n)}


def owned() -> set[str]:
    names: set[str] = set()
    for cls, path in OWNERS.items():
        names |= class_privates(ast.parse(path.read_text(encoding="utf-8")), cls)
    return names


def _modules(tree: ast.Module) -> set[str]:
    """The names the module's imports bind (``import a.b`` binds ``a``): modules, or a module's
    names (``from poimen.cli import _main as m``), never a kernel."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                bound.add(alias.asname or alias.name.split(".")[0])
    return bound


def _suspect(receiver: ast.expr, annotations: dict[str, str]) -> bool:
    if not isinstance(receiver, ast.Name):
        return False
    name = receiver.id.lower()
    typed = annotations.get(receiver.id, "").lower()
    return any(s in name or s in typed for s in SUSPECT) or name in ("k", "e")


def reaches(path: Path, privates: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = class_privates(tree)
    modules = _modules(tree)
    annotations = {
        a.arg: ast.unparse(a.annotation)
        for a in ast.walk(tree)
        if isinstance(a, ast.arg) and a.annotation is not None
    }
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr in privates):
            continue
        receiver = node.value
        if isinstance(receiver, ast.Name) and (
            receiver.id in ("self", "cls") or receiver.id in modules
        ):
            continue
        if node.attr in own and not _suspect(receiver, annotations):
            continue
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_the_kernel_or_the_engine() -> None:
    privates = owned()
    assert {"_engine", "_issuer", "_build", "_closed", "_pools"} <= privates
    owners = set(OWNERS.values())
    files = [f for d in (PACKAGE, ROOT / "verification", ROOT / "bench") for f in sorted(d.rglob("*.py"))]
    found = [r for f in files if f not in owners for r in reaches(f, privates)]
    assert found == [], "\n".join(found)


def test_the_scan_sees_a_reach(tmp_path: Path) -> None:
    """The scan's own check: a reach through a kernel is seen, a module's own private is not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "class Box:\n"
        "    def __init__(self, engine):\n"
        "        self._engine = engine\n"
        "    def peer(self, other):\n"
        "        return other._engine\n"
        "def bad(kernel):\n"
        "    return kernel._engine\n"
        "def also_bad(e):\n"
        "    return e._pools\n",
        encoding="utf-8",
    )
    found = reaches(sample, owned())
    assert sorted(f.rsplit(": ", 1)[1] for f in found) == ["e._pools", "kernel._engine"]
