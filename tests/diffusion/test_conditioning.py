import math

import pytest
import torch

import hardeq
from hardeq.diffusion import DDPMOptions, channel_sum_constraint, constrained_x0, ddpm_sample, project_onto

from .conftest import RTOL, assert_exact, gen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("per_image", [False, True])
def test_constrained_x0_exact(dtype, per_image):
    x = 3 * torch.randn(4, 3, 5, 5, dtype=dtype, generator=gen(0))
    totals = torch.randn(4, 3, dtype=dtype, generator=gen(1)) * 10 if per_image else torch.tensor([1.0, -2, 7],
                                                                                                    dtype=dtype)
    c = channel_sum_constraint(x.shape, totals)
    for det in (False, True):
        y = constrained_x0(x, c, 0.1, generator=gen(2), deterministic=det)
        assert y.shape == x.shape and y.dtype == dtype
        assert_exact(y, totals, RTOL[dtype])


def test_deterministic_is_projection_and_mean():
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, generator=gen(0))
    totals = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    c = channel_sum_constraint(x.shape, totals)
    mean = constrained_x0(x, c, 0.3, deterministic=True)
    # mean = x + (k_c - sum_c x) / (H W) on every pixel of channel c
    expected = x + ((totals - x.sum((-2, -1))) / 16)[..., None, None]
    torch.testing.assert_close(mean, expected, rtol=0, atol=1e-13)
    torch.testing.assert_close(project_onto(c, x), expected, rtol=0, atol=1e-13)
    # the isotropic scale does not matter for the mean
    torch.testing.assert_close(constrained_x0(x, c, 7.0, deterministic=True), expected, rtol=0, atol=1e-12)


def test_same_generator_same_sample_and_noise_use():
    x = torch.randn(2, 2, 3, 3, generator=gen(0))
    c = channel_sum_constraint(x.shape, [0.0, 1.0])
    a = constrained_x0(x, c, 0.5, generator=gen(5))
    b = constrained_x0(x, c, 0.5, generator=gen(5))
    assert torch.equal(a, b)
    # the sample is x_hat + s * z conditioned, with z the generator's (B, n) normals
    z = torch.randn(2, 18, generator=gen(5)).reshape(x.shape)
    torch.testing.assert_close(a, project_onto(c, x + 0.5 * z), rtol=1e-6, atol=1e-6)


def _mc_check(samples, mean, cov, z=5.0):
    """Sample mean / covariance of ``samples`` ``(N, d)`` against the analytic ones, to ``z`` standard errors."""
    N = samples.shape[0]
    m = samples.mean(0)
    d = samples - m
    S = d.T @ d / (N - 1)
    var = cov.diagonal()
    assert bool(((m - mean).abs() <= z * (var / N).sqrt() + 1e-12).all()), (m, mean)
    se = ((var[:, None] * var[None, :] + cov**2) / N).sqrt()
    assert bool(((S - cov).abs() <= z * se + 1e-12).all()), (S, cov)


def test_monte_carlo_ddpm_last_step_isotropic():
    """ddpm_sample's conditioned last step is N(mu, beta_0 I) | A x0 = k exactly: 2 channels x 3 pixels."""
    N, beta = 40000, 0.25
    mu_in = torch.tensor([[[[0.3, -1.0, 2.0]], [[1.5, 0.5, -0.7]]]], dtype=torch.float64)  # x_1, (1, 2, 1, 3)
    totals = torch.tensor([1.0, -2.0], dtype=torch.float64)
    c = channel_sum_constraint((N, 2, 1, 3), totals)
    x0 = ddpm_sample(lambda x, t: torch.zeros_like(x), (N, 2, 1, 3), DDPMOptions(betas=torch.tensor([beta])),
                     constraint=c, noise=mu_in.expand(N, 2, 1, 3), condition_generator=gen(11))
    assert_exact(x0, totals, 1e-12)
    mu = (mu_in / math.sqrt(1 - beta)).reshape(2, 3)  # x0_hat = x_1 / sqrt(abar_0) for eps = 0
    mean = (mu + ((totals - mu.sum(-1)) / 3)[:, None]).reshape(6)
    block = beta * (torch.eye(3, dtype=torch.float64) - 1 / 3)
    cov = torch.block_diag(block, block)
    _mc_check(x0.reshape(N, 6), mean, cov)


def test_monte_carlo_constrained_x0_anisotropic():
    """Per-pixel scales: the conditional N(mu + K(k - A mu), S - K A S), K = S A^T (A S A^T)^-1."""
    N = 40000
    mu = torch.tensor([0.3, -1.0, 2.0, 1.5, 0.5, -0.7], dtype=torch.float64)
    s = torch.tensor([0.2, 0.5, 1.0, 0.3, 0.3, 0.9], dtype=torch.float64)
    totals = torch.tensor([1.0, -2.0], dtype=torch.float64)
    c = channel_sum_constraint((2, 1, 3), totals)
    x0 = constrained_x0(mu.reshape(1, 2, 1, 3).expand(N, 2, 1, 3), c, s.reshape(1, 2, 1, 3), generator=gen(3))
    assert_exact(x0, totals, 1e-12)
    A = c.dense_matrix()
    S = torch.diag(s**2)
    K = S @ A.T @ torch.linalg.inv(A @ S @ A.T)
    _mc_check(x0.reshape(N, 6), mu + K @ (totals - A @ mu), S - K @ A @ S)


def test_dense_linear_constraint():
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64, generator=gen(0))
    A = torch.randn(3, 32, dtype=torch.float64, generator=gen(1))
    k = torch.randn(3, 3, dtype=torch.float64, generator=gen(2))  # one k per image
    c = hardeq.LinearConstraint(A, k)
    y = constrained_x0(x, c, 0.2, generator=gen(3))
    torch.testing.assert_close(y.reshape(3, 32) @ A.T, k, rtol=0, atol=1e-11)


def test_float64_totals_with_float32_images():
    x = torch.randn(2, 3, 4, 4, generator=gen(0))
    c = channel_sum_constraint(x.shape, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    y = constrained_x0(x, c, 0.1, generator=gen(1))
    assert y.dtype == torch.float32
    assert_exact(y, [1.0, 2.0, 3.0], 1e-5)


def test_gradient_flows():
    x = torch.randn(2, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    c = channel_sum_constraint(x.shape, [0.0, 1.0])
    constrained_x0(x, c, 0.1, generator=gen(0)).square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(scale=0.0), ValueError, "positive finite"),
    (dict(scale=-1.0), ValueError, "positive finite"),
    (dict(scale=float("nan")), ValueError, "positive finite"),
    (dict(scale=torch.zeros(2, 1, 1)), ValueError, "positive finite"),
    (dict(scale=torch.ones(5)), ValueError, "does not broadcast"),
    (dict(scale="big"), TypeError, "scale must be"),
    (dict(generator=3), TypeError, "generator must be a torch.Generator"),
])
def test_bad_arguments(kwargs, exc, match):
    x = torch.randn(2, 2, 3, 3)
    c = channel_sum_constraint(x.shape, [0.0, 1.0])
    args = dict(scale=0.1) | kwargs
    with pytest.raises(exc, match=match):
        constrained_x0(x, c, **args)


def test_bad_constraint():
    x = torch.randn(2, 2, 3, 3)
    with pytest.raises(TypeError, match="constraint must be a hardeq.EqualityConstraint"):
        constrained_x0(x, torch.ones(2), 0.1)
    with pytest.raises(ValueError, match="flatten to n = 18"):
        constrained_x0(x, channel_sum_constraint((2, 4, 4), [0.0, 1.0]), 0.1)
    with pytest.raises(ValueError, match="batch shape must be"):
        constrained_x0(x, channel_sum_constraint((3, 2, 3, 3), torch.zeros(3, 2)), 0.1)
    with pytest.raises(TypeError, match="x0_hat must be a torch.Tensor"):
        constrained_x0([1.0], channel_sum_constraint((2, 3, 3), [0.0, 1.0]), 0.1)
