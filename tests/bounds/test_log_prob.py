"""log_prob of the truncated law, its normaliser and its training gradient, against scipy.stats.truncnorm (one free
dimension: the plane is a line), gradcheck, a maximum-likelihood fit, and the Monte Carlo gradient identity."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import optimize, stats

import hardeq
from hardeq.bounds import log_diff_ndtr

from .cases import DTYPES, dense_picture


def _line(dtype, loc=(0.2, 0.9, 0.4), scale=(0.3, 0.5, 0.4), k=(0.6, 0.1), validate=True):
    A = torch.tensor([[1.0, 1.0, -1.0], [0.5, -1.0, 1.0]], dtype=dtype)
    return hardeq.ConstrainedNormal(torch.tensor(loc, dtype=dtype), torch.tensor(scale, dtype=dtype),
                                    constraint=hardeq.LinearConstraint(A, torch.tensor(k, dtype=dtype)),
                                    validate_args=validate)


def _oracle(dist, lo, hi):
    """numpy: the line z = mu_bar + s d (|d| = 1), the sd of s and its interval in the box."""
    mu, Sigma, A, k = (x[0] for x in dense_picture(dist))
    d = np.linalg.svd(A)[2][-1]
    mu_bar = mu + Sigma @ A.T @ np.linalg.solve(A @ Sigma @ A.T, k - A @ mu)
    sd = 1.0 / math.sqrt(d @ np.linalg.solve(Sigma, d))
    t1, t2 = (lo - mu_bar) / d, (hi - mu_bar) / d
    return mu_bar, d, sd, np.max(np.minimum(t1, t2)), np.min(np.maximum(t1, t2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_log_prob_matches_truncnorm_on_a_line(dtype):
    dist = _line(dtype)
    lo, hi = np.array([0.0, 0.0, -1.0]), np.array([1.0, 1.0, 1.0])
    t = dist.truncate(torch.tensor(lo, dtype=dtype), torch.tensor(hi, dtype=dtype))
    assert t.normaliser_exact and float(t.log_normaliser_stderr) == 0
    mu_bar, d, sd, s_lo, s_hi = _oracle(dist, lo, hi)
    s = np.linspace(s_lo, s_hi, 7)[1:-1]
    z = torch.tensor(mu_bar + s[:, None] * d, dtype=dtype)
    ref = stats.truncnorm.logpdf(s, s_lo / sd, s_hi / sd, loc=0.0, scale=sd)  # density of the arc length s
    rtol = 1e-10 if dtype == torch.float64 else 2e-5
    np.testing.assert_allclose(t.log_prob(z).double().numpy(), ref, rtol=rtol, atol=rtol)
    ref_z = math.log(stats.norm.cdf(s_hi / sd) - stats.norm.cdf(s_lo / sd))
    np.testing.assert_allclose(float(t.log_normaliser), ref_z, rtol=rtol, atol=rtol)
    # outside the box (still on the plane): -inf
    out = torch.tensor(mu_bar + (s_hi + 0.1) * d, dtype=dtype)
    assert float(t.log_prob(out)) == -math.inf
    # off the plane: the untruncated distribution's support check
    with pytest.raises(ValueError):
        t.log_prob(z[0] + torch.tensor([0.1, 0.0, 0.0], dtype=dtype))


def test_log_diff_ndtr_tails():
    a = torch.tensor([-40.0, -3.0, 5.0, 30.0, -1e-3, 8.0], dtype=torch.float64)
    b = torch.tensor([-39.0, 3.0, 5.5, 31.0, 1e-3, 8.0 + 1e-6], dtype=torch.float64)
    import mpmath

    mpmath.mp.dps = 60
    ref = [float(mpmath.log(mpmath.ncdf(-x) - mpmath.ncdf(-y)) if x > 0 else
                 mpmath.log(mpmath.ncdf(y) - mpmath.ncdf(x))) for x, y in zip(a.tolist(), b.tolist())]
    np.testing.assert_allclose(log_diff_ndtr(a, b).numpy(), ref, rtol=1e-9)
    assert float(log_diff_ndtr(torch.tensor(1.0), torch.tensor(1.0))) == -math.inf


def test_gradcheck_exact_normaliser():
    """float64 gradcheck of log_prob w.r.t. loc, scale and k through the exact one-free-dimension normaliser."""
    dist0 = _line(torch.float64)
    lo = torch.tensor([0.0, 0.0, -1.0], dtype=torch.float64)
    hi = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    torch.manual_seed(0)
    z = dist0.truncate(lo, hi).sample((3,), method="rejection")
    A = dist0.constraint.dense_matrix()

    def f(loc, scale, k):
        d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k), validate_args=False)
        return d.truncate(lo, hi).log_prob(z)

    args = (dist0.loc.clone().requires_grad_(), dist0.scale.clone().requires_grad_(),
            dist0.constraint.k.clone().requires_grad_())
    assert torch.autograd.gradcheck(f, args)
    # and the normaliser alone carries gradient (the draws are inside, so the -inf branch is not taken)
    g = torch.autograd.grad(f(*args).sum(), args)
    assert all(bool(torch.isfinite(x).all()) for x in g)


def test_maximum_likelihood_matches_scipy_truncnorm():
    """One free dimension: z = (t, 1 - t), loc = (m, 1 - m), scale s on both coordinates, box [0, 1]^2, so
    t ~ TruncNormal(m, s / sqrt(2); [0, 1]). Fit (m, log s) by our log_prob and by scipy's truncnorm likelihood."""
    rng = np.random.default_rng(0)
    m_true, sd_true = 0.3, 0.25
    t = stats.truncnorm.rvs((0 - m_true) / sd_true, (1 - m_true) / sd_true, loc=m_true, scale=sd_true, size=3000,
                            random_state=rng)
    z = torch.tensor(np.stack([t, 1 - t], 1), dtype=torch.float64)
    con = hardeq.SumConstraint(torch.zeros(2, dtype=torch.long), torch.ones(1, dtype=torch.float64))

    def nll_torch(p):
        loc = torch.stack([p[0], 1 - p[0]])
        d = hardeq.ConstrainedNormal(loc, p[1].exp().expand(2), constraint=con, validate_args=False)
        return -d.truncate(0.0, 1.0).log_prob(z).mean()

    p = torch.tensor([0.5, math.log(0.5)], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([p], max_iter=200, tolerance_grad=1e-12, tolerance_change=1e-14,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = nll_torch(p)
        loss.backward()
        return loss

    opt.step(closure)

    def nll_scipy(q):
        m, sd = q[0], math.exp(q[1])
        return -np.mean(stats.truncnorm.logpdf(t, (0 - m) / sd, (1 - m) / sd, loc=m, scale=sd))

    ref = optimize.minimize(nll_scipy, [0.5, math.log(0.3)], method="Nelder-Mead",
                            options={"xatol": 1e-10, "fatol": 1e-14, "maxiter": 20000}).x
    m_hat, sd_hat = float(p[0].detach()), math.exp(float(p[1].detach())) / math.sqrt(2)
    assert abs(m_hat - ref[0]) < 1e-5 and abs(sd_hat - math.exp(ref[1])) < 1e-5
    assert abs(m_hat - m_true) < 0.05 and abs(sd_hat - sd_true) < 0.03  # and near the truth


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_monte_carlo_normaliser_within_its_error(dtype):
    """The forced Monte Carlo normaliser agrees with the exact one within four of its standard errors."""
    dist = _line(dtype)
    lo, hi = torch.tensor([0.0, 0.0, -1.0], dtype=dtype), torch.tensor([1.0, 1.0, 1.0], dtype=dtype)
    exact = float(dist.truncate(lo, hi).log_normaliser)
    torch.manual_seed(3)
    t = dist.truncate(lo, hi, normaliser="monte-carlo", normaliser_samples=20000)
    assert not t.normaliser_exact
    assert abs(float(t.log_normaliser) - exact) < 4 * float(t.log_normaliser_stderr)


def test_monte_carlo_gradient_is_unbiased():
    """The surrogate's gradient E_trunc[grad log p] against the exact gradient of log Z (one free dimension),
    w.r.t. loc and scale: the mean over 40 independent estimates (64 rejection draws each) is within 4.5 standard
    errors of it in each of the 6 components."""
    dtype = torch.float64
    lo, hi = torch.tensor([0.0, 0.0, -1.0], dtype=dtype), torch.tensor([1.0, 1.0, 1.0], dtype=dtype)
    base = _line(dtype)
    loc = base.loc.clone().requires_grad_()
    scale = base.scale.clone().requires_grad_()
    A, k = base.constraint.dense_matrix(), base.constraint.k

    def dist(**kw):
        d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k))
        return d.truncate(lo, hi, **kw)

    exact = torch.cat(torch.autograd.grad(dist().log_normaliser, (loc, scale)))
    torch.manual_seed(5)
    est = []
    for _ in range(40):
        t = dist(normaliser="monte-carlo", grad_samples=64, normaliser_samples=16)
        z = t.sample((1,), method="rejection")
        # d/dtheta of log_prob = d log p(z) - d log Z; the MC part of -d log Z is what we check
        est.append(torch.cat(torch.autograd.grad((t.base.log_prob(z) - t.log_prob(z)).sum(), (loc, scale))))
    est = torch.stack(est)
    mean, se = est.mean(0), est.std(0) / math.sqrt(est.shape[0])
    assert bool(((mean - exact).abs() <= 4.5 * se + 1e-12).all()), (mean, exact, se)
    assert bool((exact.abs() > 10 * se).any())  # the test can tell a wrong estimator (e.g. untruncated draws: 0)
    assert bool((se > 0).all())


def test_monte_carlo_normaliser_multi_dimensional_against_numpy():
    """n - a = 3: log Z by Monte Carlo against a numpy estimate with 200,000 draws (no shared code)."""
    dist = hardeq.ConstrainedNormal(torch.tensor([0.3, 0.8, 0.1, 0.5], dtype=torch.float64),
                                    torch.tensor([0.4, 0.3, 0.5, 0.2], dtype=torch.float64),
                                    constraint=hardeq.SumConstraint(torch.zeros(4, dtype=torch.long),
                                                                    torch.tensor([1.5], dtype=torch.float64)))
    torch.manual_seed(1)
    t = dist.truncate(0.0, 1.0, normaliser_samples=20000)
    mu, Sigma, A, k = (x[0] for x in dense_picture(dist))
    K = Sigma @ A.T @ np.linalg.inv(A @ Sigma @ A.T)
    mu_bar = mu + K @ (k - A @ mu)
    Sb = Sigma - K @ A @ Sigma
    w, V = np.linalg.eigh(0.5 * (Sb + Sb.T))
    z = mu_bar + np.random.default_rng(2).standard_normal((200000, 4)) @ (V * np.sqrt(np.clip(w, 0, None))).T
    p = np.mean(np.all((z >= 0) & (z <= 1), axis=1))
    se = math.sqrt(float(t.log_normaliser_stderr) ** 2 + (1 - p) / (200000 * p))
    assert abs(float(t.log_normaliser) - math.log(p)) < 4 * se


def test_log_prob_gradient_flows_on_monte_carlo_path():
    """n - a > 1 with parameters requiring grad: log_prob is finite inside, -inf outside, and has a gradient."""
    loc = torch.tensor([0.3, 0.8, 0.1, 0.5], dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([0.4, 0.3, 0.5, 0.2], dtype=torch.float64, requires_grad=True)
    dist = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.SumConstraint(
        torch.zeros(4, dtype=torch.long), torch.tensor([1.5], dtype=torch.float64)))
    torch.manual_seed(0)
    t = dist.truncate(0.0, 1.0)
    z = t.sample((5,), method="rejection")
    lp = t.log_prob(z)
    assert bool(torch.isfinite(lp).all())
    gl, gs = torch.autograd.grad(lp.sum(), (loc, scale))
    assert bool(torch.isfinite(gl).all()) and bool(gs.abs().sum() > 0)
    with torch.no_grad():
        assert float(t.log_prob(torch.tensor([1.2, 0.3, 0.0, 0.0], dtype=torch.float64))) == -math.inf


def test_monte_carlo_path_warns_that_k_gets_no_normaliser_gradient():
    k = torch.tensor([1.5], dtype=torch.float64, requires_grad=True)
    dist = hardeq.ConstrainedNormal(torch.tensor([0.3, 0.8, 0.1, 0.5], dtype=torch.float64, requires_grad=True), 0.4,
                                    constraint=hardeq.SumConstraint(torch.zeros(4, dtype=torch.long), k))
    torch.manual_seed(0)
    t = dist.truncate(0.0, 1.0, normaliser="monte-carlo")  # (one sum row: "auto" is the exact 1-D convolution)
    z = t.sample((3,), method="rejection")
    with pytest.warns(UserWarning, match="carries no gradient to k"):
        lp = t.log_prob(z)
    assert bool(torch.isfinite(lp).all())
