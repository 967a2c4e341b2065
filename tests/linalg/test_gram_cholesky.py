"""The blocked Gram-Cholesky (``hardeq.linalg.cholesky.gram_cholesky_lower``) and the Cholesky factor built on it
(a shared dense ``A`` with many rows under a diagonal covariance).

References: the dense float64 Cholesky of the explicitly formed Gram matrix, the dense float64 conditional
(``hardeq.testing.dense_conditional``: an SVD null-space basis, no Gram matrix), and the unblocked factor of the same
problem.
"""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.linalg import cholesky as chol
from hardeq.linalg.conditioning import cholesky as factor_module
from hardeq.testing import assert_exact_per_row, dense_conditional
from tests.device import device

#: the blocked Gram-Cholesky route is the CPU's (``_blocked_operand``); on a GPU the same problems take the
#: equilibrated ``cholesky_ex`` route, and these tests check the same mathematics there
BLOCKED = device().type == "cpu"

DTYPES = (torch.float32, torch.float64)
TOL = {torch.float32: 2e-5, torch.float64: 1e-12}


def _gram64(A, v):
    A64, v64 = A.double(), v.double()
    return (A64 * v64.unsqueeze(-2)) @ A64.mT


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("a, n, batch", [(300, 500, (3,)), (130, 400, ()), (64, 100, (2, 2)), (200, 201, (1,))])
def test_factor_matches_dense_cholesky_of_the_formed_gram(dtype, a, n, batch):
    g = torch.Generator().manual_seed(a + n)
    A = torch.randn(a, n, generator=g, dtype=dtype)
    v = torch.rand(batch + (n,), generator=g, dtype=dtype) + 0.1
    L, info, diag = chol.gram_cholesky_lower(A, v)
    assert L.shape == batch + (a, a) and info.shape == batch and diag.shape == batch + (a,)
    assert L.dtype == dtype and bool((info == 0).all())
    S = _gram64(A, v)
    L64 = torch.linalg.cholesky(S)
    err = (L.double().tril() - L64).abs().amax() / L64.abs().amax()
    assert err < 100 * torch.finfo(dtype).eps * a ** 0.5, float(err)
    torch.testing.assert_close(diag.double(), S.diagonal(dim1=-2, dim2=-1), rtol=50 * torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_solvers_read_only_the_lower_triangle(dtype):
    """The strictly upper triangle is unspecified: the solves the factor uses must ignore it (NaN there)."""
    g = torch.Generator().manual_seed(1)
    a, n = 150, 300
    A = torch.randn(a, n, generator=g, dtype=dtype)
    v = torch.rand(2, n, generator=g, dtype=dtype) + 0.5
    L, _, _ = chol.gram_cholesky_lower(A, v)
    poisoned = L.clone()
    iu = torch.triu_indices(a, a, 1)
    poisoned[..., iu[0], iu[1]] = float("nan")
    clean = L.tril()
    r = torch.randn(2, a, 3, generator=g, dtype=dtype)
    for M, N in ((poisoned, clean), (poisoned.mT, clean.mT)):
        upper = M is not poisoned
        x = torch.linalg.solve_triangular(M, r, upper=upper)
        assert torch.equal(x, torch.linalg.solve_triangular(N, r, upper=upper))


def test_info_names_the_first_failing_pivot():
    a, n = 200, 300
    A = torch.randn(a, n, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    A[150] = 0.0  # S_150,150 = 0: the leading minor of order 151 is singular
    v = torch.ones(3, n, dtype=torch.float64)
    v[1, :] = 2.0
    _, info, _ = chol.gram_cholesky_lower(A, v)
    assert info.tolist() == [151, 151, 151]
    v2 = torch.ones(n, dtype=torch.float64)
    A2 = A.clone()
    A2[150] = 1.0
    _, info2, _ = chol.gram_cholesky_lower(A2, v2)
    assert int(info2) == 0


def _problem(dtype, B=3, n=600, a=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(a, n, generator=g, dtype=torch.float64) / n ** 0.5
    loc = torch.randn(B, n, generator=g, dtype=torch.float64)
    scale = torch.rand(B, n, generator=g, dtype=torch.float64) + 0.5
    k = torch.randn(B, a, generator=g, dtype=torch.float64)
    return A.to(dtype), loc.to(dtype), scale.to(dtype), k.to(dtype)


def _dist(A, loc, scale, k, validate=False):
    """The checked conditioner (the distribution validated: the blocked route is the checked mode's; without
    validation the sync-free static factor is a float64 Cholesky)."""
    con = hardeq.LinearConstraint(A, k, validate_args=validate)
    return hardeq.ConstrainedNormal(loc, scale, constraint=con, validate_args=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_blocked_factor_against_the_dense_oracle(dtype):
    A, loc, scale, k = _problem(dtype)
    d = _dist(A, loc, scale, k)
    factor = d.conditioner.factor
    assert d.conditioner.method == "cholesky" and (factor.d is None) == BLOCKED  # the blocked route on the CPU
    z = d.sample((4,))
    assert_exact_per_row(d.constraint, z)
    for b in range(loc.shape[0]):
        oracle = dense_conditional(loc[b], torch.diag(scale[b].double() ** 2), A, k[b])
        torch.testing.assert_close(d.mean[b].double(), oracle.mean, rtol=0, atol=TOL[dtype] * 100)
        var = torch.diagonal(oracle.covariance)
        torch.testing.assert_close(d.variance[b].double(), var, rtol=0, atol=TOL[dtype] * 100)
        lp = oracle.log_prob(z[:, b].double())
        torch.testing.assert_close(d.log_prob(z)[:, b].double(), lp, rtol=TOL[dtype] * 10, atol=TOL[dtype] * 100)


@pytest.mark.cpu_only(reason="the blocked route is the CPU's: on a GPU both sides would be the unblocked factor")
@pytest.mark.parametrize("dtype", DTYPES)
def test_blocked_and_unblocked_factors_agree(dtype, monkeypatch):
    A, loc, scale, k = _problem(dtype, seed=1)
    blocked = _dist(A, loc, scale, k)
    assert blocked.conditioner.factor.d is None  # built now, before the route is switched off
    monkeypatch.setattr(factor_module, "BLOCKED_MIN_ROWS", 10 ** 9)
    plain = _dist(A, loc, scale, k)
    assert plain.conditioner.factor.d is not None and blocked.conditioner.factor.d is None
    cb, cp = blocked.conditioner, plain.conditioner
    tol = TOL[dtype]
    assert abs(cb.factor.kappa - cp.factor.kappa) <= 1e-3 * cp.factor.kappa
    torch.testing.assert_close(cb.logdet(), cp.logdet(), rtol=tol, atol=tol * A.shape[0])
    torch.testing.assert_close(blocked.mean, plain.mean, rtol=0, atol=100 * tol)
    r = torch.randn(5, 3, A.shape[0], dtype=dtype)
    torch.testing.assert_close(cb.inv_quad(r), cp.inv_quad(r), rtol=100 * tol, atol=0)
    torch.testing.assert_close(cb.gain_matvec(r), cp.gain_matvec(r), rtol=0, atol=100 * tol)


def test_ill_conditioned_float32_escalates_to_the_blocked_float64_factor():
    A, loc, scale, k = _problem(torch.float64, B=2, seed=3)
    scale = torch.logspace(-4, 4, A.shape[1], dtype=torch.float64).expand(2, -1).contiguous()
    A[1] = A[0] + 1e-4 * A[1]  # nearly dependent rows: kappa far above the float32 limit
    d = _dist(A.float(), loc.float(), scale.float(), k.float())
    factor = d.conditioner.factor
    assert d.conditioner.method == "cholesky64" and factor.precision == torch.float64
    assert (factor.d is None) == BLOCKED
    z = d.sample((3,))
    assert_exact_per_row(d.constraint, z)


def test_gradient_keeps_the_unblocked_differentiable_factor():
    A, loc, scale, k = _problem(torch.float64, B=2, n=600, a=260, seed=4)
    scale = scale.clone().requires_grad_()
    d = _dist(A, loc, scale, k)
    assert d.conditioner.factor.d is not None  # a gradient is wanted: the differentiable path
    z = d.rsample()
    z.square().sum().backward()
    assert scale.grad is not None and bool(torch.isfinite(scale.grad).all())
    with torch.no_grad():
        ref = _dist(A, loc, scale.detach(), k)
        assert (ref.conditioner.factor.d is None) == BLOCKED
        torch.testing.assert_close(ref.mean, d.mean.detach(), rtol=0, atol=1e-11)
