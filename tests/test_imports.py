"""The four packages import one way (docs/ARCHITECTURE.md), and no module imports itself round a cycle.

Every import statement counts, also the ones inside functions: a lazy import still ties two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("clef_model", "surgery", "canaries", "variants")
# which packages each package may import (besides itself)
ALLOWED = {"clef_model": set(), "surgery": {"clef_model"}, "canaries": {"clef_model"},
           "variants": {"clef_model", "surgery", "canaries"}}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The blaze modules `path` imports (a `from pkg import name` of a submodule counts as that submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, modules) - {name} for name, path in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (as a path that returns to its start), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _is_package_init(name: str) -> bool:
    return (ROOT / Path(*name.split(".")) / "__init__.py").is_file()


def test_packages_import_one_way():
    wrong = sorted(f"{source} imports {target}" for source, targets in import_graph().items()
                   for target in targets
                   if (a := source.split(".")[0]) != (b := target.split(".")[0]) and b not in ALLOWED[a])
    assert not wrong, wrong


def test_no_import_cycle_between_modules():
    # a package's __init__ importing its own submodules (and they importing the package) is not a cycle of logic
    graph = {name: {t for t in targets if not _is_package_init(t)} for name, targets in import_graph().items()
             if not _is_package_init(name)}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_checker_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
