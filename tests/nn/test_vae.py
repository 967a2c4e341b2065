"""hardeq.nn VAE layers: constrained latent, constrained observation, importance-sampled log-likelihood."""

import math

import pytest
import torch
from torch.distributions import MultivariateNormal, Normal

from hardeq import ConstrainedNormal, LinearConstraint, SumConstraint
from hardeq.estimators import available_estimators
from hardeq.nn import ConstrainedGaussianLatent, ConstrainedGaussianObservation, importance_log_likelihood


def _sum_zero(n, dtype=torch.float32):
    return SumConstraint(torch.zeros(n, dtype=torch.long), torch.zeros(1, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["sum", "dense"])
def test_latent_samples_satisfy_constraint_for_every_estimator(dtype, kind):
    torch.manual_seed(0)
    n = 20
    if kind == "sum":
        c = _sum_zero(n, dtype)
    else:
        c = LinearConstraint(torch.randn(3, n, dtype=dtype), torch.zeros(3, dtype=dtype))
    layer = ConstrainedGaussianLatent(16, n, c).to(dtype)
    h = torch.randn(32, 16, dtype=dtype)
    tol = 2e-5 if dtype == torch.float32 else 1e-12
    for est in available_estimators():
        q = layer(h)  # a fresh graph per backward pass
        z = q.rsample((4,), estimator=est)
        assert z.shape == (4, 32, n)
        scale = 1 + z.abs().amax(-1) * (c.dense_matrix().abs().sum(-1).amax() if kind == "dense" else n)
        assert bool((c.residual(z).abs().amax(-1) <= tol * scale).all()), est
        loss = z.square().sum()
        loss.backward()
        assert layer.mean.weight.grad is not None and torch.isfinite(layer.mean.weight.grad).all()
        layer.zero_grad()


def test_latent_kl_matches_monte_carlo():
    torch.manual_seed(1)
    layer = ConstrainedGaussianLatent(8, 5, _sum_zero(5, torch.float64)).double()
    q = layer(torch.randn(3, 8, dtype=torch.float64))
    p = layer.prior()
    z = q.sample((200_000,))
    mc = q.log_prob(z) - p.log_prob(z)
    est, se = mc.mean(0), mc.std(0) / math.sqrt(z.shape[0])
    kl = layer.kl(q)
    assert bool(((est - kl).abs() < 5 * se).all()), (est, kl, se)
    assert bool(torch.isfinite(kl).all()) and bool((kl >= 0).all())


def test_unconstrained_latent_is_a_diagonal_gaussian():
    layer = ConstrainedGaussianLatent(8, 4, None)
    q = layer(torch.randn(5, 8))
    assert isinstance(q.base_dist, Normal) and q.event_shape == (4,)
    assert torch.allclose(layer.kl(q), torch.distributions.kl_divergence(q, layer.prior()))


def test_latent_rejects_bad_input():
    with pytest.raises(ValueError, match="latent_features"):
        ConstrainedGaussianLatent(8, 4, _sum_zero(5))
    with pytest.raises(TypeError, match="constraint"):
        ConstrainedGaussianLatent(8, 4, torch.ones(1, 4))
    with pytest.raises(ValueError, match="prior_scale"):
        ConstrainedGaussianLatent(8, 4, None, prior_scale=0.0)
    with pytest.raises(ValueError, match=r"features must have shape \(\.\.\., 8\)"):
        ConstrainedGaussianLatent(8, 4, _sum_zero(4))(torch.randn(2, 7))


def test_observation_log_prob_matches_dense_oracle():
    """log p(x | A x = k) = log N(x; m, S) - log N(k; A m, A S A^T) - 1/2 log det(A A^T) for x on the plane."""
    torch.manual_seed(2)
    n, total = 6, 3.0
    c = SumConstraint(torch.zeros(n, dtype=torch.long), torch.tensor([total], dtype=torch.float64))
    obs = ConstrainedGaussianObservation(c)
    mean, log_var = torch.rand(4, n, dtype=torch.float64), torch.randn(4, n, dtype=torch.float64) * 0.5
    p = obs(mean, log_var)
    x = p.sample()
    assert torch.allclose(x.sum(-1), torch.full((4,), total, dtype=torch.float64))
    var = log_var.exp()
    A = torch.ones(1, n, dtype=torch.float64)
    joint = MultivariateNormal(mean, torch.diag_embed(var)).log_prob(x)
    marg = Normal((mean @ A.T)[:, 0], (var @ A.T.square())[:, 0].sqrt()).log_prob(torch.tensor(total))
    oracle = joint - marg - 0.5 * torch.logdet(A @ A.T)
    assert torch.allclose(p.log_prob(x), oracle, atol=1e-10)
    assert torch.allclose(p.mean.sum(-1), torch.full((4,), total, dtype=torch.float64))
    unc = obs(mean, log_var, condition=False)
    assert torch.allclose(unc.log_prob(x), MultivariateNormal(mean, torch.diag_embed(var)).log_prob(x))


def test_observation_float32_reconstructions_exact():
    c = SumConstraint(torch.zeros(784, dtype=torch.long), torch.tensor([100.0]))
    p = ConstrainedGaussianObservation(c)(torch.rand(16, 784), torch.full((16, 784), -4.0))
    assert float((p.mean.double().sum(-1) - 100).abs().max()) < 1e-3
    assert float((p.sample().double().sum(-1) - 100).abs().max()) < 1e-3


def test_observation_rejects_bad_input():
    with pytest.raises(ValueError, match="same shape"):
        ConstrainedGaussianObservation()(torch.rand(2, 3), torch.rand(2, 4))
    with pytest.raises(ValueError, match="min_log_var"):
        ConstrainedGaussianObservation(min_log_var=1.0, max_log_var=0.0)
    with pytest.raises(ValueError, match="size 5"):
        ConstrainedGaussianObservation(_sum_zero(5))(torch.rand(2, 3), torch.rand(2, 3))


def test_importance_log_likelihood_is_exact_with_the_exact_constrained_posterior():
    """z on the line z1 + z2 = 0, z = t u with u = (1, -1)/sqrt(2): p(z) = N(0, I | sum z = 0) gives t ~ N(0, 1);
    x | z ~ N(z1 - z2, 1) = N(sqrt(2) t, 1), so p(x) = N(0, 3). The exact posterior of t is N(sqrt(2) x / 3, 1/3),
    i.e. the ConstrainedNormal with loc m u and scale 1/sqrt(3); with it every importance weight equals p(x), so the
    estimate is exact for every K -- which holds only if log p(z) and log q(z) are densities on the same line."""
    dtype = torch.float64
    c = SumConstraint(torch.zeros(2, dtype=torch.long), torch.zeros(1, dtype=dtype))
    u = torch.tensor([1.0, -1.0], dtype=dtype) / math.sqrt(2)
    x = torch.tensor([0.7, -1.3, 2.0], dtype=dtype)
    prior = ConstrainedNormal(torch.zeros(2, dtype=dtype), torch.ones(2, dtype=dtype), constraint=c)
    q = ConstrainedNormal((math.sqrt(2) * x / 3)[:, None] * u, torch.full((3, 2), 3 ** -0.5, dtype=dtype),
                          constraint=c)
    z = q.sample((7,))
    log_px_z = Normal(z[..., 0] - z[..., 1], 1.0).log_prob(x)
    ll = importance_log_likelihood(log_px_z + prior.log_prob(z) - q.log_prob(z))
    assert torch.allclose(ll, Normal(0.0, math.sqrt(3)).log_prob(x), atol=1e-12)


def test_importance_log_likelihood_basics():
    w = torch.tensor([[0.0, 1.0], [math.log(3.0), 1.0]])
    assert torch.allclose(importance_log_likelihood(w), torch.tensor([math.log(2.0), 1.0]))
    assert torch.allclose(importance_log_likelihood(w.T, dim=1), torch.tensor([math.log(2.0), 1.0]))
    big = torch.tensor([1000.0, 1000.0])
    assert torch.allclose(importance_log_likelihood(big), torch.tensor(1000.0))
    with pytest.raises(ValueError, match="NaN"):
        importance_log_likelihood(torch.tensor([0.0, float("nan")]))
    with pytest.raises(ValueError, match="scalar"):
        importance_log_likelihood(torch.tensor(0.0))
