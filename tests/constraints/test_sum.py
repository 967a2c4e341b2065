"""SumConstraint: the conformance suite and its O(n) structure."""

import torch

import hardeq
from hardeq.testing import ConstraintTestCase


class TestSumConstraint(ConstraintTestCase):
    """Uneven groups, one of them of size one (a pinned coordinate)."""

    def create(self, batch_shape, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        index = torch.tensor([0, 1, 2, 1, 0, 2, 2, 3, 1])
        k = torch.randn(batch_shape + (4,), generator=g, dtype=torch.float64).to(dtype)
        A = torch.nn.functional.one_hot(index, 4).mT.to(dtype)
        return hardeq.SumConstraint(index, k), A, k


def test_same_partition_with_other_labels_is_the_same_row_space():
    c = hardeq.SumConstraint(torch.tensor([0, 0, 1, 1, 2]), torch.zeros(3))
    assert c.same_row_space(hardeq.SumConstraint(torch.tensor([2, 2, 0, 0, 1]), torch.ones(3)))
    assert not c.same_row_space(hardeq.SumConstraint(torch.tensor([0, 1, 1, 0, 2]), torch.zeros(3)))


def test_poisson_needs_a_grouped_constraint():
    dense = hardeq.LinearConstraint(torch.ones(1, 3), torch.ones(1))
    try:
        hardeq.ConstrainedPoisson(torch.ones(3), constraint=dense)
    except TypeError as e:
        assert "group" in str(e) and "LinearConstraint" in str(e)
    else:
        raise AssertionError("a dense constraint was accepted by ConstrainedPoisson")
    # a sum constraint written as a dense matrix has no group_index either: only grouped structure is used
    assert dense.group_index is None
