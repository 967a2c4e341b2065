"""Blocked Gibbs on the plane (``hardeq.bounds.blocked_gibbs``, ``method="gibbs"``) and its 1-D truncated normal
draws, against oracles that share no code with it: scipy.stats.truncnorm, exact draws by naive numpy rejection from
the dense conditional, a numerical integral, and the law of independent truncated normals conditioned on their sum
(an FFT convolution)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

import hardeq
from hardeq.bounds import GibbsResult, blocked_gibbs, truncated_mode, truncated_standard_normal
from hardeq.testing import sum_conditioned_truncated_means
from hardeq.testing.exactness import assert_exact_per_row

from .test_hmc import _box, _conditional, _problem, _rejection, _two_sample_pvalues

CONSTRAINTS = ("sum", "dense", "sparse")
DTYPES = (torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------- 1-D draws
INTERVALS = [  # (a, b) of the standard normal: inside, one-sided, tails, deep tails, narrow, far and narrow
    (-1.0, 1.0), (0.5, 2.0), (-math.inf, -3.0), (2.0, math.inf), (-math.inf, math.inf), (-3.0, 0.2),
    (-29.5, -28.0), (31.0, 33.0), (40.0, math.inf), (40.0, 40.5), (-math.inf, -1e3), (1e3, 1e3 + 0.01),
    (0.3, 0.3001), (-5.0, -4.99), (-1e-9, 1e-9), (7.9, 8.3),
]


def test_truncated_standard_normal_against_scipy():
    """4000 draws per interval, KS against scipy.stats.truncnorm, Bonferroni over the intervals at level 1e-3; the
    1e3-sd intervals against their exact limit law (x - a ~ Exp(a) truncated, to O(1/a^2)), where truncnorm's
    own CDF is not accurate."""
    g = torch.Generator().manual_seed(0)
    a = torch.tensor([i[0] for i in INTERVALS], dtype=torch.float64)
    b = torch.tensor([i[1] for i in INTERVALS], dtype=torch.float64)
    x = truncated_standard_normal(a.expand(4000, -1), b.expand(4000, -1), generator=g).numpy()
    assert x.dtype == np.float64 and bool(((x >= a.numpy()) & (x <= b.numpy())).all())
    level = 1e-3 / len(INTERVALS)
    for j, (lo, hi) in enumerate(INTERVALS):
        if min(abs(lo), abs(hi)) >= 1e3 and lo * hi > 0:  # an interval 1e3 sd out, on one side
            s = 1.0 if lo >= 0 else -1.0
            edge = lo if s > 0 else hi                       # the interval's end nearest 0
            width = hi - lo
            rate = abs(edge)
            y = s * (x[:, j] - edge)                         # distance from that end, >= 0
            cdf = (lambda t, r=rate, w=width: -np.expm1(-r * t) / -np.expm1(-r * w)) if math.isfinite(width) \
                else (lambda t, r=rate: -np.expm1(-r * t))
            p = stats.kstest(y, cdf).pvalue
        else:
            ref = stats.truncnorm(lo, hi)
            p = stats.kstest(x[:, j], ref.cdf).pvalue
        assert p > level, (lo, hi, p)
    # a single point is drawn as itself; the moments of a narrow interval far out are right to round-off
    assert float(truncated_standard_normal(torch.tensor([2.5]), torch.tensor([2.5]))) == 2.5


def test_truncated_standard_normal_errors_and_determinism():
    with pytest.raises(ValueError, match="lower <= upper"):
        truncated_standard_normal(torch.tensor([1.0]), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="nan"):
        truncated_standard_normal(torch.tensor([math.nan]), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="finite point"):
        truncated_standard_normal(torch.tensor([math.inf]), torch.tensor([math.inf]))
    with pytest.raises(TypeError, match="floating-point"):
        truncated_standard_normal(torch.tensor([0]), torch.tensor([1]))
    one = truncated_standard_normal(torch.full((50,), -1.0), torch.full((50,), 2.0),
                                    generator=torch.Generator().manual_seed(3))
    two = truncated_standard_normal(torch.full((50,), -1.0), torch.full((50,), 2.0),
                                    generator=torch.Generator().manual_seed(3))
    assert torch.equal(one, two)


# ---------------------------------------------------------------------------------------------- one free dimension
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("con_kind", ["sum", "dense"])
def test_one_free_dimension_against_scipy_truncnorm(con_kind, dtype):
    """z1 + z2 = 1 (a sum, or a dense row (1, 1)) with a diagonal covariance: every sweep moves the only block, so
    each draw is an exact draw of z1 ~ N(m, s^2) truncated to the interval both boxes allow. 3000 chains from one
    feasible point, 3 sweeps: KS against scipy.stats.truncnorm at level 1e-3."""
    loc = torch.tensor([0.3, -0.2], dtype=dtype)
    scale = torch.tensor([1.0, 2.0], dtype=dtype)
    if con_kind == "sum":
        con = hardeq.SumConstraint(torch.zeros(2, dtype=torch.long), torch.tensor([1.0], dtype=dtype))
    else:
        con = hardeq.LinearConstraint(torch.ones(1, 2, dtype=dtype), torch.tensor([1.0], dtype=dtype))
    dist = hardeq.ConstrainedNormal(loc, scale, constraint=con)
    lower = torch.tensor([0.0, -0.5], dtype=dtype)
    upper = torch.tensor([2.0, 0.9], dtype=dtype)
    a_, b_ = 0.1, 1.5                          # z1 in [0, 2] and z2 = 1 - z1 in [-0.5, 0.9]
    v1, v2 = 1.0, 4.0
    m = 0.3 + v1 / (v1 + v2) * (1.0 - 0.1)
    s = math.sqrt(v1 - v1**2 / (v1 + v2))
    start = torch.tensor([[1.0, 0.0]], dtype=dtype).expand(3000, 2).contiguous()
    res = blocked_gibbs(dist, lower, upper, start, num_samples=1, burn_in=2,
                        generator=torch.Generator().manual_seed(3))
    assert isinstance(res, GibbsResult) and res.method == "gibbs" and res.block_size == 2 and res.blocks == 1
    z1 = res.samples[0, :, 0].double().numpy()
    ref = stats.truncnorm((a_ - m) / s, (b_ - m) / s, loc=m, scale=s)
    assert stats.kstest(z1, ref.cdf).pvalue > 1e-3
    assert_exact_per_row(con, res.samples[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("depth", [-500.0, -40.0, 40.0, 500.0])
def test_one_free_dimension_deep_in_the_tail_against_scipy_truncnorm(depth, dtype):
    """z1 + z2 = 1 with the conditional mean of z1 ``depth`` standard deviations below (< 0) or above (> 0) the
    interval the boxes allow: the 1-D draw is in its tail regime (the Rayleigh proposal with its Metropolis-Hastings
    correction, module hardeq.bounds.sweep). 3000 chains from one feasible point, 5 sweeps: KS against
    scipy.stats.truncnorm (computed in log space) at level 1e-3, every draw feasible and on the plane."""
    a_, b_ = 0.1, 1.5
    v1, v2 = 1.0, 4.0
    s = math.sqrt(v1 - v1**2 / (v1 + v2))
    m = a_ + depth * s if depth < 0 else b_ + depth * s
    loc = torch.tensor([(m - 0.2) / 0.8, 0.0], dtype=dtype)          # m = loc0 + v1 / (v1 + v2) * (1 - loc0)
    m = float(loc[0]) + v1 / (v1 + v2) * (1.0 - float(loc[0]))
    con = hardeq.SumConstraint(torch.zeros(2, dtype=torch.long), torch.tensor([1.0], dtype=dtype))
    dist = hardeq.ConstrainedNormal(loc, torch.tensor([1.0, 2.0], dtype=dtype), constraint=con)
    lower = torch.tensor([0.0, -0.5], dtype=dtype)
    upper = torch.tensor([2.0, 0.9], dtype=dtype)
    start = torch.tensor([[1.0, 0.0]], dtype=dtype).expand(3000, 2).contiguous()
    res = blocked_gibbs(dist, lower, upper, start, num_samples=1, burn_in=4,
                        generator=torch.Generator().manual_seed(4))
    z = res.samples[0]
    assert bool(((z >= lower) & (z <= upper)).all())
    assert_exact_per_row(con, z)
    ref = stats.truncnorm((a_ - m) / s, (b_ - m) / s, loc=m, scale=s)
    assert stats.kstest(z[:, 0].double().numpy(), ref.cdf).pvalue > 1e-3


# ---------------------------------------------------------------------------------------------- against rejection
def _diag_case(con_kind, dtype, seed, n=5):
    dist, loc, Sigma, A, k = _problem("diagonal", con_kind, n, dtype, seed=seed)
    mean, cov = _conditional(loc, Sigma, A, k)
    rng = np.random.default_rng(seed + 1)
    lower, upper = _box(mean, cov, rng)
    return dist, mean, cov, lower, upper, rng


def _stationarity(con_kind, dtype, chains, sweeps, seed, shift=0.0):
    dist, mean, cov, lower, upper, rng = _diag_case(con_kind, dtype, seed)
    start = _rejection(mean, cov, lower, upper, chains, rng)
    fresh = _rejection(mean, cov, lower, upper, chains, rng)
    t = lambda a: torch.tensor(a, dtype=dtype)  # noqa: E731
    lo, hi = t(lower), t(upper)
    z0 = torch.maximum(torch.minimum(t(start), hi), lo)  # float32 rounding of an exact draw may leave the box
    if shift:
        dist = hardeq.ConstrainedNormal(dist.loc + shift * dist.stddev, covariance=dist.covariance,
                                        constraint=dist.constraint)
    res = blocked_gibbs(dist, lo, hi, z0, num_samples=1, burn_in=sweeps - 1,
                        generator=torch.Generator().manual_seed(seed))
    z = res.samples[0]
    assert bool(((z >= lo) & (z <= hi)).all())
    return _two_sample_pvalues(z.double().numpy(), t(fresh).double().numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("con_kind", CONSTRAINTS)
def test_gibbs_leaves_the_exact_law_unchanged(con_kind, dtype):
    """Chains started from exact draws (numpy rejection from the dense conditional; n = 5, a = 2, box with a bound
    at the conditional mean and unbounded sides) stay exact after 2 sweeps: two-sample KS of the 5 marginals and 15
    pairwise products against fresh exact draws, Bonferroni at family level 1e-3 (fixed seeds; 4,000 chains)."""
    p = _stationarity(con_kind, dtype, chains=4000, sweeps=2, seed=20)
    assert min(p) > 1e-3 / len(p), min(p)


def test_stationarity_test_has_power():
    """The check above rejects chains moved by Gibbs of a different law (loc shifted by one sd)."""
    p = _stationarity("dense", torch.float64, chains=2000, sweeps=2, seed=20, shift=1.0)
    assert min(p) < 1e-3 / len(p)


def _convergence(con_kind, dtype, chains, sweeps, seed):
    """Chains from the mode (a vertex or an edge of the polytope, far from typical) after ``sweeps`` sweeps against
    exact draws: checks that the chain reaches the law, not only that it keeps it."""
    dist, mean, cov, lower, upper, rng = _diag_case(con_kind, dtype, seed)
    fresh = _rejection(mean, cov, lower, upper, chains, rng)
    t = lambda a: torch.tensor(a, dtype=dtype)  # noqa: E731
    lo, hi = t(lower), t(upper)
    start = truncated_mode(dist, lo, hi).expand(chains, -1)
    res = blocked_gibbs(dist, lo, hi, start, num_samples=1, burn_in=sweeps - 1,
                        generator=torch.Generator().manual_seed(seed))
    return _two_sample_pvalues(res.samples[0].double().numpy(), t(fresh).double().numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("con_kind", CONSTRAINTS)
def test_chains_from_the_mode_reach_the_exact_law(con_kind, dtype):
    p = _convergence(con_kind, dtype, chains=2000, sweeps=60, seed=30)
    assert min(p) > 1e-3 / len(p), min(p)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("con_kind", CONSTRAINTS)
def test_gibbs_exact_law_long(con_kind, dtype, seed):
    p = _stationarity(con_kind, dtype, chains=20000, sweeps=3, seed=100 * seed)
    assert min(p) > 1e-3 / len(p), ("stationarity", min(p))
    p = _convergence(con_kind, dtype, chains=20000, sweeps=200, seed=100 * seed + 7)
    assert min(p) > 1e-3 / len(p), ("convergence", min(p))


def test_grouped_sum_with_odd_groups_and_a_group_of_one():
    """Groups of sizes 3, 1 and 4 (dense oracle: rejection): the group of one never moves and keeps its total
    exactly; the others match exact draws (KS, Bonferroni at 1e-3)."""
    n, dtype = 8, torch.float64
    index = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2])
    rng = np.random.default_rng(5)
    sd = rng.uniform(0.5, 1.5, n)
    loc = rng.standard_normal(n)
    A = np.stack([(index.numpy() == g).astype(float) for g in range(3)])
    k = A @ (loc + 0.3 * rng.standard_normal(n))
    mean, cov = _conditional(loc, np.diag(sd**2), A, k)
    lower, upper = _box(mean, cov, rng, touching=False)
    lower[3], upper[3] = -np.inf, np.inf
    con = hardeq.SumConstraint(index, torch.tensor(k, dtype=dtype))
    dist = hardeq.ConstrainedNormal(torch.tensor(loc), torch.tensor(sd), constraint=con)
    fresh = _rejection(mean, cov, lower, upper, 3000, rng)
    start = torch.tensor(_rejection(mean, cov, lower, upper, 3000, rng))
    res = blocked_gibbs(dist, torch.tensor(lower), torch.tensor(upper), start, num_samples=1, burn_in=2,
                        generator=torch.Generator().manual_seed(1))
    z = res.samples[0]
    assert bool((z[:, 3] == float(k[1])).all())
    assert res.blocks == n // 2  # pair slots; a pair that straddles two groups stays put
    p = [stats.ks_2samp(z[:, i].numpy(), fresh[:, i]).pvalue for i in range(n) if i != 3]
    assert min(p) > 1e-3 / len(p), min(p)
    assert_exact_per_row(con, z)


def test_per_batch_stratified_partitions_keep_the_law():
    """Two batch elements whose means lie outside the box in different coordinates, so that the stratified sweeps
    (every other one) pair coordinates differently per batch element: chains from exact draws, 4 sweeps, KS of the
    marginals per batch element against fresh exact draws (Bonferroni at 1e-3)."""
    n, dtype = 6, torch.float64
    index = torch.tensor([0, 0, 0, 1, 1, 1])
    A = np.stack([(index.numpy() == g).astype(float) for g in range(2)])
    rng = np.random.default_rng(11)
    sd = rng.uniform(0.5, 1.0, (2, n))
    loc = np.array([[-0.6, 0.5, 0.8, -0.5, 0.6, 0.9], [0.6, -0.6, 0.7, 0.8, 0.5, -0.5]])
    k = np.array([[1.5, 1.4], [1.3, 1.2]])
    lower, upper = np.zeros(n), np.full(n, 2.0)
    con = hardeq.SumConstraint(index, torch.tensor(k, dtype=dtype))
    dist = hardeq.ConstrainedNormal(torch.tensor(loc), torch.tensor(sd), constraint=con)
    starts, fresh = [], []
    for b in range(2):
        mean, cov = _conditional(loc[b], np.diag(sd[b] ** 2), A, k[b])
        starts.append(_rejection(mean, cov, lower, upper, 2000, rng))
        fresh.append(_rejection(mean, cov, lower, upper, 2000, rng))
    start = torch.tensor(np.stack(starts, axis=1))                      # (chains, 2, n)
    res = blocked_gibbs(dist, torch.tensor(lower), torch.tensor(upper), start, num_samples=1, burn_in=3,
                        generator=torch.Generator().manual_seed(2))
    z = res.samples[0].numpy()
    p = [stats.ks_2samp(z[:, b, i], fresh[b][:, i]).pvalue for b in range(2) for i in range(n)]
    assert min(p) > 1e-3 / len(p), min(p)


# ---------------------------------------------------------------------------------------------- pressed against a wall
def _pressed_simplex_chains(loc: np.ndarray, sd: float, *, chains: int, num_samples: int, burn_in: int) -> GibbsResult:
    """Blocked Gibbs for N(loc, sd^2 I) on the simplex {sum z = 1, 0 <= z <= 1} (float64): ``chains`` chains from the
    truncated mode, seed 0."""
    n, dtype = len(loc), torch.float64
    con = hardeq.SumConstraint(torch.zeros(n, dtype=torch.long), torch.ones(1, dtype=dtype))
    dist = hardeq.ConstrainedNormal(torch.tensor(loc), torch.full((n,), sd, dtype=dtype), constraint=con)
    lower, upper = torch.zeros(n, dtype=dtype), torch.ones(n, dtype=dtype)
    start = truncated_mode(dist, lower, upper).expand(chains, n)
    return blocked_gibbs(dist, lower, upper, start, num_samples=num_samples, burn_in=burn_in,
                         generator=torch.Generator().manual_seed(0))


def test_pressed_three_coordinates_against_a_numerical_integral():
    """z in R^3, sum 1, box [0, 1], sd 0.016, the mean 6 sd below 0 in two coordinates (the portfolio case in
    miniature): E[z_1], E[z_1^2] and E[z_1 z_2] of 4000 chains after 40 sweeps from the mode against a 2-D
    integral over the plane (midpoint rule, 1500^2 cells on [0, 0.03]^2, where all but e^-20 of the mass lies),
    within 5 Monte Carlo standard errors."""
    sd = 0.016
    loc = np.array([-6 * sd, -5 * sd, 0.97])
    res = _pressed_simplex_chains(loc, sd, chains=4000, num_samples=1, burn_in=39)
    z = res.samples[0].numpy()
    h = 0.03 / 1500
    g = (np.arange(1500) + 0.5) * h
    z1, z2 = np.meshgrid(g, g, indexing="ij")
    z3 = 1.0 - z1 - z2
    logw = -0.5 * (((z1 - loc[0]) / sd) ** 2 + ((z2 - loc[1]) / sd) ** 2 + ((z3 - loc[2]) / sd) ** 2)
    w = np.exp(logw - logw.max())
    w /= w.sum()
    for f, name in ((z1, "z1"), (z1**2, "z1^2"), (z1 * z2, "z1 z2")):
        exact = float((w * f).sum())
        draws = {"z1": z[:, 0], "z1^2": z[:, 0] ** 2, "z1 z2": z[:, 0] * z[:, 1]}[name]
        se = draws.std() / math.sqrt(len(draws))
        assert abs(draws.mean() - exact) < 5 * se + 1e-3 * exact, (name, draws.mean(), exact, se)


def test_pressed_fifty_weights_against_the_conditioned_sum_of_truncated_normals():
    """The portfolio's long-only case: 50 weights in [0, 1] summing to 1, sd 0.016, the mean 6 sd below 0 in 38 of
    them. With a diagonal covariance the law is that of independent truncated normals conditioned on their sum, whose
    means an FFT convolution gives (grid step 2e-5). 256 chains x 200 draws after 50 sweeps from the mode (the
    burn-in takes about 20 sweeps, the autocorrelation time of the unpressed weights is about 10): each E[z_i]
    within 5 standard errors (from the measured ESS) plus the grid's 2e-5."""
    n, sd = 50, 0.016
    loc = np.concatenate([np.full(38, -6 * sd), np.linspace(0.02, 0.14, 12)])
    res = _pressed_simplex_chains(loc, sd, chains=256, num_samples=200, burn_in=50)
    assert float(res.rhat.max()) < 1.1
    z = res.samples.reshape(-1, n).numpy()
    exact = sum_conditioned_truncated_means(loc, np.full(n, sd), 1.0, 0.0, 0.25, 2e-5)
    se = z.std(0) / np.sqrt(res.ess.numpy())
    err = np.abs(z.mean(0) - exact)
    assert bool((err < 5 * se + 2e-5).all()), (err / se).max()
    assert float(exact[:38].max()) < 0.01 < float(exact[38:].max())  # the oracle sees the pressed coordinates


# ---------------------------------------------------------------------------------------------- feasibility, shapes
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("con_kind", CONSTRAINTS)
def test_every_draw_is_feasible_at_scale_ratio_1e6_with_bounds_touching_the_mean(con_kind, dtype):
    n = 8
    dist, *_ = _problem("diagonal", con_kind, n, dtype, seed=10, scale_ratio=1e6)
    mean, sd = dist.mean, dist.stddev
    i = torch.arange(n)
    lower = torch.where(i == 0, mean, mean - 0.3 * sd)
    upper = torch.where(i == 1, mean, torch.where(i == n - 1, torch.full_like(mean, math.inf), mean + sd))
    start = mean.expand(16, n).clone()
    res = blocked_gibbs(dist, lower, upper, start, num_samples=70, burn_in=5,
                        generator=torch.Generator().manual_seed(0))   # 75 sweeps: one re-projection included
    z = res.samples
    assert z.shape == (70, 16, n) and z.dtype == dtype
    assert bool(((z >= lower) & (z <= upper)).all()), "a draw left the box"
    assert_exact_per_row(dist.constraint, z.reshape(-1, n))
    moving = dist.variance > 0
    assert bool((z.reshape(-1, n).std(0)[moving] > 0).all())


def test_batch_shapes_batched_A_and_the_distribution_method():
    dtype = torch.float64
    g = torch.Generator().manual_seed(0)
    n = 7
    A = torch.randn(3, 2, n, generator=g, dtype=dtype)               # one A per batch element
    inner = 0.2 + 0.6 * torch.rand(2, 3, n, generator=g, dtype=dtype)
    k = (A @ inner.unsqueeze(-1)).squeeze(-1)                         # (2, 3, 2)
    dist = hardeq.ConstrainedNormal(inner + 0.5 * torch.randn(2, 3, n, generator=g, dtype=dtype),
                                    0.3 + torch.rand(2, 3, n, generator=g, dtype=dtype),
                                    constraint=hardeq.LinearConstraint(A, k))
    t = dist.truncate(0.0, 1.0)
    info = t.sample_with_info((4, 5), method="gibbs", burn_in=10, generator=torch.Generator().manual_seed(1))
    assert info.method == "gibbs" and info.samples.shape == (4, 5, 2, 3, n) and info.acceptance is None
    assert info.ess.shape == (2, 3, n)
    z = info.samples
    assert bool(((z >= 0) & (z <= 1)).all())
    assert_exact_per_row(dist.constraint, z)
    res = blocked_gibbs(dist, 0.0, 1.0, t.mode.expand(6, 2, 3, n), num_samples=8, burn_in=2, thin=3,
                        generator=torch.Generator().manual_seed(1))
    assert res.samples.shape == (8, 6, 2, 3, n) and res.sweeps == 2 + 8 * 3 and res.block_size == 3
    assert res.blocks == n // 3 and res.rhat.shape == (2, 3, n)
    few = blocked_gibbs(dist, 0.0, 1.0, t.mode.expand(2, 2, 3, n), num_samples=2, burn_in=0)
    assert bool(torch.isnan(few.ess).all()) and bool(torch.isnan(few.rhat).all())


def test_auto_routes_the_pressed_case_to_gibbs_and_float32_results():
    n, sd = 50, 0.016
    loc = torch.cat([torch.full((38,), -6 * sd), torch.linspace(0.02, 0.14, 12)]).expand(3, n)
    con = hardeq.SumConstraint(torch.zeros(n, dtype=torch.long), torch.ones(1))
    t = hardeq.ConstrainedNormal(loc, torch.full((n,), sd), constraint=con).truncate(0.0, 1.0)
    info = t.sample_with_info((16,), burn_in=50, generator=torch.Generator().manual_seed(0))
    assert info.method == "gibbs" and info.samples.shape == (16, 3, n) and info.samples.dtype == torch.float32
    z = info.samples
    assert bool(((z >= 0) & (z <= 1)).all())
    assert_exact_per_row(con, z)


def test_determinism_with_a_generator():
    dist, lower, upper = _problem("diagonal", "dense", 6, torch.float64, seed=3)[0], -1.0, 2.0
    t = dist.truncate(lower, upper)
    a = t.sample((10,), method="gibbs", burn_in=5, generator=torch.Generator().manual_seed(4))
    b = t.sample((10,), method="gibbs", burn_in=5, generator=torch.Generator().manual_seed(4))
    c = t.sample((10,), method="gibbs", burn_in=5, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_errors():
    dist, *_ = _problem("diagonal", "sum", 5, torch.float64, seed=1)
    mode = truncated_mode(dist, torch.full((5,), -3.0, dtype=torch.float64), torch.full((5,), 3.0, dtype=torch.float64))
    start = mode.expand(2, 5)
    for cov_kind in ("full", "lowrank", "blockdiag"):  # through the augmentation (test_gibbs_augmented.py)
        other, *_ = _problem(cov_kind, "sum", 5, torch.float64, seed=1)
        other_start = truncated_mode(other, torch.full((5,), -3.0, dtype=torch.float64),
                                     torch.full((5,), 3.0, dtype=torch.float64)).expand(2, 5)
        z = blocked_gibbs(other, -3.0, 3.0, other_start, num_samples=2).samples
        assert bool(((z >= -3) & (z <= 3)).all())
        assert other.truncate(-3.0, 3.0).sample_with_info((2,), method="gibbs").method == "gibbs"
    many = hardeq.LinearConstraint(torch.randn(65, 70, dtype=torch.float64), torch.zeros(65, dtype=torch.float64))
    big = hardeq.ConstrainedNormal(torch.zeros(70, dtype=torch.float64), 1.0, constraint=many)
    with pytest.raises(ValueError, match="a <= 64 rows.*a = 65.*method='hmc'"):
        blocked_gibbs(big, -1.0, 1.0, torch.zeros(1, 70, dtype=torch.float64), num_samples=1)
    with pytest.raises(TypeError, match="ConstrainedNormal"):
        blocked_gibbs("dist", 0.0, 1.0, start, num_samples=1)
    with pytest.raises(ValueError, match="start must lie in the box"):
        blocked_gibbs(dist, -3.0, 3.0, start + 10.0, num_samples=1)
    shifted = start.clone()
    shifted[:, 0] += 0.5
    with pytest.raises(ValueError, match="start must lie on the plane"):
        blocked_gibbs(dist, -3.0, 3.0, shifted, num_samples=1)
    with pytest.raises(ValueError, match="start must have shape"):
        blocked_gibbs(dist, -3.0, 3.0, mode, num_samples=1)
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        blocked_gibbs(dist, -3.0, 3.0, start, num_samples=0)
    with pytest.raises(TypeError, match="thin must be an int"):
        blocked_gibbs(dist, -3.0, 3.0, start, num_samples=1, thin=1.5)
    with pytest.raises(ValueError, match="lower must be <= upper"):
        blocked_gibbs(dist, 3.0, -3.0, start, num_samples=1)
    with pytest.raises(ValueError, match="travel_time is an HMC control"):
        dist.truncate(-3.0, 3.0).sample((2,), method="gibbs", travel_time=(0.5, 1.0))
