"""Every benchmark module imports, and no two of them import each other, even inside a
function: shared pieces go in a module both use (bench/readings.py), so a scenario is read
from its imports down."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
MODULES = sorted(path.stem for path in BENCH.glob("*.py") if path.stem != "__init__")


def bench_imports(name: str) -> set[str]:
    """The bench modules ``bench/<name>.py`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse((BENCH / f"{name}.py").read_text())):
        if isinstance(node, ast.ImportFrom):
            package = "bench" if node.level == 1 else node.module or ""
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif package == "bench":
                found.update(alias.name for alias in node.names)
            elif package.startswith("bench."):
                found.add(package.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[1] for alias in node.names
                         if alias.name.startswith("bench."))
    return found & set(MODULES)


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return path[path.index(imported):] + [imported]
            if imported not in state:
                found = visit(imported)
                if found:
                    return found
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


@pytest.mark.parametrize("name", MODULES)
def test_every_bench_module_imports(name):
    importlib.import_module(f"bench.{name}")


def test_no_import_cycle_inside_bench():
    graph = {name: bench_imports(name) for name in MODULES}
    assert graph["run"] >= {"concurrency", "readings"}   # the reader sees the imports
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_a_cycle_through_a_function_level_import_is_found():
    found = cycle({"run": {"concurrency"}, "concurrency": {"run"}, "report": set()})
    assert found[0] == found[-1] and set(found) == {"run", "concurrency"}
    assert cycle({"run": {"concurrency", "report"}, "concurrency": {"report"},
                  "report": set()}) is None
