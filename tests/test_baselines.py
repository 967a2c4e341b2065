"""Tests of hardeq.baselines: KKT projection, constraint layer (CL), equality completion (ECNN), penalty.

Every test is deterministic (fixed seeds or hand-worked values); there are no statistical assertions.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hardeq import LinearConstraint, SumConstraint
from hardeq.baselines import (
    ConstraintLayer,
    EqualityCompletion,
    KKTProjection,
    constraint_layer,
    kkt_projection,
    penalty_loss,
)

DTYPES = [torch.float32, torch.float64]
LAYERS = [KKTProjection, ConstraintLayer, EqualityCompletion]


def random_problem(batch_shape=(), n=6, a=2, *, a_batch=(), k_batch=None, dtype=torch.float64, seed=0):
    """Well-conditioned random A ((*a_batch, a, n)), y ((*batch_shape, n)) and k ((*k_batch, a))."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(a_batch + (a, n), generator=g, dtype=torch.float64)
    k_batch = batch_shape if k_batch is None else k_batch
    k = torch.randn(k_batch + (a,), generator=g, dtype=torch.float64)
    y = torch.randn(batch_shape + (n,), generator=g, dtype=torch.float64)
    return A.to(dtype), y.to(dtype), k.to(dtype)


def pinv_projection(A, y, k):
    """Dense oracle: y - pinv(A) (A y - k), in float64."""
    A, y, k = A.double(), y.double(), k.double()
    return y - (torch.linalg.pinv(A) @ ((A @ y.unsqueeze(-1)).squeeze(-1) - k).unsqueeze(-1)).squeeze(-1)


def apply(layer_cls, A, y, k, **kwargs):
    return layer_cls(A, **kwargs)(y, k)


# --------------------------------------------------------------------------------------------------------
# feasibility: every output satisfies A y = k to round-off
# --------------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    a=st.integers(1, 4),
    extra=st.integers(1, 5),
    batch_shape=st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple),
    a_batched=st.booleans(),
    per_sample_k=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_feasible_property(a, extra, batch_shape, a_batched, per_sample_k, dtype, seed):
    n = a + extra
    a_batch = batch_shape[-1:] if a_batched else ()
    k_batch = batch_shape if per_sample_k else a_batch
    A, y, k = random_problem(batch_shape, n, a, a_batch=a_batch, k_batch=k_batch, dtype=dtype, seed=seed)
    # keep the blocks the layers invert well conditioned, so the round-off tolerance is meaningful
    A64 = A.double()
    for block in (A64, A64[..., :a], A64[..., n - a:]):
        assume(bool((torch.linalg.cond(block) < 50).all()))
    c = LinearConstraint(A, k)
    out_shape = torch.broadcast_shapes(y.shape, A.shape[:-2] + (n,), k.shape[:-1] + (n,))
    outputs = {
        "kkt": KKTProjection(A)(y, k),
        "cl": ConstraintLayer(A)(y, k),
        "ecnn": EqualityCompletion(A)(y, k),
        "kkt_fn": kkt_projection(y, c),
        "cl_fn": constraint_layer(y, c),
    }
    for name, out in outputs.items():
        assert out.shape == out_shape, name
        assert out.dtype == dtype, name
        assert bool(c.check(out).all()), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_feasible_with_sample_dims(dtype):
    # y carries sample dims in front of the batch dims of A and k: (s, b, n) with A (b, a, n), k (b, a)
    A, _, k = random_problem((3,), 7, 3, a_batch=(3,), dtype=dtype, seed=1)
    y = torch.randn(5, 3, 7, dtype=dtype)
    c = LinearConstraint(A, k)
    for layer_cls in LAYERS:
        out = apply(layer_cls, A, y, k)
        assert out.shape == (5, 3, 7)
        assert bool(c.check(out).all()), layer_cls.__name__
    for fn in (kkt_projection, constraint_layer):
        assert bool(c.check(fn(y, c)).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_constraint(dtype):
    index = torch.tensor([0, 1, 0, 2, 1, 2, 2, 0])
    total = torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 4.0]], dtype=dtype)  # per-sample totals
    c = SumConstraint(index, total)
    dense = LinearConstraint(c.dense_matrix(), total)
    y = torch.randn(2, 8, dtype=dtype)
    for layer_cls in LAYERS:
        out = layer_cls.from_constraint(c)(y)  # default k = c.k
        assert bool(c.check(out).all()), layer_cls.__name__
    tol = {"rtol": 0, "atol": 10 * torch.finfo(dtype).eps}
    # the O(n) paths of the functional forms agree with the dense ones
    torch.testing.assert_close(kkt_projection(y, c), kkt_projection(y, dense), **tol)
    torch.testing.assert_close(constraint_layer(y, c), constraint_layer(y, dense), **tol)
    order = [7, 3, 0, 5, 1, 6, 2, 4]
    torch.testing.assert_close(constraint_layer(y, c, order), constraint_layer(y, dense, order), **tol)
    # KKT on a sum constraint subtracts each group's mean excess
    excess = (c.matvec(y) - total) / c.counts
    torch.testing.assert_close(kkt_projection(y, c), y - excess[..., index], **tol)


def test_module_equals_functional():
    A, y, k = random_problem((4,), 6, 2, seed=2)
    c = LinearConstraint(A, k)
    torch.testing.assert_close(KKTProjection(A)(y, k), kkt_projection(y, c))
    torch.testing.assert_close(ConstraintLayer(A)(y, k), constraint_layer(y, c))
    torch.testing.assert_close(ConstraintLayer(A, order=[5, 0, 4, 1, 3, 2])(y, k),
                               constraint_layer(y, c, order=[5, 0, 4, 1, 3, 2]))
    # from_constraint keeps k as the default; an explicit k overrides it
    layer = KKTProjection.from_constraint(c)
    torch.testing.assert_close(layer(y), layer(y, k))
    k2 = k + 1
    assert bool(LinearConstraint(A, k2).check(layer(y, k2)).all())


# --------------------------------------------------------------------------------------------------------
# KKT projection
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("a_batch", [(), (3,)], ids=["shared A", "batched A"])
def test_kkt_matches_pinv_oracle(a_batch):
    A, y, k = random_problem((3,), 9, 4, a_batch=a_batch, seed=3)
    expected = pinv_projection(A, y, k)
    torch.testing.assert_close(KKTProjection(A)(y, k), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(kkt_projection(y, LinearConstraint(A, k)), expected, rtol=0, atol=1e-12)
    A32, y32, k32 = A.float(), y.float(), k.float()
    torch.testing.assert_close(KKTProjection(A32)(y32, k32), expected.float(), rtol=0, atol=1e-5)


def test_kkt_idempotent_and_minimal():
    A, y, k = random_problem((50,), 8, 3, k_batch=(), seed=4)
    layer = KKTProjection(A)
    p = layer(y, k)
    torch.testing.assert_close(layer(p, k), p, rtol=0, atol=1e-12)
    # any other feasible point is farther from y: random feasible z = p + null-space direction
    null = torch.linalg.svd(A).Vh[3:]  # (n - a, n), rows span null(A)
    z = p.unsqueeze(0) + torch.randn(20, 50, 5, dtype=A.dtype) @ null  # (20, 50, 8)
    assert bool(LinearConstraint(A, k).check(z).all())
    assert bool(((z - y).norm(dim=-1) >= (p - y).norm(dim=-1)).all())
    # Pythagoras: y - p is orthogonal to the subspace
    torch.testing.assert_close((y - p) @ null.T, torch.zeros(50, 5, dtype=A.dtype), rtol=0, atol=1e-12)


def test_kkt_is_conditional_mean_with_identity_covariance():
    normal = pytest.importorskip("hardeq.distributions.normal")
    A, y, k = random_problem((4,), 6, 2, seed=5)
    c = LinearConstraint(A, k)
    d = normal.ConstrainedNormal(y, torch.ones_like(y), constraint=c)
    torch.testing.assert_close(d.mean, kkt_projection(y, c), rtol=0, atol=1e-12)
    torch.testing.assert_close(d.mean, KKTProjection(A)(y, k), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------------------
# constraint layer (CL)
# --------------------------------------------------------------------------------------------------------

# rows: y0 + y1 + y2 = k0 ; y1 + y2 + y3 = k1
HAND_A = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]], dtype=torch.float64)


def test_cl_hand_worked_default_order():
    # y3 is the highest variable of row 1: y3 = k1 - y1 - y2; then y2 (highest left in row 0):
    # y2 = k0 - y0 - y1, and substituting it back: y3 = k1 - k0 + y0.
    y = torch.tensor([1.0, 2.0, 30.0, 40.0], dtype=torch.float64)
    k = torch.tensor([4.0, 3.0], dtype=torch.float64)
    layer = ConstraintLayer(HAND_A)
    assert layer.dependent.tolist() == [3, 2]
    expected = torch.tensor([1.0, 2.0, 4.0 - 1.0 - 2.0, 3.0 - 4.0 + 1.0], dtype=torch.float64)
    torch.testing.assert_close(layer(y, k), expected, rtol=0, atol=1e-14)


def test_cl_respects_user_order():
    # ranking x3 < x2 < x1 < x0: y0 is solved from row 0 (y0 = k0 - y1 - y2), y1 from row 1
    # (y1 = k1 - y2 - y3), so y0 = k0 - k1 + y3.
    y = torch.tensor([10.0, 20.0, 2.0, 5.0], dtype=torch.float64)
    k = torch.tensor([4.0, 3.0], dtype=torch.float64)
    order = [3, 2, 1, 0]
    layer = ConstraintLayer(HAND_A, order=order)
    assert sorted(layer.dependent.tolist()) == [0, 1]
    expected = torch.tensor([4.0 - 3.0 + 5.0, 3.0 - 2.0 - 5.0, 2.0, 5.0], dtype=torch.float64)
    torch.testing.assert_close(layer(y, k), expected, rtol=0, atol=1e-14)
    torch.testing.assert_close(constraint_layer(y, LinearConstraint(HAND_A, k), order=order), expected,
                               rtol=0, atol=1e-14)
    # another order: x1 highest, then x3
    layer = ConstraintLayer(HAND_A, order=torch.tensor([0, 2, 3, 1]))
    assert layer.dependent.tolist() == [1, 3]
    assert "order=custom" in repr(layer)


def test_cl_pivots_skip_zero_coefficients():
    # the last variable appears in no constraint: the pivots are the highest variables that do (y2 from
    # row 0, the larger coefficient in its column; then y1 from row 1 - row 0)
    A = torch.tensor([[1.0, 2.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    layer = ConstraintLayer(A)
    assert layer.dependent.tolist() == [2, 1]
    # batched A: each element gets its own pivots
    A_b = torch.stack([A, torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)])
    layer = ConstraintLayer(A_b)
    assert layer.dependent.tolist() == [[2, 1], [3, 2]]
    y, k = torch.randn(5, 2, 4, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
    assert bool(LinearConstraint(A_b, k).check(layer(y, k)).all())


@pytest.mark.parametrize("order", [None, [4, 0, 5, 2, 1, 3]])
def test_cl_pass_through_and_zero_gradient(order):
    A, y, k = random_problem((3,), 6, 2, seed=6)
    layer = ConstraintLayer(A, order=order)
    dep = layer.dependent.tolist()
    free = [i for i in range(6) if i not in dep]
    out = layer(y, k)
    assert torch.equal(out[..., free], y[..., free])  # bit-for-bit pass-through
    # highest-ranked variables become dependent
    rank = list(range(6)) if order is None else [order.index(i) for i in range(6)]
    assert dep == sorted(range(6), key=lambda i: -rank[i])[:2]
    # Jacobian: zero columns at the dependent inputs, identity rows at the free outputs
    J = torch.autograd.functional.jacobian(lambda v: layer(v, k[0]), y[0])  # (n, n)
    assert torch.equal(J[:, dep], torch.zeros(6, 2, dtype=J.dtype))
    torch.testing.assert_close(J[free][:, free], torch.eye(4, dtype=J.dtype), rtol=0, atol=0)
    yg = y.clone().requires_grad_()
    layer(yg, k).square().sum().backward()
    assert torch.equal(yg.grad[..., dep], torch.zeros(3, 2, dtype=y.dtype))


def test_cl_sum_constraint_picks_last_member():
    c = SumConstraint(torch.tensor([0, 0, 1, 1, 0]), torch.tensor([1.0, 5.0], dtype=torch.float64))
    y = torch.tensor([0.1, 0.2, 3.0, 9.0, 9.0], dtype=torch.float64)
    expected = torch.tensor([0.1, 0.2, 3.0, 2.0, 0.7], dtype=torch.float64)
    torch.testing.assert_close(constraint_layer(y, c), expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(ConstraintLayer.from_constraint(c)(y), expected, rtol=0, atol=1e-15)
    # with the ordering reversed the first member of each group is solved for
    order = [4, 3, 2, 1, 0]
    expected = torch.tensor([1.0 - 0.2 - 9.0, 0.2, 5.0 - 9.0, 9.0, 9.0], dtype=torch.float64)
    torch.testing.assert_close(constraint_layer(y, c, order), expected, rtol=0, atol=1e-15)


# --------------------------------------------------------------------------------------------------------
# equality completion (ECNN)
# --------------------------------------------------------------------------------------------------------


def test_ecnn_independent_unchanged_and_complete():
    A, y, k = random_problem((4,), 7, 3, seed=7)
    layer = EqualityCompletion(A, dependent=[6, 1, 3])
    assert layer.independent.tolist() == [0, 2, 4, 5]
    out = layer(y, k)
    assert torch.equal(out[..., layer.independent], y[..., layer.independent])
    assert bool(LinearConstraint(A, k).check(out).all())
    # hand computation of the dependent values
    D, Ind = [6, 1, 3], [0, 2, 4, 5]
    y_D = torch.linalg.solve(A[:, D], (k - y[:, Ind] @ A[:, Ind].T).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out[:, D], y_D, rtol=0, atol=1e-12)
    # the dependent inputs are ignored and get zero gradient
    y2 = y.clone()
    y2[:, D] = 1e3
    torch.testing.assert_close(layer(y2, k), out, rtol=0, atol=1e-12)
    yg = y.clone().requires_grad_()
    layer(yg, k).pow(3).sum().backward()
    assert torch.equal(yg.grad[:, D], torch.zeros(4, 3, dtype=y.dtype))
    # complete() from the n - a independent values
    torch.testing.assert_close(layer.complete(y[:, Ind], k), out, rtol=0, atol=0)


def test_ecnn_default_selection():
    # column 0 is zero, column 2 is parallel to column 1: the first invertible set is {1, 3}
    A = torch.tensor([[0.0, 1.0, 2.0, 0.0, 1.0], [0.0, 2.0, 4.0, 1.0, 1.0]], dtype=torch.float64)
    layer = EqualityCompletion(A)
    assert layer.dependent.tolist() == [1, 3]
    assert layer.independent.tolist() == [0, 2, 4]
    generic = torch.randn(3, 6, dtype=torch.float64)
    assert EqualityCompletion(generic).dependent.tolist() == [0, 1, 2]
    # batched A: a column is taken only if it is independent in every batch element
    A_b = torch.tensor([[[1.0, 0.0, 1.0]], [[0.0, 1.0, 1.0]]], dtype=torch.float64)  # (2, 1, 3)
    assert EqualityCompletion(A_b).dependent.tolist() == [2]


def test_ecnn_equals_cl_on_the_same_dependent_set():
    A, y, k = random_problem((5,), 8, 3, seed=8)
    cl = ConstraintLayer(A, order=[2, 7, 0, 5, 3, 1, 6, 4])
    ecnn = EqualityCompletion(A, dependent=cl.dependent)
    torch.testing.assert_close(ecnn(y, k), cl(y, k), rtol=0, atol=1e-12)


def test_ecnn_bad_dependent():
    A = torch.tensor([[1.0, 1.0, 0.0, 1.0], [2.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"dependent.*invertible.*rank 1"):
        EqualityCompletion(A, dependent=[0, 1])
    with pytest.raises(ValueError, match="a = 2 column indices"):
        EqualityCompletion(A, dependent=[0])
    with pytest.raises(ValueError, match="repeat"):
        EqualityCompletion(A, dependent=[2, 2])
    with pytest.raises(ValueError, match=r"\[0, n\)"):
        EqualityCompletion(A, dependent=[0, 4])
    with pytest.raises(TypeError, match="dependent"):
        EqualityCompletion(A, dependent="01")
    # no column set that is invertible in every batch element
    A_b = torch.tensor([[[1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0]]], dtype=torch.float64)
    with pytest.raises(ValueError, match="every batch element"):
        EqualityCompletion(A_b)


# --------------------------------------------------------------------------------------------------------
# penalty
# --------------------------------------------------------------------------------------------------------


def test_penalty_value_and_gradient():
    A = torch.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, -1.0]], dtype=torch.float64)
    k = torch.tensor([[1.0, 0.0], [2.0, 1.0]], dtype=torch.float64)
    y = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.5, 0.5]], dtype=torch.float64, requires_grad=True)
    c = LinearConstraint(A, k)
    # residuals: sample 0: (3 - 1, 0 - 0) = (2, 0) -> 4; sample 1: (1 - 2, 0 - 1) = (-1, -1) -> 2
    expected_none = torch.tensor([4.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(penalty_loss(y, c, weight=3.0, reduction="none"), 3 * expected_none)
    torch.testing.assert_close(penalty_loss(y, c, weight=3.0, reduction="sum"), torch.tensor(18.0).double())
    loss = penalty_loss(y, c, weight=3.0)
    torch.testing.assert_close(loss, torch.tensor(9.0).double())
    loss.backward()
    # d/dy [w/N sum_s ||A y_s - k_s||^2] = 2 w / N * A^T r_s
    r = torch.tensor([[2.0, 0.0], [-1.0, -1.0]], dtype=torch.float64)
    torch.testing.assert_close(y.grad, 2 * 3.0 / 2 * r @ A)
    # zero on feasible points; works with SumConstraint and tensor weights
    c2 = SumConstraint(torch.tensor([0, 0, 1]), torch.tensor([1.0, 2.0], dtype=torch.float64))
    y2 = torch.tensor([[0.5, 0.5, 2.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(penalty_loss(y2, c2, torch.tensor([1.0, 2.0]).double(), "none"),
                               torch.tensor([0.0, 2.0 * 2.0]).double())
    with pytest.raises(ValueError, match="reduction"):
        penalty_loss(y2, c2, reduction="avg")


# --------------------------------------------------------------------------------------------------------
# gradients
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_cls", LAYERS)
def test_gradcheck_modules(layer_cls):
    A, y, k = random_problem((3,), 5, 2, seed=9)
    layer = layer_cls(A)
    y.requires_grad_()
    k.requires_grad_()
    assert torch.autograd.gradcheck(layer, (y, k))
    assert torch.autograd.gradgradcheck(layer, (y, k))


def test_gradcheck_functional():
    A, y, k = random_problem((3,), 5, 2, seed=10)
    A.requires_grad_()
    y.requires_grad_()
    k.requires_grad_()
    order = [3, 1, 4, 0, 2]
    assert torch.autograd.gradcheck(lambda y, k, A: kkt_projection(y, LinearConstraint(A, k)), (y, k, A))
    assert torch.autograd.gradcheck(lambda y, k, A: constraint_layer(y, LinearConstraint(A, k), order),
                                    (y, k, A))
    assert torch.autograd.gradcheck(lambda y, k: penalty_loss(y, LinearConstraint(A, k), 2.0), (y, k))
    index = torch.tensor([0, 1, 1, 0, 1])
    assert torch.autograd.gradcheck(lambda y, k: kkt_projection(y, SumConstraint(index, k)), (y, k))
    assert torch.autograd.gradcheck(lambda y, k: constraint_layer(y, SumConstraint(index, k)), (y, k))


def test_kkt_jacobians_closed_form():
    A, y, k = random_problem((), 5, 2, seed=11)
    layer = KKTProjection(A)
    Jy, Jk = torch.autograd.functional.jacobian(layer, (y, k))
    gain = A.T @ torch.linalg.inv(A @ A.T)  # test oracle only
    torch.testing.assert_close(Jy, torch.eye(5, dtype=A.dtype) - gain @ A, rtol=0, atol=1e-12)
    torch.testing.assert_close(Jk, gain, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------------------
# configuration and argument errors
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_cls", LAYERS)
def test_bad_configuration(layer_cls):
    with pytest.raises(ValueError, match="full row rank"):
        layer_cls(torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 0.0]]))
    with pytest.raises(ValueError, match="a < n"):
        layer_cls(torch.eye(3))
    with pytest.raises(ValueError, match=r"constraint_matrix must have shape \(\*batch, a, n\)"):
        layer_cls(torch.ones(3))
    with pytest.raises(TypeError, match="float32 or float64"):
        layer_cls(torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="from_constraint"):
        layer_cls(LinearConstraint(torch.ones(1, 3), torch.ones(1)))
    with pytest.raises(ValueError, match="NaN/inf"):
        layer_cls(torch.tensor([[1.0, float("nan"), 0.0]]))
    with pytest.raises(ValueError, match=r"constraint_value must have shape \(\.\.\., a\)"):
        layer_cls(torch.ones(1, 3), torch.ones(2))


@pytest.mark.parametrize("layer_cls", LAYERS)
def test_bad_call_arguments(layer_cls):
    layer = layer_cls(torch.tensor([[1.0, 1.0, 1.0], [1.0, -1.0, 0.0]]))
    y, k = torch.zeros(4, 3), torch.zeros(4, 2)
    name = layer_cls.__name__
    with pytest.raises(TypeError, match=rf"{name}: y has dtype torch.float64 .* holds torch.float32"):
        layer(y.double(), k)
    with pytest.raises(TypeError, match=rf"{name}: constraint_value has dtype torch.float64"):
        layer(y, k.double())
    with pytest.raises(ValueError, match=r"y must have shape \(\.\.\., n\) with n = 3, got y.shape = \(4, 4\)"):
        layer(torch.zeros(4, 4), k)
    with pytest.raises(ValueError, match=r"constraint_value must have shape \(\.\.\., a\) with a = 2"):
        layer(y, torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"batch dimensions do not broadcast: y \(4,\), constraint_value \(5,\)"):
        layer(y, torch.zeros(5, 2))
    with pytest.raises(TypeError, match="y must be a torch.Tensor, got list"):
        layer([0.0, 0.0, 0.0], k)
    here = re.escape(str(torch.empty(0).device))  # cpu, or cuda:0 under --device cuda
    with pytest.raises(ValueError, match=r"y is on device meta but the layer is on " + here):
        layer(torch.zeros(4, 3, device="meta"), k)
    with pytest.raises(ValueError, match="constraint_value .* is required"):
        layer(y)


def test_bad_functional_arguments():
    c = LinearConstraint(torch.tensor([[1.0, 1.0, 1.0]]), torch.tensor([1.0]))
    for fn in (kkt_projection, constraint_layer, penalty_loss):
        with pytest.raises(ValueError, match=r"y must have shape \(\.\.\., n\) with n = 3"):
            fn(torch.zeros(2, 4), c)
        with pytest.raises(TypeError, match="y has dtype torch.float64"):
            fn(torch.zeros(2, 3, dtype=torch.float64), c)
        with pytest.raises(TypeError, match="constraint must be a hardeq constraint"):
            fn(torch.zeros(2, 3), torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"order must be a permutation of range\(n\) with n = 3"):
        constraint_layer(torch.zeros(3), c, order=[0, 1, 1])
    with pytest.raises(ValueError, match="order must be a permutation"):
        ConstraintLayer(torch.ones(1, 3), order=[0, 1])
    with pytest.raises(TypeError, match="order"):
        ConstraintLayer(torch.ones(1, 3), order="012")


# --------------------------------------------------------------------------------------------------------
# module behaviour
# --------------------------------------------------------------------------------------------------------


def test_repr_and_buffers():
    A = torch.randn(2, 5, generator=torch.Generator().manual_seed(12))
    assert repr(KKTProjection(A)) == "KKTProjection(a=2, n=5)"
    assert repr(ConstraintLayer(A)) == "ConstraintLayer(a=2, n=5)"
    assert repr(EqualityCompletion(A)) == "EqualityCompletion(a=2, n=5, dependent=[0, 1])"
    assert "batch_shape=(3,)" in repr(KKTProjection(A.expand(3, 2, 5)))
    for layer_cls in LAYERS:
        layer = layer_cls(A)
        assert len(list(layer.parameters())) == 0
        assert "constraint_matrix" in layer.state_dict()
        # .double() converts the precomputed factors; the layer then accepts float64 input
        layer = layer.double()
        y, k = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
        assert bool(LinearConstraint(A.double(), k).check(layer(y, k)).all())


def test_layer_does_not_alias_constructor_arguments():
    A = torch.tensor([[1.0, 1.0, 1.0]])
    k = torch.tensor([1.0])
    layer = KKTProjection(A, k)
    A.mul_(2.0)
    k.zero_()
    torch.testing.assert_close(layer(torch.zeros(3)), torch.full((3,), 1.0 / 3))


@pytest.mark.parametrize("layer_cls", LAYERS)
def test_state_dict_round_trip(layer_cls):
    A1, y, k = random_problem((3,), 5, 2, seed=13)
    A2, _, _ = random_problem((3,), 5, 2, seed=14)
    layer1, layer2 = layer_cls(A1, k), layer_cls(A2, k + 1)
    assert not any(key.startswith("_") for key in layer1.state_dict())  # derived factors are not saved
    layer2.load_state_dict(layer1.state_dict())  # derived factors are recomputed from the loaded A
    torch.testing.assert_close(layer2(y), layer1(y, k), rtol=0, atol=1e-12)
