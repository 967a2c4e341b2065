"""The exact normaliser of one sum row (hardeq.bounds.sum_normaliser) against independent oracles: for n = 3 a 1-D
scipy quadrature over the plane whose inner integral is in closed form (accurate to 1e-13), Monte Carlo at a sound
level for larger n; its gradient against the oracle's finite differences; its wiring into the distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import hardeq
from hardeq.bounds.sum_normaliser import sum_row_layout, sum_row_log_normaliser

stats = pytest.importorskip("scipy.stats")
integrate = pytest.importorskip("scipy.integrate")
special = pytest.importorskip("scipy.special")

F64 = torch.float64
DTYPES = [torch.float32, torch.float64]


def oracle3(w, mu, s, lo, hi, k):
    r"""log Z for n = 3, one row w.z = k, diagonal covariance: Z = f_{S, box}(k) / f_S(k) with
    f_{S, box}(k) = int dz0 p0(z0) int dz1 p1(z1) p2((k - w0 z0 - w1 z1) / w2) / |w2| over the box; the inner
    integral is a Gaussian in z1 on an interval (closed form), the outer one scipy's adaptive quadrature split at the
    kinks. Returns (log Z, relative error estimate of the quadrature)."""
    w, mu, s, lo, hi = (np.asarray(t, dtype=float) for t in (w, mu, s, lo, hi))

    def inner(z0):
        r = k - w[0] * z0
        e1, e2 = sorted([(r - w[2] * lo[2]) / w[1], (r - w[2] * hi[2]) / w[1]])
        a, b = max(lo[1], e1), min(hi[1], e2)
        if a >= b:
            return 0.0
        c0, c1 = r / w[2], -w[1] / w[2]
        A = 1 / s[1] ** 2 + c1**2 / s[2] ** 2
        Bq = mu[1] / s[1] ** 2 - c1 * (c0 - mu[2]) / s[2] ** 2
        m, sd = Bq / A, 1 / math.sqrt(A)
        C = -(mu[1] ** 2 / s[1] ** 2 + (c0 - mu[2]) ** 2 / s[2] ** 2) / 2 + Bq**2 / (2 * A)
        mass = special.ndtr((b - m) / sd) - special.ndtr((a - m) / sd)
        return math.exp(C) * sd * math.sqrt(2 * math.pi) * mass / (2 * math.pi * s[1] * s[2] * abs(w[2]))

    pts = sorted((k - w[1] * z1 - w[2] * z2) / w[0] for z1 in (lo[1], hi[1]) for z2 in (lo[2], hi[2])
                 if lo[0] < (k - w[1] * z1 - w[2] * z2) / w[0] < hi[0])
    num, err = integrate.quad(lambda z0: stats.norm.pdf(z0, mu[0], s[0]) * inner(z0), lo[0], hi[0],
                              points=pts or None, epsabs=0, epsrel=1e-13, limit=500)
    m, v = float(w @ mu), float(((w * s) ** 2).sum())
    return math.log(num) - stats.norm.logpdf(k, m, math.sqrt(v)), err / num


#: (w, loc, scale, lower, upper, k): ordinary, uniform-like (kinks), signed weights, a tail, a corner, a narrow
#: coordinate, and a box the law makes improbable (log Z about -63)
CASES = [
    ([1, 1, 1], [0.2, 0.5, -0.1], [0.3, 0.5, 0.4], [0, 0, 0], [1, 1, 1], 1.0),
    ([1, 1, 1], [0, 0, 0], [5, 5, 5], [0, 0, 0], [1, 1, 1], 1.0),
    ([1, 1, 1], [0, 0, 0], [5, 5, 5], [0, 0, 0], [1, 1, 1], 1.5),
    ([1, -2, 0.5], [0.3, 0.1, 2], [0.2, 0.3, 1.0], [0, -1, 0], [1, 1, 3], 0.4),
    ([1, 1, 1], [0.3, 0.3, 0.3], [0.3, 0.3, 0.3], [0, 0, 0], [1, 1, 1], 2.9),
    ([1, 1, 1], [0.3, 0.3, 0.3], [0.01, 0.3, 0.3], [0, 0, 0], [1, 1, 1], 1.0),
    ([2, 1, 1], [-1.5, 2.5, 2.0], [0.3, 0.3, 0.2], [0, 0, 0], [1, 1, 1], 1.0),
]


def _dist(w, mu, s, k, dtype):
    con = hardeq.LinearConstraint(torch.tensor([w], dtype=dtype), torch.tensor([k], dtype=dtype))
    return hardeq.ConstrainedNormal(torch.tensor(mu, dtype=dtype), torch.tensor(s, dtype=dtype), constraint=con)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_three_coordinates_against_quadrature(case, dtype):
    """|log Z - oracle| within the stated error estimate (plus the float32 rounding of the inputs and the result)."""
    w, mu, s, lo, hi, k = CASES[case]
    ref, rel = oracle3(w, mu, s, lo, hi, k)
    assert rel < 1e-10
    t = _dist(w, mu, s, k, dtype).truncate(torch.tensor(lo, dtype=dtype), torch.tensor(hi, dtype=dtype))
    assert t.normaliser_exact
    log_z, err = t.log_normaliser, t.log_normaliser_stderr
    assert log_z.dtype == dtype and err.dtype == dtype
    assert float(err) < 1e-3  # the grid's estimate is small ...
    # ... and bounds the error (float32: the inputs' rounding moves log Z by ~1e-6 relative to its size)
    slack = 1e-12 if dtype == F64 else 2e-5 * max(1.0, abs(ref))
    assert abs(float(log_z) - ref) <= float(err) + slack, (float(log_z), ref, float(err))


def test_larger_rows_against_monte_carlo():
    """n = 8 and 20 (sums with Z above 0.005) against 400,000 untruncated draws: within 4.5 standard
    errors of the fraction plus the grid's estimate."""
    gen = torch.Generator().manual_seed(7)
    for n, batch in ((8, 3), (20, 3)):
        loc = torch.rand(batch, n, generator=gen, dtype=F64) * 2 / n
        scale = torch.rand(batch, n, generator=gen, dtype=F64) * 0.3 + 0.05
        w = torch.randn(n, generator=gen, dtype=F64).sign() * (torch.rand(n, generator=gen, dtype=F64) + 0.5)
        k = (w * loc).sum(-1, keepdim=True)
        d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(w.unsqueeze(0), k))
        t = d.truncate(-0.2, 0.6)
        log_z, err = t.log_normaliser, t.log_normaliser_stderr
        torch.manual_seed(11)
        z = d.sample((400_000,))
        p = ((z >= -0.2) & (z <= 0.6)).all(-1).to(F64).mean(0)
        se = ((1 - p) / (400_000 * p)).sqrt()
        assert bool((p > 0.005).all())
        assert bool(((log_z - p.log()).abs() <= 4.5 * se + err).all()), (n, log_z, p.log(), se, err)


def test_groups_zero_weights_and_groups_of_one():
    """A grouped sum is the sum of its groups' log Z (each against the quadrature, a group of one contributes 0);
    a coordinate outside a one-row constraint contributes its own box probability."""
    mu = torch.tensor([0.2, 0.5, -0.1, 0.9, 0.3, 0.3, 0.3], dtype=F64)
    s = torch.tensor([0.3, 0.5, 0.4, 0.2, 0.3, 0.3, 0.3], dtype=F64)
    index = torch.tensor([0, 0, 0, 1, 2, 2, 2])
    k = torch.tensor([1.0, 0.9, 2.9], dtype=F64)
    t = hardeq.ConstrainedNormal(mu, s, constraint=hardeq.SumConstraint(index, k)).truncate(0.0, 1.0)
    ref = oracle3([1, 1, 1], mu[:3].tolist(), s[:3].tolist(), [0] * 3, [1] * 3, 1.0)[0] \
        + oracle3([1, 1, 1], mu[4:].tolist(), s[4:].tolist(), [0] * 3, [1] * 3, 2.9)[0]
    assert t.normaliser_exact
    assert abs(float(t.log_normaliser) - ref) <= float(t.log_normaliser_stderr) + 1e-12
    # one row with a zero weight: the free coordinate's box probability joins the row's normaliser
    w = [1.0, 0.0, -2.0, 0.5]
    d = hardeq.ConstrainedNormal(torch.tensor([0.3, 0.4, 0.1, 2.0], dtype=F64), torch.tensor([0.2, 0.7, 0.3, 1.0],
                                 dtype=F64), constraint=hardeq.LinearConstraint(torch.tensor([w], dtype=F64),
                                                                                torch.tensor([0.4], dtype=F64)))
    lo, hi = torch.tensor([0.0, -0.5, -1.0, 0.0], dtype=F64), torch.tensor([1.0, 0.5, 1.0, 3.0], dtype=F64)
    t = d.truncate(lo, hi)
    free = math.log(stats.norm.cdf(0.5, 0.4, 0.7) - stats.norm.cdf(-0.5, 0.4, 0.7))
    ref = oracle3([1, -2, 0.5], [0.3, 0.1, 2.0], [0.2, 0.3, 1.0], [0, -1, 0], [1, 1, 3], 0.4)[0] + free
    assert abs(float(t.log_normaliser) - ref) <= float(t.log_normaliser_stderr) + 1e-12


def test_batch_elements_do_not_depend_on_each_other():
    gen = torch.Generator().manual_seed(3)
    loc = torch.rand(5, 6, generator=gen, dtype=F64) / 3
    scale = torch.rand(5, 6, generator=gen, dtype=F64) * 0.3 + 0.05
    con = hardeq.SumConstraint(torch.zeros(6, dtype=torch.long), torch.ones(5, 1, dtype=F64))
    d = hardeq.ConstrainedNormal(loc, scale, constraint=con)
    lo, hi = torch.zeros(6, dtype=F64), torch.ones(6, dtype=F64)
    whole = sum_row_log_normaliser(d, lo, hi, sum_row_layout(d))[0]
    for i in range(5):
        one = hardeq.ConstrainedNormal(loc[i], scale[i], constraint=hardeq.SumConstraint(
            torch.zeros(6, dtype=torch.long), torch.ones(1, dtype=F64)))
        torch.testing.assert_close(sum_row_log_normaliser(one, lo, hi, sum_row_layout(one))[0], whole[i],
                                   rtol=0, atol=1e-12)


def test_gradient_against_the_oracle():
    """d log Z / d(loc, scale, k) by autograd against central differences of the quadrature (step 1e-4, whose own
    error is about 1e-8): within 1e-4 absolute (the grid's error in the derivative)."""
    w, mu, s, lo, hi, k = [1, -2, 0.5], [0.3, 0.1, 2.0], [0.2, 0.3, 1.0], [0, -1, 0], [1, 1, 3], 0.4
    loc = torch.tensor(mu, dtype=F64, requires_grad=True)
    scale = torch.tensor(s, dtype=F64, requires_grad=True)
    kk = torch.tensor([k], dtype=F64, requires_grad=True)
    d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(torch.tensor([w], dtype=F64), kk))
    t = d.truncate(torch.tensor(lo, dtype=F64), torch.tensor(hi, dtype=F64))
    t.log_normaliser.backward()
    eps = 1e-4

    def fd(fn):
        return (fn(eps) - fn(-eps)) / (2 * eps)

    for i in range(3):
        g_mu = fd(lambda e, i=i: oracle3(w, [m + e * (j == i) for j, m in enumerate(mu)], s, lo, hi, k)[0])
        g_s = fd(lambda e, i=i: oracle3(w, mu, [v + e * (j == i) for j, v in enumerate(s)], lo, hi, k)[0])
        assert abs(float(loc.grad[i]) - g_mu) < 1e-4, (i, float(loc.grad[i]), g_mu)
        assert abs(float(scale.grad[i]) - g_s) < 1e-4, (i, float(scale.grad[i]), g_s)
    g_k = fd(lambda e: oracle3(w, mu, s, lo, hi, k + e)[0])
    assert abs(float(kk.grad[0]) - g_k) < 1e-4, (float(kk.grad[0]), g_k)


def test_log_prob_uses_it_and_where_it_does_not_apply():
    total = hardeq.SumConstraint(torch.zeros(4, dtype=torch.long), torch.ones(1, dtype=F64))
    d = hardeq.ConstrainedNormal(torch.full((4,), 0.25, dtype=F64), 0.3, constraint=total)
    t = d.truncate(0.0, 1.0, normaliser="exact")
    y = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=F64)
    torch.testing.assert_close(t.log_prob(y), d.log_prob(y) - t.log_normaliser)
    assert not d.truncate(0.0, 1.0, normaliser="monte-carlo").normaliser_exact
    full = hardeq.ConstrainedNormal(torch.zeros(4, dtype=F64), scale_tril=torch.eye(4, dtype=F64) * 0.3,
                                    constraint=total)
    assert not full.truncate(0.0, 1.0).normaliser_exact  # not diagonal: Monte Carlo
    two = hardeq.LinearConstraint(torch.tensor([[1.0, 1, 1, 1], [1, -1, 0, 0]], dtype=F64),
                                  torch.tensor([1.0, 0.0], dtype=F64))
    with pytest.raises(ValueError, match="normaliser='exact' needs one free dimension"):
        hardeq.ConstrainedNormal(torch.zeros(4, dtype=F64), 0.3, constraint=two).truncate(0.0, 1.0,
                                                                                          normaliser="exact")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [[[1.0, 1, -1, 2]], [[1.0, 1, 1, 1], [1, -1, 0, 0], [0, 0, 1, -1]]],
                         ids=["one row", "a line"])
def test_gradient_with_an_infinite_bound_is_finite(rows, dtype):
    """Regression: an infinite bound gave NaN in the scales' gradient ((inf - mean) / w has an infinite derivative,
    and log_ndtr's at -inf is NaN). With upper = inf the gradient equals the one with upper = 1e3 (the same law to
    float64: the box's far end is 3,000 sd away)."""
    grads = []
    for upper in (None, 1e3):
        loc = torch.tensor([0.3, 0.5, 0.2, 0.1], dtype=dtype, requires_grad=True)
        scale = torch.tensor([0.3, 0.2, 0.4, 0.3], dtype=dtype, requires_grad=True)
        A = torch.tensor(rows, dtype=dtype)
        con = hardeq.LinearConstraint(A, A @ torch.tensor([0.3, 0.3, 0.2, 0.2], dtype=dtype))
        t = hardeq.ConstrainedNormal(loc, scale, constraint=con).truncate(0.0, upper)
        assert t.normaliser_exact
        t.log_normaliser.backward()
        grads.append(torch.cat([loc.grad, scale.grad]))
    assert bool(torch.isfinite(grads[0]).all())
    tol = 1e-9 if dtype == F64 else 1e-4
    torch.testing.assert_close(grads[0], grads[1], rtol=tol, atol=tol)


def test_rows_too_long_for_the_grid_fall_back_to_monte_carlo():
    """Memory stays bounded: a row of 256 coordinates gets the grid (16,384 nodes), one of 257 the Monte Carlo
    normaliser (normaliser_exact False), checked on the layout alone."""
    def dist(n):
        return hardeq.ConstrainedNormal(torch.zeros(n, dtype=F64), 1.0, constraint=hardeq.SumConstraint(
            torch.zeros(n, dtype=torch.long), torch.ones(1, dtype=F64)))

    layout = sum_row_layout(dist(256))
    assert layout is not None and layout.nodes == 16384
    assert sum_row_layout(dist(257)) is None
    assert not dist(257).truncate(0.0, 1.0).normaliser_exact
