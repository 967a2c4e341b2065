"""hardeq.bounds.start.feasible_start: a point of the polytope without a host read (one sum row per coordinate), on
random problems (grouped sums; one dense row with negative, zero and large coefficients; infinite bounds; loc far
outside the box), float32 and float64: every bound met exactly, every row within the per-row tolerance
``tol * (|A||z|)_i``, no host read; None where two rows share coordinates; a Gibbs run from it is exactly feasible."""

from __future__ import annotations

import math

import pytest
import torch

import hardeq
from hardeq.bounds import blocked_gibbs
from hardeq.bounds.start import feasible_start
from hardeq.testing import count_calls

F = torch.float64
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _problem(g, kind, dtype, n, batch=3):
    lo = torch.randn(batch, n, generator=g, dtype=F) - 1
    hi = lo + torch.rand(batch, n, generator=g, dtype=F) * 3 + 1e-3
    lo[torch.rand(batch, n, generator=g) < 0.2] = -math.inf
    hi[torch.rand(batch, n, generator=g) < 0.2] = math.inf
    u = torch.rand(batch, n, generator=g, dtype=F)
    inside = torch.where(torch.isfinite(lo) & torch.isfinite(hi), lo + u * (hi - lo),
                         torch.where(torch.isfinite(lo), lo + u, torch.where(torch.isfinite(hi), hi - u, u - 0.5)))
    loc = torch.randn(batch, n, generator=g, dtype=F) * 10.0 ** int(torch.randint(-2, 4, (1,), generator=g))
    if kind == "grouped":
        groups = max(1, n // 3)
        index = torch.randint(0, groups, (n,), generator=g)
        index[:groups] = torch.arange(groups)
        k = torch.zeros(batch, groups, dtype=F).index_add_(-1, index, inside)
        con = hardeq.SumConstraint(index, k.to(dtype))
    else:
        c = torch.randn(n, generator=g, dtype=F) * (1e3 if kind == "large" else 1.0)
        c[torch.rand(n, generator=g) < 0.2] = 0.0
        c[0] = 1.0
        con = hardeq.LinearConstraint(c.unsqueeze(0).to(dtype), (inside * c).sum(-1, keepdim=True).to(dtype))
    return hardeq.ConstrainedNormal(loc.to(dtype), 0.5, constraint=con, validate_args=False), lo.to(dtype), hi.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("kind", ["grouped", "row", "large"])
def test_feasible_start_is_exactly_feasible_without_reads(kind, dtype):
    g = torch.Generator().manual_seed(7)
    checked = 0
    for _ in range(40):
        n = int(torch.randint(2, 30, (1,), generator=g))
        base, lo, hi = _problem(g, kind, dtype, n)
        try:
            d = base.truncate(lo, hi)
        except ValueError:                                       # a face drawn at random: refused, nothing to start
            continue
        with count_calls() as count:
            z = feasible_start(d.base, d.lower, d.upper)
        assert count.host_reads == 0, count.host_read_names
        assert z.dtype == dtype and z.shape == (3, n)
        assert bool(((z >= d.lower) & (z <= d.upper)).all())
        A, zz = base.constraint.dense_matrix().to(F), z.to(F)
        residual = (zz @ A.mT - base.constraint.k.to(F)).abs()
        assert bool((residual <= TOL[dtype] * (zz.abs() @ A.abs().mT)).all()), residual.max()
        checked += 1
    assert checked >= 20


def test_feasible_start_declines_shared_rows():
    A = torch.tensor([[1.0, 1.0, 1.0], [1.0, -1.0, 0.0]], dtype=F)
    d = hardeq.ConstrainedNormal(torch.zeros(3, dtype=F), 1.0,
                                 constraint=hardeq.LinearConstraint(A, torch.tensor([1.0, 0.0], dtype=F)))
    assert feasible_start(d, torch.zeros(3, dtype=F), torch.ones(3, dtype=F)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_gibbs_from_feasible_start_two_reads(dtype):
    """A fresh law's Gibbs run from this start: no mode, two host reads whatever the sweeps, every draw feasible."""
    g = torch.Generator().manual_seed(0)
    n = 50
    loc = (torch.randn(8, n, generator=g, dtype=F) - 2.0).to(dtype)   # far below the box: pressed coordinates
    d = hardeq.ConstrainedNormal(loc, 0.3, constraint=hardeq.LinearConstraint(
        torch.ones(1, n, dtype=dtype), torch.ones(8, 1, dtype=dtype)), validate_args=False).truncate(0.0, 1.0)
    for sweeps in (5, 40):
        with count_calls() as count:
            start = feasible_start(d.base, d.lower, d.upper).expand(16, 8, n)
            z = blocked_gibbs(d.base, d.lower, d.upper, start, num_samples=1, burn_in=sweeps,
                              generator=torch.Generator().manual_seed(1)).samples
        assert count.host_reads <= 2, count.host_read_names
        assert bool(((z >= 0) & (z <= 1)).all())
        assert bool(((z.to(F).sum(-1) - 1).abs() <= TOL[dtype] * z.to(F).abs().sum(-1)).all())
