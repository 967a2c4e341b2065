"""What a torch / PyG user expects of the heads: ``k`` as a number or a tensor of any broadcastable shape, per
call or fixed at construction, in both heads alike; and per-graph log-densities from the graph head, checked
against a dense float64 oracle per graph (including a one-atom graph)."""

from __future__ import annotations

import pytest
import torch

from hardeq import ConstrainedNormal, SumConstraint
from hardeq.nn import ConstrainedGaussianHead, GraphGaussianHead, GraphNormal, graph_normal
from hardeq.testing import dense_conditional

A = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, -1.0, 1.0]])
DTYPES = [torch.float32, torch.float64]
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float64: dict(rtol=1e-10, atol=1e-10)}


def _heads(dtype, **kwargs):
    torch.manual_seed(0)
    return (ConstrainedGaussianHead(3, 4, constraint_matrix=A.to(dtype), **kwargs).to(dtype),
            ConstrainedGaussianHead(3, 4, index=torch.tensor([0, 0, 1, 1]), **kwargs).to(dtype))


# ----------------------------------------------------------------------------------- ConstrainedGaussianHead: k
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, expected", [
    (1.0, [[1.0, 1.0]] * 5),
    (2, [[2.0, 2.0]] * 5),
    (torch.tensor(1.5), [[1.5, 1.5]] * 5),
    (torch.tensor([0.5]), [[0.5, 0.5]] * 5),
    (torch.tensor([1.0, -2.0]), [[1.0, -2.0]] * 5),
    (torch.arange(5.0).unsqueeze(-1), [[float(i), float(i)] for i in range(5)]),
    (torch.tensor([[3, 4]] * 5), [[3.0, 4.0]] * 5),  # an integer tensor
], ids=["float", "int", "0-dim", "(1,)", "(a,)", "(batch, 1)", "long (batch, a)"])
def test_head_accepts_k_of_any_broadcastable_shape(dtype, k, expected):
    feats = torch.randn(5, 3, dtype=dtype)
    expected = torch.tensor(expected, dtype=dtype)
    for head in _heads(dtype):
        d = head(feats, k.to(dtype) if isinstance(k, torch.Tensor) and k.is_floating_point() else k)
        assert isinstance(d, ConstrainedNormal) and d.batch_shape == (5,) and d.mean.dtype == dtype
        eps = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
        torch.testing.assert_close(d.constraint.matvec(d.mean), expected, rtol=0, atol=eps)
        torch.testing.assert_close(d.constraint.matvec(d.rsample((2,))), expected.expand(2, 5, 2), rtol=0, atol=eps)
        assert bool(d.constraint.check(d.mean).all())


def test_head_k_batch_dims_broadcast_with_the_features():
    head, _ = _heads(torch.float64)
    d = head(torch.randn(5, 3, dtype=torch.float64), torch.randn(2, 1, 2, dtype=torch.float64))
    assert d.batch_shape == (2, 5)
    d = head(torch.randn(3, dtype=torch.float64), torch.randn(7, 2, dtype=torch.float64))  # one feature vector
    assert d.batch_shape == (7,)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fixed_k_at_construction_is_a_buffer_and_a_call_overrides_it(dtype):
    torch.manual_seed(0)
    portfolio = ConstrainedGaussianHead(3, 4, constraint_matrix=torch.ones(1, 4), constraint_value=1.0).to(dtype)
    feats = torch.randn(6, 3, dtype=dtype)
    d = portfolio(feats)
    eps = {torch.float32: 1e-6, torch.float64: 1e-14}[dtype]
    torch.testing.assert_close(d.mean.sum(-1), torch.ones(6, dtype=dtype), rtol=0, atol=eps)
    assert d.mean.dtype == dtype and "constraint_value" in dict(portfolio.named_buffers())
    torch.testing.assert_close(portfolio(feats, 3.0).mean.sum(-1), torch.full((6,), 3.0, dtype=dtype), rtol=0,
                               atol=4 * eps)
    # a tensor k fixed at construction, and the state dict round trip
    grouped = ConstrainedGaussianHead(3, 4, index=torch.tensor([0, 0, 1, 1]),
                                      constraint_value=torch.tensor([1.0, -1.0])).to(dtype)
    clone = ConstrainedGaussianHead(3, 4, index=torch.tensor([0, 0, 1, 1]), constraint_value=torch.zeros(2))
    clone.load_state_dict(grouped.state_dict())
    clone = clone.to(dtype)
    torch.testing.assert_close(clone(feats).mean, grouped(feats).mean)
    torch.testing.assert_close(grouped.constraint().k, torch.tensor([1.0, -1.0], dtype=dtype))
    assert "constraint_value=(2,)" in repr(grouped)


def test_fixed_k_matches_the_same_k_per_call_and_the_dense_oracle():
    torch.manual_seed(1)
    head = ConstrainedGaussianHead(3, 4, constraint_matrix=A.double(), constraint_value=torch.tensor([1.0, 2.0]))
    head = head.double()
    feats = torch.randn(2, 3, dtype=torch.float64)
    d, ref = head(feats), head(feats, torch.tensor([[1.0, 2.0]] * 2, dtype=torch.float64))
    torch.testing.assert_close(d.mean, ref.mean, rtol=0, atol=0)
    loc, raw = head.linear(feats).chunk(2, -1)
    scale = torch.nn.functional.softplus(raw) + head.min_scale
    for b in range(2):
        o = dense_conditional(loc[b], torch.diag(scale[b] ** 2), A.double(), torch.tensor([1.0, 2.0]))
        torch.testing.assert_close(d.mean[b], o.mean)
        z = d.sample()
        torch.testing.assert_close(d.log_prob(z)[b], o.log_prob(z[b]))


HEAD_ERRORS = [
    (lambda h: h(torch.randn(5, 3)), ValueError,
     r"constraint_value \(the right-hand side k\) must be given: pass it per call.*or fix it at construction"),
    (lambda h: h(torch.randn(5, 3), torch.ones(5)), ValueError,
     r"^constraint_value must have shape \(\.\.\., 2\), got \(5,\).*batch shape \(5,\)"),
    (lambda h: h(torch.randn(5, 3), torch.ones(4, 2)), ValueError,
     r"^constraint_value must have shape \(\.\.\., 2\), got \(4, 2\).*features' batch shape \(5,\)"),
    (lambda h: h(torch.randn(5, 3), "1"), TypeError, r"constraint_value must be a Python number .* got str"),
    (lambda h: h(torch.randn(5, 3), torch.ones(5, 2, dtype=torch.bool)), TypeError, r"got torch.bool"),
    (lambda h: h(torch.randn(5, 3), torch.ones(2, device="meta")), ValueError,
     r"constraint_value is on device meta but the features are on (cpu|cuda)"),
    (lambda h: h(torch.randn(5, 4), 1.0), ValueError, r"^features must have shape \(\.\.\., 3\), got \(5, 4\)"),
]


@pytest.mark.parametrize("call, error, match", HEAD_ERRORS, ids=[m for _, _, m in HEAD_ERRORS])
def test_head_errors_name_constraint_value_and_the_shapes(call, error, match):
    head = ConstrainedGaussianHead(3, 4, constraint_matrix=A)
    with pytest.raises(error, match=match):
        call(head)


def test_head_error_hints_unsqueeze_for_one_row_and_checks_at_construction():
    head = ConstrainedGaussianHead(3, 4, constraint_matrix=torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"got \(5,\).*k\.unsqueeze\(-1\)"):
        head(torch.randn(5, 3), torch.ones(5))
    with pytest.raises(ValueError, match=r"constraint_value must have shape \(\.\.\., 1\), got \(3,\) at construction"):
        ConstrainedGaussianHead(3, 4, constraint_matrix=torch.ones(1, 4), constraint_value=torch.ones(3))
    with pytest.raises(TypeError, match="constraint_value"):
        ConstrainedGaussianHead(3, 4, constraint_matrix=torch.ones(1, 4), constraint_value=True)


# ----------------------------------------------------------------------------------- GraphGaussianHead: totals
SIZES = [3, 1, 5, 2]  # ragged, with a one-atom graph


def _graphs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = torch.repeat_interleave(torch.arange(len(SIZES)), torch.tensor(SIZES))
    N = len(batch)
    loc = torch.randn(N, generator=g, dtype=torch.float64).to(dtype)
    var = (torch.rand(N, generator=g, dtype=torch.float64) * 2 + 0.05).to(dtype)
    total = torch.randn(len(SIZES), generator=g, dtype=torch.float64).to(dtype)
    return batch, loc, var, total


def _group_sums(x, batch):
    return x.new_zeros(x.shape[:-1] + (len(SIZES),)).index_add_(-1, batch, x)


@pytest.mark.parametrize("total, expected", [
    (None, [0.0] * 4), (1.5, [1.5] * 4), (2, [2.0] * 4), (torch.tensor(-1.0), [-1.0] * 4),
    (torch.tensor([0.5]), [0.5] * 4), (torch.tensor([1, 2, 3, 4]), [1.0, 2.0, 3.0, 4.0]),
], ids=["None", "float", "int", "0-dim", "(1,)", "long (G,)"])
def test_graph_head_totals_per_call_and_fixed(total, expected):
    torch.manual_seed(0)
    batch, *_ = _graphs()
    h = torch.randn(len(batch), 4)
    expected = torch.tensor(expected, dtype=torch.float64)
    per_call = GraphGaussianHead(4, dtype=torch.float64)
    fixed = GraphGaussianHead(4, total=total, dtype=torch.float64)
    fixed.load_state_dict(per_call.state_dict(), strict=False)
    for d in (per_call(h, batch, total), fixed(h, batch)):
        assert isinstance(d, GraphNormal)
        torch.testing.assert_close(_group_sums(d.mean, batch), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(fixed(h, batch, 7.0).mean.sum(), torch.tensor(28.0, dtype=torch.float64))


def test_graph_head_total_errors():
    batch, *_ = _graphs()
    head = GraphGaussianHead(4)
    with pytest.raises(ValueError, match=r"total must have shape \(num_graphs,\) = \(4,\), or broadcast .*got \(3,\)"):
        head(torch.randn(len(batch), 4), batch, torch.zeros(3))
    with pytest.raises(TypeError, match=r"total must be a floating / integer Tensor, a number or None, got str"):
        head(torch.randn(len(batch), 4), batch, "0")
    with pytest.raises(ValueError, match=r"total must have shape \(\), \(1,\) or \(num_graphs,\), got \(2, 2\)"):
        GraphGaussianHead(4, total=torch.zeros(2, 2))
    with pytest.raises(TypeError, match="total"):
        GraphGaussianHead(4, total=True)


# ----------------------------------------------------------------------------------- per-graph log_prob
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_graph_log_prob_and_entropy_match_dense_oracles(dtype):
    batch, loc, var, total = _graphs(dtype)
    d = graph_normal(loc, var, batch, total)
    z = d.sample((6,))
    lp, H = d.log_prob(z), d.entropy()
    assert lp.shape == (6, len(SIZES)) and H.shape == (len(SIZES),) and lp.dtype == H.dtype == dtype
    for g in range(len(SIZES)):
        m = batch == g
        if int(m.sum()) == 1:  # a one-atom graph: pinned to its total, a point mass (density 1, entropy 0)
            assert bool((lp[:, g] == 0).all()) and float(H[g]) == 0.0
            torch.testing.assert_close(z[:, m].squeeze(-1), total[g].expand(6), rtol=0, atol=0)
            continue
        o = dense_conditional(loc[m], torch.diag(var[m].double()), torch.ones(1, int(m.sum()), dtype=torch.float64),
                              total[g:g + 1].double())
        torch.testing.assert_close(lp[:, g].double(), o.log_prob(z[:, m].double()), **TOL[dtype])
        torch.testing.assert_close(H[g].double(), o.entropy(), **TOL[dtype])
    # the joint density and entropy are the sums
    joint = ConstrainedNormal(loc, var.sqrt(), constraint=SumConstraint(batch, total))
    torch.testing.assert_close(lp.sum(-1), joint.log_prob(z), **TOL[dtype])
    torch.testing.assert_close(H.sum(), joint.entropy(), **TOL[dtype])


def test_per_graph_log_prob_from_the_head_and_its_gradient_stays_in_the_graph():
    torch.manual_seed(0)
    batch, _, _, total = _graphs()
    head = GraphGaussianHead(4).double()
    h = torch.randn(len(batch), 4, dtype=torch.float64, requires_grad=True)
    d = head(h, batch, total)
    y = d.sample()
    nll = -d.log_prob(y)
    assert nll.shape == (len(SIZES),)
    (grad,) = torch.autograd.grad(nll[2], h)
    assert bool((grad[batch != 2] == 0).all()) and bool((grad[batch == 2] != 0).any())


def test_per_graph_log_prob_gradcheck():
    batch, loc, var, total = _graphs()
    z = graph_normal(loc, var, batch, total).sample((2,))

    def fn(loc, var, total):
        d = graph_normal(loc, var, batch, total, validate_args=False)
        return d.log_prob(z), d.entropy()

    assert torch.autograd.gradcheck(fn, (loc.requires_grad_(), var.requires_grad_(), total.requires_grad_()))


def test_per_graph_log_prob_float32_far_from_the_plane():
    """loc a thousand scales off the planes, variances over four decades: the float32 per-graph log-density
    within 1e-4 of float64 (the issue's float32 regression case, in the grouped diagonal form)."""
    batch, _, var, total = _graphs(seed=3)
    var = var * torch.logspace(-4, 0, len(batch), dtype=torch.float64)
    loc = torch.randn(len(batch), dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 1e3 * var.sqrt()
    d64 = graph_normal(loc, var, batch, total, validate_args=False)  # takes float32 points, off its plane by ulps
    d32 = graph_normal(loc.float(), var.float(), batch, total.float())
    z = d64.sample((3,))
    z32 = d32.sample((3,))
    torch.testing.assert_close(d32.log_prob(d32.mean).double(), d64.log_prob(d32.mean.double()), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(d32.log_prob(z32).double(), d64.log_prob(z32.double()), rtol=1e-4, atol=1e-4)
    assert torch.isfinite(d64.log_prob(z)).all()


def test_per_graph_log_prob_validates_support_expands_and_rejects_zero_variance():
    batch, loc, var, total = _graphs()
    d = graph_normal(loc, var, batch, total, validate_args=True)
    with pytest.raises(ValueError):
        d.log_prob(d.sample() + 0.1)
    e = d.expand((2,))
    assert isinstance(e, GraphNormal) and e.log_prob(d.sample((3, 1))).shape == (3, 2, len(SIZES))
    assert e.entropy().shape == (2, len(SIZES))
    torch.testing.assert_close(e.log_prob(d.mean)[0], d.log_prob(d.mean))
    zero = graph_normal(loc, var * (batch != 0), batch, total, validate_args=False)
    with pytest.raises(ValueError, match=r"log-normaliser of graph\(s\) \[0\] is not finite"):
        zero.log_prob(d.mean)
