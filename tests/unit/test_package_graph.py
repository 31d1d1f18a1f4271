"""The package graph of kvproxy/, derived from the imports: no cycle, and each layer's reach.

Each sub-folder of kvproxy/ is one node, each top-level module (``config.py``,
``errors.py``, ``routes.py``, ``__init__.py`` ...) its own. An import anywhere in a
module counts, at the top or inside a function, so a cycle cannot hide in a late import.
"""
from __future__ import annotations

import ast
from pathlib import Path

from kvproxy import routes

PACKAGE = Path(__file__).resolve().parents[2] / "kvproxy"
INIT = "__init__"


def node_of(parts: list[str]) -> str:
    """The node a dotted name inside kvproxy (without the leading ``kvproxy``) belongs to."""
    if not parts:
        return INIT
    first = parts[0]
    if (PACKAGE / first).is_dir() or (PACKAGE / f"{first}.py").is_file():
        return first
    return INIT  # a name defined in kvproxy/__init__.py (create_app, __version__)


def node_of_file(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported_modules(path: Path) -> list[list[str]]:
    """Dotted names of kvproxy imported by ``path`` (without ``kvproxy``); ``from kvproxy.a
    import b`` counts as ``a.b`` so a sub-module imported by name is found."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (node.module or "").split(".") if node.module else []
            if node.level:
                base = package[:len(package) - node.level + 1] + base
            names = [base + [alias.name] for alias in node.names]
        else:
            continue
        found += [name[1:] for name in names if name and name[0] == "kvproxy"]
    return found


def package_graph() -> dict[str, set[str]]:
    """Node -> the nodes it imports; the app factory also imports every module the route
    table names for its blueprints (``routes.BLUEPRINTS``, imported by name)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        source = node_of_file(path)
        targets = graph.setdefault(source, set())
        for parts in imported_modules(path):
            target = node_of(parts)
            if target != source:
                targets.add(target)
    for where in routes.BLUEPRINTS.values():
        graph[INIT].add(node_of(where.partition(":")[0].split(".")[1:]))
    return graph


def imports_of(node: str) -> set[str]:
    """Top-level modules (``flask``, ``requests``) and kvproxy nodes a node imports."""
    paths = [PACKAGE / f"{node}.py"] if (PACKAGE / f"{node}.py").is_file() \
        else list((PACKAGE / node).rglob("*.py"))
    found: set[str] = set()
    for path in paths:
        for parsed in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(parsed, ast.Import):
                found |= {alias.name.split(".")[0] for alias in parsed.names}
            elif isinstance(parsed, ast.ImportFrom) and not parsed.level and parsed.module:
                found.add(parsed.module.split(".")[0])
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

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
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_graph_sees_the_packages():
    graph = package_graph()
    assert {"slots", "storage", "web", "ops", "config", "routes", INIT} <= set(graph)
    assert "config" in graph[INIT] and "slots" in graph["ops"]


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def assert_no_cycle(graph: dict[str, set[str]]) -> None:
    found = cycles(graph)
    assert not found, "import cycles between packages of kvproxy/: " + "; ".join(
        " <-> ".join(group) for group in found)


def test_no_package_cycle():
    assert_no_cycle(package_graph())


def test_telemetry_imports_nothing_of_kvproxy():
    assert "kvproxy" not in imports_of("telemetry")


def test_web_imports_neither_slots_nor_storage():
    assert not {"slots", "storage"} & package_graph()["web"]


def test_translate_imports_no_flask():
    assert "flask" not in imports_of("translate")


def test_the_relay_imports_neither_flask_nor_web_nor_ops():
    """The application layer gets everything in its call (``relay/context.py``)."""
    assert "flask" not in imports_of("relay")
    assert not {"web", "ops"} & package_graph()["relay"]
