"""Tests of the ``vae-data`` study's architectures (``hardeq_studies.vae_data.models``).

Small networks (``hidden = H``), batch of 8. Statistical checks use fixed seeds and z-intervals from
``hardeq.testing.mc_atol`` at ``FAILURE_RATE`` per assertion (Bonferroni over the images).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor
from torch.distributions import Normal, kl_divergence

from hardeq_studies.vae_data.models import MODELS, PIXELS, VAE, GraphVAE, LadderVAE
from hardeq.testing import mc_atol

H = (64, 48, 32, 16)
SMALL = {
    "vae": lambda: VAE(latent=8, hidden=H),
    "ladder": lambda: LadderVAE(latents=(8, 4, 2), hidden=H, top_down=16),
    "graph": lambda: GraphVAE(nodes=3, node_dim=4, hidden=H, message=8),
    "graph-concrete": lambda: GraphVAE(nodes=3, node_dim=4, hidden=H, message=8, gate_temperature=0.5),
}
HIERARCHICAL = ["ladder", "graph"]


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _data(batch: int = 8, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, PIXELS, generator=g)


def _model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return SMALL[name]().to(dtype)


def _log_lik(x: Tensor, mean: Tensor, log_var: Tensor) -> Tensor:
    return Normal(mean, torch.exp(0.5 * log_var)).log_prob(x).sum(-1)


def test_registry_builds_the_appendix_models():
    assert set(MODELS) == {"vae", "ladder", "graph"}
    torch.manual_seed(0)
    x = _data(4)
    for cls in MODELS.values():
        mean, log_var, kl = cls()(x)
        assert mean.shape == log_var.shape == (4, PIXELS) and kl.shape == (4,)


@pytest.mark.parametrize("name", list(SMALL))
def test_shapes_finiteness_and_gradients(name):
    model, x = _model(name), _data()
    model.train()
    mean, log_var, kl = model(x)
    assert mean.shape == log_var.shape == x.shape and kl.shape == (8,)
    for t in (mean, log_var, kl):
        assert torch.isfinite(t).all()
    assert ((mean > 0) & (mean < 1)).all()
    assert (log_var >= -12).all() and (log_var <= 6).all()
    assert (kl >= 0).all()
    loss = (-_log_lik(x, mean, log_var) + kl).mean()
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname

    model.eval()
    with torch.no_grad():
        mean, log_var, log_ratio = model.importance(x, 5, torch.Generator().manual_seed(1))
    assert mean.shape == log_var.shape == (5, 8, PIXELS) and log_ratio.shape == (5, 8)
    for t in (mean, log_var, log_ratio):
        assert torch.isfinite(t).all()
    assert ((mean > 0) & (mean < 1)).all()


def test_graph_gates_are_an_upper_triangular_matrix_in_unit_interval():
    model = _model("graph")
    with torch.no_grad():
        model.gate_logits.copy_(torch.tensor([-3.0, 0.0, 2.0]))
    c = model.eval().gates()
    assert torch.equal(c.tril(), torch.zeros(3, 3))
    assert torch.allclose(c[0, 1], torch.sigmoid(torch.tensor(-3.0)))
    assert torch.allclose(c[1, 2], torch.sigmoid(torch.tensor(2.0)))


@pytest.mark.parametrize("name", list(SMALL))
def test_importance_is_reproducible_and_uses_no_global_rng(name):
    model, x = _model(name).eval(), _data()
    with torch.no_grad():
        torch.manual_seed(123)
        state = torch.get_rng_state()
        a = model.importance(x, 7, torch.Generator().manual_seed(5))
        assert torch.equal(torch.get_rng_state(), state)
        torch.manual_seed(456)
        b = model.importance(x, 7, torch.Generator().manual_seed(5))
        c = model.importance(x, 7, torch.Generator().manual_seed(6))
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert not torch.equal(a[2], c[2])


def test_vae_kl_is_the_analytic_kl():
    model, x = _model("vae", dtype=torch.float64), _data().double()
    for mode in (True, False):
        model.train(mode)
        mu, lv = model.encode(x)
        _, _, kl = model(x)
        expected = kl_divergence(Normal(mu, torch.exp(0.5 * lv)), Normal(0.0, 1.0)).sum(-1)
        torch.testing.assert_close(kl, expected)
    # and the log-ratio is log N(z; 0, I) - log q(z | x) at the sampled z: its negative mean is the KL
    with torch.no_grad():
        _, _, log_ratio = model.eval().importance(x, 2000, torch.Generator().manual_seed(0))
    err = -log_ratio.mean(0) - kl.detach()
    assert (err.abs() <= mc_atol(log_ratio.std(0), log_ratio.shape[0])).all(), err


@pytest.mark.parametrize("name", HIERARCHICAL)
def test_log_ratio_is_consistent_with_the_kl(name):
    """E_q[-log_ratio] = KL(q(z|x) || p(z)) = E_q[sum_l KL_l(at sampled parents)], per image."""
    model, x = _model(name, dtype=torch.float64).eval(), _data().double()
    n = 1500
    with torch.no_grad():
        torch.manual_seed(1)
        _, _, kl = model(x.repeat(n, 1))  # eval mode: rows are independent samples
        kl = kl.view(n, -1)
        _, _, log_ratio = model.importance(x, n, torch.Generator().manual_seed(2))
    diff = kl.mean(0) + log_ratio.mean(0)
    se = torch.sqrt(kl.var(0) / n + log_ratio.var(0) / n)
    assert (diff.abs() <= mc_atol(se, 1)).all(), (diff, se)
    # the hierarchical KL is not trivial here
    assert (kl.mean(0) > 0.5).all()


@pytest.mark.parametrize("name", list(SMALL))
def test_importance_estimate_dominates_the_elbo(name):
    model, x = _model(name, dtype=torch.float64).eval(), _data().double()
    n, reps, k = 500, 16, 16
    with torch.no_grad():
        torch.manual_seed(3)
        mean, log_var, kl = model(x.repeat(n, 1))
        elbo = (_log_lik(x.repeat(n, 1), mean, log_var) - kl).view(n, -1).mean(-1)  # (n,) batch means
        mean, log_var, log_ratio = model.importance(x, reps * k, torch.Generator().manual_seed(4))
        log_w = (_log_lik(x, mean, log_var) + log_ratio).view(reps, k, -1)
        iwae = (torch.logsumexp(log_w, 1) - math.log(k)).mean(-1)  # (reps,) batch means
    se = torch.sqrt(elbo.var() / n + iwae.var() / reps)
    assert iwae.mean() >= elbo.mean() - mc_atol(se, 1), (iwae.mean(), elbo.mean(), se)


@pytest.mark.parametrize("name", list(SMALL))
def test_overfits_a_tiny_batch(name):
    model, x = _model(name), _data(16, seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(150):
        mean, log_var, kl = model(x)
        loss = (-_log_lik(x, mean, log_var) + kl).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    start, end = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert math.isfinite(end) and end < start - 300, (start, end)
