"""The caches of unvalidated constructors trust the tensor's version counter (``hardeq.constraints._cache``): an
in-place operation on the cached tensor is seen (the entry is recomputed), an edit through ``.data`` is not (the
documented gap), and a validated constructor compares the contents and sees it. A trusted hit costs no ATen call."""

from __future__ import annotations

import warnings

import pytest
import torch

import hardeq
from hardeq.constraints._cache import no_host_reads
from hardeq.constraints.linear import _DERIVED
from hardeq.constraints.sparse import _PREPARED
from hardeq.constraints.sum import _LAYOUTS
from hardeq.linalg.device import forced
from hardeq.testing import count_calls

RAGGED = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 3, 4, 5, 5])


def _sum(index: torch.Tensor, validate: bool) -> hardeq.SumConstraint:
    return hardeq.SumConstraint(index, torch.ones(6), validate_args=validate)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_an_unvalidated_sum_constraint_sees_in_place_edits_of_its_index_and_not_edits_through_data(profile):
    index = RAGGED.clone()
    with forced(profile):
        _sum(index, False)
        first = _sum(index, False)  # (the second use takes the snapshot)
        assert _sum(index, False)._layout is first._layout  # a hit
        index[:3] = torch.tensor([0, 1, 1])  # in place: bumps index._version, seen
        _sum(index, False)
        moved = _sum(index, False)  # (laid out afresh twice: a changed tensor is a new one to the lazy snapshot)
        assert moved._layout is not first._layout and _sum(index, False)._layout is moved._layout
        torch.testing.assert_close(moved.matvec(torch.ones(12)), torch.bincount(index, minlength=6).float())
        index.data[:3] = torch.tensor([0, 0, 0])  # through .data: no version bump, not seen unvalidated
        assert _sum(index, False)._layout is moved._layout
        checked = _sum(index, True)  # validated: the contents are compared, the edit is seen
        assert checked._layout is not moved._layout
        torch.testing.assert_close(checked.matvec(torch.ones(12)), torch.bincount(index, minlength=6).float())


def _sparse_A() -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.randn(3, 8, generator=g, dtype=torch.float64).to_sparse_csr()


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_an_unvalidated_sparse_constraint_sees_in_place_edits_of_A_and_not_edits_through_data(profile):
    A, k = _sparse_A(), torch.ones(3, dtype=torch.float64)
    dense = A.to_dense()
    z = torch.randn(8, dtype=torch.float64)
    with forced(profile):
        first = hardeq.SparseConstraint(A, k, validate_args=False)
        assert hardeq.SparseConstraint(A, k, validate_args=False)._parts.At is first._parts.At  # a hit
        A.values().mul_(2)  # in place on a view of A: bumps A._version, seen
        second = hardeq.SparseConstraint(A, k, validate_args=False)
        assert second._parts.At is not first._parts.At
        torch.testing.assert_close(second.rmatvec(torch.ones(3, dtype=torch.float64)), 2 * dense.sum(0))
        A.values().data.mul_(3)  # through .data: no version bump, not seen unvalidated (A^T is the stale one)
        stale = hardeq.SparseConstraint(A, k, validate_args=False)
        assert stale._parts.At is second._parts.At
        torch.testing.assert_close(stale.rmatvec(torch.ones(3, dtype=torch.float64)), 2 * dense.sum(0))
        checked = hardeq.SparseConstraint(A, k, validate_args=True)  # validated: compared, the edit is seen
        assert checked._parts.At is not second._parts.At
        torch.testing.assert_close(checked.rmatvec(torch.ones(3, dtype=torch.float64)), 6 * dense.sum(0))
        torch.testing.assert_close(checked.matvec(z), 6 * dense @ z)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_an_unvalidated_dense_constraint_sees_in_place_edits_of_A_and_not_edits_through_data(profile):
    g = torch.Generator().manual_seed(5)
    A, k = torch.randn(3, 8, generator=g, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    original = A.clone()
    with forced(profile):
        first = hardeq.LinearConstraint(A, k, validate_args=False)
        assert hardeq.LinearConstraint(A, k, validate_args=False).derived() is first.derived()  # a hit
        A.mul_(2)  # in place: bumps A._version, seen
        second = hardeq.LinearConstraint(A, k, validate_args=False)
        assert second.derived() is not first.derived()
        torch.testing.assert_close(second.abs_A(), 2 * original.abs())
        A.data.mul_(3)  # through .data: no version bump, not seen unvalidated (|A| is the stale one)
        stale = hardeq.LinearConstraint(A, k, validate_args=False)
        assert stale.derived() is second.derived()
        torch.testing.assert_close(stale.abs_A(), 2 * original.abs())
        checked = hardeq.LinearConstraint(A, k, validate_args=True)  # validated: compared, the edit is seen
        assert checked.derived() is not second.derived()
        torch.testing.assert_close(checked.abs_A(), 6 * original.abs())


def test_a_trusted_hit_costs_no_aten_call_and_a_compared_one_does():
    index = RAGGED.clone()
    _sum(index, False)
    _sum(index, False)
    A = _sparse_A()
    hardeq.SparseConstraint(A, torch.ones(3, dtype=torch.float64), validate_args=False)
    dense = torch.randn(3, 8, dtype=torch.float64)
    hardeq.LinearConstraint(dense, torch.ones(3, dtype=torch.float64), validate_args=False).derived()
    for cache, tensor in ((_LAYOUTS, index), (_PREPARED, A), (_DERIVED, dense)):
        with count_calls() as trusted:
            assert cache.get(tensor, trust_version=True) is not None
        with no_host_reads(), count_calls() as compared:
            assert cache.get(tensor) is not None
        assert trusted.calls == 0 and compared.calls > 0 and compared.host_reads == 0
