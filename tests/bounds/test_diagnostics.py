"""Effective sample size and split R-hat against cases with known answers."""

import math

import numpy as np
import pytest
import torch

from hardeq.bounds import effective_sample_size, split_rhat


def _ar1(rho: float, draws: int, chains: int, dims: int, seed: int) -> torch.Tensor:
    """Stationary AR(1) chains x_t = rho x_{t-1} + sqrt(1 - rho^2) e_t, ``(draws, chains, dims)``: the integrated
    autocorrelation time is (1 + rho) / (1 - rho)."""
    rng = np.random.default_rng(seed)
    e = rng.standard_normal((draws, chains, dims))
    x = np.empty_like(e)
    x[0] = e[0]
    c = math.sqrt(1.0 - rho**2)
    for t in range(1, draws):
        x[t] = rho * x[t - 1] + c * e[t]
    return torch.from_numpy(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_iid_draws_have_ess_near_the_number_of_draws_and_rhat_near_one(dtype):
    x = torch.randn(2000, 4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype)
    ess, rhat = effective_sample_size(x), split_rhat(x)
    assert ess.shape == rhat.shape == (6,) and ess.dtype == rhat.dtype == torch.float64
    # the estimator's relative sd for iid draws is a few percent at M N = 8000
    assert bool(((ess / 8000 - 1).abs() < 0.15).all()), ess
    assert bool(((rhat - 1).abs() < 0.01).all()), rhat


@pytest.mark.parametrize("rho", [0.5, 0.9, -0.5])
def test_ar1_chains_have_ess_n_times_one_minus_rho_over_one_plus_rho(rho):
    draws, chains = 5000, 8
    x = _ar1(rho, draws, chains, 4, seed=1)
    expected = draws * chains * (1 - rho) / (1 + rho)
    ess = effective_sample_size(x)
    if rho < 0:  # antithetic: tau = 1/3 and ESS = 3 N M, capped by Stan's tau >= 1 / log10(N M)
        expected = draws * chains / max((1 + rho) / (1 - rho),
                                        1 / math.log10(draws * chains))
    assert bool(((ess / expected - 1).abs() < 0.2).all()), (ess, expected)


def test_disagreeing_chains_have_rhat_far_above_one():
    x = torch.randn(500, 4, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x[:, 0] += 3.0  # one chain stuck elsewhere
    assert bool((split_rhat(x) > 1.5).all())
    # a trend within each chain is seen by the split (the halves disagree) even when every chain agrees
    noise = torch.randn(500, 4, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    trend = torch.linspace(-3, 3, 500, dtype=torch.float64)[:, None, None] + 0.1 * noise
    assert bool((split_rhat(trend) > 1.5).all())
    assert bool((effective_sample_size(trend) < 100).all())


def test_constant_coordinate_is_known_exactly():
    x = torch.randn(100, 3, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    x[..., 1] = 0.25
    ess, rhat = effective_sample_size(x), split_rhat(x)
    assert ess[1].item() == 300 and rhat[1].item() == 1.0
    assert bool(torch.isfinite(ess).all() and torch.isfinite(rhat).all())
    x[:, 0, 0] = 1.0
    x[:, 1:, 0] = 2.0
    assert split_rhat(x)[0].item() == math.inf


def test_single_chain_and_batch_dimensions():
    x = _ar1(0.5, 4000, 1, 6, seed=5).reshape(4000, 1, 2, 3)
    ess = effective_sample_size(x)
    assert ess.shape == (2, 3)
    assert bool(((ess / (4000 / 3) - 1).abs() < 0.25).all()), ess
    assert split_rhat(x).shape == (2, 3)


@pytest.mark.parametrize("fn", [effective_sample_size, split_rhat])
def test_bad_input(fn):
    with pytest.raises(TypeError, match="samples must be a torch.Tensor"):
        fn(np.zeros((10, 2)))
    with pytest.raises(ValueError, match=r"shape \(draws, chains, ...\)"):
        fn(torch.zeros(10))
    with pytest.raises(ValueError, match="at least 4 draws"):
        fn(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="non-finite"):
        fn(torch.full((10, 2), math.nan))
    with pytest.raises(TypeError, match="floating-point"):
        fn(torch.zeros(10, 2, dtype=torch.long))
