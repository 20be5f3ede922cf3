"""The layout's promises: no import cycle among the project's modules (imports inside functions count; those
only type checkers read do not), no source file past ~800 lines, and an RL loop that reads as its steps."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_SOURCE_LINES = 800
MAX_LOOP_LINES = 100


def package_dirs() -> dict[str, Path]:
    """Import name -> folder, from pyproject's setuptools package-dir (`miles.rollout` -> rollout/)."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: REPO / folder for name, folder in setuptools["package-dir"].items()}


def project_modules() -> dict[str, Path]:
    roots = package_dirs()
    modules: dict[str, Path] = {}
    for package, folder in roots.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if package == "miles" and parts and f"miles.{parts[0]}" in roots:
                continue  # a component folder of its own, mapped under its own name
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but those under `if TYPE_CHECKING:`."""
    nodes, stack = [], [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        nodes.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return nodes


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()

    def resolve(name: str) -> str | None:
        while name:
            if name in modules:
                return name
            name = name.rpartition(".")[0]
        return None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_nodes(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # `from pkg import module` imports the module; `from module import name` the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                found = resolve(target)
                # Importing `a.b.c` runs `a.b`'s __init__ first (but not again the importer's own packages).
                while found is not None and found != name and not name.startswith(found + "."):
                    graph[name].add(found)
                    found = resolve(found.rpartition(".")[0])
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_imports_and_every_package() -> None:
    graph = import_graph()
    assert {"miles.rl.loop", "miles.rollout", "miles.trainer", "miles.weight_sync", "miles.rewards"} <= set(
        graph
    )
    assert "miles.rl" in graph["miles.run"]  # a top-level import
    assert "miles.trainer" in graph["miles.build"]  # an import inside a function


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_no_source_file_is_too_long() -> None:
    long = {
        str(path.relative_to(REPO)): n
        for path in project_modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_SOURCE_LINES
    }
    assert long == {}


def test_the_rl_loop_body_fits_a_screen() -> None:
    from miles.rl import loop

    tree = ast.parse(Path(loop.__file__).read_text())
    (run_rl,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run_rl"]
    assert run_rl.end_lineno - run_rl.lineno + 1 <= MAX_LOOP_LINES
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert all(f.end_lineno - f.lineno + 1 <= 60 for f in functions), [f.name for f in functions]
