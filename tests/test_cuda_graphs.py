"""CUDA-graph capture of the static and grouped paths: capture + replay gives the eager values (needs CUDA).

Built inside ``torch.cuda.graph`` (capture counts as tracing, so ``ConstrainedNormal(..., validate_args=False)``
takes the static path with no host synchronisation), then replayed on new inputs copied into the captured
tensors; the replay must equal the same computation run eagerly on those inputs in the static regime (the same
kernels), meet every row of ``A z = k``, and match the default (checked) path to round-off.
"""

from __future__ import annotations

import pytest
import torch

import hardeq._utils
from hardeq.testing import assert_exact_per_row
from tests.static_cases import HOT_PATHS, build, hot_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DTYPES = [torch.float32, torch.float64]
#: replay vs eager: the same kernels, but a scatter (SumConstraint) may add in another order
RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}
#: static (replayed) vs the default checked path: different refinement schedules, both exact to round-off
RTOL_DEFAULT = {torch.float32: 2e-4, torch.float64: 1e-9}


def _step(kind, cov, t):
    d = build(kind, cov, t, validate_args=False)
    z = d.rsample((2,), noise=t["eps"])
    return z, d.log_prob(z), d.sample((4,))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,cov", HOT_PATHS)
def test_capture_replay_matches_eager(monkeypatch, kind, cov, dtype):
    cuda = torch.device("cuda")
    t = {name: v.to(cuda) for name, v in hot_inputs(kind, cov, dtype).items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph requires
        for _ in range(2):
            _step(kind, cov, t)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        z, lp, s = _step(kind, cov, t)
    fresh = hot_inputs(kind, cov, dtype, seed=1)
    for name in ("loc", "k", "eps"):  # new inputs into the captured tensors
        t[name].copy_(fresh[name].to(cuda))
    graph.replay()
    torch.cuda.synchronize()
    z, lp, s = z.clone(), lp.clone(), s.clone()

    monkeypatch.setattr(hardeq._utils, "cuda_graph_capturing", lambda: True)  # eager, static regime
    with torch.no_grad():
        d = build(kind, cov, t, validate_args=False)
        assert d.conditioner.static
        z_eager = d.rsample((2,), noise=t["eps"])
        lp_eager = d.log_prob(z_eager)
    for got, want, rtol in [(z, z_eager, RTOL[dtype]), (lp, lp_eager, RTOL[dtype])]:
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().amax()))
    assert_exact_per_row(d.constraint, z)
    assert_exact_per_row(d.constraint, s)
    assert s.shape == (4,) + z.shape[1:] and torch.isfinite(s).all()

    monkeypatch.setattr(hardeq._utils, "cuda_graph_capturing", lambda: False)  # the default, checked path
    ref = build(kind, cov, t, validate_args=True)
    z_ref = ref.rsample((2,), noise=t["eps"]).detach()
    rtol = RTOL_DEFAULT[dtype]
    torch.testing.assert_close(z, z_ref, rtol=rtol, atol=rtol * float(z_ref.abs().amax()))
    torch.testing.assert_close(lp, ref.log_prob(z_ref).detach(), rtol=rtol, atol=rtol * float(lp.abs().amax()))
