"""A fuzzer of modes at vertices: planes through a point with several coordinates at 0 (so the box often meets the
plane at a vertex, degenerate or not), rows scaled over two decades, diagonal variances over three decades, float32
and float64. Whenever the polytope is accepted (``check_polytope`` raises no ``ValueError``), the mode must be found,
lie in the box, meet every row at the dtype's tolerance, and be no worse in the objective than the point the problem
was built from. Three modes of this kind were once refused (``ModeNotFound``); see tests/bounds/test_mode.py."""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.testing import assert_exact_per_row


def _case(g: torch.Generator):
    n = int(torch.randint(3, 8, (1,), generator=g))
    a = int(torch.randint(1, n, (1,), generator=g))
    row_scale = 10 ** (2 * torch.rand(a, 1, generator=g, dtype=torch.float64))
    A = torch.randn(a, n, generator=g, dtype=torch.float64) * row_scale
    p = torch.rand(n, generator=g, dtype=torch.float64)
    p[torch.randperm(n, generator=g)[:int(torch.randint(1, n, (1,), generator=g))]] = 0
    mu = p + 2 * torch.randn(n, generator=g, dtype=torch.float64)
    sd = 10 ** (-3 * torch.rand(n, generator=g, dtype=torch.float64))
    return A, A @ p, mu, sd, p


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("seed", [11, 12])
def test_modes_at_vertices_are_found(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    found = 0
    for _ in range(30):
        A, k, mu, sd, p = (t.to(dtype) if t.dtype == torch.float64 and i < 4 else t for i, t in enumerate(_case(g)))
        d = hardeq.ConstrainedNormal(mu, sd, constraint=hardeq.LinearConstraint(A, k))
        try:
            truncated = d.truncate(0.0, None)
        except ValueError:  # an empty (or, rounded, single-point) polytope: refused before any search, correctly
            continue
        mode = truncated.mode
        found += 1
        assert bool((mode >= 0).all())
        assert_exact_per_row(hardeq.LinearConstraint(A, k), mode)
        objective = (((mode.double() - mu.double()) / sd.double()) ** 2).sum()
        assert float(objective) <= float((((p - mu.double()) / sd.double()) ** 2).sum()) * (1 + 1e-5) + 1e-9
    assert found >= 15  # the fuzzer must exercise the search, not only the polytope check
