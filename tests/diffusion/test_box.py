"""box_project: the exact projection onto {channel sums = k} ∩ [lo, hi]^n in a diagonal metric, against two
independent oracles (a float64 bisection on the multiplier, and scipy's SLSQP on small n), plus the degenerate
cases (totals at the box limits, equal variances, tied breakpoints) and the native samplers' final="box"."""


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hardeq
import hardeq.diffusion
from hardeq import SumConstraint
from hardeq.diffusion import box_project, channel_sum_constraint
from hardeq.testing import assert_exact_per_row



def gen(seed):
    return torch.Generator().manual_seed(seed)


def bisect_oracle(mu, v, k, lo, hi, iters=200):
    """Per image and channel: bisection on lambda of sum clip(mu + lambda v) = k, float64, from scratch."""
    mu, v = mu.double(), v.double()
    B, C = mu.shape[:2]
    m = mu[0, 0].numel()
    mu2, v2 = mu.reshape(B, C, m), v.reshape(B, C, m)
    k = torch.as_tensor(k, dtype=torch.float64).expand(B, C)
    span = ((hi - lo) + (mu2.abs().amax(-1) + abs(lo) + abs(hi))) / v2.amin(-1)
    a, b = -span, span
    for _ in range(iters):
        mid = (a + b) / 2
        s = (mu2 + mid[..., None] * v2).clamp(lo, hi).sum(-1)
        a, b = torch.where(s < k, mid, a), torch.where(s < k, b, mid)
    lam = (a + b) / 2
    return (mu2 + lam[..., None] * v2).clamp(lo, hi).reshape(mu.shape)


def check_exact(y, x, totals, lo, hi):
    assert y.dtype == x.dtype and y.shape == x.shape
    c = channel_sum_constraint(x.shape, torch.as_tensor(totals, dtype=torch.float64))
    assert_exact_per_row(c, y.reshape(y.shape[0], -1))
    assert bool((y >= lo).all()) and bool((y <= hi).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("box", [(-1.0, 1.0), (0.0, 1.0)])
@pytest.mark.parametrize("metric", ["iso", "pixel", "channel"])
def test_matches_bisection_oracle(dtype, box, metric):
    lo, hi = box
    g = gen(1)
    B, C, H, W = 5, 3, 6, 7
    m = H * W
    x = (1.5 * torch.randn(B, C, H, W, generator=g, dtype=torch.float64) + (lo + hi) / 2).to(dtype)
    v = {"iso": 0.3, "pixel": torch.rand(B, C, H, W, generator=g, dtype=torch.float64) + 0.05,
         "channel": torch.rand(C, 1, 1, generator=g, dtype=torch.float64) + 0.05}[metric]
    totals = lo * m + (hi - lo) * m * torch.rand(B, C, generator=g, dtype=torch.float64)
    y = box_project(x, totals, v, lo, hi)
    check_exact(y, x, totals, lo, hi)
    vt = torch.as_tensor(v, dtype=torch.float64).expand(B, C, H, W)
    ref = bisect_oracle(x, vt, totals, lo, hi)
    atol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(y.double(), ref, atol=atol, rtol=0)


def test_matches_scipy_slsqp():
    scipy_opt = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(0)
    for trial in range(8):
        n = int(rng.integers(2, 9))
        mu = rng.normal(0.5, 0.8, n)
        v = rng.uniform(0.1, 2.0, n)
        k = rng.uniform(0.05, 0.95) * n
        res = scipy_opt.minimize(lambda z, mu=mu, v=v: ((z - mu) ** 2 / v).sum(), np.clip(mu, 0, 1),
                                 method="SLSQP", jac=lambda z, mu=mu, v=v: 2 * (z - mu) / v, bounds=[(0, 1)] * n,
                                 constraints=[{"type": "eq", "fun": lambda z, k=k: z.sum() - k,
                                               "jac": lambda z: np.ones_like(z)}],
                                 options={"ftol": 1e-12, "maxiter": 500})
        assert res.success, res.message
        y = box_project(torch.tensor(mu).reshape(1, 1, 1, n), torch.tensor([k]), torch.tensor(v).reshape(1, 1, 1, n),
                        0.0, 1.0)
        np.testing.assert_allclose(y.flatten().numpy(), res.x, atol=1e-6, err_msg=f"trial {trial}")


def test_kkt_conditions():
    """Stationarity: (x - mu)/v is the same lambda on the active pixels; pixels at lo have (lo - mu)/v >= lambda,
    pixels at hi have (hi - mu)/v <= lambda."""
    g = gen(2)
    x = 2 * torch.randn(3, 2, 5, 5, generator=g, dtype=torch.float64)
    v = torch.rand(3, 2, 5, 5, generator=g, dtype=torch.float64) + 0.1
    y = box_project(x, torch.tensor([3.0, -10.0]), v, -1.0, 1.0)
    r = (y - x) / v
    for b in range(3):
        for c in range(2):
            act = (y[b, c] > -1) & (y[b, c] < 1)
            lam = r[b, c][act]
            assert lam.numel() > 0 and float(lam.max() - lam.min()) < 1e-10
            lam0 = float(lam.mean())
            assert bool((r[b, c][y[b, c] == -1] >= lam0 - 1e-10).all())
            assert bool((r[b, c][y[b, c] == 1] <= lam0 + 1e-10).all())


def test_isotropic_is_euclidean_projection_and_variance_free():
    x = torch.randn(2, 3, 4, 4, generator=gen(3), dtype=torch.float64)
    totals = torch.tensor([5.0, -3.0, 0.0], dtype=torch.float64)
    y1 = box_project(x, totals, 1.0, -1, 1)
    y2 = box_project(x, totals, 1e-4, -1, 1)
    torch.testing.assert_close(y1, y2, atol=1e-12, rtol=0)


def test_no_pixel_at_the_box_equals_the_unboxed_projection():
    x = 0.1 * torch.randn(2, 3, 4, 4, generator=gen(4), dtype=torch.float64)
    totals = x.sum((-2, -1)) + 0.3
    y = box_project(x, totals, 0.7, -1, 1)
    c = channel_sum_constraint(x.shape, totals)
    torch.testing.assert_close(y, hardeq.diffusion.project_onto(c, x), atol=1e-13, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_degenerate_cases(dtype):
    B, C, H, W = 2, 3, 4, 4
    m = H * W
    x = torch.randn(B, C, H, W, generator=gen(5), dtype=dtype)
    # totals at the box limits: every pixel at the limit
    y = box_project(x, torch.tensor([m * 0.0, m * 1.0, m * 0.5]), 1.0, 0.0, 1.0)
    assert bool((y[:, 0] == 0).all()) and bool((y[:, 1] == 1).all())
    check_exact(y, x, [0.0, m, m / 2], 0.0, 1.0)
    # ties in the breakpoints: all pixels equal (every breakpoint tied), and repeated values
    x_tied = torch.full((B, C, H, W), 0.3, dtype=dtype)
    y = box_project(x_tied, torch.tensor([4.0, 8.0, 12.0]), 1.0, 0.0, 1.0)
    torch.testing.assert_close(y[:, :, 0, 0], torch.tensor([0.25, 0.5, 0.75], dtype=dtype).expand(B, C))
    x_rep = torch.tensor([2.0, 2.0, -3.0, -3.0, 0.5, 0.5, 0.5, 0.0], dtype=dtype).reshape(1, 1, 2, 4)
    for k in (-8.0, -5.0, 0.0, 1.5, 3.0, 7.9, 8.0):
        y = box_project(x_rep, torch.tensor([k], dtype=torch.float64), 1.0, -1.0, 1.0)
        check_exact(y, x_rep, [k], -1.0, 1.0)
        torch.testing.assert_close(y.double(), bisect_oracle(x_rep, torch.ones_like(x_rep), [k], -1.0, 1.0),
                                   atol=1e-6, rtol=0)
    # all pixels outside the box on the same side, k inside
    y = box_project(torch.full((1, 1, 2, 2), 5.0, dtype=dtype), torch.tensor([1.0]), 1.0, 0.0, 1.0)
    torch.testing.assert_close(y.flatten(), torch.full((4,), 0.25, dtype=dtype))


def test_general_sum_constraint_and_per_image_totals():
    """Unequal, interleaved groups (not channels) and a (B, a) total."""
    index = torch.tensor([0, 2, 1, 0, 0, 2, 1, 1, 1, 0, 2, 0])
    g = gen(6)
    x = 2 * torch.randn(4, 12, generator=g, dtype=torch.float64)
    v = torch.rand(4, 12, generator=g, dtype=torch.float64) + 0.1
    counts = torch.bincount(index).double()
    total = (torch.rand(4, 3, generator=g, dtype=torch.float64) * 2 - 1) * counts
    con = SumConstraint(index, total)
    y = box_project(x, con, v, -1.0, 1.0)
    assert_exact_per_row(con, y)
    assert bool((y.abs() <= 1).all())
    # against the oracle, group by group
    for j in range(3):
        sel = index == j
        ref = bisect_oracle(x[:, sel].reshape(4, 1, 1, -1), v[:, sel].reshape(4, 1, 1, -1), total[:, j:j + 1],
                            -1.0, 1.0)
        torch.testing.assert_close(y[:, sel], ref.reshape(4, -1), atol=1e-12, rtol=0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(2, 12), C=st.integers(1, 3), frac=st.floats(0.0, 1.0),
       spread=st.floats(0.01, 20.0), f64=st.booleans())
def test_fuzz_exact_in_the_box(seed, m, C, frac, spread, f64):
    dtype = torch.float64 if f64 else torch.float32
    g = gen(seed)
    x = (spread * torch.randn(2, C, 1, m, generator=g, dtype=torch.float64)).to(dtype)
    v = torch.rand(2, C, 1, m, generator=g, dtype=torch.float64) * 5 + 1e-3
    totals = torch.full((C,), frac * m * 2 - m, dtype=torch.float64)  # in [-m, m]
    y = box_project(x, totals, v, -1.0, 1.0)
    check_exact(y, x, totals, -1.0, 1.0)
    atol = 1e-9 if f64 else 1e-5
    torch.testing.assert_close(y.double(), bisect_oracle(x, v, totals, -1.0, 1.0), atol=atol, rtol=0)


def test_errors():
    x = torch.zeros(1, 2, 2, 2)
    with pytest.raises(ValueError, match=r"group 1 of image 0 has 4 pixels in \[0.0, 1.0\].*got 5.0"):
        box_project(x, torch.tensor([1.0, 5.0]), 1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="lo < hi"):
        box_project(x, torch.tensor([1.0, 1.0]), 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="positive"):
        box_project(x, torch.tensor([1.0, 1.0]), 0.0, 0.0, 1.0)
    with pytest.raises(TypeError, match="SumConstraint"):
        box_project(x, hardeq.LinearConstraint(torch.ones(1, 8), torch.ones(1)), 1.0, 0.0, 1.0)
    # totals beyond the limit by round-off are accepted (all pixels at the limit)
    y = box_project(x, torch.tensor([4.0 * (1 + 1e-7), 0.0]), 1.0, 0.0, 1.0)
    assert bool((y[0, 0] == 1).all())




def test_contiguous_unequal_groups_and_a_single_pixel_group():
    """Hand-solved: a one-pixel group takes its total; group 1 moves by lambda = -31/30; group 2 has lambda = 4."""
    con = SumConstraint(torch.tensor([0, 1, 1, 1, 2, 2]), torch.tensor([0.3, -2.5, 1.0], dtype=torch.float64))
    x = torch.tensor([[5.0, 0.1, 0.2, 0.3, -4.0, 4.0]], dtype=torch.float64)
    y = box_project(x, con, 1.0, -1.0, 1.0)
    lam = -31 / 30
    expected = torch.tensor([[0.3, 0.1 + lam, 0.2 + lam, 0.3 + lam, 0.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(y, expected, atol=1e-15, rtol=0)
