"""Training mode of the truncated law (hardeq.bounds.training): the normaliser's gradient from persistent chains,
against exact gradients (products of lines, closed form; a triangle, Gauss-Legendre quadrature) and a maximum-
likelihood fit by an exact method; the long-only portfolio step's time."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from scipy import optimize

import hardeq
from hardeq.bounds import PersistentChains, rejection_sample

F = torch.float64


def _pairs(loc, scale):
    """z0 + z1 = 1 and z2 + z3 = 1: two independent lines, so log Z is the sum of two closed-form 1-D terms."""
    A = torch.tensor([[1., 1, 0, 0], [0, 0, 1, 1]], dtype=F)
    return hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, torch.ones(2, dtype=F)))


def _pairs_log_z(loc, scale):
    """Exact log P([0, 1]^4 | plane) of :func:`_pairs`, differentiable (torch.special.log_ndtr): on the line
    z0 + z1 = 1, z0 ~ N(m, s^2) with m = (v1 mu0 + v0 (1 - mu1)) / (v0 + v1), s^2 = v0 v1 / (v0 + v1); box z0 in
    [0, 1]."""
    total = 0.0
    for i, j in ((0, 1), (2, 3)):
        v0, v1 = scale[i] ** 2, scale[j] ** 2
        m = (v1 * loc[i] + v0 * (1 - loc[j])) / (v0 + v1)
        s = (v0 * v1 / (v0 + v1)).sqrt()
        a, b = (0 - m) / s, (1 - m) / s
        total = total + torch.log(torch.special.ndtr(b) - torch.special.ndtr(a))
    return total


def test_training_gradient_matches_the_exact_gradient_on_lines():
    """At fixed parameters the persistent chains' gradient of -log_prob, averaged over steps, equals the exact
    gradient (closed-form log Z by autograd) within 5 standard errors of its mean, per component."""
    torch.manual_seed(0)
    loc0 = torch.tensor([0.2, 0.5, 0.9, -0.3], dtype=F)
    scale0 = torch.tensor([0.3, 0.5, 0.4, 0.6], dtype=F)
    y = torch.tensor([[0.3, 0.7, 0.6, 0.4]], dtype=F)
    loc = loc0.clone().requires_grad_()
    scale = scale0.clone().requires_grad_()
    exact = -(_pairs(loc, scale).log_prob(y).sum() - _pairs_log_z(loc, scale))
    g_exact = torch.cat(torch.autograd.grad(exact, [loc, scale]))
    chains = PersistentChains(chains=64, sweeps=4)
    grads = []
    for step in range(45):
        d = _pairs(loc, scale).truncate(0.0, 1.0, training=chains)
        g = torch.cat(torch.autograd.grad(-d.log_prob(y).sum(), [loc, scale]))
        if step >= 5:  # the chains start at the data; 20 sweeps of burn-in
            grads.append(g)
    G = torch.stack(grads)
    err = (G.mean(0) - g_exact).abs()
    se = G.std(0) / math.sqrt(G.shape[0]) * 2.0  # the steps are correlated through the chains: twice the iid se
    assert bool((err <= 5 * se + 1e-9).all()), (G.mean(0), g_exact, se)


def test_training_value_is_unnormalised_and_chains_persist():
    torch.manual_seed(0)
    loc = torch.tensor([0.2, 0.5, 0.9, -0.3], dtype=F, requires_grad=True)
    scale = torch.tensor([0.3, 0.5, 0.4, 0.6], dtype=F)
    y = torch.tensor([[0.3, 0.7, 0.6, 0.4], [0.1, 0.9, 0.5, 0.5]], dtype=F)
    chains = PersistentChains(chains=3, sweeps=2)
    base = _pairs(loc.expand(2, 4), scale)
    d = base.truncate(0.0, 1.0, training=chains)
    lp = d.log_prob(y)
    # the value is log p(y | plane) (no log Z; documented), -inf outside the box
    torch.testing.assert_close(lp, base.log_prob(y))
    assert chains.steps == 1 and chains.state.shape == (3, 2, 4)
    # the chains started at the data (one value per batch element, feasible) and moved by 2 sweeps, staying feasible
    s = chains.state
    assert bool(((s >= 0) & (s <= 1)).all()) and bool(base.constraint.check(s).all())
    before = s.clone()
    d2 = _pairs(loc.expand(2, 4), scale).truncate(0.0, 1.0, training=chains)
    d2.log_prob(y).sum().backward()
    assert chains.steps == 2 and not torch.equal(chains.state, before)
    outside = torch.tensor([[1.3, -0.3, 0.5, 0.5], [0.1, 0.9, 0.5, 0.5]], dtype=F)
    assert float(d2.log_prob(outside)[0].detach()) == -math.inf   # (a third step of the chains)
    # a changed polytope (k) restarts the chains from the data or the mode, never from infeasible states
    A = torch.tensor([[1., 1, 0, 0], [0, 0, 1, 1]], dtype=F)
    moved = hardeq.ConstrainedNormal(loc.expand(2, 4), scale, constraint=hardeq.LinearConstraint(
        A, torch.full((2,), 1.5, dtype=F))).truncate(0.0, 1.0, training=chains)
    moved.log_prob(torch.tensor([0.75, 0.75, 0.75, 0.75], dtype=F).expand(2, 4)).sum().backward()
    assert torch.allclose(chains.state.sum(-1), torch.full((3, 2), 3.0, dtype=F)) and chains.steps == 4
    # without a gradient the chains do not move
    with torch.no_grad():
        moved.log_prob(torch.tensor([0.75, 0.75, 0.75, 0.75], dtype=F))
    assert chains.steps == 4


def test_training_argument_errors_and_exact_path():
    d = _pairs(torch.zeros(4, dtype=F), 1.0)
    with pytest.raises(TypeError, match="training must be a bool or a hardeq.bounds.PersistentChains"):
        d.truncate(0.0, 1.0, training="yes")
    with pytest.raises(ValueError, match="chains must be a positive int"):
        PersistentChains(chains=0)
    with pytest.raises(ValueError, match="sweeps must be a positive int"):
        PersistentChains(sweeps=1.5)
    assert d.truncate(0.0, 1.0, training=True).training is not None
    # one free dimension: the exact normaliser is used, training or not (exact value and gradient)
    line = hardeq.ConstrainedNormal(torch.zeros(2, dtype=F, requires_grad=True), 0.5, constraint=hardeq.SumConstraint(
        torch.zeros(2, dtype=torch.long), torch.ones(1, dtype=F)))
    value = torch.tensor([0.4, 0.6], dtype=F)
    a = line.truncate(0.0, 1.0, training=True).log_prob(value)
    b = line.truncate(0.0, 1.0).log_prob(value)
    torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------- the ML reference
_X, _W = np.polynomial.legendre.leggauss(80)
_S, _T = np.meshgrid((_X + 1) / 2, (_X + 1) / 2, indexing="ij")
_WQ = np.outer(_W, _W) / 4 * (1 - _S)
_P = np.stack([_S, (1 - _S) * _T, 1 - _S - (1 - _S) * _T], -1)   # the triangle z >= 0, z0 + z1 + z2 = 1


def _quad(mu, sigma):
    """log of the integral of exp(-|z - mu|^2 / (2 sigma^2)) over the triangle (Gauss-Legendre, 80 x 80 on the
    square mapped with its Jacobian 1 - s), and the truncated mean."""
    q = (((_P - mu) / sigma) ** 2).sum(-1) / 2
    m = q.min()
    w = _WQ * np.exp(-(q - m))
    return math.log(w.sum()) - m, (w[..., None] * _P).sum((0, 1)) / w.sum()


def _nll(theta, y):
    mu, sigma = theta[:3], math.exp(theta[3])
    return (((y - mu) / sigma) ** 2).sum(-1).mean() / 2 + _quad(mu, sigma)[0]


@pytest.mark.slow
def test_training_fit_matches_an_exact_maximum_likelihood_reference():
    """N(mu, sigma^2 I) given z0 + z1 + z2 = 1 in [0, 1]^3, 2,000 exact draws. Reference: Nelder-Mead on the exact
    NLL (quadrature normaliser). Training mode (persistent chains, Adam, the iterates of the last third averaged)
    must reach the reference's likelihood-ratio region: excess NLL below chi2_4(0.9995) / (2 N) = 0.005 nats per
    point, and the truncated mean within 0.01 of the reference's."""
    torch.manual_seed(0)
    total = hardeq.SumConstraint(torch.zeros(3, dtype=torch.long), torch.ones(1, dtype=F))
    truth = hardeq.ConstrainedNormal(torch.tensor([0.6, 0.3, -0.2], dtype=F), 0.25, constraint=total)
    y, _ = rejection_sample(truth, torch.zeros(3, dtype=F), torch.ones(3, dtype=F), 2000,
                            generator=torch.Generator().manual_seed(0))
    yn = y.numpy()
    ref = optimize.minimize(_nll, np.array([0.3, 0.3, 0.3, math.log(0.3)]), args=(yn,), method="Nelder-Mead",
                            options=dict(xatol=1e-8, fatol=1e-12, maxiter=5000))
    loc = torch.full((3,), 0.3, dtype=F, requires_grad=True)
    log_sigma = torch.tensor(math.log(0.3), dtype=F, requires_grad=True)
    opt = torch.optim.Adam([loc, log_sigma], lr=0.05)
    steps = 900
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < steps // 3 else (0.2 if s < 2 * steps // 3
                                                                                          else 0.04))
    chains = PersistentChains(chains=32, sweeps=4)
    kept = []
    for step in range(steps):
        d = hardeq.ConstrainedNormal(loc, log_sigma.exp(), constraint=total).truncate(0.0, 1.0, training=chains)
        loss = -d.log_prob(y).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step >= 2 * steps // 3:
            kept.append(torch.cat([loc.detach(), log_sigma.detach()[None]]))
    theta = torch.stack(kept).mean(0).numpy()
    assert _nll(theta, yn) - ref.fun < 0.005
    mean_fit = _quad(theta[:3], math.exp(theta[3]))[1]
    mean_ref = _quad(ref.x[:3], math.exp(ref.x[3]))[1]
    assert np.abs(mean_fit - mean_ref).max() < 0.01, (mean_fit, mean_ref)


# ---------------------------------------------------------------------------------------------- the portfolio step
def portfolio_step_times(steps: int = 3, seed: int = 0) -> list[float]:
    """Seconds per optimiser step of the long-only portfolio head: n = 50, batch 32, one sum row as a dense
    LinearConstraint, truncate(0, 1), a random nn.Linear(8, 100) giving loc and log-scale, Dirichlet targets, from a
    random start (benchmarks/bench_bounds_training.py prints the same)."""
    torch.manual_seed(seed)
    n, batch = 50, 32
    head = torch.nn.Linear(8, 2 * n).double()
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    x = torch.randn(batch, 8, dtype=F)
    y = torch.distributions.Dirichlet(torch.ones(n, dtype=F)).sample((batch,))
    con = hardeq.LinearConstraint(torch.ones(1, n, dtype=F), torch.ones(batch, 1, dtype=F))
    chains = PersistentChains()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = head(x)
        d = hardeq.ConstrainedNormal(out[:, :n], out[:, n:].exp(), constraint=con).truncate(0.0, 1.0, training=chains)
        loss = -d.log_prob(y).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    assert all(math.isfinite(float(p.grad.abs().sum())) for p in head.parameters())
    return times


@pytest.mark.slow
def test_portfolio_training_step_under_one_second():
    """Before: one step at batch 32 did not finish in 600 s (subset simulation of log Z every step)."""
    assert portfolio_step_times()[0] < 1.0
