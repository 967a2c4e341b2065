"""Every public class and function carries a docstring example, and every docstring example runs as written.

Public names: the ``__all__`` of ``hardeq`` and of each public subpackage (below). Names that need a missing
optional dependency (``hardeq.contrib.pyro`` without Pyro, ``ConstrainedScheduler`` without diffusers) are left
out, as are the modules that import one. The examples print CPU tensors, hence ``cpu_only``.
"""

import doctest
import importlib
import importlib.util
import inspect
import pkgutil

import pytest
import torch

import hardeq

PACKAGES = ["hardeq", "hardeq.nn", "hardeq.bounds", "hardeq.diffusion", "hardeq.testing", "hardeq.baselines",
            "hardeq.estimators", "hardeq.linalg", "hardeq.contrib.pyro"]
OPTIONAL = {"hardeq.contrib.pyro": "pyro", "hardeq.diffusion.scheduler": "diffusers"}  # module -> dependency
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _missing(module_name: str) -> str | None:
    """The optional dependency ``module_name`` needs and this environment lacks, else None."""
    dependency = OPTIONAL.get(module_name)
    return dependency if dependency is not None and importlib.util.find_spec(dependency) is None else None


def public_objects() -> dict[str, object]:
    """``{"package.name": object}`` for each public class and function (constants, submodules and
    ``__version__`` have no example to carry), each object under the first package that exports it."""
    found, seen = {}, set()
    for package_name in PACKAGES:
        if _missing(package_name):
            continue
        package = importlib.import_module(package_name)
        for name in getattr(package, "__all__", ()):
            if package_name == "hardeq.diffusion" and name.startswith("ConstrainedScheduler") and _missing(
                    "hardeq.diffusion.scheduler"):
                continue
            obj = getattr(package, name)
            if (inspect.isclass(obj) or inspect.isroutine(obj)) and id(obj) not in seen:
                seen.add(id(obj))
                found[f"{package_name}.{name}"] = obj
    return found


def _unimportable(name: str):
    raise ImportError(f"{name} cannot be imported, so its modules cannot be listed")


def library_modules() -> list[str]:
    """Every module of the library (each public name is defined in one of them), by walking ``src/hardeq``."""
    names = ["hardeq"]
    for info in pkgutil.walk_packages(hardeq.__path__, "hardeq.", onerror=_unimportable):
        names.append(info.name)
    return sorted(names)


def test_every_public_name_has_an_example():
    objects = public_objects()
    assert len(objects) > 50  # the enumeration itself works (about 100 names)
    parser = doctest.DocTestParser()
    lacking = [name for name, obj in objects.items()
               if not parser.get_examples(obj.__doc__ or "")]  # its own docstring, not an inherited one
    assert not lacking, f"public names whose docstring has no >>> example: {lacking}"


def test_every_public_example_is_run():
    """``test_doctests`` finds each public name's example: the name is defined in a library module, under the
    ``__module__`` and ``__qualname__`` that doctest's finder looks for (not, e.g., re-exported from elsewhere)."""
    modules, finder, found, missed = set(library_modules()), doctest.DocTestFinder(), {}, []
    for name, obj in public_objects().items():
        module_name = obj.__module__
        if module_name not in found:
            tests = finder.find(importlib.import_module(module_name), module_name) if module_name in modules else []
            found[module_name] = {test.name for test in tests if test.examples}
        if f"{module_name}.{obj.__qualname__}" not in found[module_name]:
            missed.append(name)
    assert not missed, f"public names whose example test_doctests would not run: {missed}"


def _globals(module_name: str) -> dict:
    """``torch``, ``hardeq`` and its top-level names, and the names of the public subpackage holding the module
    (the examples of ``hardeq.diffusion`` use its names unqualified)."""
    globs = {"torch": torch, "hardeq": hardeq, **{name: getattr(hardeq, name) for name in hardeq.__all__}}
    for package_name in PACKAGES[1:]:
        if (module_name == package_name or module_name.startswith(package_name + ".")) and not _missing(package_name):
            package = importlib.import_module(package_name)
            for name in getattr(package, "__all__", ()):
                try:
                    globs[name] = getattr(package, name)
                except ImportError:  # ConstrainedScheduler without diffusers
                    continue
    return globs


@pytest.mark.cpu_only(reason="the examples print CPU tensors")
@pytest.mark.parametrize("module_name", library_modules())
def test_doctests(module_name):
    dependency = _missing(module_name)
    if dependency:
        pytest.skip(f"{module_name} needs {dependency}, which is not installed")
    module = importlib.import_module(module_name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more threads only add overhead
    try:
        finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=FLAGS)
        for test in finder.find(module, module_name, extraglobs=_globals(module_name)):
            runner.run(test)
        result = runner.summarize(verbose=False)
    finally:
        torch.set_num_threads(threads)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {module_name} failed (above)"
