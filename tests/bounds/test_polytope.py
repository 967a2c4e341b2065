"""Bounds validation and the feasibility of {A z = k} ∩ box: clear errors naming the argument, row or group."""

from __future__ import annotations

import pytest
import torch

import hardeq


def _sum_dist(k, n=4, dtype=torch.float64):
    index = torch.tensor([0, 0, 1, 1])[:n]
    return hardeq.ConstrainedNormal(torch.zeros(n, dtype=dtype), 1.0,
                                    constraint=hardeq.SumConstraint(index, torch.tensor(k, dtype=dtype)))


def test_bound_types_and_shapes():
    d = _sum_dist([1.0, 1.0])
    with pytest.raises(TypeError, match="lower must be None, a real number or a torch.Tensor"):
        d.truncate(lower="0")
    with pytest.raises(ValueError, match=r"upper must broadcast to batch_shape \+ \(n,\) = \(4,\), got shape \(3,\)"):
        d.truncate(upper=torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="lower must not hold NaN"):
        d.truncate(lower=torch.tensor([0.0, float("nan"), 0, 0], dtype=torch.float64))
    with pytest.raises(ValueError, match="lower > upper"):
        d.truncate(lower=1.0, upper=0.0)
    with pytest.raises(ValueError, match="lower == upper pins the coordinate"):
        d.truncate(lower=torch.tensor([0.0, 0.5, 0, 0], dtype=torch.float64),
                   upper=torch.tensor([1.0, 0.5, 1, 1], dtype=torch.float64))
    with pytest.raises(ValueError, match="not representable"):
        hardeq.ConstrainedNormal(torch.zeros(4), 1.0, constraint=hardeq.SumConstraint(
            torch.tensor([0, 0, 1, 1]), torch.ones(2))).truncate(lower=torch.tensor(0.1, dtype=torch.float64))
    two_rows = hardeq.ConstrainedNormal(torch.zeros(4, dtype=torch.float64), 1.0, constraint=hardeq.LinearConstraint(
        torch.tensor([[1.0, 1, 1, 1], [1, -1, 0, 0]], dtype=torch.float64),
        torch.tensor([1.0, 0.0], dtype=torch.float64)))
    with pytest.raises(ValueError, match="normaliser='exact' needs one free dimension"):
        two_rows.truncate(0.0, 1.0, normaliser="exact")
    assert d.truncate(0.0, 1.0, normaliser="exact").normaliser_exact  # grouped sums, diagonal: the 1-D convolution


def test_grouped_infeasible_names_group():
    d = _sum_dist([1.0, 2.5])
    with pytest.raises(ValueError, match=r"group 1 of batch element \(\) cannot be met; its 2 members in their bounds "
                                         r"sum to \[0, 2\], but k = 2\.5"):
        d.truncate(0.0, 1.0)


def test_grouped_face_and_single_point():
    with pytest.raises(ValueError, match=r"no volume on the plane: group 1 .* at the upper end"):
        _sum_dist([1.0, 2.0]).truncate(0.0, 1.0)
    with pytest.raises(ValueError, match=r"no volume on the plane: group 0 .*lower end.*single point"):
        _sum_dist([0.0, 0.0]).truncate(0.0, 1.0)


def test_dense_row_infeasible_names_row_and_batch():
    A = torch.tensor([[1.0, -2.0, 0.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    k = torch.tensor([[0.0, 1.0], [0.0, 2.5]], dtype=torch.float64)
    d = hardeq.ConstrainedNormal(torch.zeros(2, 3, dtype=torch.float64), 1.0,
                                 constraint=hardeq.LinearConstraint(A, k))
    with pytest.raises(ValueError, match=r"row 1 of batch element \(1,\) cannot be met; \(A z\) over the box ranges "
                                         r"over \[0, 2\], but k = 2\.5"):
        d.truncate(0.0, 1.0)


def test_one_free_dimension_empty_line_section():
    """n - a = 1: the section is tested exactly, even where every row alone is feasible."""
    A = torch.tensor([[1.0, 1.0, 0.0], [1.0, -1.0, 0.0]], dtype=torch.float64)
    d = hardeq.ConstrainedNormal(torch.zeros(3, dtype=torch.float64), 1.0,
                                 constraint=hardeq.LinearConstraint(A, torch.tensor([1.5, 0.9], dtype=torch.float64)))
    with pytest.raises(ValueError, match="is empty: the plane is a line"):
        d.truncate(0.0, 1.0)


def test_infinite_bounds_feasible():
    d = _sum_dist([-5.0, 7.0])
    t = d.truncate(lower=None, upper=10.0)
    assert bool((t.mode <= 10).all())
    with pytest.raises(ValueError, match=r"group 0 .* sum to \[-2, inf\], but k = -5"):
        d.truncate(lower=-1.0)
    t = _sum_dist([-1.0, 7.0]).truncate(lower=-1.0)
    assert bool((t.mode >= -1).all())
