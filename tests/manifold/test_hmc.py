"""manifold_hmc against the exact restricted law (scipy quadrature) on a circle and a sphere.

Note [Randomized statistical tests]: each test fixes its seeds. Draws are the final states of independent chains
(one per draw, after burn-in from the mode), so they are independent and KS / mean tests apply as for iid draws;
the remaining error is the chains' distance from stationarity after burn-in, which the tests bound together with
the sampling error. Levels: KS p-value above 1e-4, means within a two-sided z-interval at failure rate 1e-4
(Bonferroni over the coordinates). After an RNG change, bump the seed once and say so.
"""

import numpy as np
import pytest
import scipy.stats
import torch

from hardeq import ConstrainedNormal, LinearConstraint, NonlinearConstraint
from hardeq.bounds import effective_sample_size, split_rhat
from hardeq.manifold import feasibility_tol

from .cases import sphere
from .exact import circle_cdf, circle_moments, sphere_moments

FAILURE_RATE = 1e-4


def _mean_ok(draws, mean, second):
    std = np.sqrt(np.maximum(second.diagonal() - mean ** 2, 0) if second.ndim == 2 else second - mean ** 2)
    z = scipy.stats.norm.isf(FAILURE_RATE / (2 * mean.size))
    return np.abs(draws.mean(0) - mean) <= z * std / np.sqrt(len(draws)) + 1e-8


def _circle(dtype, chains, burn_in, seed):
    mu, sigma = np.array([0.6, 0.2]), np.array([0.5, 1.0])
    radii = np.array([1.0, 1.5])
    con = NonlinearConstraint(lambda z: (z * z).sum(-1, keepdim=True),
                              torch.tensor(radii[:, None] ** 2, dtype=dtype))  # a batch of two circles
    d = ConstrainedNormal(torch.tensor(mu, dtype=dtype), torch.tensor(sigma, dtype=dtype), constraint=con)
    out = d.sample_with_info((chains,), "manifold_hmc", burn_in=burn_in, generator=torch.Generator().manual_seed(seed))
    z = out.samples
    assert z.shape == (chains, 2, 2) and z.dtype == dtype
    assert con.row_ratio(z).max() <= feasibility_tol(dtype)
    for b, r in enumerate(radii):
        draws = z[:, b].double().numpy()
        angle = np.arctan2(draws[:, 1], draws[:, 0])
        assert scipy.stats.kstest(angle, circle_cdf(mu, sigma, r)).pvalue > FAILURE_RATE
        _, mean, second = circle_moments(mu, sigma, r)
        assert _mean_ok(draws, mean, second).all()
    return out


def test_circle_float64():
    out = _circle(torch.float64, chains=200, burn_in=25, seed=0)
    assert out.acceptance.shape == (2,) and bool((out.acceptance > 0.3).all())


@pytest.mark.parametrize("dtype", [torch.float64, pytest.param(torch.float32, marks=pytest.mark.slow)])
def test_ellipse_jacobian_factor(dtype):
    # h(z) = z1^2 / a^2 + z2^2 = 1, z = (a cos t, sin t): |J| = 2 sqrt(cos^2 t / a^2 + sin^2 t) varies along the
    # ellipse and the arc length is sqrt(a^2 sin^2 t + cos^2 t) dt, so N(z) / |J| dH gives the angle t the density
    # N(z(t)) * a (the two factors cancel): without the 1 / |J| factor the law would be N(z(t)) * arc length instead.
    a, mu, sigma = 3.0, np.array([1.0, 0.3]), np.array([1.5, 0.6])
    con = NonlinearConstraint(lambda z: (z[..., :1] / a) ** 2 + z[..., 1:] ** 2, torch.tensor([1.0], dtype=dtype))
    d = ConstrainedNormal(torch.tensor(mu, dtype=dtype), torch.tensor(sigma, dtype=dtype), constraint=con)
    z = d.sample((300,), "manifold_hmc", burn_in=25, generator=torch.Generator().manual_seed(6))
    assert con.row_ratio(z).max() <= feasibility_tol(dtype)
    t = np.arctan2(z[:, 1].double().numpy(), z[:, 0].double().numpy() / a)
    grid = np.linspace(-np.pi, np.pi, 4001)
    dens = np.exp(-0.5 * (((a * np.cos(grid) - mu[0]) / sigma[0]) ** 2 + ((np.sin(grid) - mu[1]) / sigma[1]) ** 2))
    cdf = np.concatenate([[0.0], np.cumsum((dens[1:] + dens[:-1]) / 2 * np.diff(grid))])
    assert scipy.stats.kstest(t, lambda x: np.interp(x, grid, cdf / cdf[-1])).pvalue > FAILURE_RATE
    wrong = cdf_with(grid, dens * np.sqrt(a ** 2 * np.sin(grid) ** 2 + np.cos(grid) ** 2))
    assert np.abs(wrong - cdf / cdf[-1]).max() > 0.1  # the test can tell the two laws apart at this size


def cdf_with(grid, dens):
    cdf = np.concatenate([[0.0], np.cumsum((dens[1:] + dens[:-1]) / 2 * np.diff(grid))])
    return cdf / cdf[-1]


@pytest.mark.slow
def test_circle_float32():
    _circle(torch.float32, chains=600, burn_in=60, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sphere(dtype):
    mu, sigma, r = np.array([0.8, -0.3, 0.5]), np.array([0.6, 1.0, 0.4]), 1.2
    d = ConstrainedNormal(torch.tensor(mu, dtype=dtype), torch.tensor(sigma, dtype=dtype),
                          constraint=sphere(r * r, dtype))
    z = d.sample((800,), "manifold_hmc", burn_in=60, generator=torch.Generator().manual_seed(2))
    assert d.constraint.row_ratio(z).max() <= feasibility_tol(dtype)
    mean, second = sphere_moments(mu, sigma, r)
    draws = z.double().numpy()
    assert _mean_ok(draws, mean, second).all()
    # the law of z_3 = r cos(u): KS against its CDF by quadrature over the sphere (independent chains' last draws)
    grid = np.linspace(-r, r, 401)
    cdf_vals = np.array([_sphere_z3_cdf(mu, sigma, r, t) for t in grid])
    assert scipy.stats.kstest(draws[:, 2], lambda t: np.interp(t, grid, cdf_vals)).pvalue > FAILURE_RATE


def _sphere_z3_cdf(mu, sigma, r, t, _cache={}):  # noqa: B006  (a memo of the normaliser)
    import scipy.integrate as si

    def dens(u, v):
        z = r * np.array([np.sin(u) * np.cos(v), np.sin(u) * np.sin(v), np.cos(u)])
        return np.exp(-0.5 * np.sum(((z - mu) / sigma) ** 2)) * np.sin(u)
    key = (tuple(mu), tuple(sigma), r)
    if key not in _cache:
        _cache[key] = si.dblquad(lambda v, u: dens(u, v), 0, np.pi, 0, 2 * np.pi, epsrel=1e-9)[0]
    if t <= -r:
        return 0.0
    if t >= r:
        return 1.0
    u0 = np.arccos(t / r)  # z_3 <= t  <=>  u >= u0
    return si.dblquad(lambda v, u: dens(u, v), u0, np.pi, 0, 2 * np.pi, epsrel=1e-9)[0] / _cache[key]


@pytest.mark.slow
def test_affine_hmc_matches_linear_conditional():
    gen = torch.Generator().manual_seed(3)
    A = torch.randn(1, 3, dtype=torch.float64, generator=gen)
    k = torch.tensor([0.5], dtype=torch.float64)
    loc, scale = torch.randn(3, dtype=torch.float64, generator=gen), torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    d = ConstrainedNormal(loc, scale, constraint=NonlinearConstraint(lambda z: z @ A.T, k))
    lin = ConstrainedNormal(loc, scale, constraint=LinearConstraint(A, k))
    z = d.sample((600,), "manifold_hmc", burn_in=40, generator=torch.Generator().manual_seed(4)).numpy()
    mean, var = lin.mean.numpy(), lin.variance.numpy()
    assert _mean_ok(z, mean, var + mean ** 2).all()


def test_diagnostics_and_chains():
    d = ConstrainedNormal(torch.tensor([0.6, 0.2], dtype=torch.float64), 0.7, constraint=sphere(1.0))
    out = d.sample_with_info((40,), "manifold_hmc", chains=4, burn_in=5,
                             generator=torch.Generator().manual_seed(5))
    assert out.samples.shape == (40, 2) and out.ess.shape == (2,) and out.rhat.shape == (2,)
    chains = out.samples.reshape(10, 4, 2)  # draw-major: (draws, chains, n)
    torch.testing.assert_close(out.ess, effective_sample_size(chains))
    torch.testing.assert_close(out.rhat, split_rhat(chains))
    assert 0 <= float(out.reversibility_rejections) <= 1 and 0 <= float(out.acceptance) <= 1
    assert float(out.step_size) > 0


def test_bad_arguments():
    d = ConstrainedNormal(torch.tensor([0.5, 0.0], dtype=torch.float64), 1.0, constraint=sphere(1.0))
    with pytest.raises(ValueError, match="method must be one of"):
        d.sample((2,), "hmc")
    with pytest.raises(ValueError, match="chains must be a positive int"):
        d.sample((2,), "manifold_hmc", chains=0)
    with pytest.raises(ValueError, match="step_size must be a positive finite number"):
        d.sample((2,), "manifold_hmc", step_size=-1.0)
    with pytest.raises(ValueError, match="rsample supports method='linearised' only"):
        d.rsample((2,), method="manifold_hmc")
