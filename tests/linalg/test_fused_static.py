"""The static (sync-free) sampler chunk by chunk (``hardeq.linalg.conditioning.fused_static``; per-sample scales:
the fused factor's, ``static_dense``): the samples of the unfused static path on the same noise, to round-off, exact
per row, with no host read; a failing row raises."""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.linalg.device import forced
from hardeq.linalg.conditioning import fused as fused_module
from hardeq.linalg.conditioning import fused_static
from hardeq.linalg.covariance import DiagonalCovariance
from hardeq.linalg.conditioning import Conditioner
from hardeq.linalg.conditioning.static_dense import StaticPairsFactor
from hardeq.testing import assert_exact_per_row, count_calls

DTYPES = (torch.float32, torch.float64)
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _problem(dtype, B=6, n=3000, a=5, seed=0, decades=3.0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(a, n, generator=g, dtype=torch.float64)
    loc = torch.randn(B, n, generator=g, dtype=torch.float64)
    scale = 10 ** (decades * (torch.rand(B, n, generator=g, dtype=torch.float64) - 0.5))
    k = torch.randn(B, a, generator=g, dtype=torch.float64)
    return A.to(dtype), loc.to(dtype), scale.to(dtype), k.to(dtype)


@pytest.mark.cpu_only(reason="the CPU generator's stream")
@pytest.mark.parametrize("shared", [False, True], ids=["per-sample", "shared"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_static_fused_sample_is_the_unfused_static_sample(dtype, shared, monkeypatch):
    monkeypatch.setattr(fused_module, "FUSED_CHUNK_ELEMS", 2 * 3000)  # several chunks
    A, loc, scale, k = _problem(dtype)
    if shared:
        loc, scale, k = loc[0], scale[0], k[0]
    con = hardeq.LinearConstraint(A, k, validate_args=False)
    cond = Conditioner(DiagonalCovariance(scale), con, static=True)
    shape = (4,) if shared else ()
    spy = []
    if shared:
        original = fused_static.sample_static_fused
        monkeypatch.setattr(fused_static, "sample_static_fused", lambda *a: spy.append(1) or original(*a))
    else:  # (per-sample scales: the fused factor's own sampler, linalg.conditioning.static_dense)
        assert isinstance(cond.factor, StaticPairsFactor)
        own = StaticPairsFactor.sample_checked
        monkeypatch.setattr(StaticPairsFactor, "sample_checked", lambda *a: spy.append(1) or own(*a))
    torch.manual_seed(3)
    with count_calls() as count:
        z = cond.sample(loc, shape)
    assert spy == [1] and count.host_reads == 0
    torch.manual_seed(3)
    eps = torch.randn(torch.Size(shape) + loc.shape, dtype=dtype)
    z_ref = cond.condition(loc + scale * eps)  # the unfused static path on the same noise
    assert_exact_per_row(con, z)
    assert_exact_per_row(con, z_ref)
    tol = TOL[dtype]
    torch.testing.assert_close(z, z_ref, rtol=tol, atol=tol * float(z_ref.abs().amax()))


def test_static_fused_sample_failure_names_the_row():
    """Nearly dependent rows: the float64 factor cannot meet them; the deferred check raises (at once on the CPU)
    with the row."""
    A = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0 + 1e-9, 0.0, 0.0]])
    con = hardeq.LinearConstraint(A, torch.zeros(2), validate_args=False)
    d = hardeq.ConstrainedNormal(torch.zeros(4), torch.ones(4), constraint=con, validate_args=False)
    with forced("gpu"), pytest.raises(hardeq.NotPSDError, match=r"misses a row of A z = k.*row \d"):
        d.sample((8,))
