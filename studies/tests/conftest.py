"""Study tests: distribution validation on (as in the library's tests), and a time limit for the slow group.

Slow tests (``@pytest.mark.slow``: a study run end to end) are deselected by default (``addopts`` in
studies/pyproject.toml) and run with ``python -m pytest studies/tests -m slow``. Each gets a time limit of
:data:`SLOW_TIMEOUT_S` seconds through pytest-timeout (the ``test`` extra); running past it FAILS the test, it
never skips it. Subprocesses go through :func:`study_test_helpers.run_or_fail`, which fails the same way.
"""

import pytest
import torch

#: seconds a slow test may take (the slowest, diffusion's CIFAR-10 smoke run, takes ~20 s on 2 idle cores)
SLOW_TIMEOUT_S = 900


def pytest_collection_modifyitems(config, items):
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow and not config.pluginmanager.hasplugin("timeout"):
        raise pytest.UsageError("the slow study tests need pytest-timeout, so that a run past its time limit fails "
                                "instead of hanging: pip install -e \"./studies[test]\"")
    for item in slow:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


@pytest.fixture(autouse=True)
def _validate_distributions():
    """Tests run with distribution validation on (torch's DistributionsTestCase does the same)."""
    previous = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(True)
    yield
    torch.distributions.Distribution.set_default_validate_args(previous)


@pytest.fixture(autouse=True, scope="session")
def _last_reproduce_dir_of_the_session(tmp_path_factory):
    """``hardeq reproduce`` records where it wrote in results/.last/ of the current folder (``hardeq report``
    draws from there); the tests' in-process runs record it in a temporary folder, not in the checkout. Session
    scope, so that module-scoped fixtures that run a study (set up before any function-scoped fixture) are covered
    too."""
    from hardeq_studies import cli

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "LAST_DIR", tmp_path_factory.mktemp("last-session"))
        yield


@pytest.fixture(autouse=True)
def _last_reproduce_dir(tmp_path_factory, monkeypatch):
    """Each test's own results/.last/ (no test sees where another test's run wrote)."""
    from hardeq_studies import cli

    monkeypatch.setattr(cli, "LAST_DIR", tmp_path_factory.mktemp("last"))

