"""hardeq.ops.GroupSum: the equal-block fast path agrees with the scatter path and a float64 reference."""

import pytest
import torch

from hardeq import SumConstraint
from hardeq.ops import GroupSum


@pytest.mark.parametrize("a,n", [(1, 784), (3, 3 * 1024), (8, 8 * 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equal_blocks_match_the_scatter_path(a, n, dtype):
    torch.manual_seed(0)
    index = torch.arange(a).repeat_interleave(n // a)
    fast = GroupSum(index, a)
    slow = GroupSum(index, a)
    slow.block = None
    assert fast.block == n // a
    x = torch.randn(4, 5, n, dtype=dtype)
    ref = x.double().reshape(4, 5, a, n // a).sum(-1)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert torch.allclose(fast(x).double(), ref, rtol=tol, atol=tol * n ** 0.5)
    assert torch.allclose(fast(x), slow(x), rtol=tol, atol=tol * n ** 0.5)
    X = torch.randn(2, n, 3, dtype=dtype)
    assert torch.allclose(fast.matmul(X), slow.matmul(X), rtol=tol, atol=tol * n ** 0.5)
    u = torch.randn(4, a, dtype=dtype)
    assert torch.equal(fast.broadcast(u), slow.broadcast(u))


def test_unequal_or_unsorted_groups_use_the_scatter_path():
    assert GroupSum(torch.tensor([0, 0, 1, 1, 1]), 2).block is None
    assert GroupSum(torch.tensor([1, 1, 0, 0]), 2).block is None
    assert GroupSum(torch.tensor([0, 1, 0, 1]), 2).block is None


def test_sum_constraint_gradients_through_the_fast_path():
    index = torch.arange(2).repeat_interleave(3)
    c = SumConstraint(index, torch.zeros(2, dtype=torch.float64))
    z = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    u = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: c.matvec(z), (z,))
    assert torch.autograd.gradcheck(lambda u: c.rmatvec(u), (u,))
