"""ManifoldNormal as ConstrainedNormal(..., constraint=NonlinearConstraint(...)): routing, log_prob (exact for affine h,
against quadrature on a circle), errors, truncate, expand."""

import math

import numpy as np
import pytest
import scipy.integrate as si
import torch

import hardeq
from hardeq import ConstrainedNormal, LinearConstraint, ManifoldNormal, NonlinearConstraint

from .cases import energy_balance, sphere
from .exact import circle_moments


def test_routing_and_shapes():
    con = sphere(torch.tensor([1.0, 4.0], dtype=torch.float64))
    d = ConstrainedNormal(torch.tensor([0.5, 0.2], dtype=torch.float64), 1.0, constraint=con)
    assert isinstance(d, ManifoldNormal) and hardeq.ManifoldNormal is ManifoldNormal
    assert d.batch_shape == (2,) and d.event_shape == (2,)
    assert d.mode.shape == (2, 2) and bool(d.support.check(d.mode).all())
    e = d.expand((3, 2))
    assert e.batch_shape == (3, 2) and e.mode.shape == (3, 2, 2)
    torch.testing.assert_close(e.mode[1], d.mode)
    assert "ManifoldNormal(n=2" in repr(d)
    # the linear path is untouched
    lin = ConstrainedNormal(torch.zeros(3), 1.0, constraint=LinearConstraint(torch.ones(1, 3), torch.ones(1)))
    assert type(lin) is ConstrainedNormal


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_prob_affine_equals_linear(dtype):
    gen = torch.Generator().manual_seed(0)
    A = torch.randn(2, 5, dtype=dtype, generator=gen)
    c, k = torch.randn(2, dtype=dtype, generator=gen), torch.randn(2, dtype=dtype, generator=gen)
    loc, scale = torch.randn(4, 5, dtype=dtype, generator=gen), torch.rand(4, 5, dtype=dtype, generator=gen) + 0.5
    d = ConstrainedNormal(loc, scale, constraint=NonlinearConstraint(lambda z: z @ A.T + c, k))
    lin = ConstrainedNormal(loc, scale, constraint=LinearConstraint(A, k - c))
    z = lin.sample((6,))
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(d.log_prob(z), lin.log_prob(z), rtol=tol, atol=tol)
    log_z, stderr = d.log_normaliser("importance", num_samples=64)  # weights are exactly 1: no error
    torch.testing.assert_close(log_z, d.log_normaliser()[0], rtol=tol, atol=tol)
    assert float(stderr.max()) <= (1e-3 if dtype == torch.float32 else 1e-9)


def test_unnormalised_density_integrates_to_the_normaliser():
    # exp(unnormalised_log_prob) integrated along the circle (arc length r dt) is Z = circle_moments' Z
    mu, sigma, r = np.array([0.6, 0.2]), np.array([0.5, 1.0]), 1.3
    d = ConstrainedNormal(torch.tensor(mu), torch.tensor(sigma), constraint=sphere(r * r))

    def f(t):
        z = torch.tensor([r * math.cos(t), r * math.sin(t)], dtype=torch.float64)
        return math.exp(float(d.unnormalised_log_prob(z))) * r
    Z_quad = si.quad(f, -math.pi, math.pi, epsabs=0, epsrel=1e-11)[0]
    Z_ref, _, _ = circle_moments(mu, sigma, r)
    assert abs(Z_quad / Z_ref - 1) < 1e-9


def test_log_prob_gradient_in_loc():
    con = energy_balance(torch.float64)
    loc = torch.tensor([0.4, 0.5, 3.0, 1.0, 2.0], dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([0.1, 0.1, 0.5, 0.5, 0.5], dtype=torch.float64)
    z = ConstrainedNormal(loc.detach(), scale, constraint=con).sample((3,))
    assert torch.autograd.gradcheck(lambda m: ConstrainedNormal(m, scale, constraint=con).log_prob(z), (loc,))


def test_mode_first_used_without_grad_keeps_the_gradient():
    con = energy_balance(torch.float64)
    loc = torch.tensor([0.4, 0.5, 3.0, 1.0, 2.0], dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([0.1, 0.1, 0.5, 0.5, 0.5], dtype=torch.float64)
    d = ConstrainedNormal(loc, scale, constraint=con)
    with torch.no_grad():
        z = d.sample((2,))  # uses the mode without a graph
    (g,) = torch.autograd.grad(d.log_prob(z).sum(), loc)
    fresh = ConstrainedNormal(loc, scale, constraint=con)
    (g_fresh,) = torch.autograd.grad(fresh.log_prob(z).sum(), loc)
    torch.testing.assert_close(g, g_fresh)


def test_errors():
    con = sphere(1.0)
    with pytest.raises(TypeError, match="constraint has dtype torch.float64 but loc has dtype torch.float32"):
        ConstrainedNormal(torch.ones(2), 1.0, constraint=con)
    with pytest.raises(ValueError, match="a nonlinear constraint needs a < n"):
        ConstrainedNormal(torch.ones(1, dtype=torch.float64), 1.0, constraint=con)
    with pytest.raises(ValueError, match="batch shapes do not broadcast"):
        ConstrainedNormal(torch.ones(3, 2, dtype=torch.float64), 1.0,
                          constraint=sphere(torch.ones(2, dtype=torch.float64)))
    with pytest.raises(ValueError, match="pass exactly one of"):
        ConstrainedNormal(torch.ones(2, dtype=torch.float64), constraint=con)
    d = ConstrainedNormal(torch.tensor([1.0, 0.5], dtype=torch.float64), 1.0, constraint=con, validate_args=True)
    with pytest.raises(ValueError, match=r"value is not on the manifold.*row 0"):
        d.log_prob(torch.tensor([2.0, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., n\) with n = 2"):
        d.project(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must have the distribution's dtype"):
        d.project(torch.zeros(2))
    with pytest.raises(ValueError, match="method must be 'laplace' or 'importance'"):
        d.log_normaliser("exact")
    with pytest.raises(NotImplementedError, match="truncate.*NonlinearConstraint.*reflects on the box walls"):
        d.truncate(0.0, 1.0)


def test_sample_with_info_linearised_and_normaliser_arguments():
    d = ConstrainedNormal(torch.tensor([0.9, 0.3], dtype=torch.float64), 0.2, constraint=sphere(1.0))
    out = d.sample_with_info((5,))
    assert out.method == "linearised" and out.samples.shape == (5, 2) and out.ess is None and out.acceptance is None
    assert not out.samples.requires_grad
    with pytest.raises(ValueError, match="num_samples must be an int >= 2"):
        d.log_normaliser("importance", num_samples=1)
