"""The fused per-sample sampler of the Cholesky factor (``CholeskyFactor.sample_fused``: draw, Matheron step and
per-row check chunk by chunk) and the per-``A`` constants it relies on.

References: the unfused conditioner applied to the same noise (``rsample(noise=...)``, drawn with the same seed), the
dense float64 conditional mean, and the per-row exactness criterion.
"""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.linalg.conditioning import cholesky as factor_module
from hardeq.testing import assert_exact_per_row, dense_conditional

DTYPES = (torch.float32, torch.float64)


def _problem(dtype, B=5, n=3000, a=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(a, n, generator=g, dtype=torch.float64)
    loc = torch.randn(B, n, generator=g, dtype=torch.float64)
    scale = torch.rand(B, n, generator=g, dtype=torch.float64) + 0.5
    k = torch.randn(B, a, generator=g, dtype=torch.float64)
    return A.to(dtype), loc.to(dtype), scale.to(dtype), k.to(dtype)


def _dist(A, loc, scale, k):
    con = hardeq.LinearConstraint(A, k, validate_args=False)
    return hardeq.ConstrainedNormal(loc, scale, constraint=con, validate_args=False)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of two rows, so that every test crosses chunk boundaries."""
    monkeypatch.setattr(factor_module, "FUSED_CHUNK_ELEMS", 2 * 3000)


def _spy(monkeypatch):
    calls = []
    original = factor_module.CholeskyFactor.sample_fused

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(factor_module.CholeskyFactor, "sample_fused", spy)
    return calls


@pytest.mark.cpu_only(reason="the same numbers need the CPU generator, whose stream does not depend on how a draw "
                            "is split into chunks; CUDA's Philox offsets do (the law is tested below on every device)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [False, True])
def test_fused_sample_is_the_conditioned_draw_of_the_same_noise(dtype, shared, small_chunks, monkeypatch):
    A, loc, scale, k = _problem(dtype)
    calls = _spy(monkeypatch)
    if shared:
        d, shape = _dist(A, loc[0], scale[0], k[0]), (7,)
    else:
        d, shape = _dist(A, loc, scale, k), ()
    torch.manual_seed(3)
    z = d.sample(shape)
    assert calls == [True]  # the fused path ran
    torch.manual_seed(3)
    noise = torch.randn(torch.Size(shape) + d.batch_shape + d.event_shape, dtype=dtype)
    reference = d.rsample(shape, noise=noise)  # the unfused conditioner on the same noise
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(z, reference, rtol=0, atol=200 * eps * float(reference.abs().max()))
    assert_exact_per_row(d.constraint, z)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_mean_over_many_draws_matches_the_dense_oracle(dtype, small_chunks):
    A, loc, scale, k = _problem(dtype, B=1, n=40, a=3, seed=5)
    d = _dist(A, loc[0], scale[0], k[0])
    torch.manual_seed(0)
    z = d.sample((20000,)).double()
    oracle = dense_conditional(loc[0], torch.diag(scale[0].double() ** 2), A, k[0])
    stddev = torch.diagonal(oracle.covariance).clamp_min(0).sqrt()
    err = (z.mean(0) - oracle.mean).abs() / (stddev / 20000 ** 0.5 + 1e-12)
    assert float(err.max()) < 5.5  # 5.5 standard errors over 40 coordinates: a false alarm below 1e-6


def test_a_failing_chunk_check_goes_to_the_refinement_loop(monkeypatch):
    """When a chunk's check fails, the conditioner refines the whole output as the unfused path would."""
    A, loc, scale, k = _problem(torch.float32)
    original = factor_module.CholeskyFactor.sample_fused
    monkeypatch.setattr(factor_module.CholeskyFactor, "sample_fused",
                        lambda self, *args: (lambda out: (out[0], False))(original(self, *args)))
    refined = []
    cond = _dist(A, loc, scale, k).conditioner
    original_refined = cond._refined
    cond._refined = lambda z: refined.append(1) or original_refined(z)
    z = cond.sample(loc)
    assert refined == [1]
    assert_exact_per_row(cond.constraint, z)


def test_fused_path_skipped_for_pinned_coordinates_and_sample_times_batch(monkeypatch):
    A, loc, scale, k = _problem(torch.float64)
    calls = _spy(monkeypatch)
    A_pinned = A.clone()
    A_pinned[0] = 0.0
    A_pinned[0, 5] = 2.0  # row 0 fixes z_5 = k_0 / 2
    d = _dist(A_pinned, loc, scale, k)
    z = d.sample()
    assert calls == []  # pinned coordinates: the unfused path (it sets them exactly)
    assert torch.equal(z[:, 5], k[:, 0] / 2)
    z = _dist(A, loc, scale, k).sample((2,))  # sample and batch dimensions: not fused
    assert calls == [False]
    assert_exact_per_row(hardeq.LinearConstraint(A, k), z)


def test_per_A_constants_follow_an_in_place_change_of_A():
    A, loc, scale, k = _problem(torch.float64, B=3, n=500, a=4, seed=7)
    z1 = _dist(A, loc, scale, k).sample()
    assert_exact_per_row(hardeq.LinearConstraint(A, k), z1)
    with torch.no_grad():
        A.mul_(-3.0)[1, 7:] = 0.0  # new values, same tensor
    z2 = _dist(A, loc, scale, k).sample()
    assert_exact_per_row(hardeq.LinearConstraint(A, k), z2)
    con = hardeq.LinearConstraint(A, k, validate_args=False)
    A_t, abs_t = con.columns()
    assert torch.equal(A_t, A.mT) and torch.equal(abs_t, A.abs().mT)


def test_broadcast_loc_and_shared_k_in_a_batch():
    A, loc, scale, k = _problem(torch.float64)
    d = _dist(A, loc[:1], scale, k[0])  # loc (1, n), scale (B, n), k (a,)
    z = d.sample()
    assert z.shape == scale.shape
    assert_exact_per_row(hardeq.LinearConstraint(A, k[0].expand(5, -1)), z)


def test_chunks_are_cache_sized_on_the_cpu_and_whole_elsewhere():
    """On the CPU a chunk holds about FUSED_CHUNK_ELEMS elements and at least ``min_rows`` rows; on another device
    (kernel launches cost more than cache misses there) every row goes in one chunk."""
    rows = factor_module._rows_per_chunk
    elems = factor_module.FUSED_CHUNK_ELEMS
    assert rows(64, 100_000, 8, torch.device("cpu")) == max(8, elems // 100_000)
    assert rows(64, 100_000, 40, torch.device("cpu")) == 40  # each chunk streams A once: at least a rows
    assert rows(3, 10, 8, torch.device("cpu")) == 3  # never more than there are
    assert rows(64, 100_000, 8, torch.device("meta")) == 64
    assert rows(0, 100, 8, torch.device("meta")) == 1
