"""Tests of the Poisson-family gradient estimators (hardeq.estimators.poisson).

Every estimator returns the exact sample in the forward pass; its backward pass is compared with autograd
through the proxy it documents, computed here independently with ``torch.distributions``.

Note [Randomized statistical tests]: the ``random`` estimator's noise statistics are checked with a fixed seed
and Bonferroni-corrected z-intervals, each failing with probability at most ``FAILURE_RATE`` when correct.
"""

from __future__ import annotations

import pytest
import scipy.stats
import torch

import hardeq.estimators.poisson as poisson_estimators
from hardeq.distributions.poisson import ConstrainedPoisson
from hardeq.estimators.registry import available_estimators, get_estimator
from hardeq.ops import binomial_log_pmf

FAILURE_RATE = 1e-4
NAMES = ["marginal_expectation", "constrained_marginal", "unconstrained_marginal", "random"]


def _zscore(failure_rate: float, num_checks: int) -> float:
    return float(scipy.stats.norm.isf(failure_rate / (2 * num_checks)))


def make_setup(kind: str, dtype=torch.float64, seed: int = 0):
    """rate (requires grad), total, index, exact sample of shape (3, *batch, n)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "single":
        rate = torch.rand(5, generator=gen, dtype=dtype) + 0.2
        total, index = torch.tensor(6, dtype=dtype), None
    elif kind == "batched":
        rate = torch.rand(2, 5, generator=gen, dtype=dtype) + 0.2
        total, index = torch.tensor([4, 9], dtype=dtype), None
    elif kind == "grouped":
        rate = torch.rand(2, 7, generator=gen, dtype=dtype) + 0.2
        index = torch.tensor([0, 1, 0, 2, 1, 2, 2])
        total = torch.tensor([[3, 1, 5], [0, 4, 2]], dtype=dtype)
    elif kind == "broadcast-rate":  # one rate vector shared by a batch of totals
        rate = torch.rand(6, generator=gen, dtype=dtype) + 0.2
        index = torch.tensor([1, 0, 1, 0, 0, 1])
        total = torch.tensor([[3, 1], [2, 5], [0, 0]], dtype=dtype)
    else:
        raise AssertionError(kind)
    rate.requires_grad_()
    torch.manual_seed(seed)
    sample = ConstrainedPoisson(rate.detach(), total, index=index).sample((3,))
    return rate, total, index, sample


def reference_proxy(name: str, rate, total, index, sample):
    """The documented proxy m(rate), built independently with torch.distributions."""
    if index is None:
        p = rate / rate.sum(-1, keepdim=True)
        k = total.unsqueeze(-1).expand(p.shape[:-1] + (rate.shape[-1],))
        p = p.expand(k.shape)
    else:
        group_sum = torch.stack([rate[..., index == g].sum(-1) for g in range(total.shape[-1])], -1)
        p = rate / group_sum[..., index]
        k = total[..., index]
        p, k = torch.broadcast_tensors(p, k)
    if name == "marginal_expectation":
        return k * p
    if name == "constrained_marginal":
        return torch.distributions.Binomial(total_count=k, probs=p).log_prob(sample).exp()
    if name == "unconstrained_marginal":
        return torch.distributions.Poisson(rate).log_prob(sample).exp()
    raise AssertionError(name)


def test_registry():
    assert set(NAMES) <= set(available_estimators("poisson"))
    for name in NAMES:
        est = get_estimator(name, family="poisson")
        assert est.family == "poisson" and est.exact is False
        assert "rate" in est.fn.__doc__
    assert get_estimator("random", family="poisson").fn is poisson_estimators.poisson_random
    with pytest.raises(ValueError, match="unknown estimator 'pathwise'"):
        get_estimator("pathwise", family="poisson")


@pytest.mark.parametrize("kind", ["single", "batched", "grouped", "broadcast-rate"])
@pytest.mark.parametrize("name", NAMES)
def test_forward_is_the_exact_sample(name, kind):
    rate, total, index, sample = make_setup(kind)
    out = get_estimator(name, family="poisson")(rate, total, sample, index=index)
    assert out.shape == sample.shape and out.dtype == sample.dtype
    assert torch.equal(out, sample)
    assert out.requires_grad


@pytest.mark.parametrize("kind", ["single", "batched", "grouped", "broadcast-rate"])
@pytest.mark.parametrize("name", ["marginal_expectation", "constrained_marginal", "unconstrained_marginal"])
def test_backward_is_autograd_through_the_proxy(name, kind):
    rate, total, index, sample = make_setup(kind)
    w = torch.randn(sample.shape, dtype=sample.dtype, generator=torch.Generator().manual_seed(1))
    out = get_estimator(name, family="poisson")(rate, total, sample, index=index)
    (grad,) = torch.autograd.grad((out * w).sum(), rate)
    proxy = reference_proxy(name, rate, total, index, sample)
    (expected,) = torch.autograd.grad((proxy.expand(sample.shape) * w).sum(), rate)
    assert grad.shape == rate.shape
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("name", NAMES)
def test_float32(name):
    rate, total, index, sample = make_setup("grouped", dtype=torch.float32)
    out = get_estimator(name, family="poisson")(rate, total, sample, index=index)
    assert out.dtype == torch.float32 and torch.equal(out, sample)
    out.sum().backward()
    assert rate.grad.dtype == torch.float32 and torch.isfinite(rate.grad).all()


@pytest.mark.parametrize("name", NAMES)
def test_rsample_uses_the_registered_estimator(name):
    rate, total, index, _ = make_setup("grouped")
    d = ConstrainedPoisson(rate, total, index=index)
    torch.manual_seed(5)
    z = d.sample((4,))
    torch.manual_seed(5)
    zr = d.rsample((4,), estimator=name)
    assert torch.equal(zr, z) and zr.requires_grad
    if name != "random":
        w = torch.randn(z.shape, dtype=z.dtype)
        (grad,) = torch.autograd.grad((zr * w).sum(), rate)
        direct = get_estimator(name, family="poisson")(rate, total, z, index=index)
        (expected,) = torch.autograd.grad((direct * w).sum(), rate)
        torch.testing.assert_close(grad, expected)


def test_marginal_expectation_is_exact_for_linear_losses():
    # m = E[z], so for a loss linear in z the proxy gradient equals the gradient of the expected loss
    rate, total, index, sample = make_setup("grouped")
    w = torch.randn(rate.shape[-1], dtype=rate.dtype)
    out = poisson_estimators.poisson_marginal_expectation(rate, total, sample, index=index)
    (grad,) = torch.autograd.grad((out * w).sum() / sample.shape[0], rate)
    mean = ConstrainedPoisson(rate, total, index=index).mean
    (expected,) = torch.autograd.grad((mean * w).sum(), rate)
    torch.testing.assert_close(grad, expected)


def test_singleton_group_gradients_are_finite():
    rate = torch.tensor([1.0, 2.0, 3.0, 0.5], dtype=torch.float64, requires_grad=True)
    index = torch.tensor([0, 0, 1, 0])  # group 1 has one coordinate: p = 1, z = total
    total = torch.tensor([4.0, 3.0], dtype=torch.float64)
    sample = ConstrainedPoisson(rate.detach(), total, index=index).sample((5,))
    for name in NAMES:
        out = get_estimator(name, family="poisson")(rate, total, sample, index=index)
        (grad,) = torch.autograd.grad(out.sum(), rate)
        assert torch.isfinite(grad).all(), name
        if name in ("marginal_expectation", "constrained_marginal"):
            assert grad[2].abs().item() < 1e-12  # p_2 = 1 does not depend on rate


def test_random_gradient_statistics():
    torch.manual_seed(0)  # statistical test, see the note at the top
    rate = (torch.rand(64, 1, 40) + 0.1).requires_grad_()  # unbroadcast rate: batch (64, 3)
    total = torch.randint(0, 10, (64, 3)).float()
    d = ConstrainedPoisson(rate, total)
    z = d.rsample((2,), estimator="random")
    assert z.shape == (2, 64, 3, 40)
    (g1,) = torch.autograd.grad((z * torch.randn_like(z)).sum(), rate)
    assert g1.shape == rate.shape and g1.dtype == rate.dtype
    N = g1.numel()
    z_crit = _zscore(FAILURE_RATE, 2)
    assert abs(g1.mean().item()) < z_crit / N**0.5  # mean 0
    assert abs(g1.var().item() - 1.0) < z_crit * (2.0 / N) ** 0.5  # variance 1 (var of s^2 is 2/N)
    assert scipy.stats.kstest(g1.flatten().numpy(), "norm").pvalue > FAILURE_RATE
    # independent of the loss and fresh on every backward
    z2 = d.rsample(estimator="random")
    (g2,) = torch.autograd.grad(0.0 * z2.sum(), rate)
    assert g2.shape == rate.shape and g2.abs().sum() > 0 and not torch.equal(g1, g2)


def test_estimator_argument_errors():
    rate, total, index, sample = make_setup("grouped")
    for name in NAMES:
        fn = get_estimator(name, family="poisson")
        with pytest.raises(ValueError, match=r"sample.*n = rate.shape\[-1\] = 7"):
            fn(rate, total, sample[..., :5], index=index)
        with pytest.raises(ValueError, match=r"index.*\(7,\)"):
            fn(rate, total, sample, index=index[:5])
    d = ConstrainedPoisson(rate, total, index=index)
    with pytest.raises(ValueError, match="unknown estimator"):
        d.rsample(estimator="score_function")
    with pytest.raises(TypeError, match="estimator"):
        d.rsample(estimator=3)


@pytest.mark.parametrize("name", NAMES)
def test_estimators_at_large_totals(name):
    # totals of 1e9 and 1e12 (a group of one coordinate, p = 1, too): the forward is the exact sample, the
    # gradient finite; marginal_expectation's is exact for a linear loss, as at small totals
    rate = torch.tensor([[0.5, 1.0, 2.0, 4.0, 3.0], [1e-6, 1.0, 1.0, 1.0, 7.0]], dtype=torch.float64)
    rate.requires_grad_()
    index = torch.tensor([0, 0, 1, 1, 2])
    total = torch.tensor([[1e12, 1e9, 5e11], [1e12, 3.0, 1e12]], dtype=torch.float64)
    d = ConstrainedPoisson(rate, total, index=index)
    torch.manual_seed(0)
    z = d.sample((4,))
    torch.manual_seed(0)
    zr = d.rsample((4,), estimator=name)
    assert torch.equal(zr, z)
    w = torch.randn(4, 2, 5, dtype=torch.float64)
    (grad,) = torch.autograd.grad((zr * w).sum(), rate)
    assert torch.isfinite(grad).all()
    if name == "marginal_expectation":
        (expected,) = torch.autograd.grad((d.mean * w).sum(), rate)
        torch.testing.assert_close(grad, expected)
    if name == "constrained_marginal":  # chain rule, d/dp b(z; k, p) = b(z; k, p) (z / p - (k - z) / (1 - p))
        p = d.probs
        k = total[:, index]
        q = torch.where(p < 1, p, 0.5).detach()  # p = 1: the singleton group, whose p has no gradient
        m = binomial_log_pmf(z, k, p.detach()).exp()
        dm_dp = torch.where(p < 1, m * (z / q - (k - z) / (1 - q)), 0.0)
        (expected,) = torch.autograd.grad((p * (w * dm_dp).sum(0)).sum(), rate)
        torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-12)
