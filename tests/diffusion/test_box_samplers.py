"""The native samplers' final="box": the last step is box_project of the last step's unconditioned mean."""

from dataclasses import replace

import pytest
import torch

from hardeq.diffusion import DDIMOptions, DDPMOptions, box_project, channel_sum_constraint, ddim_sample, ddpm_sample
from hardeq.testing import assert_exact_per_row


def gen(seed):
    return torch.Generator().manual_seed(seed)


def far_model(x, t):
    """A noise predictor whose x0-prediction runs far out of [-1, 1] (so that the box binds)."""
    return -0.8 * x - 0.05 * torch.tanh(x.flip(-1))


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_samplers_final_box(sampler):
    shape = (3, 2, 4, 4)
    m = 16
    totals = torch.tensor([0.4 * m, -0.7 * m])
    c = channel_sum_constraint(shape, totals)
    betas = torch.linspace(1e-4, 0.02, 20, dtype=torch.float64)
    if sampler == "ddpm":
        run = lambda o, **kw: ddpm_sample(far_model, shape, DDPMOptions(betas=betas, **o), constraint=c,  # noqa: E731
                                          generator=gen(7), **kw)
    else:
        run = lambda o, **kw: ddim_sample(far_model, shape, DDIMOptions(num_steps=5, betas=betas, **o),  # noqa: E731
                                          constraint=c, generator=gen(7), **kw)
    plain = run({}, schedule=())
    boxed = run(dict(final="box", box=(-1.0, 1.0)))
    assert float(plain.abs().max()) > 1.0  # the box binds
    assert_exact_per_row(c.to(dtype=torch.float64), boxed.reshape(3, -1))
    assert bool((boxed.abs() <= 1).all())
    # the last step is the projection (isotropic metric) of the unconditioned last-step mean: the same noise
    # (separate streams) means the same pre-final trajectory
    torch.testing.assert_close(boxed, box_project(plain, totals, 1.0, -1.0, 1.0), atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="final"):
        run(dict(final="clip"))


def test_samplers_final_box_needs_sum_constraint():
    with pytest.raises(ValueError, match="constraint"):
        ddim_sample(far_model, (1, 1, 2, 2), DDIMOptions(num_steps=3, final="box",
                                                         betas=torch.linspace(1e-4, 0.02, 10)))


def test_final_box_uses_the_last_steps_variance_as_the_metric():
    """A per-pixel scale makes the last step the projection in the metric diag(scale^2)."""
    shape = (2, 2, 4, 4)
    totals = torch.tensor([0.3 * 16, -0.5 * 16], dtype=torch.float64)
    c = channel_sum_constraint(shape, totals)
    scale = torch.rand(shape, generator=gen(8), dtype=torch.float64) + 0.05
    opts = DDIMOptions(num_steps=4, betas=torch.linspace(1e-4, 0.02, 10, dtype=torch.float64), dtype=torch.float64)
    plain = ddim_sample(far_model, shape, opts, constraint=c, schedule=(), generator=gen(9))
    boxed = ddim_sample(far_model, shape, replace(opts, final="box", scale=scale), constraint=c, generator=gen(9))
    torch.testing.assert_close(boxed, box_project(plain, totals, scale**2, -1.0, 1.0), atol=1e-12, rtol=0)
    iso = box_project(plain, totals, 1.0, -1.0, 1.0)
    assert float((boxed - iso).abs().max()) > 1e-3  # the metric matters once pixels hit the box
