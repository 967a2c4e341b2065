"""NonlinearConstraint: values, Jacobians, the per-row tolerance and the errors for bad input."""

import pytest
import torch

from hardeq import NonlinearConstraint
from hardeq.manifold import ManifoldError, feasibility_tol

from .cases import energy_balance, sphere, two_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("make", [sphere, two_rows, energy_balance])
def test_jacobian_matches_autograd(make, dtype):
    con = make(1.0, dtype) if make is sphere else make(dtype)
    n = 3 if make is sphere else (4 if make is two_rows else 5)
    z = torch.randn(2, 3, n, dtype=dtype, generator=torch.Generator().manual_seed(0))
    J = con.jacobian(z)
    assert J.shape == (2, 3, con.num_constraints, n)
    dense = torch.autograd.functional.jacobian(lambda x: con.h(x).sum((0, 1)), z)  # (a, 2, 3, n)
    torch.testing.assert_close(J, dense.permute(1, 2, 0, 3))


def test_user_jacobian_and_loop_fallback():
    h = lambda z: torch.stack([z.sum(-1), (z * z).sum(-1)], -1)  # noqa: E731
    jac = lambda z: torch.stack([torch.ones_like(z), 2 * z], -2)  # noqa: E731
    k = torch.tensor([1.0, 2.0], dtype=torch.float64)
    z = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(NonlinearConstraint(h, k, jacobian=jac).jacobian(z), jac(z))

    def not_vmappable(z):  # .item() breaks vmap: the loop of backward passes takes over
        return torch.stack([z.sum(-1) * float(torch.ones(()).item()), (z * z).sum(-1)], -1)
    torch.testing.assert_close(NonlinearConstraint(not_vmappable, k).jacobian(z), jac(z))


def test_per_row_tolerance():
    # two rows of very different sizes: the small one cannot hide behind the large one
    con = NonlinearConstraint(lambda z: torch.stack([1e6 * (z * z).sum(-1), z[..., 0] * z[..., 1]], -1),
                              torch.tensor([2e6, 0.5], dtype=torch.float64))
    z = torch.tensor([1.0, 1.0], dtype=torch.float64)
    assert not bool(con.check(z))  # row 1: 1.0 != 0.5
    ratio = con.row_ratio(z)
    assert ratio.shape == (2,) and ratio[0] == 0 and ratio[1] > 0.1
    tol = feasibility_tol(torch.float64)
    c = sphere(4.0)
    on = torch.tensor([2.0, 0.0], dtype=torch.float64)
    assert bool(c.check(on)) and bool(c.check(on * (1 + 0.5 * tol)))  # s = 4 r^2 = 16: slack 1e-12 * 16
    assert not bool(c.check(on * (1 + 4 * tol)))
    with pytest.raises(ManifoldError, match=r"batch index \(1,\), row 0"):
        c.assert_feasible(torch.stack([on, 1.1 * on]))


def test_batched_k_and_shapes():
    con = sphere(torch.tensor([1.0, 4.0, 9.0], dtype=torch.float64))
    assert con.batch_shape == (3,) and con.num_constraints == 1
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]], dtype=torch.float64)
    assert bool(con.check(z).all())
    assert con.check(z.expand(5, 3, 2)).shape == (5, 3)


def test_bad_input():
    k = torch.tensor([1.0])
    with pytest.raises(TypeError, match="h must be a callable"):
        NonlinearConstraint(3, k)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        NonlinearConstraint(lambda z: z, [1.0])
    with pytest.raises(TypeError, match="k must be float32 or float64"):
        NonlinearConstraint(lambda z: z, torch.tensor([1.0], dtype=torch.float16))
    with pytest.raises(ValueError, match="k must have at least 1"):
        NonlinearConstraint(lambda z: z, torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"k \(shape \(1,\)\) must be finite"):
        NonlinearConstraint(lambda z: z, torch.tensor([float("nan")]), validate_args=True)
    with pytest.raises(TypeError, match="jacobian must be None or a callable"):
        NonlinearConstraint(lambda z: z, k, jacobian=1)
    con = NonlinearConstraint(lambda z: z, k)  # (n,) -> (n,): wrong output size for a = 1
    with pytest.raises(ValueError, match=r"h must map \(\.\.\., n\) to \(\.\.\., a\) with a = k.shape\[-1\] = 1"):
        con.value(torch.zeros(3))
    with pytest.raises(TypeError, match="z must have the constraint's dtype torch.float32"):
        sphere(1.0, torch.float32).value(torch.zeros(2, dtype=torch.float64))
    bad_jac = NonlinearConstraint(lambda z: z.sum(-1, keepdim=True), k, jacobian=lambda z: z)
    with pytest.raises(ValueError, match="jacobian must map"):
        bad_jac.jacobian(torch.zeros(3))
