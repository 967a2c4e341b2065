"""The O(n) grouped path with arbitrary entries: every column of ``A`` has at most one nonzero ``a_i`` (any value,
any sign), some columns none (free coordinates).

Regression (issue "Core v4", item 1): the grouped variance assumed 0/1 entries, so ``A = [[1, 2]]`` with unit scales
gave variances ``[0.8, 0.9]`` instead of ``[0.8, 0.2]``, a free coordinate got variance 0 and ``KL(d, d) = -inf``,
and the wrong variances flowed into ``expected_l1`` / ``expected_l2``. Everything is compared with the dense float64
null-space oracle (:func:`hardeq.testing.dense_conditional`), under every covariance structure (the diagonal one
takes the grouped path; the others take the dense paths and must agree), in float32 and float64.
"""

from __future__ import annotations

import math

import pytest
import torch

import hardeq
from hardeq.testing import dense_conditional

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
TOL = {torch.float32: dict(rtol=2e-4, atol=2e-5), torch.float64: dict(rtol=1e-10, atol=1e-12)}

#: A (one nonzero per column at most), k
CASES = {
    "single_row_1_2": ([[1.0, 2.0]], [1.0]),
    "free_column": ([[1.0, 1.0, 0.0]], [1.0]),
    "negative_entries": ([[1.0, -2.0, 0.5, 0.0]], [0.3]),
    "disjoint_rows": ([[2.0, 0.0, -1.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.5, 0.0, -0.25]], [1.0, -2.0]),
}


def _covariance(kind: str, n: int, dtype: torch.dtype, seed: int = 0):
    """A covariance object and its dense float64 matrix."""
    g = torch.Generator().manual_seed(seed)
    scale = (0.5 + torch.rand(n, dtype=torch.float64, generator=g))
    if kind == "unit":
        scale = torch.ones(n, dtype=torch.float64)
    if kind in ("unit", "diagonal"):
        return hardeq.DiagonalCovariance(scale.to(dtype)), torch.diag(scale ** 2)
    if kind == "full":
        X = torch.randn(n, n, dtype=torch.float64, generator=g)
        L = torch.linalg.cholesky(X @ X.T / n + 0.5 * torch.eye(n, dtype=torch.float64))
        return hardeq.FullCovariance(L.to(dtype)), L @ L.T
    W = 0.7 * torch.randn(n, 2, dtype=torch.float64, generator=g)
    return hardeq.LowRankCovariance(W.to(dtype), scale.to(dtype)), W @ W.T + torch.diag(scale ** 2)


def _case(name: str, cov_kind: str, dtype: torch.dtype):
    A, k = (torch.tensor(x, dtype=torch.float64) for x in CASES[name])
    n = A.shape[-1]
    cov, S = _covariance(cov_kind, n, dtype)
    loc = torch.linspace(-0.7, 0.9, n, dtype=torch.float64)
    con = hardeq.SparseConstraint(A.to(dtype).to_sparse_csr(), k.to(dtype))
    d = hardeq.ConstrainedNormal(loc.to(dtype), covariance=cov, constraint=con)
    return d, dense_conditional(loc, S, A, k), A, k, loc, S


def _close(actual, expected, dtype, what):
    torch.testing.assert_close(actual.double(), expected.double(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


def _folded_mean(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """E|X| for X ~ N(m, v), float64, v >= 0 (|m| where v = 0)."""
    sd = v.clamp_min(0).sqrt()
    safe = torch.where(sd > 0, sd, torch.ones_like(sd))
    phi = torch.exp(-0.5 * (m / safe) ** 2) / math.sqrt(2 * math.pi)
    Phi = 0.5 * torch.erfc(-(m / safe) / math.sqrt(2))
    out = safe * 2 * phi + m * (2 * Phi - 1)
    return torch.where(sd > 0, out, m.abs())


def test_the_reported_case_exactly():
    """``A = [[1, 2]]``, unit scales, ``k = [1]``: variances [0.8, 0.2] (float64), the grouped path."""
    d, *_ = _case("single_row_1_2", "unit", torch.float64)
    assert d.conditioner.method == "grouped"
    torch.testing.assert_close(d.variance, torch.tensor([0.8, 0.2], dtype=torch.float64), rtol=1e-14, atol=1e-15)
    assert float(torch.distributions.kl_divergence(d, d)) == pytest.approx(0.0, abs=1e-13)


@DTYPES
@pytest.mark.parametrize("cov_kind", ["unit", "diagonal", "full", "lowrank"])
@pytest.mark.parametrize("name", list(CASES))
def test_moments_kl_and_losses_against_the_dense_oracle(name, cov_kind, dtype):
    d, oracle, A, k, loc, S = _case(name, cov_kind, dtype)
    if cov_kind in ("unit", "diagonal"):
        assert d.conditioner.method == "grouped", "one nonzero per column + diagonal covariance: the O(n) path"
    var = oracle.covariance.diagonal()
    _close(d.mean, oracle.mean, dtype, "mean")
    _close(d.variance, var, dtype, "variance")
    _close(d.covariance_matrix, oracle.covariance, dtype, "covariance_matrix")
    _close(d.entropy(), oracle.entropy(), dtype, "entropy")
    z = oracle.mean + oracle.basis @ torch.linspace(-0.5, 0.5, oracle.basis.shape[-1], dtype=torch.float64)
    _close(d.log_prob(z.to(dtype)), oracle.log_prob(z), dtype, "log_prob")
    kl_self = torch.distributions.kl_divergence(d, d)
    assert torch.isfinite(kl_self) and abs(float(kl_self)) < (1e-4 if dtype == torch.float32 else 1e-12)
    # against a second distribution on the same plane (different loc and diagonal scales): the oracle's t-space KL
    scale_p = torch.linspace(0.6, 1.4, A.shape[-1], dtype=torch.float64)
    loc_p = loc.flip(-1)
    p = hardeq.ConstrainedNormal(loc_p.to(dtype), scale_p.to(dtype), constraint=d.constraint)
    oracle_p = dense_conditional(loc_p, torch.diag(scale_p ** 2), A, k)
    expected_kl = torch.distributions.kl_divergence(oracle.t_distribution, oracle_p.t_distribution)
    _close(torch.distributions.kl_divergence(d, p), expected_kl, dtype, "KL(d, p)")
    _close(torch.distributions.kl_divergence(p, d),
           torch.distributions.kl_divergence(oracle_p.t_distribution, oracle.t_distribution), dtype, "KL(p, d)")
    # expected losses: closed forms from the dense conditional's mean and variance
    y = torch.linspace(1.0, -1.0, A.shape[-1], dtype=torch.float64)
    m = oracle.mean - y
    _close(d.expected_l2(y.to(dtype)), m ** 2 + var, dtype, "expected_l2")
    _close(d.expected_l1(y.to(dtype)), _folded_mean(m, var), dtype, "expected_l1")


@DTYPES
def test_free_coordinates_keep_their_variance_and_pass_through(dtype):
    """A coordinate in no row keeps :math:`\\sigma_i^2` and its own mean; samples of it are unconstrained."""
    d, oracle, A, *_ = _case("disjoint_rows", "diagonal", dtype)
    free = (A == 0).all(0)
    _close(d.variance[free], d.covariance.diagonal()[free], dtype, "free variance")
    _close(d.mean[free], d.loc[free], dtype, "free mean")


@DTYPES
def test_batched_k_and_monte_carlo_variance(dtype):
    """A batch of right-hand sides on the grouped path: per-element oracle variances, and sample variances that match
    them (20,000 draws, 5-sigma band of the sample variance, sd = var sqrt(2 / N))."""
    A, _ = (torch.tensor(x, dtype=torch.float64) for x in CASES["disjoint_rows"])
    k = torch.tensor([[1.0, -2.0], [0.0, 4.0], [-3.0, 0.5]], dtype=torch.float64)
    scale = torch.linspace(0.5, 2.0, A.shape[-1], dtype=torch.float64)
    loc = torch.linspace(-1.0, 1.0, A.shape[-1], dtype=torch.float64)
    con = hardeq.SparseConstraint(A.to(dtype).to_sparse_csr(), k.to(dtype))
    d = hardeq.ConstrainedNormal(loc.to(dtype), scale.to(dtype), constraint=con)
    assert d.conditioner.method == "grouped"
    torch.manual_seed(0)
    N = 20_000
    z = d.sample((N,)).double()
    for b in range(3):
        oracle = dense_conditional(loc, torch.diag(scale ** 2), A, k[b])
        var = oracle.covariance.diagonal()
        _close(d.variance[b], var, dtype, f"variance[{b}]")
        _close(d.mean[b], oracle.mean, dtype, f"mean[{b}]")
        band = 5 * var * math.sqrt(2 / N) + (1e-5 if dtype == torch.float32 else 1e-12)
        assert bool(((z[:, b].var(0) - var).abs() <= band).all()), (z[:, b].var(0), var)
