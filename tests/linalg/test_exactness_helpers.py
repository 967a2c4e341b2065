"""hardeq.testing.exactness: the per-row ratio |(Az - k)_i| / (|A||z|)_i in float64 (0/0 = 0, x/0 = inf) for a
dense A and for every constraint type, and assert_exact_per_row's verdict and message."""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.testing import assert_exact_per_row, exactness_tolerance, row_residual_ratio


def test_ratio_is_per_row_in_float64():
    A = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1e-6]])
    z = torch.tensor([1.0, 2.0, 5.0])
    k = torch.tensor([3.0, 4e-6])  # row 1: residual 1e-6 on a scale of 5e-6
    ratio = row_residual_ratio(A, z, k)
    assert ratio.dtype == torch.float64
    torch.testing.assert_close(ratio, torch.tensor([0.0, 0.2], dtype=torch.float64), rtol=1e-6, atol=0)


def test_zero_over_zero_and_x_over_zero():
    A = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    z = torch.zeros(2, dtype=torch.float64)
    ratio = row_residual_ratio(A, z, torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert ratio[0] == 0 and ratio[1] == float("inf")


def test_constraint_types_agree_with_their_dense_matrix():
    g = torch.Generator().manual_seed(0)
    index = torch.tensor([0, 0, 1, 2, 2, 2])
    total = torch.randn(4, 3, generator=g)
    z = torch.randn(5, 4, 6, generator=g)
    for con in (hardeq.SumConstraint(index, total),
                hardeq.LinearConstraint(torch.randn(2, 6, generator=g), torch.randn(4, 2, generator=g))):
        dense = con.dense_matrix()
        torch.testing.assert_close(row_residual_ratio(con, z), row_residual_ratio(dense, z, con.k))


def test_assert_names_the_worst_row_and_batch_index():
    con = hardeq.SumConstraint(torch.tensor([0, 0, 1, 1]), torch.tensor([[2.0, 1.0], [2.0, 1.0], [2.0, 1.0]]))
    z = torch.tensor([1.0, 1.0, 0.5, 0.5]).repeat(2, 3, 1)  # (sample 2, batch 3, n 4): exact
    assert_exact_per_row(con, z)
    z[1, 2, 3] += 1e-3  # sample 1, batch 2, row 1
    with pytest.raises(AssertionError, match=r"1 of 12 rows .* index \(1, 2\) .*row 1: \|\(Az - k\)_i\| = 1\.000e-03"):
        assert_exact_per_row(con, z)
    assert_exact_per_row(con, z, tol=1e-2)
    z[0, 0, 0] = float("nan")
    with pytest.raises(AssertionError, match=r"index \(0, 0\)"):
        assert_exact_per_row(con, z, tol=1e-2)


def test_tolerances():
    assert exactness_tolerance(torch.float32) == 1e-5 and exactness_tolerance(torch.float64) == 1e-12
