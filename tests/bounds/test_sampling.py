"""Sampling the truncated law: rejection against independent oracles (scipy.stats.truncnorm on a line, a naive
numpy rejection sampler on small planes), feasibility of every draw, and the sampler choice (HMC via a stand-in
for hardeq.bounds.hmc where that module is absent)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from scipy import stats

import hardeq
from hardeq.bounds import RejectionBudgetExceeded, TruncatedSamples

from .cases import CONSTRAINTS, COVARIANCES, DTYPES, dense_picture, make_case, numpy_rejection, rows_ok


def _line_case(dtype, seed, offset):
    """n = 3, a = 2 (a line), box [0, 1]^3 with the mean pushed ``offset`` off-centre."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(2, 3, generator=g, dtype=torch.float64)
    inner = torch.full((3,), 0.5, dtype=torch.float64)
    k = A @ inner
    loc = inner + offset * torch.randn(3, generator=g, dtype=torch.float64)
    scale = 0.3 * torch.exp(0.3 * torch.randn(3, generator=g, dtype=torch.float64))
    return hardeq.ConstrainedNormal(loc.to(dtype), scale.to(dtype),
                                    constraint=hardeq.LinearConstraint(A.to(dtype), k.to(dtype)))


def _line_oracle(dist, lower, upper):
    """Independent picture of a one-free-dimension plane: numpy SVD null vector d, the conditional mean and
    variance along d from dense formulas, and the interval of s (z = mu_bar + s d) in the box."""
    mu, Sigma, A, k = (x[0] for x in dense_picture(dist))
    d = np.linalg.svd(A)[2][-1]
    S = A @ Sigma @ A.T
    mu_bar = mu + Sigma @ A.T @ np.linalg.solve(S, k - A @ mu)
    var_s = 1.0 / (d @ np.linalg.solve(Sigma, d))
    lo, hi = lower.double().numpy(), upper.double().numpy()
    t1, t2 = (lo - mu_bar) / d, (hi - mu_bar) / d
    s_lo, s_hi = np.max(np.minimum(t1, t2)), np.min(np.maximum(t1, t2))
    return mu_bar, d, np.sqrt(var_s), s_lo, s_hi


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_free_dimension_marginal_matches_truncnorm(dtype):
    """KS of s = d.(z - mu_bar) against scipy's truncnorm over 4 seeds, Bonferroni at 0.01 overall."""
    pvals = []
    for seed in range(4):
        dist = _line_case(dtype, seed, offset=0.8)
        lower, upper = torch.zeros(3, dtype=dtype), torch.ones(3, dtype=dtype)
        torch.manual_seed(100 + seed)
        z = dist.truncate(lower, upper).sample((1500,), method="rejection")
        mu_bar, d, sd, s_lo, s_hi = _line_oracle(dist, lower, upper)
        s = (z.double().numpy() - mu_bar) @ d
        pvals.append(stats.kstest(s, stats.truncnorm(s_lo / sd, s_hi / sd, loc=0.0, scale=sd).cdf).pvalue)
    assert min(pvals) > 0.01 / len(pvals), pvals


def _compare_with_numpy_oracle(cov, con, num, seed):
    """Two-sample KS of every marginal and every pairwise product against a naive numpy rejection sampler that
    shares no code (dense conditional formulas, eigh square root); Bonferroni over all tests at 0.002 overall."""
    dtype = torch.float64
    dist, lower, upper = make_case(cov, con, dtype, seed=seed, batch=(1,), mean_offset=0.3)
    torch.manual_seed(seed)
    trunc = dist.truncate(lower, upper)
    res = trunc.sample_with_info((num,), method="rejection")
    assert res.method == "rejection" and res.rhat is None
    assert res.acceptance.shape == (1,) and 0 < float(res.acceptance[0]) <= 1
    z = res.samples[:, 0].numpy()
    mu, Sigma, A, k = (x[0] for x in dense_picture(dist))
    ref = numpy_rejection(mu, Sigma, A, k, lower.numpy(), upper.numpy(), num, np.random.default_rng(seed + 1))
    n = z.shape[1]
    feats = [(z[:, i], ref[:, i]) for i in range(n)]
    feats += [(z[:, i] * z[:, j], ref[:, i] * ref[:, j]) for i in range(n) for j in range(i + 1, n)]
    p = min(stats.ks_2samp(x, y).pvalue for x, y in feats)
    assert p > 0.002 / len(feats), p


@pytest.mark.parametrize("cov,con", [("diag", "sum"), ("full", "dense"), ("lowrank", "sparse"), ("block", "dense")])
def test_rejection_matches_numpy_oracle(cov, con):
    _compare_with_numpy_oracle(cov, con, 800, seed=13)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [13, 18])
@pytest.mark.parametrize("con", CONSTRAINTS)
@pytest.mark.parametrize("cov", COVARIANCES)
def test_rejection_matches_numpy_oracle_long(cov, con, seed):
    _compare_with_numpy_oracle(cov, con, 6000, seed=seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("con", CONSTRAINTS)
@pytest.mark.parametrize("cov", COVARIANCES)
def test_every_rejection_draw_feasible(cov, con, dtype):
    """Every draw in the box exactly and on the plane to the per-row tolerance, float32 and float64."""
    dist, lower, upper = make_case(cov, con, dtype, seed=2, mean_offset=0.3)
    z = dist.truncate(lower, upper).sample((100,), method="rejection")
    assert z.dtype == dtype and z.shape == (100,) + dist.batch_shape + dist.event_shape
    assert bool((z >= lower).all()) and bool((z <= upper).all())
    assert bool(rows_ok(dist, z).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("con", ["dense", "sum"])
def test_feasible_at_scale_ratio_1e6_with_bounds_touching_the_mean(con, dtype):
    """Scales over six decades (1e-3 .. 1e3), loc on the lower faces (0), box [0, 1]: every draw in the box exactly
    and on the plane to the per-row tolerance, by rejection and at the mode."""
    n = 6
    scale = torch.logspace(-3, 3, n, dtype=torch.float64)
    index = torch.arange(n) % 2  # each row holds small and large scales
    if con == "sum":
        A = torch.nn.functional.one_hot(index, 2).T.to(torch.float64)
        inner = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.5], dtype=torch.float64)
        constraint = hardeq.SumConstraint(index, (A @ inner).to(dtype))
    else:
        g = torch.Generator().manual_seed(0)
        A = torch.nn.functional.one_hot(index, 2).T.to(torch.float64) * (0.5 + torch.rand(2, n, generator=g,
                                                                                         dtype=torch.float64))
        inner = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5, 0.5], dtype=torch.float64)
        constraint = hardeq.LinearConstraint(A.to(dtype), (A @ inner).to(dtype))
    d2 = hardeq.ConstrainedNormal(torch.zeros(2, n, dtype=dtype), scale.to(dtype).expand(2, n), constraint=constraint)
    lower, upper = torch.zeros(n, dtype=dtype), torch.ones(n, dtype=dtype)
    t = d2.truncate(lower, upper)
    res = t.sample_with_info((60,), method="rejection")
    for z in (res.samples, t.mode):
        assert bool((z >= lower).all()) and bool((z <= upper).all())
        assert bool(rows_ok(d2, z).all())
    assert bool((res.acceptance > 0).all())


def test_rejection_budget_error():
    """A box holding almost no mass: rejection stops at its budget and says so (with the acceptance)."""
    d = hardeq.ConstrainedNormal(torch.zeros(3, dtype=torch.float64), 1.0,
                                 constraint=hardeq.SumConstraint(torch.zeros(3, dtype=torch.long),
                                                                 torch.tensor([12.0], dtype=torch.float64)))
    t = d.truncate(3.98, 4.03)
    with pytest.raises(RejectionBudgetExceeded, match="measured acceptance .* Use method='hmc'"):
        t.sample((5,), method="rejection", max_draws=500)


def test_sample_api_and_reproducibility():
    dist, lower, upper = make_case("diag", "sum", torch.float64, seed=0, batch=(3,), mean_offset=0.2)
    t = dist.truncate(lower, upper)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a = t.sample((4, 5), method="rejection", generator=g1)
    b = t.sample((4, 5), method="rejection", generator=g2)
    assert a.shape == (4, 5, 3, 6)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert t.sample((), method="rejection").shape == (3, 6)
    with pytest.raises(ValueError, match="method must be one of"):
        t.sample((2,), method="slice")
    assert isinstance(t.sample_with_info((2,), method="rejection"), TruncatedSamples)
    assert "TruncatedConstrainedNormal(n=6, batch_shape=(3,), lower=0" in repr(t)
    e = t.expand((2, 3))
    assert e.batch_shape == (2, 3) and e.sample((2,), method="rejection").shape == (2, 2, 3, 6)
    assert bool(t.support.check(a).all())
    assert not bool(t.support.check(a + 0.5).all())


def test_half_precision_base():
    loc = torch.full((4,), 0.25, dtype=torch.bfloat16)
    d = hardeq.ConstrainedNormal(loc, 0.3, constraint=hardeq.SumConstraint(torch.zeros(4, dtype=torch.long),
                                                                           torch.ones(1, dtype=torch.bfloat16)))
    t = d.truncate(0.0, 1.0)
    z = t.sample((50,), method="rejection")
    assert z.dtype == torch.bfloat16 and bool((z >= 0).all()) and bool((z <= 1).all())
    assert t.mode.dtype == torch.bfloat16


# ---------------------------------------------------------------------- the HMC path, through a stand-in
class _StandInResult:
    def __init__(self, samples, ess, rhat):
        self.samples, self.ess, self.rhat, self.method, self.bounces = samples, ess, rhat, "hmc", None


@pytest.fixture
def hmc_stand_in(monkeypatch):
    """A stand-in ``hardeq.bounds.hmc.exact_hmc`` with the agreed interface that records its arguments and returns
    exact draws (rejection), so the wiring is tested independently of the real sampler."""
    calls = {}

    def exact_hmc(dist, lower, upper, start, *, num_samples, burn_in=100, thin=1, travel_time=(0.39, 1.57),
                  generator=None):
        from hardeq.bounds import rejection_sample

        calls.update(dist=dist, lower=lower, upper=upper, start=start, num_samples=num_samples, burn_in=burn_in,
                     thin=thin, travel_time=travel_time)
        chains = start.shape[0]
        z, _ = rejection_sample(dist, lower, upper, num_samples * chains, generator=generator)
        z = z.reshape((num_samples, chains) + z.shape[1:])
        ess = torch.full(z.shape[2:], float(num_samples * chains))
        return _StandInResult(z, ess, torch.ones(z.shape[2:]))

    module = types.ModuleType("hardeq.bounds.hmc")
    module.exact_hmc = exact_hmc
    monkeypatch.setitem(sys.modules, "hardeq.bounds.hmc", module)
    return calls


def test_hmc_path_wiring(hmc_stand_in):
    dist, lower, upper = make_case("full", "dense", torch.float32, seed=1, batch=(2,))
    t = dist.truncate(lower, upper)
    res = t.sample_with_info((3, 4), method="hmc", burn_in=7, thin=2, travel_time=(0.5, 1.0))
    assert res.method == "hmc" and res.acceptance is None
    assert res.samples.shape == (3, 4, 2, 6) and res.samples.dtype == torch.float32
    assert res.ess.shape == (2, 6) and res.rhat.shape == (2, 6)
    calls = hmc_stand_in
    assert calls["start"].shape == (12, 2, 6)  # chains = prod(sample_shape)
    # started at a point of the polytope built without a host read (rows share coordinates: dual_start on the box
    # shrunk by the volume check's margin), certified, so strictly inside the box and on the plane
    start = calls["start"][0]
    assert bool(((start > lower) & (start < upper)).all())
    assert bool(dist.constraint.check(start).all())
    assert (calls["num_samples"], calls["burn_in"], calls["thin"], calls["travel_time"]) == (1, 7, 2, (0.5, 1.0))
    res = t.sample_with_info((10,), method="hmc", chains=4)
    assert hmc_stand_in["num_samples"] == 3 and res.samples.shape == (10, 2, 6)
    assert bool((res.samples >= lower).all()) and bool((res.samples <= upper).all())


def test_auto_picks_by_pilot_acceptance(hmc_stand_in):
    # wide box: acceptance ~ 1 -> rejection
    dist, _, _ = make_case("diag", "sum", torch.float64, seed=0)
    t = dist.truncate(-50.0, 50.0)
    assert t.sample_with_info((5,)).method == "rejection"
    # narrow box far in the tail: acceptance < 0.1 -> gibbs (diagonal covariance), hmc for a full one
    d = hardeq.ConstrainedNormal(torch.zeros(4, dtype=torch.float64), 1.0,
                                 constraint=hardeq.SumConstraint(torch.zeros(4, dtype=torch.long),
                                                                 torch.tensor([4.0], dtype=torch.float64)))
    t = d.truncate(0.8, 1.5)
    assert float(t.acceptance) < 0.1
    assert t.sample_with_info((5,)).method == "gibbs"
    assert t.sample_with_info((5,), threshold=0.0).method == "rejection"
    full = hardeq.ConstrainedNormal(torch.zeros(4, dtype=torch.float64), scale_tril=torch.eye(4, dtype=torch.float64),
                                    constraint=d.constraint).truncate(0.8, 1.5)
    assert full.sample_with_info((5,)).method == "gibbs"  # through the augmentation Sigma = D + V V^T
    # where Gibbs does not apply (a dense A of more than 64 rows): HMC
    A = torch.cat([torch.ones(1, 70, dtype=torch.float64), torch.eye(70, dtype=torch.float64)[:65]])
    many = hardeq.ConstrainedNormal(torch.zeros(70, dtype=torch.float64), 1.0, constraint=hardeq.LinearConstraint(
        A, torch.cat([torch.tensor([1.0], dtype=torch.float64), torch.full((65,), 0.0, dtype=torch.float64)])))
    assert many.truncate(-0.5, 0.5).sample_with_info((2,), threshold=1.01).method == "hmc"


# ---------------------------------------------------------------------- the real HMC sampler through the class
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cov,con", [("diag", "sum"), ("full", "dense"), ("lowrank", "sparse"), ("block", "sum")])
def test_hmc_draws_feasible_and_named(cov, con, dtype):
    dist, lower, upper = make_case(cov, con, dtype, seed=2)
    res = dist.truncate(lower, upper).sample_with_info((64,), method="hmc", burn_in=20,
                                                       generator=torch.Generator().manual_seed(0))
    assert res.method == "hmc" and res.samples.shape == (64,) + dist.batch_shape + dist.event_shape
    assert res.samples.dtype == dtype and res.ess.shape == dist.batch_shape + dist.event_shape
    z = res.samples
    assert bool((z >= lower).all()) and bool((z <= upper).all())
    assert bool(rows_ok(dist, z).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hmc_feasible_at_scale_ratio_1e6_mean_on_faces(dtype):
    n = 6
    scale = torch.logspace(-3, 3, n, dtype=dtype)
    index = torch.arange(n) % 2
    constraint = hardeq.SumConstraint(index, torch.tensor([0.5, 0.5], dtype=dtype))
    d = hardeq.ConstrainedNormal(torch.zeros(2, n, dtype=dtype), scale.expand(2, n), constraint=constraint)
    res = d.truncate(0.0, 1.0).sample_with_info((32,), method="hmc", burn_in=20,
                                                generator=torch.Generator().manual_seed(1))
    assert bool((res.samples >= 0).all()) and bool((res.samples <= 1).all())
    assert bool(rows_ok(d, res.samples).all())


def test_hmc_agrees_with_rejection():
    """The real HMC through sample_with_info against exact rejection draws: two-sample KS of each marginal
    (HMC draws from 300 chains after a burn-in of 40, one draw per chain), Bonferroni at 0.002 overall."""
    dist, lower, upper = make_case("lowrank", "dense", torch.float64, seed=13, batch=(1,), mean_offset=0.3)
    t = dist.truncate(lower, upper)
    torch.manual_seed(0)
    ref = t.sample((300,), method="rejection")[:, 0].numpy()
    z = t.sample((300,), method="hmc", burn_in=40, generator=torch.Generator().manual_seed(2))[:, 0].numpy()
    p = min(stats.ks_2samp(z[:, i], ref[:, i]).pvalue for i in range(z.shape[1]))
    assert p > 0.002 / z.shape[1], p
