"""Shared fixtures of the hardeq.diffusion tests: tiny models, kept fast (2 shared CPU cores)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add overhead (8x slower on a busy 2-core machine). Restored after each
    test; the library itself never changes the thread count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def toy_eps(x, t):
    """A smooth deterministic noise predictor ``(B, C, H, W), (B,) -> (B, C, H, W)``."""
    tt = t.to(device=x.device, dtype=x.dtype).view(-1, *([1] * (x.dim() - 1)))  # diffusers' timesteps: host
    return 0.5 * torch.tanh(x) + 0.01 * tt.sin() * x.flip(-1)


@pytest.fixture
def toy_model():
    return toy_eps


@pytest.fixture(scope="module")
def tiny_unet():
    """A randomly initialised 2-channel 8x8 ``diffusers.UNet2DModel`` (no attention)."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=8, in_channels=2, out_channels=2, block_out_channels=(8, 16), layers_per_block=1,
        norm_num_groups=4, down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
    )
    return unet.eval()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def assert_exact(x, totals, rtol):
    """Per-channel sums of ``x`` ``(B, C, H, W)`` equal ``totals`` (``(C,)`` or ``(B, C)``) to round-off:
    ``|sum - k| <= rtol * (1 + sum|x| + |k|)``, evaluated in float64."""
    x64 = x.to(torch.float64)
    k = torch.as_tensor(totals, dtype=torch.float64).expand(x.shape[0], x.shape[1])
    err = (x64.sum((-2, -1)) - k).abs()
    tol = rtol * (1 + x64.abs().sum((-2, -1)) + k.abs())
    assert bool((err <= tol).all()), f"max residual {err.max().item():.3e}, tolerance {tol.min().item():.3e}"


RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}
