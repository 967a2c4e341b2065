"""``pytest --device``: the option, its refusal without CUDA, and the host-generator mode it installs on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.device import HostGenerators, device

def test_device_fixture_matches_the_option(device, request):
    assert device == torch.device(request.config.getoption("--device"))
    assert torch.empty(0).device.type == device.type  # the suite's tensors are created there


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: --device cuda would run")
def test_device_cuda_without_cuda_fails_clearly():
    """The conftest's start-up hook refuses ``--device cuda`` (pytest prints the message and exits non-zero)."""
    from tests import conftest

    class Config:  # what pytest_configure reads of pytest's config
        def getoption(self, name, default=None):
            return "cuda" if name == "--device" else default

        def addinivalue_line(self, name, line):
            pass

    with pytest.raises(pytest.UsageError, match=r"--device cuda was given but torch\.cuda\.is_available\(\) is False"):
        conftest.pytest_configure(Config())
    assert device().type == "cpu" and torch.empty(0).device.type == "cpu"  # nothing was switched


@pytest.mark.cpu_only(reason="moves tensors to the meta device, whose values cannot be read back")
def test_host_generators_draw_on_the_host_and_move():
    """A seeded CPU generator gives the same numbers, placed on the target device (meta stands in for CUDA)."""
    expected = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with HostGenerators(torch.device("meta")):
        out = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        explicit = torch.rand(2, generator=torch.Generator().manual_seed(0), device="cpu")
        plain = torch.randn(2)  # no generator: passes through (the default device applies)
    assert out.device.type == "meta" and out.shape == expected.shape and out.dtype == expected.dtype
    assert explicit.device.type == "cpu" and plain.device.type == "cpu"


def test_host_generators_hand_numpy_a_host_copy():
    x = torch.arange(3.0)
    with HostGenerators(device()):
        assert x.numpy().tolist() == [0.0, 1.0, 2.0]


def test_suite_device_is_used_by_the_shared_builders(device):
    from tests.distributions.cases import make_case

    case = make_case("diag", "linear")
    assert case.loc.device.type == device.type and case.dist.sample().device.type == device.type
