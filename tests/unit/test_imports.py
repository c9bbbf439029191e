"""Import direction (cost_models <- planner <- runtime) and no module cycles, read with ast."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cost_models", "planner", "runtime")  # bottom first: a package imports only those before it


@dataclass(frozen=True)
class Import:
    """One import statement's target module, where it is, and the module that runs it."""

    importer: str
    imported: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.imported}"


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the three packages."""
    files: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imports_in(source: str, module: str, is_package: bool, known: set[str], path: str = "?") -> list[Import]:
    """Every import of ``source`` that reaches the three packages, lazy ones included.

    Imports under ``if TYPE_CHECKING:`` are left out (they never run); ``from x import y``
    where ``x.y`` is a module counts as importing ``x.y``. Importing ``a.b.c`` also runs the
    ``a`` and ``a.b`` package files, but only ``a.b.c`` counts (or every package that imports
    its own submodules would be a cycle).
    """
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []
    for node in _running_nodes(ast.parse(source)):
        for name in _imported_names(node, package, known):
            if name.partition(".")[0] in PACKAGES:
                found.append(Import(module, _known_prefix(name, known), path, node.lineno))
    return sorted(set(found), key=lambda record: (record.line, record.imported))


def _running_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` blocks."""
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imported_names(node: ast.AST, package: str, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _absolute(node.module or "", node.level, package)
        return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names]
    if isinstance(node, ast.Call) and _is_import_call(node.func) and node.args:
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return [first.value]
    return []


def _is_import_call(func: ast.expr) -> bool:
    return ((isinstance(func, ast.Name) and func.id in ("__import__", "import_module"))
            or (isinstance(func, ast.Attribute) and func.attr == "import_module"))


def _absolute(name: str, level: int, package: str) -> str:
    if level == 0:
        return name
    parts = package.split(".")
    base = ".".join(parts[:len(parts) - (level - 1)])
    return f"{base}.{name}" if name else base


def _known_prefix(name: str, known: set[str]) -> str:
    """The longest prefix of ``name`` that is a module file (``name`` itself when none is)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return name


def all_imports(root: Path = ROOT) -> list[Import]:
    files = module_files(root)
    known = set(files)
    found: list[Import] = []
    for module, path in files.items():
        found += imports_in(path.read_text(), module, path.name == "__init__.py", known,
                            str(path.relative_to(root)))
    return found


def find_cycles(edges: Mapping[str, set[str]]) -> list[tuple[str, ...]]:
    """The shortest cycle through each module that is on one, each starting at its smallest module."""
    cycles: set[tuple[str, ...]] = set()
    for component in _strong_components(edges):
        for start in sorted(component):
            cycle = _shortest_cycle(start, edges, component)
            if cycle:
                turn = cycle.index(min(cycle))
                cycles.add(cycle[turn:] + cycle[:turn])
    return sorted(cycles)


def _strong_components(edges: Mapping[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components (recursive; module graphs are shallow)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(edges.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component: set[str] = set()
            while module not in component:
                component.add(stack.pop())
            components.append(component)

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return components


def _shortest_cycle(start: str, edges: Mapping[str, set[str]], within: set[str]) -> tuple[str, ...]:
    """Breadth-first from ``start`` back to it inside one component; () when there is no way back."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for target in sorted(edges.get(module, ())):
            if target == start:
                path = [module]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return tuple(reversed(path))
            if target in within and target not in parent:
                parent[target] = module
                queue.append(target)
    return ()


def _graph(imports: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for record in imports:
        edges.setdefault(record.importer, set()).add(record.imported)
    return edges


def _describe(cycle: tuple[str, ...], imports: list[Import]) -> str:
    first: dict[tuple[str, str], Import] = {}
    for record in imports:
        first.setdefault((record.importer, record.imported), record)
    steps = [str(first[(a, b)]) for a, b in zip(cycle, cycle[1:] + cycle[:1])]
    return " -> ".join((*cycle, cycle[0])) + "\n      " + "\n      ".join(steps)


def test_packages_import_downward_only() -> None:
    rank = {package: level for level, package in enumerate(PACKAGES)}
    upward = [record for record in all_imports()
              if rank[record.imported.partition(".")[0]] > rank[record.importer.partition(".")[0]]]
    assert not upward, ("imports against the direction cost_models <- planner <- runtime "
                        "(move the shared code down, or pass it in as an argument):\n  "
                        + "\n  ".join(str(record) for record in upward))


def test_no_import_cycles_between_modules() -> None:
    imports = all_imports()
    cycles = find_cycles(_graph(imports))
    assert not cycles, (f"{len(cycles)} import cycles (lazy imports count; break each by moving the "
                        f"shared part into a module both can import):\n  "
                        + "\n  ".join(_describe(cycle, imports) for cycle in cycles))


def test_the_cycle_finder_reports_each_cycle_once_from_its_smallest_module() -> None:
    edges = {"b": {"c"}, "c": {"a", "d"}, "a": {"b"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": {"g"}}
    assert find_cycles(edges) == [("a", "b", "c"), ("d", "e"), ("g",)]
    assert find_cycles({"a": {"b"}, "b": {"c"}}) == []


def test_a_new_lazy_import_that_closes_a_loop_is_a_cycle() -> None:
    known = {"planner.x", "planner.y"}
    x = imports_in("from planner import y\n", "planner.x", False, known, "planner/x.py")
    y = imports_in("def f():\n    from .x import g\n", "planner.y", False, known, "planner/y.py")
    assert [str(record) for record in x + y] == ["planner/x.py:1 imports planner.y",
                                                 "planner/y.py:2 imports planner.x"]
    assert find_cycles(_graph(x + y)) == [("planner.x", "planner.y")]


def test_type_checking_imports_do_not_count_and_their_else_branch_does() -> None:
    source = ("import typing\nif typing.TYPE_CHECKING:\n    from planner.a import A\nelse:\n"
              "    import runtime.b\nif TYPE_CHECKING:\n    import runtime.c\n"
              "importlib.import_module('runtime.d')\n")
    found = imports_in(source, "cost_models.m", False, {"runtime.b"})
    assert [(record.imported, record.line) for record in found] == [("runtime.b", 5), ("runtime.d", 8)]


def test_the_planner_and_its_command_line_start_without_torchs_compiler() -> None:
    """torch.distributed.pipelining imports dynamo (about 2 s of every `tessera` command's start, profiling or
    not): only the profiler's split-backward timing and the runtime need it, and import it themselves."""
    probe = ("import sys, planner, planner.api, planner.cli.parser; "
             "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch.distributed.pipelining'))))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]", result.stdout
