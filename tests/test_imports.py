"""The import graph: no cycle, one direction, and a typed public surface.

The graph is read from the source (every ``import`` and ``from ... import`` statement, at module
level and inside functions), not from what a run happens to import, so a cycle hidden by an
import inside a function is found too. Run this file directly to print the graph in Graphviz
DOT, between modules or between folders (``--wings``): ``python3 tests/test_imports.py --wings |
dot -Tsvg > docs/import-graph.svg``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"evenflow.engine": ROOT / "engine", "evenflow.transports": ROOT / "transports"}
TOOLS = "evenflow.engine._tools"
# `python -m evenflow.engine` runs the command-line tools: an entry point, not part of the core.
ENTRY_POINTS = {"evenflow.engine.__main__"}
# Modules that sit outside their wing's folder for the sake of a short public import path.
WING_OF = {
    "evenflow.engine.__main__": "engine._tools",
    "evenflow.transports.launch": "transports.testing",
}


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    # (imported module, line, where): where is "top", "function" or "type-checking"
    imports: list[tuple[str, int, str]] = field(default_factory=list)


def _module_files() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            name = ".".join([package, *parts])
            modules[name] = Module(name, path, is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _collect(module: Module, known: dict[str, Module]) -> None:
    tree = ast.parse(module.path.read_text(encoding="utf-8"), filename=str(module.path))

    def resolve(target: str, names: list[str]) -> list[str]:
        # "from pkg import name": an edge to pkg.name when that is a module, else to pkg.
        found = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
        return found if len(found) == len(names) else [target, *found]

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                here = "function" if where == "top" else where
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    visit_stmt(stmt, "type-checking")
                for stmt in child.orelse:
                    visit_stmt(stmt, here)
                continue
            visit_stmt(child, here)

    def visit_stmt(stmt: ast.AST, where: str) -> None:
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                module.imports.append((alias.name, stmt.lineno, where))
        elif isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
            for target in resolve(stmt.module, [a.name for a in stmt.names]):
                module.imports.append((target, stmt.lineno, where))
        visit(stmt, where)

    visit(tree, "top")


def build_graph() -> dict[str, Module]:
    modules = _module_files()
    for module in modules.values():
        _collect(module, modules)
    return modules


GRAPH = build_graph()


def _project_edges(kinds: tuple[str, ...]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in GRAPH}
    for module in GRAPH.values():
        for target, _, where in module.imports:
            if where in kinds and target in GRAPH and target != module.name:
                edges[module.name].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_sees_every_module_and_its_imports() -> None:
    # A parser that silently saw nothing would pass every check below.
    assert "evenflow.engine._pipeline.loader" in GRAPH
    assert "evenflow.transports._wire" in GRAPH
    edges = _project_edges(("top",))
    assert "evenflow.engine._config" in edges["evenflow.engine._pipeline.loader"]
    assert sum(len(targets) for targets in edges.values()) > 100


def test_the_cycle_finder_finds_a_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    cycles = _cycles(_project_edges(("top", "function")))
    assert not cycles, f"import cycles (top-level and function-level imports): {cycles}"


def test_the_wings_form_layers() -> None:
    """Between folders the arrows point one way: no two wings import each other, even through
    modules that do not form a cycle themselves."""
    edges: dict[str, set[str]] = {}
    for source, targets in _project_edges(("top", "function")).items():
        for target in targets:
            if _wing(source) != _wing(target):
                edges.setdefault(_wing(source), set()).add(_wing(target))
                edges.setdefault(_wing(target), set())
    assert len(edges) >= 8, sorted(edges)
    assert not _cycles(edges), f"wings importing each other: {_cycles(edges)}"


def test_transports_never_import_engine() -> None:
    bad = [
        f"{m.name}:{line} imports {target}"
        for m in GRAPH.values()
        if m.name.startswith("evenflow.transports")
        for target, line, _ in m.imports
        if target.startswith("evenflow.engine")
    ]
    assert not bad, bad


def test_the_engine_takes_transport_internals_from_the_internal_face() -> None:
    """The engine imports public names from the public transport modules and the rest from
    :mod:`evenflow.transports.internal`, never from a private ``transports._*`` module: the
    layout of those is the transports' own business (see the internal face's docstring)."""
    bad = [
        f"{m.name}:{line} imports {target}"
        for m in GRAPH.values()
        if m.name.startswith("evenflow.engine")
        for target, line, _ in m.imports
        if target.startswith("evenflow.transports._")
    ]
    assert not bad, (
        "engine modules import private transport modules; import the name from "
        "evenflow.transports (public) or evenflow.transports.internal instead:\n" + "\n".join(bad)
    )


def test_the_private_transport_import_check_sees_both_spellings() -> None:
    # "from evenflow.transports import _wire" counts as an import of the private module (the
    # transports write it so among themselves), so an empty list above means none, not a
    # blind parser; and the engine's imports of the internal face are seen.
    assert "evenflow.transports._wire" in {
        t for t, _, _ in GRAPH["evenflow.transports._local"].imports
    }
    assert "evenflow.transports.internal" in {
        t for t, _, _ in GRAPH["evenflow.engine.errors"].imports
    }


def test_the_core_never_imports_the_tools() -> None:
    bad = [
        f"{m.name}:{line} imports {target}"
        for m in GRAPH.values()
        if not m.name.startswith(TOOLS) and m.name not in ENTRY_POINTS
        for target, line, _ in m.imports
        if target.startswith(TOOLS)
    ]
    assert not bad, bad


def test_no_project_import_inside_a_function() -> None:
    """The graph a reader sees at the top of a file is the graph that runs. Imports inside
    functions are left to heavy or optional third-party dependencies (torch.distributed,
    matplotlib, torch_npu); the CLI finds its subcommands by name through importlib."""
    bad = [
        f"{m.name}:{line} imports {target} inside a function"
        for m in GRAPH.values()
        for target, line, where in m.imports
        if where == "function" and target.startswith("evenflow.")
    ]
    assert not bad, "\n".join(bad)


def test_test_modules_import_helpers_from_testkit_not_from_each_other() -> None:
    """A helper two test modules share lives in ``tests/testkit``: importing a test module
    runs its module-level code and couples two files' tests (a rename in one breaks the
    other's collection)."""
    tests = ROOT / "tests"
    names = {path.stem for path in tests.glob("test_*.py")}
    assert len(names) > 40, sorted(names)
    bad = []
    for path in sorted(tests.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                # load_test_module("test_x.py") and friends: a test module loaded by path
                targets = [node.value.removesuffix(".py")] if node.value.endswith(".py") else []
            else:
                continue
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} {t}" for t in targets if t in names]
    assert not bad, bad


def _wing(name: str) -> str:
    """The folder (wing) a module belongs to: ``engine._planning``, ``transports.testing``..."""
    if name in WING_OF:
        return WING_OF[name]
    parts = name.removeprefix("evenflow.").split(".")
    if len(parts) > 2 or (len(parts) == 2 and GRAPH[name].is_package):
        return ".".join(parts[:2])
    return f"{parts[0]} (top level)"


def _dot(wings: bool) -> str:
    """The import graph in Graphviz DOT, between modules or (``wings``) between folders."""
    lines = ["digraph evenflow {", "  rankdir=BT;", "  node [shape=box, fontsize=10];"]
    edges = _project_edges(("top", "function"))
    pairs: set[tuple[str, str]] = set()
    for source in edges:
        for target in edges[source]:
            a, b = (_wing(source), _wing(target)) if wings else (source, target)
            if a != b:
                pairs.add((a.removeprefix("evenflow."), b.removeprefix("evenflow.")))
    lines += [f'  "{a}" -> "{b}";' for a, b in sorted(pairs)]
    lines.append("}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(_dot(wings="--wings" in sys.argv[1:]) + "\n")
