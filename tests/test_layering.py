"""The library sits below the programs, and its modules import one another without cycles.

Read with :mod:`ast`, not by importing: every import statement under ``moonvit/`` (those inside
functions too) for rule (a); the module-level ones (outside functions, ``TYPE_CHECKING`` blocks
excluded) for the import graph of rule (b). Importing ``a.b.c`` runs ``a`` and ``a.b`` first, so an
edge to a module is also an edge to each package above it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "moonvit"
PROGRAMS = {"moonvit_projector", "moonvit_eval", "moonvit_train", "projector", "eval", "train"}
KNOWN_CYCLES: set[tuple[str, ...]] = set()
"""Import cycles among the library's modules that exist today; the set may shrink, never grow."""


def module_name(path: Path) -> str:
    parts = path.relative_to(LIBRARY.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def library_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(LIBRARY.rglob("*.py"))}


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute names an import statement brings in (``from x import y`` gives ``x.y`` and ``x``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    source = ".".join(part for part in (base if node.level else "", node.module or "") if part)
    return [source, *(f"{source}.{alias.name}" for alias in node.names)]


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements run when the module is imported: outside functions and ``TYPE_CHECKING``."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif isinstance(node, ast.If) and is_type_checking(node):
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> dict[str, set[str]]:
    """Library module -> the library modules (and their packages) it imports at module level."""
    modules = library_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        targets: set[str] = set()
        for node in module_level_imports(tree):
            for name in imported(node, module, path.name == "__init__.py"):
                while name:
                    if name in modules:
                        targets.add(name)
                    name = name.rpartition(".")[0]
        # a module's own packages are running (or done) when it runs: not an edge
        graph[module] = {t for t in targets if t != module and not module.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted tuple."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[tuple[str, ...]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.add(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_library_imports_no_program():
    offenders = []
    for module, path in library_modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in imported(node, module, path.name == "__init__.py"):
                    if name.split(".")[0] in PROGRAMS:
                        offenders.append(f"{path.relative_to(LIBRARY.parent)}:{node.lineno} imports {name}")
    assert not offenders, "the library imports a program package:\n" + "\n".join(sorted(set(offenders)))


def test_library_import_graph_has_no_new_cycles():
    found = cycles(import_graph())
    assert found <= KNOWN_CYCLES, f"new import cycles in the library: {sorted(found - KNOWN_CYCLES)}"
    assert found == KNOWN_CYCLES, f"cycles gone, remove them from KNOWN_CYCLES: {sorted(KNOWN_CYCLES - found)}"


def test_the_graph_sees_what_it_should():
    """The reader itself: relative imports resolve, and a known edge is there."""
    graph = import_graph()
    assert "moonvit.model.config" in graph["moonvit.model.encoder"]
    assert "moonvit.model.projector" in graph["moonvit.weights.projector"]
    assert "moonvit.weights" not in graph["moonvit.model.projector"]  # loaded lazily, as the encoder's weights
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == {("a", "b")}


def test_importing_the_packages_does_not_import_ray():
    """Ray is an extra: the library and the programs import it only when a Ray path runs."""
    code = "import sys, moonvit, moonvit.ray_data, projector, projector.export; print('ray' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=LIBRARY.parent)
    assert done.stdout.strip() == "False", done.stderr
