"""hardeq's distributions as Pyro sample sites: SVI with Trace_ELBO recovers a closed-form posterior, plates batch,
poutine.trace / replay score the sites with hardeq's own densities."""

from __future__ import annotations

import math

import pytest
import torch

pyro = pytest.importorskip("pyro", reason="the Pyro bridge needs pyro-ppl (pip install 'hardeq[pyro]')")

import pyro.distributions as pdist  # noqa: E402
from pyro import poutine  # noqa: E402
from pyro.infer import SVI, Trace_ELBO  # noqa: E402
from pyro.optim import Adam, ClippedAdam  # noqa: E402

import hardeq  # noqa: E402
from hardeq import SumConstraint  # noqa: E402
from hardeq.contrib.pyro import ConstrainedNormal, ConstrainedPoisson  # noqa: E402


def zero_sum(m: int, dtype=torch.float64) -> SumConstraint:
    return SumConstraint(torch.zeros(m, dtype=torch.long), torch.zeros(1, dtype=dtype))


@pytest.fixture(autouse=True)
def _clean_param_store():
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


def test_same_numbers_as_hardeq():
    g = torch.Generator().manual_seed(0)
    loc, scale = torch.randn(5, generator=g, dtype=torch.float64), torch.rand(5, generator=g, dtype=torch.float64) + 0.5
    c = zero_sum(5)
    ours, plain = ConstrainedNormal(loc, scale, constraint=c), hardeq.ConstrainedNormal(loc, scale, constraint=c)
    assert isinstance(ours, hardeq.ConstrainedNormal)
    z = plain.sample((7,))
    torch.testing.assert_close(ours.log_prob(z), plain.log_prob(z), rtol=0, atol=0)
    torch.testing.assert_close(ours.mean, plain.mean, rtol=0, atol=0)
    log_prob, score, entropy = ours.score_parts(z)
    torch.testing.assert_close(log_prob, plain.log_prob(z))
    assert ours.has_rsample


def test_plate_expands_and_keeps_the_class():
    d = ConstrainedNormal(torch.zeros(4, dtype=torch.float64), 1.0, constraint=zero_sum(4))

    def model():
        with pyro.plate("rows", 6):
            return pyro.sample("z", d)

    trace = poutine.trace(model).get_trace()
    site = trace.nodes["z"]
    assert isinstance(site["fn"], ConstrainedNormal) and site["fn"].batch_shape == (6,)
    assert site["value"].shape == (6, 4)
    assert site["value"].sum(-1).abs().max() < 1e-12
    trace.compute_log_prob()
    torch.testing.assert_close(site["log_prob_sum"], d.log_prob(site["value"]).sum())


def test_trace_replay_scores_the_guide_value_under_the_model():
    c = zero_sum(3)

    def model():
        return pyro.sample("b", ConstrainedNormal(torch.zeros(3, dtype=torch.float64), 2.0, constraint=c))

    def guide():
        return pyro.sample("b", ConstrainedNormal(torch.tensor([1.0, -0.5, -0.5], dtype=torch.float64), 0.3,
                                                  constraint=c))

    guide_trace = poutine.trace(guide).get_trace()
    model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace()
    value = guide_trace.nodes["b"]["value"]
    assert torch.equal(model_trace.nodes["b"]["value"], value)
    expected = hardeq.ConstrainedNormal(torch.zeros(3, dtype=torch.float64), 2.0, constraint=c).log_prob(value)
    torch.testing.assert_close(model_trace.log_prob_sum(), expected)


def test_svi_recovers_the_closed_form_posterior_of_a_sum_to_zero_effect_model():
    """b ~ N(0, tau^2 I) | sum b = 0, y_gj ~ N(b_g, sigma^2). The posterior is the unconstrained Gaussian posterior
    N(m, V) (V = diag(1/(1/tau^2 + n_g/sigma^2)), m = V s/sigma^2, s the group sums of y) conditioned on sum b = 0:
    mean m - V 1 (1^T m)/(1^T V 1). A guide in the same family, fitted by SVI, must reach it."""
    torch.manual_seed(0)
    pyro.set_rng_seed(0)
    dtype = torch.float64
    m, tau, sigma = 4, 1.5, 0.7
    counts = torch.tensor([3, 5, 2, 6])
    true_b = torch.tensor([1.0, -0.4, 0.3, -0.9], dtype=dtype)
    group = torch.repeat_interleave(torch.arange(m), counts)
    y = true_b[group] + sigma * torch.randn(len(group), dtype=dtype)
    c = zero_sum(m, dtype)

    def model(y):
        b = pyro.sample("b", ConstrainedNormal(torch.zeros(m, dtype=dtype), tau, constraint=c))
        # the observations as one event: b's batch dims (Trace_ELBO's particle plate) stay left of it
        pyro.sample("y", pdist.Normal(b[..., group], sigma).to_event(1), obs=y)

    def guide(y):
        loc = pyro.param("loc", torch.zeros(m, dtype=dtype))
        log_scale = pyro.param("log_scale", torch.full((m,), -1.0, dtype=dtype))
        pyro.sample("b", ConstrainedNormal(loc, log_scale.exp(), constraint=c))

    # the learning rate decays to 0.05 * 0.994**800 = 4e-4, so the last iterates carry little SGD noise
    svi = SVI(model, guide, ClippedAdam({"lr": 0.05, "lrd": 0.994}),
              Trace_ELBO(num_particles=16, vectorize_particles=True))
    for _ in range(800):
        svi.step(y)

    V = 1.0 / (1.0 / tau**2 + counts.to(dtype) / sigma**2)
    s = torch.zeros(m, dtype=dtype).index_add_(0, group, y)
    mu = V * s / sigma**2
    post_mean = mu - V * mu.sum() / V.sum()
    fitted = hardeq.ConstrainedNormal(pyro.param("loc").detach(), pyro.param("log_scale").detach().exp(),
                                      constraint=c)
    posterior = hardeq.ConstrainedNormal(mu, V.sqrt(), constraint=c)
    # Monte Carlo ELBO gradients: the optimum is reached up to SGD noise, far below the posterior's spread
    assert (fitted.mean - post_mean).abs().max() < 0.1 * posterior.stddev.min()
    torch.testing.assert_close(fitted.stddev, posterior.stddev, rtol=0.05, atol=0)
    assert abs(fitted.mean.sum().item()) < 1e-10


def test_svi_with_an_observed_constrained_site_fits_its_conditional_mean():
    """Observed compositions with a known total: the maximum-likelihood conditional mean is the sample mean."""
    pyro.set_rng_seed(1)
    dtype = torch.float64
    c = SumConstraint(torch.zeros(3, dtype=torch.long), torch.ones(1, dtype=dtype))
    truth = hardeq.ConstrainedNormal(torch.tensor([0.2, 0.5, 0.3], dtype=dtype), 0.1, constraint=c)
    data = truth.sample((400,))

    def model(data):
        loc = pyro.param("loc", torch.zeros(3, dtype=dtype))
        with pyro.plate("rows", len(data)):
            pyro.sample("x", ConstrainedNormal(loc, 0.1, constraint=c), obs=data)

    svi = SVI(model, lambda data: None, Adam({"lr": 0.02}), Trace_ELBO())
    for _ in range(600):
        svi.step(data)
    fitted = hardeq.ConstrainedNormal(pyro.param("loc").detach(), 0.1, constraint=c).mean
    torch.testing.assert_close(fitted, data.mean(0), atol=1e-4, rtol=0)


def test_constrained_poisson_as_an_observed_site():
    rate = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    total = torch.tensor([3.0, 5.0], dtype=torch.float64)
    index = torch.tensor([0, 0, 1, 1])
    counts = torch.tensor([[1.0, 2.0, 2.0, 3.0], [3.0, 0.0, 5.0, 0.0]], dtype=torch.float64)

    def model():
        with pyro.plate("rows", 2):
            pyro.sample("z", ConstrainedPoisson(rate, total, index=index), obs=counts)

    trace = poutine.trace(model).get_trace()
    trace.compute_log_prob()
    # the multinomial pmf per group, computed by hand
    p = torch.tensor([1 / 3, 2 / 3, 3 / 7, 4 / 7], dtype=torch.float64)

    def multinomial(x, probs):
        k = x.sum()
        return math.lgamma(k + 1) - sum(math.lgamma(v + 1) for v in x.tolist()) + (x * probs.log()).sum().item()

    expected = sum(multinomial(row[:2], p[:2]) + multinomial(row[2:], p[2:]) for row in counts)
    assert trace.log_prob_sum().item() == pytest.approx(expected, rel=1e-12)


def test_missing_pyro_message(monkeypatch):
    import builtins
    import importlib
    import sys

    real_import = builtins.__import__

    def no_pyro(name, *args, **kwargs):
        if name == "pyro" or name.startswith("pyro."):
            raise ImportError("No module named 'pyro'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyro)
    monkeypatch.delitem(sys.modules, "hardeq.contrib.pyro", raising=False)
    with pytest.raises(ImportError, match=r'pip install "hardeq\[pyro\]"'):
        importlib.import_module("hardeq.contrib.pyro")


def test_module_docstring_example_runs():
    import doctest

    import hardeq.contrib.pyro as bridge

    pyro.set_rng_seed(0)
    result = doctest.testmod(bridge, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_truncated_site_observed_in_a_plate_fits_a_long_only_mean():
    """Long-only weights (sum one, in [0, 1]) observed: the exact one-free-dimension normaliser makes the
    likelihood exact, and SVI's MAP of the untruncated mean matches a direct maximisation of the same likelihood."""
    from hardeq.contrib.pyro import TruncatedConstrainedNormal

    pyro.set_rng_seed(2)
    dtype = torch.float64
    c = SumConstraint(torch.zeros(2, dtype=torch.long), torch.ones(1, dtype=dtype))
    truth = hardeq.ConstrainedNormal(torch.tensor([0.9, 0.1], dtype=dtype), 0.3, constraint=c).truncate(0.0, 1.0)
    data = truth.sample((300,))

    def model(data):
        loc = pyro.param("loc", torch.tensor([0.5, 0.5], dtype=dtype))
        site = ConstrainedNormal(loc, 0.3, constraint=c).truncate(0.0, 1.0)
        assert isinstance(site, TruncatedConstrainedNormal)
        with pyro.plate("rows", len(data)):
            pyro.sample("w", site, obs=data)

    trace = poutine.trace(model).get_trace(data)
    assert isinstance(trace.nodes["w"]["fn"], TruncatedConstrainedNormal)
    assert trace.nodes["w"]["fn"].batch_shape == (300,)
    svi = SVI(model, lambda data: None, Adam({"lr": 0.02}), Trace_ELBO())
    for _ in range(400):
        svi.step(data)
    fitted = pyro.param("loc").detach()
    # the same likelihood maximised directly (LBFGS on the hardeq class)
    loc = torch.tensor([0.5, 0.5], dtype=dtype, requires_grad=True)
    opt = torch.optim.LBFGS([loc], max_iter=200, tolerance_grad=1e-12, tolerance_change=1e-14)

    def closure():
        opt.zero_grad()
        loss = -hardeq.ConstrainedNormal(loc, 0.3, constraint=c).truncate(0.0, 1.0).log_prob(data).sum()
        loss.backward()
        return loss

    opt.step(closure)
    direct = hardeq.ConstrainedNormal(loc.detach(), 0.3, constraint=c).mean
    ours = hardeq.ConstrainedNormal(fitted, 0.3, constraint=c).mean
    torch.testing.assert_close(ours, direct, atol=5e-3, rtol=0)
