"""The "linearised" sampler: every draw feasible per row, exact for an affine h, differentiable (implicit return),
and its density formula checked through the importance-sampled normaliser against quadrature."""

import math

import numpy as np
import pytest
import torch

from hardeq import ConstrainedNormal, LinearConstraint, NonlinearConstraint
from hardeq.manifold import feasibility_tol

from .cases import energy_balance, sphere
from .exact import circle_moments


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["sphere", "energy"])
def test_every_draw_feasible(case, dtype):
    torch.manual_seed(0)
    if case == "sphere":
        con, loc, scale = sphere(4.0, dtype), torch.tensor([1.0, 0.5, -0.5], dtype=dtype), 0.8
    else:
        con, loc = energy_balance(dtype), torch.tensor([0.4, 0.5, 3.0, 1.0, 2.0], dtype=dtype)
        scale = torch.tensor([0.1, 0.1, 0.5, 0.5, 0.5], dtype=dtype)
    d = ConstrainedNormal(loc.expand(2, -1), scale, constraint=con)
    z = d.sample((500,))
    assert z.shape == (500, 2, loc.shape[0]) and z.dtype == dtype
    assert con.row_ratio(z).max() <= feasibility_tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_affine_is_the_linear_sampler(dtype):
    gen = torch.Generator().manual_seed(1)
    A = torch.randn(2, 5, dtype=dtype, generator=gen)
    c, k = torch.randn(2, dtype=dtype, generator=gen), torch.randn(2, dtype=dtype, generator=gen)
    loc, scale = torch.randn(5, dtype=dtype, generator=gen), torch.rand(5, dtype=dtype, generator=gen) + 0.5
    d = ConstrainedNormal(loc, scale, constraint=NonlinearConstraint(lambda z: z @ A.T + c, k))
    lin = ConstrainedNormal(loc, scale, constraint=LinearConstraint(A, k - c))
    noise = torch.randn(100, 5, dtype=dtype, generator=gen)
    eps = torch.finfo(dtype).eps
    scale_z = float(lin.rsample((100,), noise=noise).abs().max()) + 1
    torch.testing.assert_close(d.rsample((100,), noise=noise), lin.rsample((100,), noise=noise), rtol=0,
                               atol=100 * eps * scale_z)


def test_rsample_gradcheck():
    con = energy_balance(torch.float64)
    loc = torch.tensor([0.4, 0.5, 3.0, 1.0, 2.0], dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([0.1, 0.1, 0.5, 0.5, 0.5], dtype=torch.float64, requires_grad=True)
    k = con.k.clone().requires_grad_()
    noise = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def fn(loc, scale, k):
        d = ConstrainedNormal(loc, scale, constraint=NonlinearConstraint(con.h, k))
        return d.rsample((3,), noise=noise)
    assert torch.autograd.gradcheck(fn, (loc, scale, k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_importance_normaliser_matches_quadrature(dtype):
    # the importance weights use the linearised law's density on the manifold; their mean recovers the exact Z
    torch.manual_seed(3)
    mu, sigma, r = np.array([0.9, 0.3]), np.array([0.15, 0.2]), 1.0
    d = ConstrainedNormal(torch.tensor(mu, dtype=dtype), torch.tensor(sigma, dtype=dtype),
                          constraint=sphere(r * r, dtype))
    Z, _, _ = circle_moments(mu, sigma, r)
    log_z, stderr = d.log_normaliser("importance", num_samples=20000)
    # the chart (the arc within 90 degrees of the mode) holds all but about 1e-9 of the mass here
    assert abs(float(log_z) - math.log(Z)) <= 5 * float(stderr) + (1e-4 if dtype == torch.float32 else 1e-9)
    laplace, zero = d.log_normaliser("laplace")
    assert float(zero) == 0 and abs(float(laplace) - math.log(Z)) > 5 * float(stderr)  # curvature: Laplace is off
