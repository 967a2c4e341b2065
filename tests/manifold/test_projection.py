"""project / mode: the Sigma-nearest point of the manifold, against closed forms and scipy SLSQP; batching;
infeasible k; implicit gradients against finite differences."""

import time

import numpy as np
import pytest
import scipy.optimize
import torch

from hardeq import (ConstrainedNormal, DiagonalCovariance, FullCovariance, LinearConstraint, LowRankCovariance,
                    NonlinearConstraint)
from hardeq.manifold import ManifoldError, ManifoldTarget, feasibility_tol, kkt_solve, project

from .cases import energy_balance, sphere, two_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sphere_isotropic_is_radial(dtype):
    # identity covariance: the nearest point of |z|^2 = r^2 is r x / |x|
    x = torch.randn(50, 3, dtype=dtype, generator=torch.Generator().manual_seed(0)) * 3
    d = ConstrainedNormal(torch.zeros(3, dtype=dtype), 1.0, constraint=sphere(4.0, dtype))
    z = d.project(x)
    assert bool(d.constraint.check(z).all())
    torch.testing.assert_close(z, 2 * x / x.norm(dim=-1, keepdim=True), rtol=20 * torch.finfo(dtype).eps ** 0.5 if
                               dtype == torch.float32 else 1e-10, atol=0)


@pytest.mark.parametrize("make, n", [(two_rows, 4), (energy_balance, 5)])
def test_against_slsqp(make, n):
    gen = torch.Generator().manual_seed(1)
    con = make(torch.float64)
    scale = torch.rand(n, dtype=torch.float64, generator=gen) + 0.5
    target = ManifoldTarget(torch.zeros(n, dtype=torch.float64), DiagonalCovariance(scale), con)
    for _ in range(5):
        x = torch.randn(n, dtype=torch.float64, generator=gen)
        z = project(target, x)
        w = (1 / scale ** 2).numpy()
        xn = x.numpy()
        res = scipy.optimize.minimize(
            lambda v, w=w, xn=xn: 0.5 * np.sum(w * (v - xn) ** 2), z.numpy() + 0.01,
            jac=lambda v, w=w, xn=xn: w * (v - xn),
            constraints=[{"type": "eq", "fun": lambda v: con.residual(torch.from_numpy(v)).numpy()}],
            method="SLSQP", options={"ftol": 1e-14, "maxiter": 500})
        assert res.success
        # same local minimum, ours at least as good and feasible per row
        assert np.abs(res.x - z.numpy()).max() < 1e-5
        assert 0.5 * float(((z - x) ** 2 / scale ** 2).sum()) <= res.fun + 1e-9
        assert bool(con.check(z))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_affine_equals_linear(dtype):
    gen = torch.Generator().manual_seed(2)
    A = torch.randn(2, 5, dtype=dtype, generator=gen)
    c, k = torch.randn(2, dtype=dtype, generator=gen), torch.randn(2, dtype=dtype, generator=gen)
    loc = torch.randn(3, 5, dtype=dtype, generator=gen)
    scale = torch.rand(3, 5, dtype=dtype, generator=gen) + 0.3
    d = ConstrainedNormal(loc, scale, constraint=NonlinearConstraint(lambda z: z @ A.T + c, k))
    lin = ConstrainedNormal(loc, scale, constraint=LinearConstraint(A, k - c))
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(d.mode, lin.mean, rtol=0, atol=200 * eps * float(lin.mean.abs().max() + 1))
    x = torch.randn(4, 3, 5, dtype=dtype, generator=gen)
    # the Sigma-nearest point of the plane is the linear conditional mean of N(x, Sigma)
    lin_x = ConstrainedNormal(x, scale, constraint=LinearConstraint(A, k - c))
    torch.testing.assert_close(d.project(x), lin_x.mean, rtol=0, atol=200 * eps * float(x.abs().max() + 1))


def test_batch_of_k_and_batch_shapes_independent():
    k = torch.tensor([[1.0], [4.0], [0.25]], dtype=torch.float64)          # batch (3,)
    loc = torch.randn(2, 1, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))  # batch (2, 1)
    scale = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    d = ConstrainedNormal(loc, scale, constraint=NonlinearConstraint(lambda z: (z * z).sum(-1, keepdim=True), k))
    assert d.batch_shape == (2, 3)
    z = d.mode
    assert z.shape == (2, 3, 3) and bool(d.constraint.check(z).all())
    for i in range(2):
        for j in range(3):  # one element alone gives the same point: results do not depend on the batch
            single = ConstrainedNormal(loc[i, 0], scale, constraint=NonlinearConstraint(
                lambda z: (z * z).sum(-1, keepdim=True), k[j]))
            torch.testing.assert_close(single.mode, z[i, j], rtol=0, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_infeasible_k_raises_without_hanging(dtype):
    k = torch.tensor([[1.0], [-1.0]], dtype=dtype)  # the second circle has radius^2 = -1: no point
    d = ConstrainedNormal(torch.ones(2, dtype=dtype), 1.0, constraint=NonlinearConstraint(
        lambda z: (z * z).sum(-1, keepdim=True), k))
    start = time.perf_counter()
    with pytest.raises(ManifoldError, match=r"did not converge in 100 Newton iterations at batch index \(1,\).*row 0"):
        _ = d.mode
    assert time.perf_counter() - start < 30


def test_singular_jacobian_named():
    d = ConstrainedNormal(torch.zeros(2, dtype=torch.float64), 1.0, constraint=sphere(1.0))
    with pytest.raises(ManifoldError, match="singular"):
        d.project(torch.zeros(2, dtype=torch.float64))  # J(0) = 0


def _gradcheck_target(cov_kind, n, make):
    gen = torch.Generator().manual_seed(4)
    scale = (torch.rand(n, dtype=torch.float64, generator=gen) + 0.5).requires_grad_()
    W = torch.randn(n, 2, dtype=torch.float64, generator=gen).mul(0.3).requires_grad_()
    L = (torch.eye(n, dtype=torch.float64) + 0.2 * torch.randn(n, n, dtype=torch.float64, generator=gen).tril(-1)
         ).requires_grad_()
    tensors = {"diag": (scale,), "lowrank": (W, scale), "full": (L,)}[cov_kind]

    def build(*ts):
        return {"diag": lambda: DiagonalCovariance(ts[0]), "lowrank": lambda: LowRankCovariance(ts[0], ts[1]),
                "full": lambda: FullCovariance(ts[0].tril())}[cov_kind]()
    return tensors, build


@pytest.mark.parametrize("cov_kind", ["diag", "lowrank", "full"])
def test_implicit_gradient_gradcheck(cov_kind):
    con0 = two_rows(torch.float64)
    x = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_()
    k = con0.k.clone().requires_grad_()
    tensors, build = _gradcheck_target(cov_kind, 4, two_rows)

    def fn(x, k, *ts):
        target = ManifoldTarget(torch.zeros(4, dtype=torch.float64), build(*ts), NonlinearConstraint(con0.h, k))
        return project(target, x)
    assert torch.autograd.gradcheck(fn, (x, k, *tensors))


def test_mode_gradient_wrt_loc_matches_finite_differences():
    con = energy_balance(torch.float64)
    loc = torch.tensor([0.3, 0.6, 2.0, 1.0, 1.5], dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([0.1, 0.1, 0.5, 0.5, 0.5], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda m: ConstrainedNormal(m, scale, constraint=con).mode, (loc,))


def test_float32_every_row_feasible():
    gen = torch.Generator().manual_seed(6)
    con = energy_balance(torch.float32)
    loc = torch.randn(200, 5, generator=gen) + torch.tensor([0.5, 0.5, 3.0, 1.0, 2.0])
    d = ConstrainedNormal(loc, torch.rand(200, 5, generator=gen) + 0.1, constraint=con)
    ratio = con.row_ratio(d.mode)
    assert ratio.max() <= feasibility_tol(torch.float32)


def test_large_batch_converges_and_matches_single_elements():
    # regression: at the round-off floor the merit line search could refuse every step for one element of a large
    # batch (BLAS blocking changes the round-off with the batch size), which then never declared convergence
    gen = torch.Generator().manual_seed(7)
    con = energy_balance(torch.float64)
    loc = torch.tensor([0.35, 0.65, 1.0, 2.0, 1.5], dtype=torch.float64) + 0.5 * torch.randn(
        512, 5, dtype=torch.float64, generator=gen)
    scale = torch.full((5,), 0.37, dtype=torch.float64)
    z = ConstrainedNormal(loc, scale, constraint=con).mode
    assert con.row_ratio(z).max() <= feasibility_tol(torch.float64)
    for i in torch.randint(0, 512, (6,), generator=gen).tolist():
        single = ConstrainedNormal(loc[i], scale, constraint=con).mode
        torch.testing.assert_close(single, z[i], rtol=1e-10, atol=1e-12)


def test_local_phase_takes_full_steps():
    # from a feasible start a tangential 1e-9 away from the solution, the merit function cannot see the decrease
    # (its changes are round-off); full Newton steps converge in a few iterations
    con = sphere(4.0)
    scale = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    target = ManifoldTarget(torch.zeros(3, dtype=torch.float64), DiagonalCovariance(scale), con)
    x = torch.tensor([[3.0, 1.0, -2.0]], dtype=torch.float64).expand(64, 3)
    z_star, _ = kkt_solve(target, x)
    gen = torch.Generator().manual_seed(8)
    tangent = torch.linalg.cross(z_star, torch.randn(64, 3, dtype=torch.float64, generator=gen))
    start = z_star + 1e-9 * tangent / tangent.norm(dim=-1, keepdim=True)
    start = 2 * start / start.norm(dim=-1, keepdim=True)  # feasible
    z, _ = kkt_solve(target, x, z0=start, max_iter=6)
    torch.testing.assert_close(z, z_star, rtol=0, atol=1e-12)


def test_gauss_newton_option_reaches_the_same_point():
    con = energy_balance(torch.float64)
    scale = torch.tensor([0.2, 0.2, 0.5, 0.5, 0.5], dtype=torch.float64)
    target = ManifoldTarget(torch.zeros(5, dtype=torch.float64), DiagonalCovariance(scale), con)
    x = torch.tensor([0.4, 0.5, 3.0, 1.0, 2.0], dtype=torch.float64) + 0.05 * torch.randn(
        20, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    z_newton, _ = kkt_solve(target, x)
    z_gn, _ = kkt_solve(target, x, newton=False, max_iter=300)
    torch.testing.assert_close(z_gn, z_newton, rtol=0, atol=1e-9)
