"""Exact HMC on the plane: feasibility of every draw, stationarity against exact draws from an independent dense
numpy oracle, one free dimension against scipy.stats.truncnorm, diagnostics, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

import hardeq
from hardeq.bounds import HMCResult, exact_hmc
from hardeq.bounds.hmc import ChainStuck
from hardeq.testing.exactness import assert_exact_per_row

COVARIANCES = ("diagonal", "full", "lowrank", "blockdiag")
CONSTRAINTS = ("dense", "sum", "sparse")
DTYPES = (torch.float32, torch.float64)


def _problem(cov_kind: str, con_kind: str, n: int, dtype: torch.dtype, seed: int, scale_ratio: float = 1.0):
    """A ConstrainedNormal with its dense float64 parameters (loc, Sigma, A, k) as numpy arrays.

    Standard deviations span ``scale_ratio`` (log-uniform); the sum and sparse constraints have two rows."""
    rng = np.random.default_rng(seed)
    sd = np.exp(rng.uniform(0.0, math.log(scale_ratio), n)) if scale_ratio > 1 else rng.uniform(0.6, 1.4, n)
    loc = rng.standard_normal(n) * sd
    if con_kind == "sum":
        index = np.concatenate([[0, 1], rng.integers(0, 2, n - 2)])
        A = np.stack([(index == g).astype(float) for g in range(2)])
    elif con_kind == "sparse":
        A = np.zeros((2, n))
        A[0, : n // 2 + 1] = rng.choice([-1.0, 1.0, 2.0], n // 2 + 1)
        A[1, n // 2 - 1:] = rng.choice([-1.0, 1.0, 0.5], n - n // 2 + 1)
    else:
        A = rng.standard_normal((2, n))
    k = A @ (loc + rng.standard_normal(n) * sd)
    t = lambda a: torch.tensor(a, dtype=dtype)  # noqa: E731
    if cov_kind == "diagonal":
        Sigma = np.diag(sd**2)
        covariance = hardeq.DiagonalCovariance(t(sd))
    elif cov_kind == "full":
        X = rng.standard_normal((n, n)) / math.sqrt(n)
        C = X @ X.T + 0.5 * np.eye(n)
        Sigma = sd[:, None] * C * sd[None, :]
        covariance = hardeq.FullCovariance(t(np.linalg.cholesky(Sigma)))
    elif cov_kind == "lowrank":
        W = 0.7 * rng.standard_normal((n, 2)) * sd[:, None]
        s = 0.7 * sd
        Sigma = W @ W.T + np.diag(s**2)
        covariance = hardeq.LowRankCovariance(t(W), t(s))
    else:
        groups = np.sort(np.concatenate([[0, 1], rng.integers(0, 2, n - 2)]))
        W = 0.7 * rng.standard_normal((n, 1)) * sd[:, None]
        s = 0.7 * sd
        mask = groups[:, None] == groups[None, :]
        Sigma = (W @ W.T) * mask + np.diag(s**2)
        covariance = hardeq.BlockDiagonalCovariance(torch.tensor(groups), t(W), t(s))
    if con_kind == "sum":
        constraint = hardeq.SumConstraint(torch.tensor(index), t(k))
    elif con_kind == "sparse":
        constraint = hardeq.SparseConstraint(t(A).to_sparse_csr(), t(k))
    else:
        constraint = hardeq.LinearConstraint(t(A), t(k))
    dist = hardeq.ConstrainedNormal(t(loc), covariance=covariance, constraint=constraint)
    return dist, loc, Sigma, A, k


def _conditional(loc, Sigma, A, k):
    """Dense float64 numpy conditional mean and covariance (the oracle: no hardeq code)."""
    S = A @ Sigma @ A.T
    K = np.linalg.solve(S, A @ Sigma).T
    mean = loc + K @ (k - A @ loc)
    cov = Sigma - K @ A @ Sigma
    return mean, (cov + cov.T) / 2


def _rejection(mean, cov, lower, upper, count, rng):
    """``count`` exact draws of N(mean, cov) (singular) restricted to [lower, upper], by naive rejection."""
    vals, vecs = np.linalg.eigh(cov)
    root = vecs * np.sqrt(np.where(vals > 1e-12 * vals.max(), vals, 0.0))  # the a null directions: exactly 0
    # a coordinate the constraint determines is set to its value exactly: its round-off noise (row of ``root`` of
    # size 1e-17, not 0) would otherwise decide acceptance against a bound at that value, selecting on the noise
    pinned = np.diag(cov) <= 1e-12 * np.diag(cov).max()
    out, have = [], 0
    while have < count:
        z = mean + rng.standard_normal((4 * count, len(mean))) @ root.T
        z[:, pinned] = mean[pinned]
        z = z[((z >= lower) & (z <= upper)).all(-1)]
        out.append(z)
        have += len(z)
    return np.concatenate(out)[:count]


def _box(mean, cov, rng, touching: bool = True):
    """A box around the conditional mean: some bounds at the mean itself, some a fraction of a standard deviation
    away, some infinite (acceptance of a few percent to tens of percent for n <= 6)."""
    n = len(mean)
    sd = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    lower = mean - rng.uniform(0.0, 1.5, n) * sd
    upper = mean + rng.uniform(0.2, 1.5, n) * sd
    if touching:
        lower[0] = mean[0]
    upper[-1] = np.inf
    lower[1] = -np.inf
    return lower, upper


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("con_kind", CONSTRAINTS)
@pytest.mark.parametrize("cov_kind", COVARIANCES)
def test_every_draw_is_feasible_at_scale_ratio_1e6_with_bounds_touching_the_mean(cov_kind, con_kind, dtype):
    n = 8
    dist, *_ = _problem(cov_kind, con_kind, n, dtype, seed=10, scale_ratio=1e6)
    mean = dist.mean
    sd = dist.stddev
    # coordinate 0 bounded below at the mean, 1 above (the mean, the start, is on two walls: an edge), the others
    # within [mean - 0.3 sd, mean + sd] (the box is tight: most trajectories bounce); 7 is unbounded above
    i = torch.arange(n)
    lower = torch.where(i == 0, mean, mean - 0.3 * sd)
    upper = torch.where(i == 1, mean, torch.where(i == n - 1, torch.full_like(mean, math.inf), mean + sd))
    start = mean.expand(16, n).clone()
    res = exact_hmc(dist, lower, upper, start, num_samples=10, burn_in=5,
                    generator=torch.Generator().manual_seed(0))
    z = res.samples
    assert z.shape == (10, 16, n) and z.dtype == dtype
    assert bool(((z >= lower) & (z <= upper)).all()), "a draw left the box"
    assert_exact_per_row(dist.constraint, z.reshape(-1, n))
    assert res.bounces > 0
    # the chains move: every coordinate with variance on the plane takes more than one value
    moving = dist.variance > 0
    assert bool((z.reshape(-1, n).std(0)[moving] > 0).all())


def _two_sample_pvalues(x: np.ndarray, y: np.ndarray) -> list[float]:
    """KS p-values of each marginal and of each pairwise product of the columns of two samples."""
    n = x.shape[1]
    p = [stats.ks_2samp(x[:, i], y[:, i]).pvalue for i in range(n)]
    for i in range(n):
        for j in range(i, n):
            p.append(stats.ks_2samp(x[:, i] * x[:, j], y[:, i] * y[:, j]).pvalue)
    return p


def _stationarity(cov_kind, con_kind, dtype, chains, iterations, seed):
    n = 5
    dist, loc, Sigma, A, k = _problem(cov_kind, con_kind, n, dtype, seed=seed)
    mean, cov = _conditional(loc, Sigma, A, k)
    rng = np.random.default_rng(seed + 1)
    lower, upper = _box(mean, cov, rng)
    start = _rejection(mean, cov, lower, upper, chains, rng)
    fresh = _rejection(mean, cov, lower, upper, chains, rng)
    t = lambda a: torch.tensor(a, dtype=dtype)  # noqa: E731
    lo, hi = t(lower), t(upper)
    z0 = torch.maximum(torch.minimum(t(start), hi), lo)  # float32 rounding of an exact draw may leave the box
    res = exact_hmc(dist, lo, hi, z0, num_samples=1, burn_in=iterations - 1,
                    generator=torch.Generator().manual_seed(seed))
    z = res.samples[0].double().numpy()
    assert res.bounces > 0.2 * chains * iterations, "too few bounces for the box to matter"
    # the reference rounded to the working dtype (a coordinate the constraint determines is one float32 value)
    return _two_sample_pvalues(z, t(fresh).double().numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("con_kind", CONSTRAINTS)
@pytest.mark.parametrize("cov_kind", COVARIANCES)
def test_hmc_leaves_the_exact_law_unchanged(cov_kind, con_kind, dtype):
    """Chains started from exact draws (numpy rejection from the dense conditional) stay exact after HMC
    iterations: two-sample KS tests of the 5 marginals and 15 pairwise products against fresh exact draws,
    Bonferroni over the 20 tests at family level 1e-3 (fixed seeds; the test is deterministic)."""
    p = _stationarity(cov_kind, con_kind, dtype, chains=1500, iterations=2, seed=20)
    assert min(p) > 1e-3 / len(p), min(p)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("con_kind", CONSTRAINTS)
@pytest.mark.parametrize("cov_kind", COVARIANCES)
def test_hmc_leaves_the_exact_law_unchanged_long(cov_kind, con_kind, dtype, seed):
    p = _stationarity(cov_kind, con_kind, dtype, chains=20000, iterations=5, seed=100 * seed)
    assert min(p) > 1e-3 / len(p), min(p)


def test_stationarity_test_has_power():
    """The stationarity check above fails for a sampler that leaves the law: the same chains moved by HMC of a
    different law (loc shifted by one standard deviation) are rejected."""
    n, dtype = 5, torch.float64
    dist, loc, Sigma, A, k = _problem("diagonal", "dense", n, dtype, seed=20)
    mean, cov = _conditional(loc, Sigma, A, k)
    rng = np.random.default_rng(21)
    lower, upper = _box(mean, cov, rng)
    start = _rejection(mean, cov, lower, upper, 1500, rng)
    fresh = _rejection(mean, cov, lower, upper, 1500, rng)
    shift = torch.tensor(np.sqrt(np.diag(Sigma)))
    wrong = hardeq.ConstrainedNormal(dist.loc + shift, covariance=dist.covariance, constraint=dist.constraint)
    res = exact_hmc(wrong, torch.tensor(lower), torch.tensor(upper), torch.tensor(start), num_samples=1, burn_in=1,
                    generator=torch.Generator().manual_seed(20))
    p = _two_sample_pvalues(res.samples[0].numpy(), fresh)
    assert min(p) < 1e-3 / len(p)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
def test_one_free_dimension_against_scipy_truncnorm(dtype):
    """z1 + z2 = k with a diagonal covariance: the plane is a line, z1 ~ N(m, s^2) truncated to the interval both
    boxes allow. 3000 chains from one feasible point, 30 burn-in iterations, the last draw of each: KS against
    scipy.stats.truncnorm at level 1e-3."""
    loc = torch.tensor([0.3, -0.2], dtype=dtype)
    scale = torch.tensor([1.0, 2.0], dtype=dtype)
    con = hardeq.LinearConstraint(torch.ones(1, 2, dtype=dtype), torch.tensor([1.0], dtype=dtype))
    dist = hardeq.ConstrainedNormal(loc, scale, constraint=con)
    lower = torch.tensor([0.0, -0.5], dtype=dtype)
    upper = torch.tensor([2.0, 0.9], dtype=dtype)
    # z1 in [0, 2] and z2 = 1 - z1 in [-0.5, 0.9]  =>  z1 in [0.1, 1.5]
    a_, b_ = 0.1, 1.5
    v1, v2 = 1.0, 4.0
    m = 0.3 + v1 / (v1 + v2) * (1.0 - 0.1)
    s = math.sqrt(v1 - v1**2 / (v1 + v2))
    start = torch.tensor([[1.0, 0.0]], dtype=dtype).expand(3000, 2).contiguous()
    res = exact_hmc(dist, lower, upper, start, num_samples=1, burn_in=30, generator=torch.Generator().manual_seed(3))
    z1 = res.samples[0, :, 0].double().numpy()
    ref = stats.truncnorm((a_ - m) / s, (b_ - m) / s, loc=m, scale=s)
    assert stats.kstest(z1, ref.cdf).pvalue > 1e-3
    assert bool((res.samples.sum(-1) == res.samples.sum(-1)).all())
    assert_exact_per_row(con, res.samples[0])


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_one_free_dimension_against_scipy_truncnorm_many_seeds(seed):
    dtype = torch.float64
    rng = np.random.default_rng(seed)
    v = rng.uniform(0.5, 2.0, 2) ** 2
    loc = torch.tensor(rng.standard_normal(2))
    con = hardeq.LinearConstraint(torch.tensor([[1.0, 1.0]], dtype=dtype), torch.tensor([0.5], dtype=dtype))
    dist = hardeq.ConstrainedNormal(loc, torch.tensor(np.sqrt(v)), constraint=con)
    m = loc[0].item() + v[0] / v.sum() * (0.5 - loc.sum().item())
    s = math.sqrt(v[0] - v[0] ** 2 / v.sum())
    a_, b_ = m + rng.uniform(-2.0, 0.5) * s, None
    b_ = a_ + rng.uniform(0.2, 3.0) * s
    lower = torch.tensor([a_, -math.inf], dtype=dtype)
    upper = torch.tensor([b_, math.inf], dtype=dtype)
    mid = (a_ + b_) / 2
    start = torch.tensor([[mid, 0.5 - mid]], dtype=dtype).expand(20000, 2).contiguous()
    res = exact_hmc(dist, lower, upper, start, num_samples=1, burn_in=30,
                    generator=torch.Generator().manual_seed(seed))
    ref = stats.truncnorm((a_ - m) / s, (b_ - m) / s, loc=m, scale=s)
    assert stats.kstest(res.samples[0, :, 0].numpy(), ref.cdf).pvalue > 1e-3


def test_batch_and_diagnostics_and_result():
    """A batch of two laws at once (different boxes); ESS and R-hat have the batch shape, the chains mix."""
    dtype = torch.float64
    n = 6
    loc = torch.randn(2, n, generator=torch.Generator().manual_seed(0), dtype=dtype)
    con = hardeq.SumConstraint(torch.zeros(n, dtype=torch.long), torch.tensor([[1.0], [2.0]], dtype=dtype))
    dist = hardeq.ConstrainedNormal(loc, 1.0, constraint=con)
    lower = torch.tensor([[0.0], [-1.0]], dtype=dtype)
    upper = torch.tensor([[1.0], [math.inf]], dtype=dtype)
    start = torch.tensor([1.0 / n, 2.0 / n], dtype=dtype)[:, None].expand(4, 2, n).contiguous()
    res = exact_hmc(dist, lower, upper, start, num_samples=60, burn_in=10, thin=1,
                    generator=torch.Generator().manual_seed(1))
    assert isinstance(res, HMCResult) and res.method == "hmc"
    assert res.samples.shape == (60, 4, 2, n)
    assert res.ess.shape == res.rhat.shape == (2, n)
    assert res.trajectories == 4 * 2 * (10 + 60)
    assert bool((res.rhat < 1.1).all()) and bool((res.ess > 60).all())
    assert bool(((res.samples >= lower) & (res.samples <= upper)).all())
    assert_exact_per_row(con, res.samples)
    # reproducible with the generator
    again = exact_hmc(dist, lower, upper, start, num_samples=60, burn_in=10, thin=1,
                      generator=torch.Generator().manual_seed(1))
    assert torch.equal(res.samples, again.samples)


def test_long_run_matches_rejection_moments():
    """Chains from one feasible point (not from the law) converge: the mean of a long run matches rejection draws
    of the dense oracle within the Monte Carlo error implied by the run's own ESS."""
    dtype = torch.float64
    dist, loc, Sigma, A, k = _problem("full", "dense", 5, dtype, seed=7)
    mean, cov = _conditional(loc, Sigma, A, k)
    rng = np.random.default_rng(8)
    lower, upper = _box(mean, cov, rng)
    exact = _rejection(mean, cov, lower, upper, 40000, rng)
    start = torch.tensor(exact[:1]).expand(8, 5).contiguous()
    res = exact_hmc(dist, torch.tensor(lower), torch.tensor(upper), start, num_samples=250, burn_in=20,
                    generator=torch.Generator().manual_seed(9))
    z = res.samples.reshape(-1, 5).numpy()
    se = np.sqrt(exact.var(0) / res.ess.numpy() + exact.var(0) / len(exact))
    assert np.all(np.abs(z.mean(0) - exact.mean(0)) < 4.5 * se), (z.mean(0), exact.mean(0), se)


def test_pinned_coordinate_and_unbounded_coordinates():
    """A coordinate the constraint determines never moves; an unbounded problem is plain exact sampling."""
    dtype = torch.float64
    A = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]], dtype=dtype)
    con = hardeq.LinearConstraint(A, torch.tensor([0.5, 1.0], dtype=dtype))
    dist = hardeq.ConstrainedNormal(torch.zeros(3, dtype=dtype), 1.0, constraint=con)
    start = torch.tensor([[0.5, 0.5, 0.5]], dtype=dtype).expand(4, 3).contiguous()
    res = exact_hmc(dist, torch.tensor([0.0, 0.0, -math.inf], dtype=dtype), None, start, num_samples=50,
                    burn_in=0, generator=torch.Generator().manual_seed(0))
    assert bool((res.samples[..., 0] == 0.5).all())
    assert res.ess[0].item() == 200 and res.rhat[0].item() == 1.0
    assert bool((res.samples[..., 1] >= 0).all())
    free = exact_hmc(dist, None, None, start, num_samples=10, burn_in=0, generator=torch.Generator().manual_seed(0))
    assert free.bounces == 0


def test_errors():
    dtype = torch.float64
    con = hardeq.SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([1.0], dtype=dtype))
    dist = hardeq.ConstrainedNormal(torch.zeros(3, dtype=dtype), 1.0, constraint=con)
    ok = torch.full((2, 3), 1 / 3, dtype=dtype)
    run = lambda **kw: exact_hmc(**{**dict(dist=dist, lower=0.0, upper=1.0, start=ok, num_samples=2,  # noqa: E731
                                           burn_in=0), **kw})
    with pytest.raises(TypeError, match="dist must be a hardeq.ConstrainedNormal"):
        run(dist="x")
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        run(num_samples=0)
    with pytest.raises(TypeError, match="thin must be an int"):
        run(thin=1.5)
    with pytest.raises(ValueError, match="travel_time must satisfy"):
        run(travel_time=(1.0, 0.5))
    with pytest.raises(ValueError, match="lower must be <= upper"):
        run(lower=torch.tensor([0.0, 2.0, 0.0], dtype=dtype))
    with pytest.raises(ValueError, match=r"upper must broadcast to batch_shape \+ \(n,\)"):
        run(upper=torch.ones(2, dtype=dtype))
    with pytest.raises(ValueError, match=r"start must have shape \(chains, \*batch_shape, n\)"):
        run(start=ok[0])
    with pytest.raises(ValueError, match="start must lie in the box.*1 entries are outside"):
        run(start=torch.tensor([[1 / 3, 1 / 3, 1 / 3], [-0.5, 0.75, 0.75]], dtype=dtype))
    with pytest.raises(ValueError, match="start must lie on the plane"):
        run(start=torch.full((2, 3), 0.5, dtype=dtype))
    with pytest.raises(ValueError, match="lower contains nan"):
        run(lower=math.nan)
    with pytest.raises(TypeError, match="max_bounces must be an int"):
        run(max_bounces=1.5)
    # a trajectory reaching max_bounces is rejected (not an error): the chain stays, a warning names the fraction
    # (allow_stuck: a chain every trajectory of which was capped would return copies of its start; by default that
    # is a ChainStuck error naming the thin direction, tests/bounds/test_gibbs_augmented.py)
    narrow = dict(lower=torch.tensor([0.3, 0.3, 0.3], dtype=dtype), upper=torch.tensor([0.4, 0.4, 0.4], dtype=dtype),
                  max_bounces=1)
    with pytest.warns(RuntimeWarning, match=r"reached max_bounces = 1 and were rejected"):
        res = run(**narrow, allow_stuck=True)
    assert res.capped > 0 and res.capped <= res.trajectories
    with pytest.raises(ChainStuck, match="never moved"):
        run(**narrow, burn_in=3)


def test_few_draws_give_nan_diagnostics_and_float64_bounds_round_inward():
    dtype = torch.float32
    con = hardeq.SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([1.0], dtype=dtype))
    dist = hardeq.ConstrainedNormal(torch.zeros(3, dtype=dtype), 1.0, constraint=con)
    lower = torch.tensor(0.1, dtype=torch.float64)  # 0.1 is not a float32: the float32 bound must not be below it
    start = torch.full((64, 3), 1 / 3, dtype=dtype)
    res = exact_hmc(dist, lower, 1.0, start, num_samples=2, burn_in=3, generator=torch.Generator().manual_seed(0))
    assert bool(torch.isnan(res.ess).all() and torch.isnan(res.rhat).all())
    assert bool((res.samples.double() >= 0.1).all())


def test_host_reads_one_per_bounce_event_and_one_per_iteration():
    """Each event of the trajectories (a step to the next wall) reads the host once, whatever it finds (a bounce
    left, a capped trajectory, a chain in a corner); each iteration once more (bounces, capped, finiteness); the
    rest is a constant (the start's checks, the diagnostics). Before: three per event and four per iteration.
    Counted under the GPU profile (a CPU's checked conditioner also reads, for free, in each draw's conditioning)."""
    profile = "gpu"
    from hardeq.linalg.device import forced
    from hardeq.testing import count_calls

    g = torch.Generator().manual_seed(3)
    n, a = 20, 3
    A = torch.rand(a, n, generator=g, dtype=torch.float64)
    loc = torch.rand(4, n, generator=g, dtype=torch.float64)
    with forced(profile):
        d = hardeq.ConstrainedNormal(loc, 0.4, constraint=hardeq.LinearConstraint(A, 0.5 * A.sum(-1)),
                                     validate_args=False)
        lo, hi = torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
        start = d.truncate(lo, hi).mode.expand(3, 4, n)
        iterations = 6
        with count_calls() as count:
            res = exact_hmc(d, lo, hi, start, num_samples=iterations, burn_in=0,
                            generator=torch.Generator().manual_seed(0))
    assert res.bounces > 0
    assert count.host_reads <= res.steps + iterations + 12, (count.host_reads, res.steps)
