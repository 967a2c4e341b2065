"""Tests of hardeq.ConstrainedPoisson (Poissons conditioned on grouped sums) and its expected losses.

Note [Randomized statistical tests]
-----------------------------------
Statistical assertions (chi-square goodness of fit, Monte Carlo moments) run with a fixed seed, so a run is
deterministic. Each is designed to fail with probability at most ``FAILURE_RATE`` when the code is correct
(chi-square: p-value threshold; moments: Bonferroni-corrected z-intervals from ``mc_atol``). After a change
of the RNG stream (torch upgrade, different draw order), bump the seed once and say so in the commit.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hardeq.distributions.poisson import ConstrainedPoisson
from hardeq.distributions.poisson_losses import binomial_cdf, binomial_expected_l1, binomial_expected_l2

FAILURE_RATE = 1e-4  # per statistical assertion


def mc_atol(stddev: torch.Tensor, num_samples: int, failure_rate: float = FAILURE_RATE) -> torch.Tensor:
    """Two-sided z-interval half-width for a sample mean, Bonferroni over stddev.numel() checks."""
    z = scipy.stats.norm.isf(failure_rate / (2 * stddev.numel()))
    return z * stddev / num_samples**0.5 + 1e-8


# ------------------------------------------------------------------------------------------------- oracles
def compositions(total: int, n: int):
    """All non-negative integer vectors of length n summing to total."""
    for cuts in itertools.combinations(range(total + n - 1), n - 1):
        prev, out = -1, []
        for c in cuts:
            out.append(c - prev - 1)
            prev = c
        out.append(total + n - 1 - prev - 1)
        yield out


def enumerate_outcomes(totals, index, n):
    """All count vectors (numpy, (num, n)) with group sums ``totals`` for the group ids ``index``."""
    index = np.asarray(index)
    groups = [np.nonzero(index == g)[0] for g in range(len(totals))]
    per_group = [list(compositions(int(t), len(members))) for t, members in zip(totals, groups, strict=True)]
    rows = []
    for combo in itertools.product(*per_group):
        z = np.zeros(n)
        for members, part in zip(groups, combo, strict=True):
            z[members] = part
        rows.append(z)
    return np.array(rows)


def oracle_pmf(outcomes, rate, totals, index):
    """Product over groups of scipy.stats.multinomial pmfs."""
    rate, index = np.asarray(rate, dtype=float), np.asarray(index)
    out = np.ones(len(outcomes))
    for g, t in enumerate(totals):
        members = np.nonzero(index == g)[0]
        p = rate[members] / rate[members].sum()
        out *= scipy.stats.multinomial.pmf(outcomes[:, members], int(t), p)
    return out


# Single-group and grouped cases: (rate, total, index or None).
CASES = {
    "single": ([0.5, 1.0, 2.5], 4, None),
    "single-n1": ([1.7], 3, None),
    "single-k0": ([0.5, 1.0, 2.5], 0, None),
    "grouped": ([1.0, 2.0, 0.3, 4.0, 1.5, 0.8], [3, 2, 4], [0, 1, 0, 2, 1, 2]),
    "grouped-singleton": ([1.0, 2.0, 0.3, 4.0], [3, 2], [0, 0, 1, 0]),
}


def make(case, dtype=torch.float64, requires_grad=False):
    rate, total, index = CASES[case]
    rate_t = torch.tensor(rate, dtype=dtype, requires_grad=requires_grad)
    index_t = None if index is None else torch.tensor(index)
    total_t = torch.tensor(total, dtype=dtype)
    d = ConstrainedPoisson(rate_t, total_t, index=index_t)
    totals = [total] if index is None else total
    idx = [0] * len(rate) if index is None else index
    return d, rate_t, totals, idx


# ---------------------------------------------------------------------------------------------- pmf & moments
@pytest.mark.parametrize("case", list(CASES))
def test_log_prob_matches_scipy_multinomial(case):
    d, rate, totals, idx = make(case)
    outcomes = enumerate_outcomes(totals, idx, len(rate))
    expected = oracle_pmf(outcomes, rate.numpy(), totals, idx)
    actual = d.log_prob(torch.tensor(outcomes)).exp().numpy()
    np.testing.assert_allclose(actual, expected, rtol=1e-10, atol=1e-14)
    assert actual.sum() == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_moments_match_enumeration(case):
    d, rate, totals, idx = make(case)
    outcomes = enumerate_outcomes(totals, idx, len(rate))
    w = oracle_pmf(outcomes, rate.numpy(), totals, idx)[:, None]
    mean = (w * outcomes).sum(0)
    var = (w * (outcomes - mean) ** 2).sum(0)
    np.testing.assert_allclose(d.mean.numpy(), mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(d.variance.numpy(), var, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(d.stddev.numpy() ** 2, var, rtol=1e-10, atol=1e-12)
    # conditional marginals are Binomial(k_g, p_i)
    marg = d.marginal()
    assert isinstance(marg, torch.distributions.Binomial) and marg.batch_shape == (len(rate),)
    for i in range(len(rate)):
        for v in range(int(marg.total_count[i]) + 1):
            exact = w[outcomes[:, i] == v].sum()
            value = torch.zeros(len(rate), dtype=torch.float64)
            value[i] = v
            assert marg.log_prob(value)[i].exp().item() == pytest.approx(exact, rel=1e-8, abs=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_expected_losses_match_enumeration(case):
    d, rate, totals, idx = make(case)
    n = len(rate)
    outcomes = enumerate_outcomes(totals, idx, n)
    w = oracle_pmf(outcomes, rate.numpy(), totals, idx)[:, None]
    kmax = max(totals)
    # targets: every integer 0..max total, one below / above, and non-integers
    targets = [np.full(n, float(v)) for v in range(-1, kmax + 2)] + [np.linspace(-0.5, kmax + 0.7, n)]
    targets += [outcomes[len(outcomes) // 2]]  # a feasible target
    for y in targets:
        l1 = (w * np.abs(outcomes - y)).sum(0)
        l2 = (w * (outcomes - y) ** 2).sum(0)
        yt = torch.tensor(y)
        np.testing.assert_allclose(d.expected_l1(yt).numpy(), l1, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(d.expected_l2(yt).numpy(), l2, rtol=1e-10, atol=1e-12)


def test_log_prob_off_support():
    # as ConstrainedNormal.log_prob off the plane: validation on raises, validation off gives -inf (never NaN)
    d, *_ = make("grouped")
    d_nv = ConstrainedPoisson(d.rate, d.total, index=d.index, validate_args=False)
    good = torch.tensor([2.0, 1.0, 1.0, 1.0, 1.0, 3.0])
    assert torch.isfinite(d.log_prob(good))
    assert bool(d.support.check(good))
    wrong_sum = torch.tensor([2.0, 1.0, 2.0, 1.0, 1.0, 3.0])
    expected = r"value.*support.*sums are \[4\.0, 2\.0, 4\.0\].*total is \[3\.0, 2\.0, 4\.0\]"
    with pytest.raises(ValueError, match=expected):
        d.log_prob(wrong_sum)
    assert d_nv.log_prob(wrong_sum).item() == -math.inf
    assert not bool(d.support.check(wrong_sum))
    # with validation, non-integer / negative counts are rejected; without, their pmf is 0
    for bad in ([2.5, 1.0, 0.5, 1.0, 1.0, 3.0], [4.0, 1.0, -1.0, 1.0, 1.0, 3.0]):
        with pytest.raises(ValueError, match="non-negative integer"):
            d.log_prob(torch.tensor(bad))
        assert d_nv.log_prob(torch.tensor(bad)).item() == -math.inf
    # integer dtype values and batched values are accepted; a batch with one bad event names it
    batch = torch.stack([good, wrong_sum]).long()
    with pytest.raises(ValueError, match=r"at event \(1,\).*1 of 2 events"):
        d.log_prob(batch)
    lp = d_nv.log_prob(batch)
    assert lp.shape == (2,) and torch.isfinite(lp[0]) and lp[1] == -math.inf
    # single group, huge total: the sum is checked exactly in float64
    big = ConstrainedPoisson(torch.ones(3, dtype=torch.float64), torch.tensor(1e12, dtype=torch.float64))
    z = torch.tensor([4e11, 3e11, 3e11 + 1], dtype=torch.float64)
    expected = r"value.*sum equals total.*\[1000000000001\.0\].*total is \[1000000000000\.0\]"
    with pytest.raises(ValueError, match=expected):
        big.log_prob(z)
    assert torch.isfinite(big.log_prob(z - torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)))


def test_invalid_totals_and_rates_never_sample_silently():
    # a total of 3.5 cannot be met by integer counts: validation on raises at construction, off at sampling
    with pytest.raises(ValueError, match="total"):
        ConstrainedPoisson(torch.ones(3), torch.tensor(3.5))
    d = ConstrainedPoisson(torch.ones(3), torch.tensor(3.5), validate_args=False)
    with pytest.raises(ValueError, match=r"cannot sample: total.*non-negative integers.*3\.5"):
        d.sample()
    with pytest.raises(ValueError, match="cannot sample: total"):
        d.rsample((2,))
    assert d.log_prob(torch.tensor([1.0, 1.0, 2.0])).item() == -math.inf  # documented: -inf, never NaN
    for total in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="cannot sample: total"):
            ConstrainedPoisson(torch.ones(3), torch.tensor(total), validate_args=False).sample()
    with pytest.raises(ValueError, match=r"cannot sample: total.*2\*\*53"):
        ConstrainedPoisson(torch.ones(3, dtype=torch.float64), torch.tensor(2.0**54, dtype=torch.float64),
                           validate_args=False).sample()
    # a non-positive or non-finite rate: validation on raises at construction, off at sampling (no NaN counts)
    for rate in ([1.0, -2.0, 1.0], [1.0, 0.0, 1.0], [1.0, math.nan, 1.0], [1.0, math.inf, 1.0]):
        with pytest.raises(ValueError, match="rate"):
            ConstrainedPoisson(torch.tensor(rate), torch.tensor(3.0))
        with pytest.raises(ValueError, match="cannot sample: rate must be positive and finite"):
            ConstrainedPoisson(torch.tensor(rate), torch.tensor(3.0), validate_args=False).sample()


def test_float32_totals_above_2_pow_24_raise():
    # float32 holds integers exactly up to 2**24; larger totals are refused (whatever validate_args says)
    ConstrainedPoisson(torch.ones(3), torch.tensor(2**24))
    for validate in (True, False):
        with pytest.raises(ValueError, match=r"total.*2\*\*24.*torch\.float32.*got 1\.67772e\+07.*float64"):
            ConstrainedPoisson(torch.ones(3), torch.tensor(2**24 + 1), validate_args=validate)
    with pytest.raises(ValueError, match=r"total.*torch\.float32"):
        ConstrainedPoisson(torch.ones(4), torch.tensor([3.0, 1e9]), index=torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match=r"total.*2\*\*11 = 2048.*torch\.float16"):
        ConstrainedPoisson(torch.ones(3, dtype=torch.float16), torch.tensor(2049))
    z16 = ConstrainedPoisson(torch.ones(3, dtype=torch.float16), torch.tensor(2048)).sample((4,))
    assert z16.dtype == torch.float16 and bool((z16.double().sum(-1) == 2048).all())
    # the fix named in the message works
    z = ConstrainedPoisson(torch.ones(3, dtype=torch.float64), torch.tensor(2**24 + 1, dtype=torch.float64)).sample()
    assert z.sum().item() == 2**24 + 1


@pytest.mark.parametrize("total", [1e6, 1e12, 2.0**52])
def test_log_prob_accurate_at_large_totals(total):
    # the pmf over every outcome with non-negligible mass sums to 1 (the lgamma form is off by ~1e-2 at 1e12),
    # and neighbouring outcomes differ by the exact ratio log(z_j p_i / ((z_i + 1) p_j))
    k = torch.tensor(total, dtype=torch.float64)
    rate = torch.tensor([1e4 / total, 1.0], dtype=torch.float64)  # mean of z_0: about 1e4
    d = ConstrainedPoisson(rate, k)
    x = torch.arange(0, 30_000, dtype=torch.float64)
    z = torch.stack([x, k - x], -1)
    lp = d.log_prob(z)
    assert lp.exp().sum().item() == pytest.approx(1.0, abs=1e-10)
    p = rate / rate.sum()
    step = torch.log(z[:-1, 1] * p[0] / ((z[:-1, 0] + 1) * p[1]))
    torch.testing.assert_close(lp[1:] - lp[:-1], step, rtol=0, atol=1e-9)
    # float32 rates and counts (up to 2**24): the same float64 evaluation, rounded
    k32 = float(2**24)
    r = torch.tensor([1.0, 2.0, 5.0])
    z32 = torch.tensor([[2097152.0, 4194304.0, 10485760.0], [2097000.0, 4194000.0, 10486216.0]])
    lp32 = ConstrainedPoisson(r, torch.tensor(k32)).log_prob(z32)
    lp64 = ConstrainedPoisson(r.double(), torch.tensor(k32, dtype=torch.float64)).log_prob(z32.double())
    torch.testing.assert_close(lp32.double(), lp64, rtol=1e-6, atol=1e-6)


def test_log_prob_gradcheck():
    torch.manual_seed(0)
    rate = (torch.rand(2, 5, dtype=torch.float64) + 0.2).requires_grad_()
    index = torch.tensor([0, 1, 0, 1, 1])
    total = torch.tensor([[3.0, 2.0], [1.0, 4.0]], dtype=torch.float64)
    value = ConstrainedPoisson(rate.detach(), total, index=index).sample((3,))
    assert torch.autograd.gradcheck(
        lambda r: ConstrainedPoisson(r, total, index=index).log_prob(value), (rate,)
    )


# ---------------------------------------------------------------------------------------------- binomial math
def test_binomial_expected_l1_scalar_grid():
    ks = torch.arange(0, 13, dtype=torch.float64)
    ps = torch.tensor([0.0, 1e-9, 0.03, 0.3, 0.5, 0.77, 1 - 1e-9, 1.0], dtype=torch.float64)
    ys = torch.arange(-2.0, 15.0, 0.5, dtype=torch.float64)
    K, P, Y = torch.meshgrid(ks, ps, ys, indexing="ij")
    actual = binomial_expected_l1(Y, K, P)
    actual_l2 = binomial_expected_l2(Y, K, P)
    m = np.arange(13)
    pmf = scipy.stats.binom.pmf(m[None, None, None, :], K.numpy()[..., None], P.numpy()[..., None])
    expected = (pmf * np.abs(m - Y.numpy()[..., None])).sum(-1)
    expected_l2 = (pmf * (m - Y.numpy()[..., None]) ** 2).sum(-1)
    np.testing.assert_allclose(actual.numpy(), expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(actual_l2.numpy(), expected_l2, rtol=1e-10, atol=1e-12)


def test_binomial_expected_l1_large_total():
    k, p = 2000.0, torch.tensor([0.013, 0.25, 0.5, 0.91], dtype=torch.float64)
    y = torch.tensor([30.0, 480.0, 1000.0, 1900.0], dtype=torch.float64)
    m = np.arange(2001)
    pmf = scipy.stats.binom.pmf(m[None, :], k, p.numpy()[:, None])
    expected = (pmf * np.abs(m[None, :] - y.numpy()[:, None])).sum(-1)
    np.testing.assert_allclose(
        binomial_expected_l1(y, torch.tensor(k, dtype=torch.float64), p).numpy(), expected, rtol=1e-9
    )
    # float32 is computed through a float64 cdf and stays accurate
    out32 = binomial_expected_l1(y.float(), torch.tensor(k), p.float())
    np.testing.assert_allclose(out32.numpy(), expected, rtol=2e-4)


def test_binomial_cdf_value_and_gradient():
    k = torch.tensor([1.0, 5.0, 40.0, 300.0], dtype=torch.float64)[:, None]
    x = torch.tensor([0.0, 0.0, 17.0, 160.0], dtype=torch.float64)[:, None] + torch.tensor([0.0, 0.7])
    p = (
        torch.tensor([0.2, 0.6, 0.45, 0.5], dtype=torch.float64)[:, None]
        .expand(4, 2)
        .clone()
        .requires_grad_()
    )
    F = binomial_cdf(x, k, p)
    expected = scipy.stats.binom.cdf(np.floor(x.numpy()), k.numpy(), p.detach().numpy())
    np.testing.assert_allclose(F.detach().numpy(), expected, rtol=1e-10, atol=1e-14)
    # regularized incomplete beta identity F(m; k, p) = I_{1-p}(k - m, m + 1)
    m = np.floor(x.numpy())
    np.testing.assert_allclose(
        F.detach().numpy(), scipy.special.betainc(k.numpy() - m, m + 1, 1 - p.detach().numpy()), rtol=1e-10
    )
    (grad,) = torch.autograd.grad(F.sum(), p)
    expected_grad = -k.numpy() * scipy.stats.binom.pmf(m, k.numpy() - 1, p.detach().numpy())
    np.testing.assert_allclose(grad.numpy(), expected_grad, rtol=1e-9, atol=1e-14)
    assert torch.autograd.gradcheck(lambda q: binomial_cdf(x, k, q), (p,))
    assert torch.autograd.gradgradcheck(lambda q: binomial_cdf(x, k, q), (p,))
    # edges: below / above the support, degenerate probabilities
    edge = binomial_cdf(
        torch.tensor([-1.0, 3.0, 5.0, 0.0, 2.0]), torch.tensor(3.0), torch.tensor([0.5, 0.5, 0.5, 0.0, 1.0])
    )
    assert edge.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]


def test_binomial_cdf_and_expected_l1_at_large_totals():
    # the cdf sums only a window of ~48 sqrt(k p (1 - p)) pmf terms, so large totals with moderate variance work;
    # against scipy's incomplete-beta cdf (scipy's own logpmf is off by ~1e-3 at k = 1e12, ours is not)
    k = torch.tensor([1e6, 1e9, 1e12, 1e12, 2.0**53], dtype=torch.float64)
    p = torch.tensor([0.3, 1e-3, 1e-6, 1e-9, 1e-12], dtype=torch.float64)
    x = torch.round(k * p + torch.tensor([100.0, -3000.0, 500.0, 2.0, -30.0], dtype=torch.float64))
    expected = scipy.stats.binom.cdf(x.numpy(), k.numpy(), p.numpy())
    np.testing.assert_allclose(binomial_cdf(x, k, p).numpy(), expected, rtol=1e-10, atol=1e-13)
    # E|Z - y| at the mean is sqrt(2 var / pi) (1 + O(1/var)) for a near-normal binomial
    d = ConstrainedPoisson(torch.tensor([1.0, 1e6 - 1.0], dtype=torch.float64), torch.tensor(1e12, dtype=torch.float64))
    l1 = d.expected_l1(d.mean.detach())
    np.testing.assert_allclose(l1.detach().numpy(), (2 * d.variance / math.pi).sqrt().numpy(), rtol=1e-5)
    # where the window is too wide for the bound, a ValueError names the method, the total and the bound
    wide = ConstrainedPoisson(torch.ones(100, dtype=torch.float64), torch.tensor(1e12, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"expected_l1.*pmf terms.*CDF_MAX_TERMS = 4194304.*k = 1e\+12"):
        wide.expected_l1(wide.mean)
    torch.testing.assert_close(wide.expected_l2(wide.mean), wide.variance)  # the closed forms still work


# ---------------------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("case", ["single", "grouped", "grouped-singleton", "batched"])
@pytest.mark.parametrize("loss", ["expected_l1", "expected_l2"])
def test_expected_loss_gradcheck(case, loss):
    torch.manual_seed(1)
    if case == "batched":
        rate = (torch.rand(2, 3, 6, dtype=torch.float64) + 0.2).requires_grad_()
        index = torch.tensor([0, 1, 0, 2, 1, 2])
        total = torch.randint(0, 7, (3, 3)).double()
        d0 = ConstrainedPoisson(rate.detach(), total, index=index)
    else:
        d0, rate, *_ = make(case, requires_grad=True)
        index, total = d0.index, d0.total
    y = d0.sample()  # feasible integer targets; also a non-integer one
    y_frac = y + 0.37

    def fn(r):
        d = ConstrainedPoisson(r, total, index=index)
        return getattr(d, loss)(y), getattr(d, loss)(y_frac)

    assert torch.autograd.gradcheck(fn, (rate,))
    if loss == "expected_l1":
        assert torch.autograd.gradgradcheck(fn, (rate,))


def test_expected_l1_gradient_vs_enumeration_finite_difference():
    # d/d rate of the enumerated expectation, by central differences, vs autograd of the closed form
    d, rate, totals, idx = make("grouped", requires_grad=True)
    outcomes = enumerate_outcomes(totals, idx, len(rate))
    y = outcomes[3]
    weights = torch.tensor([0.3, -1.0, 0.7, 2.0, -0.5, 1.1], dtype=torch.float64)
    (grad,) = torch.autograd.grad((d.expected_l1(torch.tensor(y)) * weights).sum(), rate)

    def enum_loss(r):
        w = oracle_pmf(outcomes, r, totals, idx)[:, None]
        return ((w * np.abs(outcomes - y)).sum(0) * weights.numpy()).sum()

    h, r0 = 1e-6, rate.detach().numpy()
    fd = np.array([(enum_loss(r0 + h * e) - enum_loss(r0 - h * e)) / (2 * h) for e in np.eye(len(r0))])
    np.testing.assert_allclose(grad.numpy(), fd, rtol=1e-6, atol=1e-8)


# ---------------------------------------------------------------------------------------------- sampling
def _chisquare_pvalue(samples: np.ndarray, outcomes: np.ndarray, pmf: np.ndarray) -> float:
    radix = int(max(samples.max(), outcomes.max())) + 1
    weights = radix ** np.arange(outcomes.shape[1])
    codes = {int(c): i for i, c in enumerate(outcomes @ weights)}
    observed = np.zeros(len(outcomes))
    idx, counts = np.unique((samples @ weights).astype(np.int64), return_counts=True)
    for c, cnt in zip(idx, counts, strict=True):
        observed[codes[int(c)]] += cnt  # KeyError would mean a sample outside the support
    expected = pmf * len(samples)
    assert expected.min() >= 5, "test design: every outcome needs >= 5 expected counts"
    return scipy.stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chisquare_single_group(dtype):
    torch.manual_seed(0)  # statistical test, see the note at the top
    rate, total = [0.7, 1.0, 1.6], 4
    d = ConstrainedPoisson(torch.tensor(rate, dtype=dtype), torch.tensor(total))
    samples = d.sample((20_000,))
    assert samples.dtype == dtype
    outcomes = enumerate_outcomes([total], [0, 0, 0], 3)
    pmf = oracle_pmf(outcomes, rate, [total], [0, 0, 0])
    assert _chisquare_pvalue(samples.double().numpy(), outcomes, pmf) > FAILURE_RATE / 4


def test_chisquare_grouped_batched_different_totals():
    torch.manual_seed(0)  # statistical test, see the note at the top
    index = [1, 0, 1, 0, 2, 2]
    rate = torch.tensor([[1.0, 2.0, 0.6, 1.5, 1.0, 1.0], [0.5, 0.5, 1.0, 1.0, 3.0, 1.0]], dtype=torch.float64)
    total = torch.tensor([[2, 3, 1], [1, 2, 3]])  # totals differ per batch element and per group
    d = ConstrainedPoisson(rate, total, index=torch.tensor(index))
    samples = d.sample((20_000,))
    assert samples.shape == (20_000, 2, 6)
    for b in range(2):
        totals = total[b].tolist()
        outcomes = enumerate_outcomes(totals, index, 6)
        pmf = oracle_pmf(outcomes, rate[b].numpy(), totals, index)
        assert _chisquare_pvalue(samples[:, b].numpy(), outcomes, pmf) > FAILURE_RATE / 4


def test_chisquare_enumerated_n3_k6_and_uneven_groups():
    # small totals, all outcomes enumerated: n = 3, k = 6 (28 outcomes), and a group of 5 (a splitting tree with
    # an unpaired node at every level) next to a group of 2, batched
    torch.manual_seed(0)  # statistical test, see the note at the top
    rate = [0.8, 1.0, 1.3]
    d = ConstrainedPoisson(torch.tensor(rate, dtype=torch.float64), torch.tensor(6))
    samples = d.sample((40_000,))
    outcomes = enumerate_outcomes([6], [0, 0, 0], 3)
    pvalue = _chisquare_pvalue(samples.numpy(), outcomes, oracle_pmf(outcomes, rate, [6], [0, 0, 0]))
    assert pvalue > FAILURE_RATE / 4  # seed 0: p = 0.80 (the grouped batch: 0.31, 0.53)
    index = [0, 1, 0, 0, 1, 0, 0]
    rate = torch.tensor([[0.5, 1.0, 1.0, 1.5, 1.0, 2.0, 1.0], [1.0, 1.0, 0.7, 1.3, 1.0, 1.0, 2.0]], dtype=torch.float64)
    total = torch.tensor([[3, 2], [3, 2]])
    samples = ConstrainedPoisson(rate, total, index=torch.tensor(index)).sample((40_000,))
    for b in range(2):
        outcomes = enumerate_outcomes([3, 2], index, 7)
        pmf = oracle_pmf(outcomes, rate[b].numpy(), [3, 2], index)
        assert _chisquare_pvalue(samples[:, b].numpy(), outcomes, pmf) > FAILURE_RATE / 4


@pytest.mark.parametrize("total", [1e6, 1e9, 1e12])
def test_binomial_marginals_at_large_totals(total):
    # large totals: every marginal z_i ~ Bin(k, p_i), and a sum across the splitting tree's halves
    # z_0 + z_3 ~ Bin(k, p_0 + p_3); standardised sample means and variances over 2,000 samples
    torch.manual_seed(0)  # statistical test, see the note at the top
    num = 2000
    rate = torch.tensor([1e-6, 0.3, 1.0, 2.5, 0.05], dtype=torch.float64)
    d = ConstrainedPoisson(rate, torch.tensor(total, dtype=torch.float64))
    z = d.sample((num,))
    assert torch.equal(z.sum(-1), torch.full((num,), total, dtype=torch.float64))
    p = rate / rate.sum()
    stats = torch.cat([z, z[:, :1] + z[:, 3:4]], -1)
    probs = torch.cat([p, p[:1] + p[3:4]])
    mean, var = total * probs, total * probs * (1 - probs)
    # Bonferroni over 2 x 6 checks; the variance of a sample variance is ~ 2 var^2 / (num - 1) (+ the excess
    # kurtosis term, below 1 / (k p (1 - p)) relative, negligible except for p_0 at k = 1e6, where it is ~1)
    z_crit = scipy.stats.norm.isf(FAILURE_RATE / (2 * 12))
    z_mean = (stats.mean(0) - mean) / (var / num).sqrt()
    kurt = (1 - 6 * probs * (1 - probs)) / var
    z_var = (stats.var(0) - var) / (var * ((2 / (num - 1)) + kurt / num).sqrt())
    assert bool((z_mean.abs() < z_crit).all()), z_mean
    assert bool((z_var.abs() < z_crit).all()), z_var
    # the whole marginal law of z_2 against scipy's binomial cdf: chi-square over 10 equiprobable bins
    k, p2 = total, float(probs[2])
    edges = scipy.stats.binom.ppf(np.linspace(0, 1, 11)[1:-1], k, p2)
    expected = np.diff(np.concatenate([[0.0], scipy.stats.binom.cdf(edges, k, p2), [1.0]])) * num
    observed = np.bincount(np.searchsorted(edges, z[:, 2].numpy(), side="left"), minlength=10)
    assert scipy.stats.chisquare(observed, expected).pvalue > FAILURE_RATE  # seed 0: p = 0.42, 0.70, 0.82


def test_binomial_sample_chunks(monkeypatch):
    # counts above BINOMIAL_CHUNK are drawn as sums of chunks: shrink the chunk to 3 and compare with scipy
    import hardeq.ops.binomial as ops

    torch.manual_seed(0)  # statistical test, see the note at the top
    monkeypatch.setattr(ops, "BINOMIAL_CHUNK", 3)
    count = torch.full((20_000,), 10.0, dtype=torch.float64)
    z = ops.binomial_sample(count, torch.tensor(0.35, dtype=torch.float64))
    assert z.dtype == torch.float64 and bool((z == z.round()).all()) and bool(((z >= 0) & (z <= 10)).all())
    observed = np.bincount(z.long().numpy(), minlength=11)
    expected = scipy.stats.binom.pmf(np.arange(11), 10, 0.35) * len(z)
    keep = expected >= 5  # pool the tails
    observed = np.append(observed[keep], observed[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    assert scipy.stats.chisquare(observed, expected).pvalue > FAILURE_RATE
    # edges: probability 0 and 1, count 0, and a count beyond the real chunk (2**40) with p = 1
    monkeypatch.undo()
    big = torch.tensor([0.0, 5.0, 5.0, 2.0**50 + 3, 2.0**53], dtype=torch.float64)
    out = ops.binomial_sample(big, torch.tensor([0.5, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64))
    assert out.tolist() == [0.0, 0.0, 5.0, 2.0**50 + 3, 0.0]


def test_binomial_sample_moments_beyond_the_chunk():
    # k = 2**45 + 1 (33 chunks of 2**40): mean and variance of Bin(k, p) at a small and a moderate p
    torch.manual_seed(0)  # statistical test, see the note at the top
    from hardeq.ops import binomial_sample

    num, k = 4000, 2.0**45 + 1
    p = torch.tensor([1e-6, 0.3], dtype=torch.float64)
    z = binomial_sample(torch.tensor(k, dtype=torch.float64), p.expand(num, 2))
    assert bool((z == z.round()).all()) and bool((z <= k).all())
    mean, var = k * p, k * p * (1 - p)
    z_crit = scipy.stats.norm.isf(FAILURE_RATE / (2 * 4))
    assert bool((((z.mean(0) - mean) / (var / num).sqrt()).abs() < z_crit).all())
    assert bool((((z.var(0) - var) / (var * (2 / (num - 1)) ** 0.5)).abs() < z_crit).all())


def test_samples_sum_exactly_at_huge_totals():
    # O(n) whatever the total: 1e12 and 2**53 (float64's last exact integer), grouped and batched
    torch.manual_seed(0)
    index = torch.tensor([0, 1, 0, 2, 1, 2, 2, 0, 0])
    total = torch.tensor([[1e12, 2.0**53, 0.0], [7.0, 1e15 + 1, 2.0**52 + 1]], dtype=torch.float64)
    rate = torch.rand(2, 9, dtype=torch.float64) * 10 + 1e-3
    rate[0, 0] = 1e-12  # a tiny probability
    d = ConstrainedPoisson(rate, total, index=index)
    z = d.sample((50,))
    assert bool((z >= 0).all()) and bool((z == z.round()).all())
    sums = torch.zeros(50, 2, 3, dtype=torch.float64).index_add(-1, index, z)
    assert torch.equal(sums, total.expand(50, 2, 3))
    assert bool(d.support.check(z).all()) and bool(torch.isfinite(d.log_prob(z)).all())


def test_sample_mean_matches_large_totals():
    torch.manual_seed(0)  # statistical test, see the note at the top
    rate = torch.rand(3, 7, dtype=torch.float64) + 0.05
    index = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    total = torch.tensor([[100, 0, 1000], [5, 37, 2], [1, 1, 1]])
    d = ConstrainedPoisson(rate, total, index=index)
    num = 4000
    samples = d.sample((num,))
    assert samples.shape == (num, 3, 7)
    assert (samples.mean(0) - d.mean).abs().le(mc_atol(d.stddev, num)).all()


def test_grouped_equals_independent_groups():
    torch.manual_seed(0)
    index = torch.tensor([0, 1, 0, 2, 1, 2, 2])
    rate = torch.rand(2, 7, dtype=torch.float64) + 0.1
    total = torch.tensor([[2.0, 3.0, 4.0], [0.0, 1.0, 5.0]], dtype=torch.float64)
    d = ConstrainedPoisson(rate, total, index=index)
    y = d.sample()
    z = d.sample((5,))
    log_prob = torch.zeros(5, 2, dtype=torch.float64)
    for g in range(3):
        members = (index == g).nonzero().squeeze(-1)
        dg = ConstrainedPoisson(rate[:, members], total[:, g])
        for name in ("probs", "mean", "variance"):
            torch.testing.assert_close(getattr(d, name)[:, members], getattr(dg, name))
        torch.testing.assert_close(d.expected_l1(y)[:, members], dg.expected_l1(y[:, members]))
        torch.testing.assert_close(d.expected_l2(y)[:, members], dg.expected_l2(y[:, members]))
        torch.testing.assert_close(z[..., members].sum(-1), total[:, g].expand(5, 2))
        log_prob += dg.log_prob(z[..., members])
    torch.testing.assert_close(d.log_prob(z), log_prob)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch_shape=st.lists(st.integers(1, 3), max_size=2),
    n=st.integers(1, 7),
    data=st.data(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    sample_shape=st.sampled_from([(), (1,), (3,), (2, 2)]),
    grouped=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_samples_sum_exactly_to_totals(batch_shape, n, data, dtype, sample_shape, grouped, seed):
    gen = torch.Generator().manual_seed(seed)
    batch_shape = tuple(batch_shape)
    # rates over many orders of magnitude (tiny probabilities stress the inverse cdf)
    log_rate = torch.rand(batch_shape + (n,), generator=gen, dtype=torch.float64) * 30 - 20
    rate = torch.exp(log_rate).to(dtype)
    if grouped:
        a = data.draw(st.integers(1, n))
        index = torch.cat([torch.arange(a), torch.randint(0, a, (n - a,), generator=gen)])
        index = index[torch.randperm(n, generator=gen)]
        total_shape = data.draw(st.sampled_from([batch_shape, batch_shape[1:], ()])) + (a,)
    else:
        index = None
        total_shape = data.draw(st.sampled_from([batch_shape, batch_shape[1:], ()]))
    total = torch.randint(0, 60, total_shape, generator=gen)
    d = ConstrainedPoisson(rate, total, index=index)
    torch.manual_seed(seed)
    z = d.sample(sample_shape)
    assert z.shape == torch.Size(sample_shape) + d.batch_shape + (n,)
    assert z.dtype == dtype and not z.requires_grad
    assert bool((z >= 0).all()) and bool((z == z.round()).all())
    assert bool(d.support.check(z).all())
    group_total = d.total.unsqueeze(-1) if index is None else d.total
    sums = torch.zeros(z.shape[:-1] + (group_total.shape[-1],), dtype=dtype)
    sums = sums.index_add(-1, torch.zeros(n, dtype=torch.long) if index is None else index, z)
    assert torch.equal(sums, group_total.expand_as(sums))


def test_samples_sum_large_totals_float32():
    torch.manual_seed(0)
    rate = torch.rand(4, 50) + 1e-3
    index = torch.arange(50) % 5
    total = torch.randint(0, 20_000, (4, 5))
    z = ConstrainedPoisson(rate, total, index=index).sample((2,))
    sums = torch.zeros(2, 4, 5).index_add(-1, index, z)
    assert torch.equal(sums, total.float().expand(2, 4, 5))


def test_zero_totals_and_empty_sample_shape():
    d = ConstrainedPoisson(torch.ones(2, 3), torch.zeros(2))
    assert torch.equal(d.sample((4,)), torch.zeros(4, 2, 3))
    assert d.sample((0,)).shape == (0, 2, 3)
    assert d.log_prob(torch.zeros(2, 3)).tolist() == [0.0, 0.0]


def test_shapes_expand_and_broadcasting():
    rate = torch.rand(5) + 0.1  # shared rate, per-batch totals
    d = ConstrainedPoisson(rate, torch.tensor([1, 2, 3]))
    assert d.batch_shape == (3,) and d.event_shape == (5,) and d.has_rsample
    assert d.rate.shape == (3, 5) and d.total.shape == (3,) and d.total.dtype == rate.dtype
    assert d.mean.shape == (3, 5) and d.probs.shape == (3, 5)
    assert d.support.event_dim == 1 and d.support.is_discrete
    e = d.expand((2, 3))
    assert e.batch_shape == (2, 3) and e.sample((4,)).shape == (4, 2, 3, 5)
    torch.testing.assert_close(e.mean, d.mean.expand(2, 3, 5))
    assert torch.equal(e.sample().sum(-1), torch.tensor([1.0, 2.0, 3.0]).expand(2, 3))
    g = ConstrainedPoisson(torch.rand(2, 1, 4) + 0.1, torch.ones(3, 2), index=torch.tensor([0, 1, 1, 0]))
    assert g.batch_shape == (2, 3) and g.sample((2,)).shape == (2, 2, 3, 4)
    assert g.expand((4, 2, 3)).sample().shape == (4, 2, 3, 4)
    assert "ConstrainedPoisson" in repr(g)
    # Python int total
    assert ConstrainedPoisson(torch.ones(3), 2).sample().sum().item() == 2.0
    # expected losses broadcast extra leading dims of y
    assert d.expected_l1(torch.zeros(7, 3, 5)).shape == (7, 3, 5)


def test_rsample_is_the_sample_and_carries_grad():
    rate = (torch.rand(2, 4) + 0.1).requires_grad_()
    d = ConstrainedPoisson(rate, torch.tensor([3, 5]))
    torch.manual_seed(3)
    z = d.sample((6,))
    torch.manual_seed(3)
    zr = d.rsample((6,))
    assert torch.equal(z, zr) and zr.requires_grad and not z.requires_grad
    zr.sum().backward()
    assert rate.grad.shape == rate.shape
    with pytest.raises(ValueError, match="unknown estimator"):
        d.rsample(estimator="pathwise")


# ---------------------------------------------------------------------------------------------- bad input
R3 = torch.tensor([1.0, 2.0, 3.0])
IDX = torch.tensor([0, 1, 1])

BAD_INPUTS = {
    "rate not a tensor": ({"rate": [1.0, 2.0], "total": torch.tensor(2)}, TypeError, "rate"),
    "rate integer dtype": (
        {"rate": torch.tensor([1, 2]), "total": torch.tensor(2)},
        TypeError,
        "rate.*dtype",
    ),
    "rate 0-d": (
        {"rate": torch.tensor(1.0), "total": torch.tensor(2)},
        ValueError,
        r"rate.*shape \(\*batch, n\)",
    ),
    "rate negative": ({"rate": torch.tensor([1.0, -2.0]), "total": torch.tensor(2)}, ValueError, "rate"),
    "rate zero": ({"rate": torch.tensor([1.0, 0.0]), "total": torch.tensor(2)}, ValueError, "rate"),
    "rate nan": ({"rate": torch.tensor([1.0, math.nan]), "total": torch.tensor(2)}, ValueError, "rate"),
    "rate inf": ({"rate": torch.tensor([1.0, math.inf]), "total": torch.tensor(2)}, ValueError, "rate"),
    "total negative": ({"rate": R3, "total": torch.tensor([2.0, -1.0])}, ValueError, "total"),
    "total non-integer": ({"rate": R3, "total": torch.tensor(2.5)}, ValueError, "total"),
    "total nan": ({"rate": R3, "total": torch.tensor(math.nan)}, ValueError, "total"),
    "total bool": ({"rate": R3, "total": torch.tensor(True)}, TypeError, "total.*dtype"),
    "total list": ({"rate": R3, "total": [1, 2]}, TypeError, "total"),
    "batch mismatch": (
        {"rate": torch.ones(2, 3), "total": torch.ones(4)},
        ValueError,
        r"batch shapes.*\(2, 3\)",
    ),
    "index float": ({"rate": R3, "total": torch.ones(2), "index": IDX.float()}, TypeError, "index.*long"),
    "index not a tensor": ({"rate": R3, "total": torch.ones(2), "index": [0, 1, 1]}, TypeError, "index"),
    "index wrong length": (
        {"rate": R3, "total": torch.ones(2), "index": torch.tensor([0, 1])},
        ValueError,
        r"index.*\(3,\).*\(2,\)",
    ),
    "index 2-d": ({"rate": R3, "total": torch.ones(2), "index": IDX[None]}, ValueError, "index.*shape"),
    "index out of range": (
        {"rate": R3, "total": torch.ones(2), "index": torch.tensor([0, 2, 1])},
        ValueError,
        r"index.*\[0, a\).*a = .*2.*\[0, 2\]",
    ),
    "index negative": (
        {"rate": R3, "total": torch.ones(2), "index": torch.tensor([0, -1, 1])},
        ValueError,
        "index",
    ),
    "empty group": (
        {"rate": R3, "total": torch.ones(3), "index": torch.tensor([0, 2, 2])},
        ValueError,
        r"group.*\[1\]",
    ),
    "index with number total": ({"rate": R3, "total": 2, "index": IDX}, ValueError, "total"),
    "index with 0-d total": (
        {"rate": R3, "total": torch.tensor(2.0), "index": IDX},
        ValueError,
        r"total.*\(\*batch, a\)",
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_raises_on_wrong_inputs(name):
    kwargs, exc, match = BAD_INPUTS[name]
    with pytest.raises(exc, match=match):
        ConstrainedPoisson(**kwargs)


def test_value_checks_follow_validate_args():
    # values are checked only under validate_args; shapes and index always
    ConstrainedPoisson(torch.tensor([1.0, -2.0]), torch.tensor(2.5), validate_args=False)
    with pytest.raises(ValueError, match="index"):
        ConstrainedPoisson(R3, torch.ones(2), index=torch.tensor([0, 5, 1]), validate_args=False)
    torch.distributions.Distribution.set_default_validate_args(False)
    try:
        ConstrainedPoisson(torch.tensor([1.0, 0.0]), torch.tensor(2))
    finally:
        torch.distributions.Distribution.set_default_validate_args(True)


def test_method_argument_errors():
    d = ConstrainedPoisson(torch.ones(2, 3), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"value.*n = 3"):
        d.log_prob(torch.ones(2, 4))
    with pytest.raises(ValueError, match="broadcast"):
        d.log_prob(torch.ones(5, 3))
    with pytest.raises(TypeError, match="value"):
        d.log_prob([1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"y.*\(2, 3\)"):
        d.expected_l1(torch.ones(4))
    with pytest.raises(ValueError, match="y"):
        d.expected_l2(torch.ones(3, 3))
    with pytest.raises(ValueError, match="y"):
        d.expected_l2(torch.tensor([0.0, math.nan, 1.0]))
    with pytest.raises(ValueError, match="unknown estimator"):
        d.rsample(estimator="nope")


def test_an_index_edited_in_place_is_laid_out_again():
    """The split tree and the group sums of an index tensor are remembered while it lives at the same version; an
    in-place edit (new groups) gives samples, means and probabilities of the new groups."""
    index = torch.tensor([0, 0, 0, 1, 1, 1])
    rate = torch.ones(6, dtype=torch.float64)
    total = torch.tensor([6.0, 3.0], dtype=torch.float64)
    for _ in range(3):  # (laid out at the first uses, then remembered)
        d = ConstrainedPoisson(rate, total, index=index, validate_args=False)
        d.sample((2,)), d.mean
    index[2] = 1  # groups of 2 and 4 members
    d = ConstrainedPoisson(rate, total, index=index, validate_args=False)
    z = d.sample((50,))
    torch.testing.assert_close(z[:, :2].sum(-1), torch.full((50,), 6.0, dtype=torch.float64))
    torch.testing.assert_close(z[:, 2:].sum(-1), torch.full((50,), 3.0, dtype=torch.float64))
    torch.testing.assert_close(d.mean, torch.tensor([3.0, 3.0, 0.75, 0.75, 0.75, 0.75], dtype=torch.float64))
