"""The truncated mode of a diagonal covariance whose variances span many decades. The dual Newton solve in the law's
metric stalls there. Before, two things went wrong: ModeNotFound ("no point of the plane in the box") on polytopes
that have volume by construction (122 of 400 random ones of the first family below), and, where the stalled active
set was finished by an exact solve on it, a feasible point returned as the mode without checking the bounds'
multipliers (seed 16 below: objective 1,188,668.8 against the true minimum 1,187,348.6). Now a point of the polytope
is found (in the box's metric where the law's stalls) and the primal active-set methods, which do check the
multipliers, finish from there. Checked against the brute-force oracle (every active set enumerated, numpy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hardeq
from hardeq.bounds import ModeNotFound, truncated_mode

from .cases import brute_force_mode

F = torch.float64


def _case(seed: int, n: int = 12, a: int = 5):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(a, n, generator=g, dtype=F)
    lo = -torch.rand(n, generator=g, dtype=F)
    hi = lo + 0.05 + 2 * torch.rand(n, generator=g, dtype=F)
    x = lo + (hi - lo) * (0.05 + 0.9 * torch.rand(2, n, generator=g, dtype=F))  # strictly inside: volume
    loc = 10 * torch.randn(2, n, generator=g, dtype=F)
    scale = 10 ** (6 * torch.rand(2, n, generator=g, dtype=F) - 3)  # variances over twelve decades
    return hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, x @ A.T)), lo, hi


def _check_against_the_oracle(d, lo, hi, z, elements=None):
    """``z`` is feasible (the box exactly, the rows to round-off) and its objective is the oracle's minimum."""
    A, k = d.constraint.A, d.constraint.k
    assert bool(((z >= lo) & (z <= hi)).all())
    rows = (z @ A.T - k).abs() / (z.abs() @ A.abs().T + k.abs())
    assert float(rows.max()) <= 1e-12
    v = d.covariance.variance
    for b in range(z.shape[0]) if elements is None else elements:
        mu = d.loc[b].numpy()
        _, best = brute_force_mode(mu, np.diag(v[b].numpy()), A.numpy(), k[b].numpy(), lo.numpy(), hi.numpy())
        ours = float((((z[b] - d.loc[b]) ** 2) / v[b]).sum())
        assert ours <= best * (1 + 1e-9), (b, ours, best)  # (and no lower: the oracle is the minimum)


@pytest.mark.parametrize("seed", range(12))
def test_small_modes_where_the_variances_span_twelve_decades_match_the_oracle(seed):
    """n = 7: every active set enumerated for each element."""
    d, lo, hi = _case(seed, n=7, a=3)
    _check_against_the_oracle(d, lo, hi, truncated_mode(d, lo, hi))


def test_modes_are_found_where_the_dual_solve_stalls():
    """n = 12: at least 34 of 40 polytopes with volume get a mode (measured: 37, and 387 of 400; before, 25 and
    278), each feasible."""
    found = 0
    for seed in range(40):
        d, lo, hi = _case(seed)
        try:
            z = truncated_mode(d, lo, hi)
        except ModeNotFound:
            continue
        found += 1
        assert bool(((z >= lo) & (z <= hi)).all())
        rows = (z @ d.constraint.A.T - d.constraint.k).abs() / (z.abs() @ d.constraint.A.abs().T
                                                                 + d.constraint.k.abs())
        assert float(rows.max()) <= 1e-12
    assert found >= 34, found


@pytest.mark.slow
def test_the_stalled_active_set_is_not_returned_as_the_mode():
    """Seed 16, element 0 (n = 12): the objective of the oracle's minimum (enumeration of 3^12 active sets, ~20 s),
    where the finished stalled active set gave 1,188,668.8."""
    d, lo, hi = _case(16)
    _check_against_the_oracle(d, lo, hi, truncated_mode(d, lo, hi), elements=[0])


def test_the_volume_check_accepts_polytopes_with_volume_whatever_the_variances():
    """The volume check's feasibility solves run in the box's metric: with the law's (variances over twelve decades)
    they stalled, and so did the mode it asks for a second opinion: 23 of these 60 polytopes, which have volume by
    construction, were refused as empty or flat (6 of 200 once the mode was rescued)."""
    for seed in range(60):
        d, lo, hi = _case(seed)
        d.truncate(lo, hi)._check_volume()  # no ValueError
