"""ConstrainedGaussianHead(..., lower=, upper=) and GraphGaussianHead(..., lower=, upper=) return the truncated law
(ConstrainedNormal.truncate): exactly feasible samples, the mode of the hand-built truncation, checked bounds."""

import math

import numpy as np
import pytest
import torch

import hardeq
from hardeq import ConstrainedNormal, LinearConstraint, SumConstraint
from hardeq.nn import ConstrainedGaussianHead, GraphGaussianHead
from hardeq.testing import assert_exact_per_row

DTYPES = [torch.float32, torch.float64]


def _feasible(z, lower, upper):
    lo = torch.as_tensor(-math.inf if lower is None else lower, dtype=z.dtype)
    hi = torch.as_tensor(math.inf if upper is None else upper, dtype=z.dtype)
    return bool(((z >= lo) & (z <= hi)).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["dense", "sum"])
def test_bounded_head_samples_are_exactly_feasible(kind, dtype):
    torch.manual_seed(0)
    if kind == "dense":
        A = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 0.0, 2.0, 0.0]], dtype=dtype)
        head = ConstrainedGaussianHead(3, 5, constraint_matrix=A, lower=0.0, upper=2.0).to(dtype)
        k = torch.tensor([[3.0, 1.0]], dtype=dtype).expand(6, 2)
    else:
        head = ConstrainedGaussianHead(3, 5, index=torch.tensor([0, 0, 0, 1, 1]), lower=0.0, upper=2.0).to(dtype)
        k = torch.tensor([[2.0, 1.5]], dtype=dtype).expand(6, 2)
    dist = head(torch.randn(6, 3, dtype=dtype), k)
    assert isinstance(dist, hardeq.TruncatedConstrainedNormal)
    info = dist.sample_with_info((20,), burn_in=10)  # a feasibility check: a short burn-in keeps it fast
    z = info.samples
    assert z.shape == (20, 6, 5) and z.dtype == dtype and info.method in ("rejection", "gibbs", "hmc")
    assert _feasible(z, 0.0, 2.0)
    assert_exact_per_row(head.constraint(k), z)
    mode = dist.mode
    assert _feasible(mode, 0.0, 2.0)
    assert_exact_per_row(head.constraint(k), mode)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bounded_head_is_the_truncation_of_the_unbounded_head(dtype):
    """Same parameters: head(lower, upper) == head(no bounds).truncate(lower, upper) (the mode, deterministic)."""
    torch.manual_seed(1)
    lower = torch.tensor([0.0, -math.inf, 0.1, 0.0], dtype=dtype)
    head = ConstrainedGaussianHead(2, 4, constraint_matrix=torch.ones(1, 4, dtype=dtype), constraint_value=1.0,
                                   lower=lower, upper=0.8).to(dtype)
    x = torch.randn(5, 2, dtype=dtype)
    bounded = head(x)
    plain = head(x, lower=None, upper=None)
    assert type(plain) is ConstrainedNormal
    torch.testing.assert_close(bounded.mode, plain.truncate(lower, 0.8).mode)
    # a call's bounds replace the head's
    only_upper = head(x, lower=None)
    torch.testing.assert_close(only_upper.mode, plain.truncate(None, 0.8).mode)
    assert "lower=(4,)" in repr(head) and "upper=0.8" in repr(head)


def test_long_only_portfolio_head_against_truncnorm():
    """Two assets summing to one: one free dimension, w_0 ~ N(m, s^2) truncated to [0, 1] (the conditional of the
    sum given by hand), against scipy.stats.truncnorm: KS test of 4,000 draws at level 1e-3."""
    stats = pytest.importorskip("scipy.stats")
    head = ConstrainedGaussianHead(1, 2, constraint_matrix=torch.ones(1, 2, dtype=torch.float64),
                                   constraint_value=1.0, lower=0.0, upper=1.0).double()
    with torch.no_grad():
        head.linear.weight.zero_()
        head.linear.bias.copy_(torch.tensor([0.9, 0.3, 0.2, -0.1], dtype=torch.float64))  # loc, raw scale
    dist = head(torch.zeros(1, 1, dtype=torch.float64))
    loc = torch.tensor([0.9, 0.3], dtype=torch.float64)
    var = (torch.nn.functional.softplus(torch.tensor([0.2, -0.1], dtype=torch.float64)) + 1e-4) ** 2
    m = float(loc[0] + var[0] * (1 - loc.sum()) / var.sum())  # conditional mean and sd of w_0 given w_0 + w_1 = 1
    s = float((var[0] - var[0] ** 2 / var.sum()).sqrt())
    torch.manual_seed(3)
    w = dist.sample((4000,))[:, 0]
    assert bool(((w >= 0) & (w <= 1)).all()) and float((w.sum(-1) - 1).abs().max()) < 1e-12
    ref = stats.truncnorm((0 - m) / s, (1 - m) / s, loc=m, scale=s)
    assert stats.kstest(w[:, 0].numpy(), ref.cdf).pvalue > 1e-3


def test_bounded_head_trains_by_log_prob():
    """-log_prob of the truncated law is differentiable in the head's parameters (the normaliser's gradient
    included) and finite on feasible targets."""
    torch.manual_seed(0)
    head = ConstrainedGaussianHead(3, 4, constraint_matrix=torch.ones(1, 4), constraint_value=1.0, lower=-1.0,
                                   upper=2.0)
    x = torch.randn(8, 3)
    y = torch.softmax(torch.randn(8, 4), -1)
    dist = head(x, training=False)  # the normalised density (the default in train() is the persistent chains)
    assert dist.training is None and dist.normaliser_exact  # one row, diagonal: the 1-D convolution (sum_normaliser)
    loss = -dist.log_prob(y).mean()
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in head.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_training_mode_default_follows_train_eval_and_grad(dtype):
    """In train() with grad on the head builds the truncation with its own PersistentChains (the same object at
    every call, so the chains persist across steps); in eval() or under no_grad, or with training=False, the
    normalised density; an explicit PersistentChains is passed through. The unnormalised training value differs from
    the normalised one by exactly log Z."""
    from hardeq.bounds import PersistentChains

    torch.manual_seed(0)
    head = ConstrainedGaussianHead(3, 4, index=torch.zeros(4, dtype=torch.long), constraint_value=1.0, lower=0.0,
                                   upper=1.0).to(dtype)
    x = torch.randn(5, 3, dtype=dtype)
    y = torch.softmax(torch.randn(5, 4, dtype=dtype), -1)
    first = head(x)
    chains = first.training
    assert isinstance(chains, PersistentChains) and chains.state is None
    (-first.log_prob(y).mean()).backward()
    assert chains.steps == 1 and chains.state is not None and chains.state.shape == (chains.chains, 5, 4)
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in head.parameters())
    assert head(x).training is chains and head(x, training=True).training is chains
    head(x).log_prob(y).sum().backward()
    assert chains.steps == 2  # the same chains advanced
    with torch.no_grad():
        assert head(x).training is None
    assert head(x, training=False).training is None
    own = PersistentChains(chains=2, sweeps=1)
    assert head(x, training=own).training is own
    with pytest.raises(TypeError, match="training must be None, a bool or a hardeq.bounds.PersistentChains"):
        head(x, training="yes")
    with torch.no_grad():
        unnormalised = head(x, training=True).log_prob(y)
    head.eval()
    normalised_dist = head(x)
    assert normalised_dist.training is None
    with torch.no_grad():
        torch.testing.assert_close(unnormalised - normalised_dist.log_normaliser, normalised_dist.log_prob(y))
    head.train()
    assert head(x).training is chains


def test_graph_head_training_mode_default():
    torch.manual_seed(0)
    head = GraphGaussianHead(4, total=2.0, lower=0.0, dtype=torch.float64)
    batch = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    h = torch.randn(9, 4)
    dist = head(h, batch)
    chains = dist.training
    assert chains is not None and head(h, batch).training is chains
    y = torch.tensor([0.5, 0.7, 0.8, 1.5, 0.5, 0.1, 0.2, 0.9, 0.8], dtype=torch.float64)
    (-dist.log_prob(y).sum()).backward()
    assert chains.steps == 1 and all(bool(torch.isfinite(p.grad).all()) for p in head.parameters())
    head.eval()
    assert head(h, batch).training is None
    assert head(h, batch, training=True).training is chains


@pytest.mark.parametrize("kwargs, err, match", [
    ({"lower": "0"}, TypeError, "lower must be None, a Python number"),
    ({"upper": torch.tensor([True, False, True, True])}, TypeError, "upper"),
    ({"lower": torch.zeros(3)}, ValueError, "last dimension is 1 or 4"),
    ({"lower": 1.0, "upper": 0.0}, ValueError, "lower <= upper"),
    ({"lower": torch.tensor([0.0, math.nan, 0.0, 0.0])}, ValueError, "NaN"),
])
def test_head_bad_bounds(kwargs, err, match):
    with pytest.raises(err, match=match):
        ConstrainedGaussianHead(2, 4, constraint_matrix=torch.ones(1, 4), **kwargs)
    head = ConstrainedGaussianHead(2, 4, constraint_matrix=torch.ones(1, 4))
    with pytest.raises(err, match=match):
        head(torch.randn(3, 2), torch.ones(3, 1), **kwargs)


def test_unbounded_head_still_returns_the_constrained_normal():
    head = ConstrainedGaussianHead(2, 4, constraint_matrix=torch.ones(1, 4), lower=None, upper=None)
    assert type(head(torch.randn(3, 2), torch.ones(3, 1))) is ConstrainedNormal
    assert head.lower is None and head.upper is None and "lower" not in repr(head)


@pytest.mark.parametrize("dtype", DTYPES)
def test_graph_head_with_nonnegative_nodes(dtype):
    torch.manual_seed(0)
    head = GraphGaussianHead(4, total=2.0, lower=0.0, dtype=dtype)
    batch = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    dist = head(torch.randn(9, 4), batch)
    assert isinstance(dist, hardeq.TruncatedConstrainedNormal)
    z = dist.sample((20,), burn_in=10)
    assert z.shape == (20, 9) and z.dtype == dtype and bool((z >= 0).all())
    sums = torch.zeros(20, 3, dtype=dtype).index_add_(1, batch, z)
    assert_exact_per_row(SumConstraint(batch, torch.full((3,), 2.0, dtype=dtype)), z)
    torch.testing.assert_close(sums, torch.full((20, 3), 2.0, dtype=dtype))
    # per-call bounds (N,) replace the head's; None removes them
    upper = torch.tensor([1.0, 1.0, 1.0, 1.5, 1.5, 0.6, 0.6, 0.6, 0.6])
    capped = head(torch.randn(9, 4), batch, upper=upper).sample((10,), burn_in=10)
    assert bool((capped >= 0).all()) and bool((capped <= upper.to(dtype)).all())
    assert type(head(torch.randn(9, 4), batch, lower=None)).__name__ == "GraphNormal"
    assert "lower=0" in repr(head)


def test_graph_head_bad_bounds():
    with pytest.raises(ValueError, match="a number at construction"):
        GraphGaussianHead(4, lower=torch.zeros(5))
    with pytest.raises(ValueError, match="lower <= upper"):
        GraphGaussianHead(4, lower=1.0, upper=0.5)
    head = GraphGaussianHead(4)
    with pytest.raises(ValueError, match="last dimension is 1 or 3"):
        head(torch.randn(3, 4), torch.tensor([0, 0, 1]), lower=torch.zeros(2))


def test_empty_polytope_is_a_clear_error():
    head = ConstrainedGaussianHead(2, 3, constraint_matrix=torch.ones(1, 3), constraint_value=5.0, lower=0.0,
                                   upper=1.0)
    with pytest.raises(ValueError):
        head(torch.randn(2, 2)).sample()


def test_dense_constraint_numpy_free():
    """The bounded head needs no more than torch: a dense LinearConstraint head, float64."""
    A = torch.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    head = ConstrainedGaussianHead(2, 3, constraint_matrix=A, lower=-1.0, upper=3.0).double()
    k = torch.tensor([[2.0, 1.5]], dtype=torch.float64)
    z = head(torch.randn(4, 2, dtype=torch.float64), k).sample((10,))
    assert_exact_per_row(LinearConstraint(A, k), z)
    assert np.all((z.numpy() >= -1) & (z.numpy() <= 3))
