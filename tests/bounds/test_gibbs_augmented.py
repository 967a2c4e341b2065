"""Blocked Gibbs for every covariance with a diagonal part, by the augmentation Sigma = D + V V^T
(hardeq.bounds.augment), against numpy/torch rejection draws; and finding A (exact HMC returned copies of the mode
on a thin polytope) against an independent limit law."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from scipy import stats

import hardeq
from hardeq.bounds import blocked_gibbs, rejection_sample, truncated_mode
from hardeq.bounds.hmc import ChainStuck
from hardeq.linalg.block_diagonal import BlockDiagonalCovariance
from hardeq.testing import assert_exact_per_row

F = torch.float64
N = 5
LOC = torch.tensor([.1, .5, .2, .4, .3], dtype=F)
W = torch.randn(N, 2, generator=torch.Generator().manual_seed(0), dtype=F) * .3


def _law(kind: str, dtype=F):
    index = torch.tensor([0, 0, 1, 1, 1])
    if kind == "blockdiag":
        cov = BlockDiagonalCovariance(index, W.to(dtype), torch.full((N,), .05 ** .5, dtype=dtype))
        return hardeq.ConstrainedNormal(LOC.to(dtype), covariance=cov,
                                        constraint=hardeq.SumConstraint(index, torch.tensor([.5, .7], dtype=dtype)))
    total = hardeq.SumConstraint(torch.zeros(N, dtype=torch.long), torch.tensor([1.2], dtype=dtype))
    if kind == "lowrank":
        return hardeq.ConstrainedNormal(LOC.to(dtype), torch.full((N,), .05 ** .5, dtype=dtype),
                                        cov_factor=W.to(dtype), constraint=total)
    return hardeq.ConstrainedNormal(LOC.to(dtype), covariance_matrix=(W @ W.T + .05 * torch.eye(N, dtype=F)).to(dtype),
                                    constraint=total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("kind", ["lowrank", "full", "blockdiag"])
def test_augmented_gibbs_matches_rejection(kind, dtype):
    """One draw per chain after a burn-in (independent chains), each coordinate against exact rejection draws by
    two-sample Kolmogorov-Smirnov tests at a Bonferroni level of 1e-3 over the 5 coordinates."""
    d = _law(kind, dtype)
    lo, hi = torch.zeros(N, dtype=dtype), torch.full((N,), .6, dtype=dtype)
    ref, _ = rejection_sample(d, lo, hi, 3000, generator=torch.Generator().manual_seed(1))
    start = truncated_mode(d, lo, hi).expand(3000, N).contiguous()
    res = blocked_gibbs(d, lo, hi, start, num_samples=1, burn_in=200, generator=torch.Generator().manual_seed(2))
    z = res.samples[0]
    assert z.dtype == dtype and bool(((z >= lo) & (z <= hi)).all())
    assert_exact_per_row(d.constraint, z)
    for i in range(N):
        assert stats.ks_2samp(z[:, i].double().numpy(), ref[:, i].double().numpy()).pvalue > 2e-4, i


@pytest.mark.slow
def test_augmented_gibbs_dense_rows_and_batch():
    """Two dense rows and a batch of two different laws: each batch element against its own rejection draws (a
    result must not depend on what else is in the batch)."""
    A = torch.tensor([[1., 1, 1, 1, 1], [1, -1, 0, .5, 0]], dtype=F)
    k = torch.tensor([[1.2, .1], [1.0, 0.0]], dtype=F)
    d = hardeq.ConstrainedNormal(LOC.expand(2, N), torch.full((N,), .05 ** .5, dtype=F), cov_factor=W,
                                 constraint=hardeq.LinearConstraint(A, k))
    lo, hi = torch.zeros(2, N, dtype=F), torch.full((2, N), .6, dtype=F)
    ref, _ = rejection_sample(d, lo, hi, 3000, generator=torch.Generator().manual_seed(1))
    start = truncated_mode(d, lo, hi).expand(3000, 2, N).contiguous()
    z = blocked_gibbs(d, lo, hi, start, num_samples=1, burn_in=1500,
                      generator=torch.Generator().manual_seed(2)).samples[0]
    for b in range(2):
        for i in range(N):
            assert stats.ks_2samp(z[:, b, i].numpy(), ref[:, b, i].numpy()).pvalue > 1e-4, (b, i)


def test_the_split_of_a_float32_scale_tril_is_formed_from_its_factor_in_float64():
    """A full covariance given by a float32 ``scale_tril`` with a small diagonal: its float32 product L L^T is
    often indefinite (the split used to take it, floor the correlation's smallest eigenvalue at 0, and fail in
    Cholesky), and even where it is not it holds Sigma only to float32. The split must reproduce L L^T of the
    float32 L, computed in float64, to float64 round-off, for every one of 40 such factors."""
    from hardeq.bounds.augment import augmentation
    from hardeq.linalg.covariance import FullCovariance

    indefinite = 0
    for trial in range(40):
        g = torch.Generator().manual_seed(trial)
        L = (torch.tril(torch.randn(6, 6, generator=g, dtype=F), -1)
             + torch.diag(1e-4 + 1e-3 * torch.rand(6, generator=g, dtype=F))).float()
        indefinite += bool(torch.linalg.eigvalsh((L @ L.mT).double())[0] <= 0)
        aug = augmentation(FullCovariance(L), torch.Size([]), 6)
        sigma = L.double() @ L.double().mT
        split = torch.diag_embed(aug.diag[0]) + aug.factor[0] @ aug.factor[0].mT
        assert bool((aug.diag > 0).all()) and bool(torch.isfinite(aug.gain).all()), trial
        assert float((split - sigma).abs().max()) <= 1e3 * torch.finfo(F).eps * float(sigma.abs().max()), trial
    assert indefinite >= 5  # the case the test is about occurs


# ---------------------------------------------------------------------------------------------- finding A
def _thin():
    B = torch.tensor([[.5, .1, 0, .2], [.1, .4, .1, 0], [0, .1, .3, .1], [.2, 0, .1, .5]], dtype=F)
    Sigma = B @ B.T + .05 * torch.eye(4, dtype=F)
    d = hardeq.ConstrainedNormal(torch.full((4,), .3, dtype=F), covariance_matrix=Sigma,
                                 constraint=hardeq.SumConstraint(torch.zeros(4, dtype=torch.long),
                                                                 torch.tensor([1.2], dtype=F)))
    hi = torch.ones(4, dtype=F)
    hi[1] = 1e-9
    return d, Sigma, hi


def _limit_law_draws(Sigma: torch.Tensor, num: int) -> np.ndarray:
    """The law as the width of z1's box goes to 0 (error O(1e-9)): N(0.3, Sigma) given z1 = 0 and sum z = 1.2,
    in [0, 1]^4, by numpy: the Gaussian conditional on the two rows, then rejection."""
    S = Sigma.numpy()
    mu = np.full(4, .3)
    R = np.array([[0., 1, 0, 0], [1, 1, 1, 1]])
    r = np.array([0.0, 1.2])
    K = S @ R.T @ np.linalg.inv(R @ S @ R.T)
    mean = mu + K @ (r - R @ mu)
    cov = S - K @ R @ S
    evals, evecs = np.linalg.eigh((cov + cov.T) / 2)
    root = evecs * np.sqrt(np.clip(evals, 0, None))
    rng = np.random.default_rng(0)
    out = []
    while sum(len(o) for o in out) < num:
        z = mean + rng.standard_normal((20000, 4)) @ root.T
        out.append(z[((z >= -1e-12) & (z <= 1)).all(1)])
    return np.concatenate(out)[:num]


def test_a_thin_polytope_auto_moves_and_matches_the_limit_law():
    """Before: auto picked exact HMC (non-diagonal covariance), every trajectory hit the bounce cap, and all 24
    draws were copies of the mode (sd 0). Now auto picks the augmented Gibbs sampler, whose draws match the
    limit law z1 = 0 (numpy rejection)."""
    d, Sigma, hi = _thin()
    out = d.truncate(0.0, hi).sample_with_info((1500,), burn_in=100, generator=torch.Generator().manual_seed(0))
    assert out.method == "gibbs"
    z = out.samples
    assert bool((z[:, 1] <= 1e-9).all() and (z >= 0).all())
    ref = _limit_law_draws(Sigma, 3000)
    for i in (0, 2, 3):
        assert stats.ks_2samp(z[:, i].numpy(), ref[:, i]).pvalue > 1e-3, i
    assert abs(float(z[:, 0].std()) - ref[:, 0].std()) < 0.03


def test_a_hmc_that_cannot_move_raises_naming_the_thin_coordinate():
    d, _, hi = _thin()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(ChainStuck, match=r"never moved.*coordinate 1 has width 1e-09"):
            d.truncate(0.0, hi).sample((2,), method="hmc", burn_in=2, generator=torch.Generator().manual_seed(0))
    assert issubclass(ChainStuck, RuntimeError)
