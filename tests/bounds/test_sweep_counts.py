"""The Gibbs sweep's budgets, counted with hardeq.testing.count_calls (a TorchDispatchMode; views, allocations and
metadata queries are not calls): at most 40 ATen calls per sweep, measured as the difference between two sample calls
that differ only in their sweeps, and at most 2 host reads per sample call whatever the number of sweeps (the mode,
the chains' start, is solved once per distribution and cached: the first call is warmed up), for a grouped sum and a
dense row, a diagonal and a low-rank covariance (the augmentation), n = 50 and 400, float32 and float64. No sort
and no QR runs per sweep (the partitions come from the pool drawn at setup)."""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.testing import count_calls

F = torch.float64


def _dist(kind, n, batch, dtype):
    g = torch.Generator().manual_seed(0)
    loc = (torch.randn(batch, n, generator=g, dtype=F) * 0.3 - 0.2).to(dtype)
    k = torch.ones(batch, 1, dtype=dtype)
    con = (hardeq.SumConstraint(torch.zeros(n, dtype=torch.long), k) if kind == "sum"
           else hardeq.LinearConstraint(torch.ones(1, n, dtype=dtype), k))
    extra = {"cov_factor": (torch.randn(n, 2, generator=g, dtype=F) * 0.1).to(dtype)} if kind == "lowrank" else {}
    return hardeq.ConstrainedNormal(loc, 0.3, constraint=con, validate_args=False, **extra).truncate(0.0, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("n", [50, 400])
@pytest.mark.parametrize("kind", ["sum", "dense", "lowrank"])
def test_sweep_budgets(kind, n, dtype):
    d = _dist(kind, n, 8, dtype)
    d.mode  # noqa: B018  (solved once per distribution, cached)
    counts = {}
    for sweeps in (20, 60):
        with count_calls() as count:
            z = d.sample((4,), method="gibbs", burn_in=sweeps - 1, generator=torch.Generator().manual_seed(1))
        counts[sweeps] = count
        assert z.shape == (4, 8, n) and bool(((z >= 0) & (z <= 1)).all())
    assert counts[20].host_reads <= 2 and counts[60].host_reads <= 2, (counts[20], counts[60].host_read_names)
    per_sweep = (counts[60].calls - counts[20].calls) / 40
    assert per_sweep <= 40, (per_sweep, (counts[60].by_name - counts[20].by_name).most_common(12))
    grown = counts[60].by_name - counts[20].by_name
    assert not any(name.split(".")[0].endswith(("sort", "argsort", "linalg_qr", "randperm")) for name in grown), grown
