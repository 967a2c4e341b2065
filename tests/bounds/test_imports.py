"""hardeq.bounds imports nothing from hardeq.distributions, and no import cycle passes through hardeq.bounds or
hardeq.distributions, counting function-level and TYPE_CHECKING imports (read from the source with ast)."""

from __future__ import annotations

import ast
from pathlib import Path

import hardeq

ROOT = Path(hardeq.__file__).parent


def _graph() -> dict[str, set[str]]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("hardeq",) + path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                elif (node.module or "").startswith("hardeq"):
                    base = node.module
                else:
                    continue
                for alias in node.names:
                    deps.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("hardeq"))
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        for nxt in graph[node]:
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return False


def test_bounds_imports_nothing_from_distributions():
    graph = _graph()
    bad = [(a, b) for a in graph for b in graph[a] if a.startswith("hardeq.bounds") and
           b.startswith("hardeq.distributions")]
    assert not bad, bad


def test_no_import_cycle_through_bounds_or_distributions():
    graph = _graph()
    area = [m for m in graph if m.startswith(("hardeq.bounds", "hardeq.distributions"))]
    cycles = [m for m in area if _reaches(graph, m, m)]
    assert not cycles, cycles
