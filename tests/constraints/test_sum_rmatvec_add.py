"""``SumConstraint.rmatvec_add_``: ``z += w * A^T u`` in place, against the dense ``A`` (float64 oracle)."""

from __future__ import annotations

import pytest
import torch

import hardeq


def _index(kind: str, n: int, a: int) -> torch.Tensor:
    if kind == "blocks":  # equal consecutive groups: the view path
        return torch.arange(n) * a // n
    return torch.randint(0, a, (n,), generator=torch.Generator().manual_seed(3))  # scattered: the gather path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["blocks", "scattered"])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_the_dense_update(dtype, kind, weighted):
    n, a, lead = 24, 4, (5, 3)
    g = torch.Generator().manual_seed(0)
    con = hardeq.SumConstraint(_index(kind, n, a), torch.zeros(a, dtype=dtype))
    dense = torch.zeros(a, n, dtype=torch.float64)
    dense[con.group_index, torch.arange(n)] = 1.0
    z = torch.randn(lead + (n,), generator=g, dtype=dtype)
    u = torch.randn(lead + (a,), generator=g, dtype=dtype)
    w = torch.rand(n, generator=g, dtype=dtype) + 0.5 if weighted else None
    expected = z.double() + (w.double() if weighted else 1.0) * (u.double() @ dense)
    out = con.rmatvec_add_(z, u, w)
    assert out is z  # in place
    torch.testing.assert_close(z.double(), expected, rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-14)


def test_a_weight_broadcast_from_one_entry():
    """A weight of shape (1,) (a scalar variance) cannot be viewed as (groups, block): the general path, same result."""
    con = hardeq.SumConstraint(torch.arange(8) // 4, torch.zeros(2, dtype=torch.float64))
    z = torch.zeros(3, 8, dtype=torch.float64)
    u = torch.tensor([[1.0, 2.0]], dtype=torch.float64).expand(3, 2)
    con.rmatvec_add_(z, u, torch.tensor([0.5], dtype=torch.float64))
    assert torch.equal(z, torch.tensor([0.5] * 4 + [1.0] * 4, dtype=torch.float64).expand(3, 8))


def test_a_non_contiguous_z_and_bad_shapes():
    con = hardeq.SumConstraint(torch.arange(8) // 4, torch.zeros(2))
    z = torch.zeros(8, 3).mT  # (3, 8), not contiguous: the general path
    con.rmatvec_add_(z, torch.ones(3, 2))
    assert torch.equal(z, torch.ones(3, 8))
    with pytest.raises(ValueError, match=r"z must have shape \(\*lead, n\)"):
        con.rmatvec_add_(torch.zeros(3, 7), torch.ones(3, 2))
