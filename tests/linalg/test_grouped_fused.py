"""The one-node grouped sample (``_GroupedSample``: ``ConstrainedNormal.rsample`` under a diagonal covariance and a
constraint whose columns have at most one nonzero) and the layouts behind it (segment sums of sorted groups, the
per-index cache of ``SumConstraint``).

Checked against independent references: ``gradcheck`` in float64 for ``loc``, ``scale`` and the totals (ragged and
unsorted groups, groups of one, weighted sums, broadcast batch shapes); values and gradients against the general
path written out op by op (the conditioner's step, differentiated by autograd) in float32 and float64; group sums
against float64 sums.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hardeq
from hardeq.estimators.normal import exact_sample
from hardeq.linalg.conditioning.grouped_sample import _GroupedSample
from hardeq.ops import SUM_CHUNK, GroupSum
from hardeq.testing import assert_exact_per_row

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
FUSED = "_GroupedSampleBackward"

#: ragged sorted groups with two groups of one (coordinates 3 and 9)
RAGGED = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 3, 4, 5, 5])
#: the same partition, unsorted (the scatter path of GroupSum)
UNSORTED = torch.tensor([2, 0, 2, 1, 0, 5, 3, 3, 0, 4, 5, 3])


def _weighted(dtype: torch.dtype, free: bool = True) -> torch.Tensor:
    """A sparse ``(4, 9)`` with one signed weight per column (column 8 in no row when ``free``)."""
    rows = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 0 if not free else 3])
    values = torch.tensor([1.5, -0.5, 2.0, 1.0, -3.0, 0.75, 1.0, -1.25, 1.0], dtype=dtype)
    if free:
        values[8] = 0.0
    A = torch.zeros(4, 9, dtype=dtype)
    A[rows, torch.arange(9)] = values
    return A


@pytest.fixture(autouse=True)
def _quiet_sparse_beta():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
        yield


def _constraint(kind: str, k: torch.Tensor) -> hardeq.EqualityConstraint:
    if kind == "ragged":
        return hardeq.SumConstraint(RAGGED, k)
    if kind == "unsorted":
        return hardeq.SumConstraint(UNSORTED, k)
    return hardeq.SparseConstraint(_weighted(k.dtype, free=kind == "weighted_free").to_sparse_csr(), k)


def _sizes(kind: str) -> tuple[int, int]:
    return {"ragged": (12, 6), "unsorted": (12, 6), "weighted": (9, 4), "weighted_free": (9, 4)}[kind]


KINDS = pytest.mark.parametrize("kind", ["ragged", "unsorted", "weighted", "weighted_free"])


def _inputs(kind: str, dtype: torch.dtype, batch=(), k_batch=(), seed: int = 0):
    n, a = _sizes(kind)
    g = torch.Generator().manual_seed(seed)
    loc = torch.randn(batch + (n,), generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    scale = (0.5 + torch.rand(batch + (n,), generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    k = torch.randn(k_batch + (a,), generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return loc, scale, k


@KINDS
@pytest.mark.parametrize("shapes", [((), (), (3,)), ((2,), (), (3,)), ((), (2,), (3,)), ((2,), (4, 1), ())],
                         ids=["shared", "batched_params", "batched_k", "broadcast"])
def test_gradcheck_float64(kind, shapes):
    batch, k_batch, sample = shapes
    loc, scale, k = _inputs(kind, torch.float64, batch, k_batch)
    full = torch.broadcast_shapes(batch, k_batch)
    eps = torch.randn(sample + full + (loc.shape[-1],), generator=torch.Generator().manual_seed(1),
                      dtype=torch.float64)

    def sample_of(loc, scale, k):
        d = hardeq.ConstrainedNormal(loc, scale, constraint=_constraint(kind, k))
        return d.rsample(sample, noise=eps)

    z = sample_of(loc, scale, k)
    assert type(z.grad_fn).__name__ == FUSED or (z.grad_fn is not None and FUSED in str(z.grad_fn.next_functions))
    assert torch.autograd.gradcheck(sample_of, (loc, scale, k))


def _general(kind: str, loc, scale, k, eps):
    """The step written out op by op and differentiated by autograd: the static conditioner (no fused node; one
    refinement step more, which changes the value by round-off only)."""
    con = _constraint(kind, k)
    cond = hardeq.linalg.conditioning.Conditioner(hardeq.DiagonalCovariance(scale), con, static=True)
    return exact_sample(cond, loc, eps)


@KINDS
def test_gradcheck_of_the_conditioners_one_node_step(kind):
    """``Conditioner.condition`` (the other estimators, the conditional mean) takes the one-node step
    ``_GroupedStep`` when a gradient is needed."""
    loc, scale, k = _inputs(kind, torch.float64, batch=(2,), seed=7)
    eps = torch.randn(3, 2, loc.shape[-1], generator=torch.Generator().manual_seed(8), dtype=torch.float64)

    def conditioned(loc, scale, k):
        cond = hardeq.linalg.conditioning.Conditioner(hardeq.DiagonalCovariance(scale), _constraint(kind, k))
        return exact_sample(cond, loc, eps)

    def mean(loc, scale, k):
        return hardeq.ConstrainedNormal(loc, scale, constraint=_constraint(kind, k)).mean

    assert "_GroupedStepBackward" in repr(conditioned(loc, scale, k).grad_fn) or any(
        "_GroupedStepBackward" in repr(f) for f, _ in conditioned(loc, scale, k).grad_fn.next_functions)
    assert torch.autograd.gradcheck(conditioned, (loc, scale, k))
    assert torch.autograd.gradcheck(mean, (loc, scale, k))


@DTYPES
@KINDS
def test_values_and_gradients_match_the_general_path(kind, dtype):
    loc, scale, k = _inputs(kind, dtype, batch=(2,), seed=3)
    eps = torch.randn(5, 2, loc.shape[-1], generator=torch.Generator().manual_seed(4), dtype=dtype)
    weight = torch.randn(5, 2, loc.shape[-1], generator=torch.Generator().manual_seed(5), dtype=dtype)
    fused = hardeq.ConstrainedNormal(loc, scale, constraint=_constraint(kind, k)).rsample((5,), noise=eps)
    general = _general(kind, loc, scale, k, eps)
    assert FUSED not in type(general.grad_fn).__name__
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused, general, **tol)
    grads_fused = torch.autograd.grad((fused * weight).sum(), (loc, scale, k))
    grads_general = torch.autograd.grad((general * weight).sum(), (loc, scale, k))
    for a, b in zip(grads_fused, grads_general):
        torch.testing.assert_close(a, b, rtol=tol["rtol"] * 10, atol=tol["atol"] * 10)


@DTYPES
@pytest.mark.parametrize("index", [RAGGED, UNSORTED], ids=["ragged", "unsorted"])
def test_groups_of_one_are_exact_in_value_and_gradient(index, dtype):
    n, a = index.numel(), int(index.max()) + 1
    loc = (torch.randn(4, n, dtype=dtype) * 1e3).requires_grad_()
    scale = (torch.rand(4, n, dtype=dtype) + 0.5).requires_grad_()
    k = (torch.randn(a, dtype=dtype) * 1e-3).requires_grad_()
    z = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.SumConstraint(index, k)).rsample((3,))
    single = torch.bincount(index, minlength=a)[index] == 1
    assert single.sum() == 2
    assert torch.equal(z[..., single], k[index[single]].expand(3, 4, 2))
    upstream = torch.randn_like(z)
    g_loc, g_scale, g_k = torch.autograd.grad((z * upstream).sum(), (loc, scale, k))
    assert torch.equal(g_loc[..., single], torch.zeros_like(g_loc[..., single]))
    assert torch.equal(g_scale[..., single], torch.zeros_like(g_scale[..., single]))
    groups = index[single]
    expected = upstream[..., single].sum((0, 1))
    torch.testing.assert_close(g_k[groups], expected)


def test_a_vector_far_from_the_plane_takes_the_general_path_and_is_exact():
    """loc 1e7 scales off the plane in float32: one step misses rows by ulp(1e7); the fused node says so and
    the conditioner refines (the result passes the per-row check)."""
    n = RAGGED.numel()
    loc = torch.full((n,), 1e7).requires_grad_()
    scale = torch.ones(n, requires_grad=True)
    k = torch.randn(6)
    d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.SumConstraint(RAGGED, k))
    z = d.rsample((16,))
    assert type(z.grad_fn).__name__ != FUSED
    assert bool(d.constraint.check(z.detach(), rtol=2.5e-6).all())
    z.sum().backward()
    assert torch.isfinite(loc.grad).all() and torch.isfinite(scale.grad).all()


def test_second_derivative_raises():
    loc, scale, k = _inputs("ragged", torch.float64)
    z = hardeq.ConstrainedNormal(loc, scale, constraint=_constraint("ragged", k)).rsample((2,))
    (g,) = torch.autograd.grad(z.square().sum(), loc, create_graph=True)
    with pytest.raises(RuntimeError):  # never a silently wrong second derivative
        torch.autograd.grad(g.sum(), loc)


def test_no_grad_and_other_estimators_are_unchanged():
    loc, scale, k = _inputs("ragged", torch.float32)
    d = hardeq.ConstrainedNormal(loc, scale, constraint=_constraint("ragged", k))
    eps = torch.randn(3, loc.shape[-1])
    with torch.no_grad():
        z = d.rsample((3,), noise=eps)
    assert z.grad_fn is None
    torch.testing.assert_close(z, _general("ragged", loc, scale, k, eps).detach(), rtol=1e-5, atol=1e-5)
    other = d.rsample((3,), "marginal_expectation", noise=eps)
    assert type(other.grad_fn).__name__ != FUSED
    torch.testing.assert_close(other, z, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------- GroupSum layouts
@DTYPES
def test_sorted_ragged_groups_use_segment_sums(dtype):
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 156, (128,), generator=g)
    index = torch.repeat_interleave(torch.arange(128), sizes)
    gs = GroupSum(index, 128)
    assert gs.block is None and gs.offsets is not None
    x = torch.randn(3, 2, index.numel(), generator=g, dtype=dtype) * 100
    expected = torch.zeros(3, 2, 128, dtype=torch.float64).index_add_(-1, index, x.double())
    tol = dict(rtol=1e-6, atol=1e-3) if dtype == torch.float32 else dict(rtol=1e-13, atol=1e-10)
    torch.testing.assert_close(gs(x).double(), expected, **tol)
    torch.testing.assert_close(GroupSum(index.flip(0), 128)(x.flip(-1)).double(), expected, **tol)  # unsorted
    assert GroupSum(index.flip(0), 128).offsets is None
    xr = x.clone().requires_grad_()
    (gs(xr) * torch.arange(128, dtype=dtype)).sum().backward()
    torch.testing.assert_close(xr.grad, torch.arange(128, dtype=dtype)[index].expand_as(x))


def test_groups_longer_than_a_chunk_keep_the_two_level_summation():
    index = torch.cat([torch.zeros(SUM_CHUNK + 5, dtype=torch.long), torch.ones(3, dtype=torch.long)])
    assert GroupSum(index, 2).offsets is None
    assert GroupSum(index[SUM_CHUNK - 10:], 2).offsets is not None


def test_sum_constraint_checks_and_lays_out_an_index_once_and_sees_edits():
    index = RAGGED.clone()
    hardeq.SumConstraint(index, torch.randn(6))  # first use: no copy kept (a fresh index per step never pays one)
    c1 = hardeq.SumConstraint(index, torch.randn(6))  # second: laid out again, now with the copy to compare with
    c2 = hardeq.SumConstraint(index, torch.randn(2, 6))
    assert c1._layout is c2._layout and c1._group_sum is c2._group_sum
    index.data[4] = 7  # an edit through .data (no version bump) is seen: the index is checked again
    with pytest.raises(ValueError, match="index values must lie in"):
        hardeq.SumConstraint(index, torch.randn(6))
    index.data[4] = 2
    c3 = hardeq.SumConstraint(index, torch.randn(6))
    assert c3._layout is not c1._layout
    assert hardeq.SumConstraint(index.clone(), torch.randn(6))._layout is not c3._layout  # another tensor


def test_an_index_used_once_keeps_no_copy_and_an_edit_before_its_second_use_is_seen():
    """The layout cache copies an index (to see edits through ``.data``) only when the index is used a second time:
    a new ``batch`` vector per step pays no copy; the second use lays the index out afresh, so an edit made in
    between is seen too."""
    from hardeq.constraints.sum import _LAYOUTS

    index = RAGGED.clone()
    first = hardeq.SumConstraint(index, torch.randn(6))
    assert _LAYOUTS._entries[id(index)][2] is None  # (no snapshot)
    index.data[4] = 7  # an edit through .data before the second use
    with pytest.raises(ValueError, match="index values must lie in"):
        hardeq.SumConstraint(index, torch.randn(6))
    index.data[4] = 2
    second = hardeq.SumConstraint(index, torch.randn(6))
    assert second._layout is not first._layout and _LAYOUTS._entries[id(index)][2] is not None
    assert hardeq.SumConstraint(index, torch.randn(6))._layout is second._layout
    index.data[:3] = torch.tensor([0, 1, 1])  # an edit that keeps the index valid: another layout, right sums
    third = hardeq.SumConstraint(index, torch.ones(6))
    assert third._layout is not second._layout
    torch.testing.assert_close(third.matvec(torch.ones(12)), torch.bincount(index, minlength=6).float())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_validation_still_names_the_argument(bad):
    n = RAGGED.numel()
    loc, scale = torch.zeros(n), torch.ones(n)
    with pytest.raises(ValueError, match="loc"):
        hardeq.ConstrainedNormal(loc.clone().index_fill_(0, torch.tensor([3]), bad), scale,
                                 constraint=hardeq.SumConstraint(RAGGED, torch.zeros(6)))
    with pytest.raises(ValueError, match="scale"):
        hardeq.ConstrainedNormal(loc, scale.clone().index_fill_(0, torch.tensor([3]), bad),
                                 constraint=hardeq.SumConstraint(RAGGED, torch.zeros(6)))
    with pytest.raises(ValueError, match="total"):
        hardeq.SumConstraint(RAGGED, torch.zeros(6).index_fill_(0, torch.tensor([1]), bad))
    with pytest.raises(ValueError, match="positive"):
        hardeq.ConstrainedNormal(loc, scale.clone().index_fill_(0, torch.tensor([3]), -1.0),
                                 constraint=hardeq.SumConstraint(RAGGED, torch.zeros(6)))


def test_a_grouped_registration_for_the_pair_is_honoured():
    """A ``"grouped"`` registration returning None turns the O(n) path off for the pair: the one-node sample and
    step are not taken either (the dense path, the same law)."""
    from hardeq.constraints import register_pair

    class NoGrouped(hardeq.SumConstraint):
        pass

    @register_pair("grouped", NoGrouped, hardeq.DiagonalCovariance)
    def _off(constraint, covariance):
        return None

    loc, scale, k = _inputs("ragged", torch.float64)
    eps = torch.randn(3, loc.shape[-1], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    d = hardeq.ConstrainedNormal(loc, scale, constraint=NoGrouped(RAGGED, k))
    z = d.rsample((3,), noise=eps)
    assert d.conditioner.method != "grouped" and "Grouped" not in repr(z.grad_fn)
    ref = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.SumConstraint(RAGGED, k)).rsample((3,), noise=eps)
    torch.testing.assert_close(z, ref, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------------------------- the closed form itself
def _dense_oracle(index: torch.Tensor, loc, scale, k, eps):
    r"""Matheron's rule written densely in float64 and differentiated by autograd: :math:`z = \hat z + \Sigma A^\top
    (A\Sigma A^\top)^{-1}(k - A\hat z)` with the one-hot ``A`` and a solve against the ``a x a`` Gram matrix (no
    closed form, no group sums, no pinning): an independent reference for values and gradients."""
    a = int(index.max()) + 1
    A = torch.nn.functional.one_hot(index, a).mT.to(torch.float64)  # (a, n)
    loc, scale, k, eps = (t.to(torch.float64) for t in (loc, scale, k, eps))
    z_hat = loc + scale * eps
    var = scale * scale
    S = (A * var.unsqueeze(-2)) @ A.mT  # (*, a, a)
    r = k - z_hat @ A.mT
    u = torch.linalg.solve(S, r.unsqueeze(-1)).squeeze(-1)
    return z_hat + var * (u @ A)


@DTYPES
@pytest.mark.parametrize("index", [RAGGED, UNSORTED], ids=["ragged", "unsorted"])
@pytest.mark.parametrize("shapes", [((), (), ()), ((2,), (), (3,)), ((), (2,), (3,)), ((2,), (4, 1), ())],
                         ids=["single", "batched_params", "batched_k", "broadcast"])
def test_values_and_gradients_match_a_dense_float64_oracle(index, shapes, dtype):
    """The one-node sample (its hand-written backward: ``g_loc = g - A^T q``, ``g_scale = g_loc (eps + 2 scale w)``,
    ``g_k = q``) against autograd through the dense float64 formula, groups of one included."""
    batch, k_batch, sample = shapes
    n, a = index.numel(), int(index.max()) + 1
    g = torch.Generator().manual_seed(11)
    loc = torch.randn(batch + (n,), generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    scale = (0.5 + torch.rand(batch + (n,), generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    k = torch.randn(k_batch + (a,), generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    full = torch.broadcast_shapes(batch, k_batch)
    eps = torch.randn(sample + full + (n,), generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(sample + full + (n,), generator=g, dtype=torch.float64)
    z = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.SumConstraint(index, k)).rsample(sample, noise=eps)
    assert type(z.grad_fn).__name__ == FUSED or FUSED in str(z.grad_fn.next_functions)
    assert z.dtype == dtype
    ref = _dense_oracle(index, loc, scale, k, eps)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(z.double(), ref.detach(), **tol)
    got = torch.autograd.grad((z.double() * weight).sum(), (loc, scale, k))
    want = torch.autograd.grad((ref * weight).sum(), (loc, scale, k))
    for name, x, y in zip(("loc", "scale", "k"), got, want):
        torch.testing.assert_close(x.double(), y.double(), **tol, msg=lambda m, name=name: f"gradient of {name}: {m}")


@DTYPES
def test_only_some_inputs_requiring_grad(dtype):
    """``needs_input_grad``: the backward forms only what is asked for (here ``k`` alone, then ``scale`` alone)."""
    n, a = RAGGED.numel(), 6
    g = torch.Generator().manual_seed(5)
    loc = torch.randn(n, generator=g, dtype=dtype)
    scale = (0.5 + torch.rand(n, generator=g, dtype=dtype))
    k = torch.randn(a, generator=g, dtype=dtype)
    eps = torch.randn(2, n, generator=g, dtype=dtype)
    for which in ("k", "scale"):
        inputs = {"loc": loc, "scale": scale.clone(), "k": k.clone()}
        inputs[which].requires_grad_()
        z = hardeq.ConstrainedNormal(inputs["loc"], inputs["scale"],
                                     constraint=hardeq.SumConstraint(RAGGED, inputs["k"])).rsample((2,), noise=eps)
        assert type(z.grad_fn).__name__ == FUSED
        (got,) = torch.autograd.grad(z.square().sum(), inputs[which])
        ref = _dense_oracle(RAGGED, loc, inputs["scale"], inputs["k"], eps)
        (want,) = torch.autograd.grad(ref.square().sum(), inputs[which])
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got.double(), want.double(), **tol)


@DTYPES
def test_groups_of_one_with_zero_totals_stay_on_the_one_node_path(dtype):
    """A group of one whose total is 0 (a neutral single atom) has |A||z| + |k| = 0 in its row: the check passes it
    (0 <= 0), the sample is exactly 0 there and the one-node path is kept."""
    n, a = RAGGED.numel(), 6
    k = torch.randn(a, dtype=dtype)
    k[1] = k[4] = 0.0  # the totals of the two groups of one
    loc = torch.randn(n, dtype=dtype, requires_grad=True)
    z = hardeq.ConstrainedNormal(loc, torch.ones(n, dtype=dtype),
                                 constraint=hardeq.SumConstraint(RAGGED, k)).rsample((4,))
    assert type(z.grad_fn).__name__ == FUSED
    assert torch.equal(z[..., [3, 9]], torch.zeros(4, 2, dtype=dtype))


def test_scales_whose_squares_underflow_take_the_general_path():
    """float32 scales of 1e-21: every variance is subnormal, the group sums lie below ``tiny / eps`` and are raised
    to it, the one step misses its rows, and the general path (normalised by the largest scale) gives the sample;
    it meets every row and matches the static conditioner on the same noise."""
    n = RAGGED.numel()
    g = torch.Generator().manual_seed(3)
    scale = torch.full((n,), 1e-21).requires_grad_()
    loc = (1e-21 * torch.randn(n, generator=g)).requires_grad_()
    k = 1e-21 * torch.randn(6, generator=g)
    eps = torch.randn(3, n, generator=g)
    d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.SumConstraint(RAGGED, k))
    z = d.rsample((3,), noise=eps)
    assert type(z.grad_fn).__name__ != FUSED
    assert_exact_per_row(d.constraint, z.detach())
    ref = _general("ragged", loc, scale, k, eps)
    torch.testing.assert_close(z, ref, rtol=1e-5, atol=1e-26)


# --------------------------------------------------------------------------------------------- construction checks
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=["float16", "float32", "float64"])
def test_the_one_pass_validation_rejects_what_the_precise_checks_reject(dtype):
    """The combined check of ``loc`` and a diagonal ``scale`` (min, max, sum: one read-back) and the precise checks it
    falls back to: the message names the argument for NaN, +-inf, a non-positive and a subnormal scale."""
    n = RAGGED.numel()
    con = hardeq.SumConstraint(RAGGED, torch.zeros(6, dtype=dtype))
    loc, scale = torch.zeros(n, dtype=dtype), torch.ones(n, dtype=dtype)
    tiny = torch.finfo(dtype).tiny
    bad_scales = {"inf": float("inf"), "nan": float("nan"), "zero": 0.0, "negative": -1.0, "subnormal": tiny / 4}
    for value in bad_scales.values():
        with pytest.raises(ValueError, match="scale"):
            hardeq.ConstrainedNormal(loc, scale.clone().index_fill_(0, torch.tensor([5]), value), constraint=con)
    for value in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="loc"):
            hardeq.ConstrainedNormal(loc.clone().index_fill_(0, torch.tensor([7]), value), scale, constraint=con)
    # finite entries whose sum overflows: the precise check decides (and accepts)
    big = torch.full((n,), torch.finfo(dtype).max / 2, dtype=dtype)
    assert torch.isinf(big.sum())
    hardeq.ConstrainedNormal(big, scale, constraint=con)
    # the smallest normal scale is accepted
    hardeq.ConstrainedNormal(loc, torch.full((n,), tiny, dtype=dtype), constraint=con)


def test_a_fresh_sorted_index_is_laid_out_in_one_pass():
    """PyG's ``batch`` vector, a new tensor each step: one pass finds the segments (or the equal blocks) and whether
    a group has one member, with the same layout and the same sums as the general detection."""
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 40, (50,), generator=g)
    sizes[7] = 1
    cases = {
        "ragged": torch.repeat_interleave(torch.arange(50), sizes),
        "blocks": torch.arange(6).repeat_interleave(5),
        "one_group": torch.zeros(7, dtype=torch.long),
        "long_groups": torch.cat([torch.zeros(SUM_CHUNK + 3, dtype=torch.long), torch.ones(4, dtype=torch.long)]),
    }
    for name, index in cases.items():
        a = int(index.max()) + 1
        layout = hardeq.SumConstraint(index.clone(), torch.zeros(a))._layout
        general = GroupSum(index, a)
        assert layout.any_single == bool(torch.bincount(index).min() == 1), name
        assert layout.group_sum.block == general.block, name
        assert (layout.group_sum.offsets is None) == (general.offsets is None), name
        if general.offsets is not None:
            assert torch.equal(layout.group_sum.offsets, general.offsets), name
        assert torch.equal(layout.counts, torch.bincount(index, minlength=a)), name
        x = torch.randn(3, index.numel(), generator=g, dtype=torch.float64)
        torch.testing.assert_close(layout.group_sum(x), general(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("index,a,message", [
    ([0, 0, 2, 2], 3, "every group must have at least one coordinate"),  # sorted, a gap
    ([1, 1, 2, 2], 3, "every group must have at least one coordinate"),  # sorted, group 0 empty
    ([0, 1, 1, 1], 3, "every group must have at least one coordinate"),  # sorted, the last group empty
    ([0, 1, 3, 3], 3, "index values must lie in"),  # sorted, out of range
    ([-1, 0, 1, 2], 3, "index values must lie in"),  # sorted, negative
    ([1, 0, 2, 2], 3, None),  # unsorted and valid: the general check accepts it
], ids=["gap", "first_empty", "last_empty", "too_large", "negative", "unsorted"])
def test_an_index_that_fails_the_one_pass_gets_the_general_checks_message(index, a, message):
    index = torch.tensor(index)
    if message is None:
        c = hardeq.SumConstraint(index, torch.zeros(a))
        assert c._layout.group_sum.offsets is None and torch.equal(c.counts, torch.bincount(index, minlength=a))
        return
    with pytest.raises(ValueError, match=message):
        hardeq.SumConstraint(index, torch.zeros(a))
    with pytest.raises(ValueError, match=message):  # also without validation: the index is always checked
        hardeq.SumConstraint(index, torch.zeros(a), validate_args=False)


# --------------------------------------------------------------------------------------------- the screened check
def _check_margins(ops, loc, scale, k, eps):
    """The sample's rows as the check sees them (the one node's own arithmetic, float32), in float64:
    ``|Az - k|``, ``|A||z|`` and ``|k|`` per row."""
    with torch.no_grad():
        z = _GroupedSample.apply(loc, scale, k, eps, ops, 1.0, 0.0, [])
        resid = (ops.matvec(z) - k).abs().double()
        return resid, ops.abs_matvec(z.abs()).double(), k.abs().double()


def test_the_screened_check_decides_as_the_full_check():
    """The check ``|Az - k| <= rtol (|A||z| + |k|)`` per row is screened by ``|Az - k| <= rtol |A||z|`` (implies it);
    the |k| term is added only when the screen fails. Rows whose members share one sign (``|k|`` about ``|A||z|``),
    with a tolerance between the two ratios: the screen fails and the full check passes; below both: it fails."""
    g = torch.Generator().manual_seed(5)
    index = torch.arange(40).repeat_interleave(torch.randint(2, 30, (40,), generator=g))
    n = index.numel()
    loc = 10 + torch.rand(n, generator=g)
    scale = 0.01 + 0.01 * torch.rand(n, generator=g)
    eps = torch.randn(n, generator=g)
    k = hardeq.SumConstraint(index, torch.zeros(40)).matvec(loc) * (1 + 1e-3 * torch.randn(40, generator=g))
    ops = hardeq.SumConstraint(index, k)._grouped_ops()
    resid, abs_z, abs_k = _check_margins(ops, loc, scale, k, eps)
    screen = float((resid / abs_z).max())
    full = float((resid / (abs_z + abs_k)).max())
    assert screen > 0 and full < 0.6 * screen  # (|k| about |A||z| in every row)

    def verdict(rtol: float) -> bool:
        out: list[bool] = []
        _GroupedSample.apply(loc, scale, k, eps, ops, rtol, 0.0, out)
        return out[0]

    assert verdict(2 * screen)  # the screen passes
    assert verdict(0.8 * screen)  # the screen fails, the full check passes
    assert not verdict(0.9 * full)  # both fail
    assert not verdict(-1.0)
    out: list[bool] = []  # a NaN fails both
    _GroupedSample.apply(loc.index_fill(0, torch.tensor([3]), float("nan")), scale, k, eps, ops, 1.0, 0.0, out)
    assert out == [False]


def test_the_direct_apply_gives_what_the_public_apply_gives(monkeypatch):
    """``grouped_rsample`` calls the C++ ``apply`` of the node (without the Python layer of
    ``torch.autograd.Function.apply``); same values and gradients as through the public ``apply``, also for a ``loc``
    that escaped a ``torch.func`` transform (a dead wrapper, which both unwrap)."""
    from hardeq.linalg.conditioning import grouped_sample as grouped

    assert grouped._APPLY is not None  # (this torch has it)
    leaked: list[torch.Tensor] = []

    def keep(x: torch.Tensor) -> torch.Tensor:
        leaked.append(x * 1)
        return x.sum()

    plain = torch.linspace(-1, 1, RAGGED.numel(), dtype=torch.float64)
    torch.func.grad(keep)(plain.clone())
    runs = []
    for apply in (grouped._APPLY, None):
        monkeypatch.setattr(grouped, "_APPLY", apply)
        for loc in (plain, leaked[0]):
            scale = torch.linspace(0.5, 2, RAGGED.numel(), dtype=torch.float64).requires_grad_()
            k = torch.arange(6, dtype=torch.float64).requires_grad_()
            d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.SumConstraint(RAGGED, k))
            z = d.rsample((2,), noise=torch.ones(2, RAGGED.numel(), dtype=torch.float64))
            assert type(z.grad_fn).__name__ == FUSED
            (z * torch.arange(RAGGED.numel())).sum().backward()
            runs.append((z.detach(), scale.grad, k.grad))
    for mine, public in zip(runs[:2], runs[2:]):
        for x, y in zip(mine, public):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
