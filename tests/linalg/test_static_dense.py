"""The fused static factor of a shared dense ``A`` under per-sample diagonal scales
(``hardeq.linalg.conditioning.static_dense``): chosen on the sync-free path, exact per row, its log-density equal to
the general path's (an independent float64 evaluation of the same formula), no host read; failures raise."""

from __future__ import annotations

import math

import pytest
import torch

import hardeq
from hardeq.linalg.conditioning import static_dense
from hardeq.linalg.conditioning.static_dense import StaticPairsFactor
from hardeq.linalg.device import forced
from hardeq.testing import assert_exact_per_row, count_calls

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])


def _problem(dtype, B=5, n=400, a=6, seed=0, decades=4.0, off=1.0):
    """Rows of A up to 1e5 apart in size, scales over ``decades``, loc ``off`` scales off the plane."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(a, n, generator=g, dtype=torch.float64)
    A[0] *= 1e3
    A[-1] *= 1e-2
    scale = 10 ** (decades * (torch.rand(B, n, generator=g, dtype=torch.float64) - 0.5))
    loc = torch.randn(B, n, generator=g, dtype=torch.float64) * scale * off
    k = torch.randn(B, a, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (A, loc, scale, k)]


def _dist(A, loc, scale, k, validate=False):
    con = hardeq.LinearConstraint(A, k, validate_args=validate)
    return hardeq.ConstrainedNormal(loc, scale, constraint=con, validate_args=validate)


def _log_prob_float64(A, loc, scale, k, z):
    """The density on the plane through ``z`` from its definition, in float64 with dense linear algebra:
    log N(z; mu, Sigma) - log N(A z; A mu, A Sigma A^T) - log det(A A^T) / 2 (the coarea factor of z -> A z)."""
    A, loc, scale, k, z = (t.double() for t in (A, loc, scale, k, z))
    n, a = A.shape[-1], A.shape[-2]
    var = scale.square()
    S = (A * var.unsqueeze(-2)) @ A.mT
    r = (z - loc) @ A.mT  # (A z - A mu: the plane through z, which a float32 z meets to its rounding only)
    joint = -0.5 * (((z - loc) / scale).square().sum(-1) + var.log().sum(-1) + n * math.log(2 * math.pi))
    marginal = -0.5 * ((r.unsqueeze(-2) @ torch.linalg.solve(S, r.unsqueeze(-1))).squeeze((-1, -2))
                       + torch.logdet(S) + a * math.log(2 * math.pi))
    return joint - marginal - 0.5 * torch.logdet(A @ A.mT)


@DTYPES
@pytest.mark.parametrize("off", [1.0, 1e3], ids=["near", "far"])
def test_sample_is_exact_and_log_prob_matches_the_definition(dtype, off):
    A, loc, scale, k = _problem(dtype, off=off)
    with forced("gpu"):
        _dist(A, loc, scale, k).log_prob(_dist(A, loc, scale, k).sample())  # (first use of A: its constants)
        d = _dist(A, loc, scale, k)
        with count_calls() as count:
            z = d.sample((3,))
            lp = d.log_prob(z)
    assert isinstance(d.conditioner.factor, StaticPairsFactor)
    assert count.host_reads == 0
    assert z.dtype == lp.dtype == dtype and z.shape == (3,) + loc.shape and lp.shape == (3, loc.shape[0])
    assert_exact_per_row(d.constraint, z)
    ref = _log_prob_float64(A, loc, scale, k, z)
    # the reference's own cancellation: joint and marginal terms ~ (off / 2) |r|^2 each, in float64
    eps = torch.finfo(dtype).eps
    tol = 50 * (eps * ref.abs() + torch.finfo(torch.float64).eps * (off ** 2 * A.shape[-1] + ref.abs()))
    assert ((lp.double() - ref).abs() <= tol).all(), (lp.double() - ref).abs().max()


@DTYPES
def test_log_prob_equals_the_general_static_path(dtype, monkeypatch):
    """Same distribution, same value: the fused log-density and the conditioner's deviation + normaliser (the
    path every other structure takes) agree to the working precision."""
    A, loc, scale, k = _problem(dtype, seed=1, off=30.0)
    with forced("gpu"):
        d = _dist(A, loc, scale, k)
        z = d.sample()
        fused = d.log_prob(z)
        monkeypatch.setattr(static_dense, "MAX_ROWS", 0)  # (the general float64 Cholesky factor instead)
        d2 = _dist(A, loc, scale, k)
        general = d2.log_prob(z)
    assert not isinstance(d2.conditioner.factor, StaticPairsFactor)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(fused, general, rtol=20 * eps, atol=20 * eps * float(general.abs().max()))


@DTYPES
def test_samples_do_not_depend_on_the_rest_of_the_batch(dtype):
    """Row b's sample is a function of row b's inputs and noise only: a batch with one row's scales 1e6 larger
    leaves the other rows' samples (same noise) within the exactness tolerance of their own scale."""
    A, loc, scale, k = _problem(dtype, B=4, seed=2)
    big = scale.clone()
    big[3] *= 1e6
    with forced("gpu"):
        torch.manual_seed(5)
        z = _dist(A, loc, scale, k).sample()
        torch.manual_seed(5)
        z_big = _dist(A, loc, big, k).sample()
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    for b in range(3):
        assert ((z[b] - z_big[b]).abs() <= tol * z[b].abs().amax()).all()


def test_a_zero_scale_has_no_density():
    A, loc, scale, k = _problem(torch.float32, seed=3)
    scale[1, 7] = 0.0
    with forced("gpu"):
        d = _dist(A, loc, scale, k)
        z = d.mean.detach()
        with pytest.raises(ValueError, match="nonsingular for log_prob"):
            d.log_prob(z)


def test_nearly_dependent_rows_raise_naming_the_row():
    """Two rows 1e-12 apart: the float64 factor cannot meet them; the deferred check raises (at once on a CPU)."""
    g = torch.Generator().manual_seed(4)
    A = torch.randn(3, 50, generator=g, dtype=torch.float64)
    A[1] = A[0] + 1e-12 * torch.randn(50, generator=g, dtype=torch.float64)
    scale = torch.rand(4, 50, generator=g, dtype=torch.float64) + 0.5
    with forced("gpu"), pytest.raises(hardeq.NotPSDError, match=r"misses a row of A z = k.*row \d"):
        d = _dist(A, torch.zeros(4, 50, dtype=torch.float64), scale, torch.ones(4, 3, dtype=torch.float64))
        assert isinstance(d.conditioner.factor, StaticPairsFactor)
        d.sample()


def test_a_gradient_takes_the_general_path():
    """log_prob with a gradient wanted w.r.t. loc: the general (differentiable) path, the same value."""
    A, loc, scale, k = _problem(torch.float64, seed=5)
    with forced("gpu"):
        z = _dist(A, loc, scale, k).sample()
        value = _dist(A, loc, scale, k).log_prob(z)
        loc_g = loc.clone().requires_grad_()
        lp = _dist(A, loc_g, scale, k).log_prob(z)
        lp.sum().backward()
    torch.testing.assert_close(lp.detach(), value, rtol=1e-12, atol=1e-9)
    assert loc_g.grad is not None and torch.isfinite(loc_g.grad).all()


@pytest.mark.parametrize("centre", [1e30, 1e-30], ids=["1e30", "1e-30"])
def test_float32_scales_far_from_one_need_no_normalising_scale(centre, monkeypatch):
    """A float32 covariance enters the float64 factor as sigma^2 itself (no c): at scales of 1e+-30 nothing over-
    or underflows; samples exact per row, log_prob as the general path's (which normalises by c)."""
    g = torch.Generator().manual_seed(6)
    A = torch.randn(5, 300, generator=g)
    scale = (centre * (0.5 + torch.rand(4, 300, generator=g, dtype=torch.float64))).float()
    loc = (torch.randn(4, 300, generator=g, dtype=torch.float64) * centre).float()
    k = (torch.randn(4, 5, generator=g, dtype=torch.float64) * centre * 10).float()
    with forced("gpu"):
        d = _dist(A, loc, scale, k)
        z = d.sample()
        fused = d.log_prob(z)
        monkeypatch.setattr(static_dense, "MAX_ROWS", 0)
        general = _dist(A, loc, scale, k).log_prob(z)
    assert isinstance(d.conditioner.factor, StaticPairsFactor)
    assert_exact_per_row(d.constraint, z)
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(fused, general, rtol=20 * eps, atol=20 * eps * float(general.abs().max()))
