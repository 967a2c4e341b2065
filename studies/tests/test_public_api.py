"""hardeq-studies uses only hardeq's public API.

Public: the names in ``hardeq.__all__`` and the public subpackages ``hardeq.nn``, ``hardeq.diffusion``,
``hardeq.estimators``, ``hardeq.baselines``, ``hardeq.testing`` (and their modules without a leading
underscore), and of each of those only the names in its ``__all__``. Not public: ``hardeq.linalg``,
``hardeq.constraints``, ``hardeq.distributions`` as modules (their public names are re-exported by ``hardeq``),
and anything whose name starts with ``_``. The scan reads every module of ``studies/hardeq_studies`` (AST, no
import): ``import``/``from`` statements, relative imports that would leave the package, and attribute
chains on the name ``hardeq`` (``hardeq.linalg.x``).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import hardeq
import hardeq_studies

PACKAGE = Path(hardeq_studies.__file__).resolve().parent
PUBLIC_SUBPACKAGES = ("nn", "diffusion", "estimators", "baselines", "testing")
PUBLIC_TOP = set(hardeq.__all__) | set(PUBLIC_SUBPACKAGES)


def _module_is_public(module: str) -> bool:
    """``hardeq`` itself, or a module below a public subpackage whose path has no private component."""
    parts = module.split(".")
    assert parts[0] == "hardeq"
    if len(parts) == 1:
        return True
    return parts[1] in PUBLIC_SUBPACKAGES and not any(p.startswith("_") for p in parts[1:])


def _name_is_public(module: str, name: str) -> bool:
    if name.startswith("_") and name != "__version__":
        return False
    if module == "hardeq":
        return name in PUBLIC_TOP
    mod = importlib.import_module(module)
    exported = getattr(mod, "__all__", None)
    if exported is None:
        return True
    if name in exported:
        return True
    # a public submodule of a public package (``from hardeq.estimators import poisson``)
    return _module_is_public(f"{module}.{name}") and importlib.util.find_spec(f"{module}.{name}") is not None


def _violations(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """The non-public uses of hardeq in ``source``, the text of module ``module`` (dotted name)."""
    tree = ast.parse(source)
    package = module.split(".") if is_package else module.split(".")[:-1]
    bad = []
    for node in ast.walk(tree):
        where = f"{module}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            bad += [f"{where}: import {a.name}" for a in node.names
                    if a.name.split(".")[0] == "hardeq" and not _module_is_public(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level:
            up = node.level - 1
            target = package[: len(package) - up] + ([node.module] if node.module else []) if up < len(package) else []
            if not target or target[0] != "hardeq_studies":
                bad.append(f"{where}: relative import {'.' * node.level}{node.module or ''} leaves hardeq_studies")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hardeq":
            if not _module_is_public(node.module):
                bad.append(f"{where}: from {node.module} import ...")
            else:
                bad += [f"{where}: from {node.module} import {a.name}" for a in node.names
                        if not _name_is_public(node.module, a.name)]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "hardeq":
            if node.attr not in PUBLIC_TOP and node.attr != "__version__":
                bad.append(f"{where}: hardeq.{node.attr}")
    return bad


def test_the_scan_sees_violations():
    """The checker itself: private modules and names, non-public modules and escaping relative imports."""
    probe = ("import hardeq.linalg.conditioning\nfrom hardeq.constraints import SumConstraint\n"
             "from hardeq import _utils\nfrom hardeq.nn import graph_normal\nfrom ...nn import x\n"
             "from ..harness import train\nimport hardeq\ny = hardeq.linalg\nz = hardeq.SumConstraint\n")
    found = _violations(probe, "hardeq_studies.mof.probe")
    assert sorted(int(v.split(":")[1]) for v in found) == [1, 2, 3, 5, 8], found  # lines 4, 6, 7, 9 are fine


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_studies_import_only_public_hardeq(path):
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    is_package = path.name == "__init__.py"
    if is_package:
        module = module.rpartition(".")[0]
    assert _violations(path.read_text(), module, is_package=is_package) == []
