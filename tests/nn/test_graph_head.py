"""hardeq.nn.graph: one SumConstraint over a ragged batch of graphs against a per-graph dense reference."""

from __future__ import annotations

import math

import pytest
import torch

from hardeq import ConstrainedNormal, LinearConstraint, SumConstraint
from hardeq.nn import GraphGaussianHead, graph_normal, per_graph_log_prob, variance_weighted_correction
from hardeq.testing import dense_conditional

SIZES = [2, 7, 3, 11, 5]  # ragged


def _batch(sizes=SIZES, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    batch = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    N = len(batch)
    loc = torch.randn(N, generator=g, dtype=dtype)
    var = torch.rand(N, generator=g, dtype=dtype) * 2 + 0.05
    total = torch.randn(len(sizes), generator=g, dtype=dtype)
    z = torch.randn(N, generator=g, dtype=dtype)
    counts = torch.tensor(sizes, dtype=dtype)
    z = z + ((total - torch.zeros(len(sizes), dtype=dtype).index_add_(0, batch, z)) / counts)[batch]  # on the planes
    return batch, loc, var, total, z


def _dense_per_graph(batch, loc, var, total):
    """Per graph: the float64 oracle restricted to an SVD null-space basis of A = 1^T (hardeq.testing)."""
    out = []
    for g in range(int(batch.max()) + 1):
        m = batch == g
        n = int(m.sum())
        ones = torch.ones(1, n, dtype=loc.dtype)
        out.append((m, dense_conditional(loc[m], torch.diag(var[m]), ones, total[g:g + 1])))
    return out


def test_ragged_batch_matches_dense_reference_per_graph():
    batch, loc, var, total, z = _batch()
    dist = graph_normal(loc, var, batch, total)
    lp = per_graph_log_prob(loc, var, batch, z, total)
    for g, (m, ref) in enumerate(_dense_per_graph(batch, loc, var, total)):
        torch.testing.assert_close(dist.mean[m], ref.mean)
        torch.testing.assert_close(dist.variance[m], ref.covariance.diagonal())
        torch.testing.assert_close(lp[g], ref.log_prob(z[m]))
        # the closed-form expected L1 is the folded-normal mean of the dense marginal
        s = ref.covariance.diagonal().sqrt()
        d = ref.mean - z[m]
        el1 = s * math.sqrt(2 / math.pi) * torch.exp(-d**2 / (2 * s**2)) + d * torch.erf(d / (math.sqrt(2) * s))
        torch.testing.assert_close(dist.expected_l1(z)[m], el1)
    torch.testing.assert_close(dist.log_prob(z), lp)  # per graph; the joint density is the product over graphs


def test_rsample_equals_per_graph_conditioning_with_the_same_noise():
    batch, loc, var, total, _ = _batch(seed=1)
    dist = graph_normal(loc, var, batch, total)
    eps = torch.randn(4, len(batch), dtype=loc.dtype, generator=torch.Generator().manual_seed(3))
    z = dist.rsample((4,), noise=eps)
    sums = torch.zeros(4, len(SIZES), dtype=loc.dtype).index_add_(1, batch, z)
    torch.testing.assert_close(sums, total.expand(4, -1), rtol=0, atol=1e-12)
    for g in range(len(SIZES)):
        m = batch == g
        one_group = SumConstraint(torch.zeros(int(m.sum()), dtype=torch.long), total[g:g + 1])
        one = ConstrainedNormal(loc[m], var[m].sqrt(), constraint=one_group)
        torch.testing.assert_close(z[:, m], one.rsample((4,), noise=eps[:, m]))


def test_head_gradients_equal_the_sum_of_per_graph_losses():
    torch.manual_seed(0)
    batch, _, _, total, z = _batch(seed=2)  # float64 targets on the planes; float32 network
    head = GraphGaussianHead(6, dtype=torch.float64)
    h = torch.randn(len(batch), 6)
    dist = head(h, batch, total)
    loss = -dist.log_prob(z).sum() + dist.expected_l1(z).sum()
    grads = torch.autograd.grad(loss, list(head.parameters()))
    ref = 0
    for g in range(len(SIZES)):
        m = batch == g
        d = head(h[m], torch.zeros(int(m.sum()), dtype=torch.long), total[g:g + 1])
        ref = ref - d.log_prob(z[m]).sum() + d.expected_l1(z[m]).sum()
    ref_grads = torch.autograd.grad(ref, list(head.parameters()))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
    assert dist.mean.dtype == torch.float64


def test_variance_weighted_correction_is_the_conditional_mean():
    """Raza et al.'s correction mu_i + v_i (t - sum mu)/sum v, written graph by graph as their code does,
    equals the conditional mean of N(mu, diag v) given the sums (and their uniform one is the projection)."""
    batch, loc, var, total, _ = _batch(seed=4)
    raza = torch.empty_like(loc)
    uniform = torch.empty_like(loc)
    for g in range(len(SIZES)):
        m = batch == g
        raza[m] = loc[m] + var[m] * (total[g] - loc[m].sum()) / var[m].sum()
        uniform[m] = loc[m] - (loc[m].sum() - total[g]) / m.sum()
    dist = graph_normal(loc, var, batch, total)
    torch.testing.assert_close(dist.mean, raza)
    torch.testing.assert_close(variance_weighted_correction(loc, var, batch, total), raza)
    torch.testing.assert_close(graph_normal(loc, torch.full_like(var, 0.3), batch, total).mean, uniform)
    # and it differs from the uniform correction when the variances differ
    assert (dist.mean - uniform).abs().max() > 1e-3


def test_dense_linear_constraint_agrees_on_the_whole_batch():
    batch, loc, var, total, z = _batch(seed=5)
    A = torch.zeros(len(SIZES), len(batch), dtype=loc.dtype)
    A[batch, torch.arange(len(batch))] = 1.0
    dense = ConstrainedNormal(loc, var.sqrt(), constraint=LinearConstraint(A, total))
    dist = graph_normal(loc, var, batch, total)
    torch.testing.assert_close(dist.mean, dense.mean)
    torch.testing.assert_close(dist.variance, dense.variance)
    torch.testing.assert_close(dist.log_prob(z).sum(), dense.log_prob(z))


def test_singleton_graph_is_pinned_to_its_total():
    batch = torch.tensor([0, 1, 1, 1])
    loc, var = torch.tensor([0.3, 1.0, 2.0, 3.0], dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    dist = graph_normal(loc, var, batch, torch.tensor([-1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(dist.mean[0], torch.tensor(-1.0, dtype=torch.float64), rtol=0, atol=1e-15)
    assert dist.variance[0] == 0.0
    assert torch.isfinite(dist.expected_l1(torch.tensor([-1.0, 0.0, 0.0, 0.0], dtype=torch.float64))).all()


def test_default_total_is_zero_and_num_graphs_is_respected():
    batch, loc, var, _, _ = _batch(seed=6)
    m = graph_normal(loc, var, batch).mean
    torch.testing.assert_close(torch.zeros(len(SIZES), dtype=m.dtype).index_add_(0, batch, m),
                               torch.zeros(len(SIZES), dtype=m.dtype), rtol=0, atol=1e-13)
    with pytest.raises(ValueError, match="total must have shape"):
        graph_normal(loc, var, batch, torch.zeros(3, dtype=loc.dtype))
    with pytest.raises(ValueError, match="at least one coordinate"):
        graph_normal(loc, var, batch, num_graphs=len(batch) + 1)


def test_bad_inputs_name_the_argument():
    batch, loc, var, total, z = _batch()
    with pytest.raises(TypeError, match="batch"):
        graph_normal(loc, var, batch.float(), total)
    with pytest.raises(ValueError, match="variance"):
        graph_normal(loc, var[:-1], batch, total)
    with pytest.raises(ValueError, match="loc"):
        graph_normal(loc[None], var, batch, total)
    with pytest.raises(ValueError, match="value"):
        per_graph_log_prob(loc, var, batch, z[:-1], total)
    head = GraphGaussianHead(4)
    with pytest.raises(ValueError, match=r"h must have shape \(num_nodes, 4\)"):
        head(torch.randn(len(batch), 5), batch)
    with pytest.raises(ValueError, match="in_features"):
        GraphGaussianHead(0)
    with pytest.raises(ValueError, match="min_variance"):
        GraphGaussianHead(3, min_variance=-1.0)
    with pytest.raises(TypeError, match="dtype"):
        GraphGaussianHead(3, dtype=torch.long)


