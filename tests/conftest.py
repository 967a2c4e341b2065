"""Options and fixtures of the library tests.

``pytest --device cuda`` runs the suite on the GPU (default ``--device cpu``): see :mod:`tests.device`. Tests that
cannot run there carry ``@pytest.mark.cpu_only(reason=...)`` and are skipped under ``--device cuda`` only.
"""

import importlib.util
import os
import sys

import pytest
import torch

from tests import device as _device

# Without a GPU, an installed triton runs in its interpreter for the whole session (tests/test_fused_kernels.py runs
# the library's kernels that way): the mode is read when triton is first imported, by whichever module does so first.
if not torch.cuda.is_available() and "triton" not in sys.modules and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--device", action="store", default="cpu", choices=("cpu", "cuda"),
                     help="device the library tests run on: cpu (default) or cuda (fails if CUDA is unavailable)")


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only(reason): cannot run under --device cuda; skipped there only")
    name = config.getoption("--device", default="cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(
            "--device cuda was given but torch.cuda.is_available() is False (torch "
            f"{torch.__version__}, built with CUDA {torch.version.cuda}): no GPU to run the suite on. "
            "Run without --device (CPU) or on a machine with a CUDA GPU."
        )
    _device.set_device(name)
    if name == "cuda":
        torch.set_default_device("cuda")
        config._hardeq_host_generators = _device.HostGenerators(torch.device("cuda"))
        config._hardeq_host_generators.__enter__()


def pytest_unconfigure(config):
    mode = getattr(config, "_hardeq_host_generators", None)
    if mode is not None:
        mode.__exit__(None, None, None)
        torch.set_default_device(None)


def pytest_collection_modifyitems(config, items):
    if _device.device().type == "cpu":
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            reason = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "CPU only")
            item.add_marker(pytest.mark.skip(reason=f"cpu_only under --device {_device.device().type}: {reason}"))


def pytest_report_header(config):
    return f"hardeq tests on device: {_device.device()}"


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device the suite runs on (``--device``, default cpu)."""
    return _device.device()


@pytest.fixture(autouse=True)
def _validate_distributions():
    """Tests run with distribution validation on (torch's DistributionsTestCase does the same)."""
    previous = torch.distributions.Distribution._validate_args
    torch.distributions.Distribution.set_default_validate_args(True)
    yield
    torch.distributions.Distribution.set_default_validate_args(previous)
