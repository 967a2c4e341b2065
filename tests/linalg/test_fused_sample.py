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
from hardeq.linalg.conditioning import fused as fused_module
from hardeq.linalg.conditioning.residual import check_rtol
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
    # the fused sampler is the checked conditioner's (validated distribution); without validation the sync-free
    # static conditioner conditions with a float64 factor and always refines
    return hardeq.ConstrainedNormal(loc, scale, constraint=con, validate_args=True)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of two rows, so that every test crosses chunk boundaries."""
    monkeypatch.setattr(fused_module, "FUSED_CHUNK_ELEMS", 2 * 3000)


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
    rows = fused_module._rows_per_chunk
    elems = fused_module.FUSED_CHUNK_ELEMS
    assert rows(64, 100_000, 8, torch.device("cpu")) == max(8, elems // 100_000)
    assert rows(64, 100_000, 40, torch.device("cpu")) == 40  # each chunk streams A once: at least a rows
    assert rows(3, 10, 8, torch.device("cpu")) == 3  # never more than there are
    assert rows(64, 100_000, 8, torch.device("meta")) == 64
    assert rows(0, 100, 8, torch.device("meta")) == 1
    assert rows(64, 700_001, 3, torch.device("cpu")) == 16  # whole blocks of 16 draws per chunk
    assert rows(64, 600_002, 3, torch.device("cpu")) == 8


@pytest.mark.cpu_only(reason="the CPU generator's stream")
def test_chunks_of_any_size_draw_the_stream_of_one_randn(monkeypatch):
    """Chunks of three rows of 3000 (9000 elements, not a multiple of 16) would redraw the last 16 values of
    each chunk; the chunks are rounded to whole blocks of 16 draws."""
    monkeypatch.setattr(fused_module, "FUSED_CHUNK_ELEMS", 3 * 3000)
    A, loc, scale, k = _problem(torch.float32, B=7, a=3)
    d = _dist(A, loc, scale, k)
    torch.manual_seed(4)
    z = d.sample()
    torch.manual_seed(4)
    reference = d.rsample(noise=torch.randn(d.batch_shape + d.event_shape))
    torch.testing.assert_close(z, reference, rtol=0, atol=200 * torch.finfo(torch.float32).eps
                               * float(reference.abs().max()))


# ---------------------------------------------------------------- the folded gain, the squared Gram, the screen
def _spread_problem(dtype, B=8, n=3000, a=2, seed=11):
    """Per-sample scales whose largest entry c ranges over 1e-7 .. 1e7 between samples (some inside the span of
    the folded gain and the squared Gram, 2^(+-16) and 2^(+-8) in float32, some outside) and over six decades within
    each sample; loc at the scale of each sample."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(a, n, generator=g, dtype=torch.float64)
    c = 10.0 ** torch.linspace(-7, 7, B, dtype=torch.float64)
    scale = c.unsqueeze(-1) * 10.0 ** (-6 * torch.rand(B, n, generator=g, dtype=torch.float64))
    loc = c.unsqueeze(-1) * torch.randn(B, n, generator=g, dtype=torch.float64)
    k = (loc @ A.mT) + c.unsqueeze(-1) * torch.randn(B, a, generator=g, dtype=torch.float64)
    return A.to(dtype), loc.to(dtype), scale.to(dtype), k.to(dtype)


@pytest.fixture
def screened(monkeypatch):
    """Screen the per-row check from n = 1000 on (the module's threshold is above the tests' sizes)."""
    monkeypatch.setattr(fused_module, "SCREEN_MIN_SIZE", 1000)


@pytest.mark.cpu_only(reason="the folded gain, its guard, the squared Gram and the screen are CPU paths")
@pytest.mark.parametrize("dtype", DTYPES)
def test_folded_gain_and_its_fallback_meet_every_row_of_rows_at_very_different_scales(dtype, monkeypatch,
                                                                                      screened):
    monkeypatch.setattr(fused_module, "FUSED_CHUNK_ELEMS", 2 * 3000)  # chunks of two rows (a = 2)
    A, loc, scale, k = _spread_problem(dtype)
    folded = []
    original = factor_module.CholeskyFactor._folded_gain_
    monkeypatch.setattr(factor_module.CholeskyFactor, "_folded_gain_",
                        lambda self, *args: (lambda done: folded.append(done) or done)(original(self, *args)))
    d = _dist(A, loc, scale, k)
    torch.manual_seed(5)
    z = d.sample()
    if dtype == torch.float32:
        assert True in folded and False in folded  # a chunk inside the span of c and one outside
    else:
        assert folded == [True] * len(folded)
    torch.manual_seed(5)
    reference = d.rsample(noise=torch.randn(d.batch_shape + d.event_shape, dtype=dtype))
    eps = torch.finfo(dtype).eps
    atol = 200 * eps * reference.abs().amax(-1, keepdim=True)  # per sample: the scales differ by 1e14
    assert bool(((z - reference).abs() <= atol).all())
    assert_exact_per_row(d.constraint, z)


@pytest.mark.cpu_only(reason="the squared Gram is a CPU path")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spread", [False, True])
def test_pairs_gram_with_and_without_the_squares_matches_a_float64_oracle(dtype, spread):
    if spread:
        A, loc, scale, k = _spread_problem(dtype)
    else:
        A, loc, scale, k = _problem(dtype)
        scale = scale * torch.linspace(0.01, 100.0, scale.shape[0], dtype=dtype).unsqueeze(-1)
    factor = _dist(A, loc, scale, k).conditioner.factor
    assert isinstance(factor, factor_module.CholeskyFactor)
    pairs = factor_module._pairs_operand(factor._con, factor.cov)
    c = factor.c.double()
    oracle = (A.double() * (scale.double() / c).square().unsqueeze(-2)) @ A.double().mT
    norm = oracle.diagonal(dim1=-2, dim2=-1).sqrt()
    norm = norm.unsqueeze(-1) * norm.unsqueeze(-2)
    eps = torch.finfo(dtype).eps
    for squares in (True, False):
        S = factor._pairs_gram(pairs, squares=squares).double()
        err = ((S - oracle).abs() / norm).amax()
        assert float(err) < 10 * A.shape[-1] ** 0.5 * eps, (squares, float(err))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_screened_check_gives_the_full_checks_verdict(dtype):
    """Residuals drawn around each row's tolerance: the screened verdict is the full one on every chunk, the
    screen decides alone where every row has room, and a row beyond its tolerance is always caught."""
    g = torch.Generator().manual_seed(2)
    rows, n, a = 3, 6000, 4
    A = torch.randn(a, n, generator=g, dtype=dtype)
    A_t, abs_A_t = A.mT.contiguous(), A.abs().mT.contiguous()
    rtol = check_rtol(dtype, n)
    screen, shrink = fused_module._screen_columns(n, dtype, torch.device("cpu"))
    assert screen == n // fused_module.SCREEN_FRACTION and 0.5 < shrink < 1.0
    scratch = torch.empty(rows, n, dtype=dtype)
    decided_by_screen, verdicts = 0, set()
    for trial in range(200):
        z = torch.randn(rows, n, generator=g, dtype=dtype) * 10.0 ** float(torch.randint(-3, 4, (), generator=g))
        size = torch.abs(z) @ abs_A_t
        # residual t * rtol * size with t over [0, 0.05) (room for the screen: 1/8 of the terms), or near 1
        t = (torch.rand(rows, a, generator=g, dtype=dtype) * 0.05 if trial % 2 else
             0.9 + 0.2 * torch.rand(rows, a, generator=g, dtype=dtype))
        k = z @ A_t + t * rtol * size
        full, _ = fused_module._chunk_fails(z, k, A_t, abs_A_t, rtol, None, shrink, scratch)
        screened, after = fused_module._chunk_fails(z, k, A_t, abs_A_t, rtol, screen, shrink, scratch)
        assert bool(full) == bool(screened)
        decided_by_screen += after is not None
        verdicts.add(bool(full))
    assert verdicts == {True, False}  # chunks on both sides of the tolerance
    assert decided_by_screen >= 90  # the small residuals pass on the screen alone


def test_a_row_outside_the_screened_columns_turns_the_screen_off_and_is_checked_in_full():
    n, a = 8000, 2
    A = torch.zeros(a, n, dtype=torch.float64)
    A[0, :4000] = 1.0
    A[1, 4000:] = 1.0  # row 1 has no entry in the first n / 8 columns: its lower bound is 0
    A_t, abs_A_t = A.mT.contiguous(), A.abs().mT.contiguous()
    z = torch.randn(2, n, dtype=torch.float64)
    rtol = 1e-12
    screen, shrink = fused_module._screen_columns(n, torch.float64, torch.device("cpu"))
    size = z.abs() @ abs_A_t
    k = z @ A_t + 0.5 * rtol * size  # within every row's tolerance, but row 1's only with its full |A||z|
    fails, after = fused_module._chunk_fails(z, k, A_t, abs_A_t, rtol, screen, shrink, torch.empty(2, n,
                                                                                                  dtype=torch.float64))
    assert after is None and not bool(fails)  # the full product decided: every row passes
    k = z @ A_t + 1.5 * rtol * size
    fails, _ = fused_module._chunk_fails(z, k, A_t, abs_A_t, rtol, None, shrink, torch.empty(2, n,
                                                                                             dtype=torch.float64))
    assert bool(fails)


def test_the_screen_is_off_the_cpu_and_for_short_vectors():
    assert fused_module._screen_columns(100_000, torch.float32, torch.device("meta")) == (None, 1.0)
    assert fused_module._screen_columns(fused_module.SCREEN_MIN_SIZE - 1, torch.float32,
                                         torch.device("cpu")) == (None, 1.0)
    m, shrink = fused_module._screen_columns(100_000, torch.float32, torch.device("cpu"))
    assert m == 100_000 // fused_module.SCREEN_FRACTION
    assert shrink == pytest.approx(1 - 3 * 100_000 * torch.finfo(torch.float32).eps)


@pytest.mark.cpu_only(reason="the same numbers need the CPU generator")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_sample_does_not_depend_on_the_rest_of_the_batch(dtype, monkeypatch, screened):
    """Row 2's sample, from the same noise, whatever the other rows' scales (which switch the squared Gram, the
    folded gain and the screen of their chunks on and off), up to rounding; every row exact."""
    monkeypatch.setattr(fused_module, "FUSED_CHUNK_ELEMS", 3 * 3000)
    A, loc, scale, k = _problem(dtype, B=6, a=3)
    torch.manual_seed(9)
    z1 = _dist(A, loc, scale, k).sample()
    other = torch.ones(6, 1, dtype=dtype)
    other[[0, 3, 5]] = 1e6 if dtype == torch.float32 else 1e60
    other[1] = 1e-6 if dtype == torch.float32 else 1e-60
    d2 = _dist(A, loc * other, scale * other, k * other)
    torch.manual_seed(9)
    z2 = d2.sample()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(z2[2], z1[2], rtol=0, atol=200 * eps * float(z1[2].abs().max()))
    assert_exact_per_row(d2.constraint, z2)
