"""``src/hardeq`` has no import cycle, counting every import: at module level, inside functions and under
``TYPE_CHECKING`` (a cycle there still ties the modules together, and moves the failure to the first call).

The import graph is read from the source with :mod:`ast` (nothing is imported): an edge ``m -> t`` for every
``import t`` / ``from t import name`` in ``m`` (``t.name`` when that is a module), relative imports resolved against
``m``'s package. Cycles are the strongly connected components with more than one module (or a module importing
itself). :data:`KNOWN_CYCLES` lists the modules (or packages) of the cycles other work is removing now; they are
left out of the graph checked, so every cycle among the other modules still fails. Empty it to check the whole
package.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "hardeq"
#: modules whose cycles are being removed in parallel (the truncated samplers); empty this to check every module
KNOWN_CYCLES: frozenset[str] = frozenset()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    return {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """``module -> the modules of the package it imports`` (see the module docstring)."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, is_package, node)
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source for a in node.names]
            for target in targets:
                while target and target not in mods and "." in target:  # ``import a.b.c`` where c is a name
                    target = target.rsplit(".", 1)[0]
                if target in mods and target.startswith(PACKAGE + ".") or target == PACKAGE:
                    graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with a cycle (Tarjan), each sorted."""
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
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _known(module: str) -> bool:
    return any(module == k or module.startswith(k + ".") for k in KNOWN_CYCLES)


def checked_graph() -> dict[str, set[str]]:
    """The import graph without the modules of :data:`KNOWN_CYCLES`."""
    return {m: {t for t in targets if not _known(t)} for m, targets in import_graph().items() if not _known(m)}


def test_the_finder_sees_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}}
    assert cycles(graph) == [["a", "b", "c"], ["d"]]
    real = import_graph()
    assert len(real) > 60 and "hardeq.linalg.covariance" in real["hardeq.distributions.normal"]
    # a function-level import counts: ConstrainedNormal.truncate imports the truncated distribution
    assert "hardeq.distributions.truncated" in real["hardeq.distributions.normal"]


def test_no_import_cycle():
    bad = cycles(checked_graph())
    assert not bad, "import cycles in src/hardeq (modules of each strongly connected component):\n" + "\n".join(
        " <-> ".join(c) for c in bad)
