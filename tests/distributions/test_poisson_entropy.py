"""ConstrainedPoisson.entropy(): Poissons conditioned on group sums are independent multinomials per group, so the
entropy is the sum of the groups' multinomial entropies. Checked against scipy, against a full enumeration of the
multinomial support, against a 50-digit mpmath sum at a total of 10^12, against -E log_prob by Monte Carlo, and
its gradient by gradcheck."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy import stats

from hardeq import ConstrainedPoisson, SumConstraint
from hardeq.distributions.poisson import ENTROPY_MAX_TERMS
from hardeq.testing import mc_atol


def _scipy_entropy(rate, total, index):
    """Sum over groups of scipy's multinomial entropy (float64, numpy)."""
    rate, total = rate.double(), total.double()
    out = 0.0
    for j in range(total.shape[-1]):
        r = rate[index == j]
        out += float(stats.multinomial(int(total[j]), (r / r.sum()).numpy()).entropy())
    return out


CASES = [  # rate, total, index: ragged groups, a group of one (entropy 0), a total of 0 and of 1
    ([1.0, 2.0, 3.0], [7.0], [0, 0, 0]),
    ([0.5, 1.5, 2.0, 4.0, 0.1, 3.0], [5.0, 0.0, 2.0], [0, 0, 1, 1, 2, 2]),
    ([1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 40.0], [0, 1, 0, 1, 1]),
    ([2.0, 1.0, 3.0, 1e-3], [12.0, 9.0], [0, 1, 0, 0]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rate, total, index", CASES)
def test_entropy_matches_scipy_multinomial_per_group(dtype, rate, total, index):
    rate, total, index = torch.tensor(rate, dtype=dtype), torch.tensor(total, dtype=dtype), torch.tensor(index)
    d = ConstrainedPoisson(rate, total, index=index)
    H = d.entropy()
    assert H.shape == () and H.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert math.isclose(float(H), _scipy_entropy(rate, total, index), rel_tol=tol, abs_tol=tol)
    via_constraint = ConstrainedPoisson(rate, constraint=SumConstraint(index, total)).entropy()
    # the same computation; on a GPU its group sums (index_add, atomic) may add in another order
    assert math.isclose(float(via_constraint), float(H), rel_tol=16 * torch.finfo(dtype).eps)


def test_entropy_equals_a_full_enumeration_of_the_support():
    """-sum p log p over every vector with the right group sums, the pmf from scipy.stats.multinomial."""
    rate = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0], dtype=torch.float64)
    index = torch.tensor([0, 0, 0, 1, 1])
    total = torch.tensor([6.0, 4.0], dtype=torch.float64)
    H = 0.0
    for j in range(2):
        members = (index == j).nonzero().flatten().tolist()
        p = (rate[members] / rate[members].sum()).numpy()
        k = int(total[j])
        for z in itertools.product(range(k + 1), repeat=len(members)):
            if sum(z) == k:
                pmf = stats.multinomial(k, p).pmf(z)
                H -= pmf * math.log(pmf)
    assert math.isclose(float(ConstrainedPoisson(rate, total, index=index).entropy()), H, rel_tol=1e-12)


def test_entropy_batched_and_without_index():
    rate = torch.rand(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.1
    total = torch.tensor([0.0, 3.0, 11.0], dtype=torch.float64)
    H = ConstrainedPoisson(rate, total).entropy()
    assert H.shape == (3,)
    for b in range(3):
        ref = float(stats.multinomial(int(total[b]), (rate[b] / rate[b].sum()).numpy()).entropy())
        assert math.isclose(float(H[b]), ref, rel_tol=1e-12, abs_tol=1e-14)
    expanded = ConstrainedPoisson(rate[0], total[2]).expand((2,)).entropy()
    torch.testing.assert_close(expanded, ConstrainedPoisson(rate[0], total[2]).entropy().expand(2))


@pytest.mark.parametrize("total, p", [(1e12, 1e-9), (2.0**50, 3e-14), (1e8, 1e-5)])
def test_entropy_at_huge_totals_against_a_50_digit_sum(total, p):
    """A two-coordinate group is Bin(k, p): H = -sum_x b(x) log b(x), summed in 50-digit arithmetic over
    mean +- 40 sd (the rest is below 1e-300). The lgamma form would lose k log k eps ~ 1e-3 at k = 1e12."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 50
    k, P = mpmath.mpf(int(total)), mpmath.mpf(p)
    mean, sd = k * P, mpmath.sqrt(k * P * (1 - P))
    lo, hi = max(0, int(mean - 40 * sd - 40)), int(mean + 40 * sd + 40)
    log_norm = mpmath.loggamma(k + 1)
    H = mpmath.mpf(0)
    for x in range(lo, hi + 1):
        logb = log_norm - mpmath.loggamma(x + 1) - mpmath.loggamma(k - x + 1) + x * mpmath.log(P) + \
            (k - x) * mpmath.log1p(-P)
        H -= mpmath.exp(logb) * logb
    rate = torch.tensor([p, 1 - p], dtype=torch.float64)
    got = float(ConstrainedPoisson(rate, torch.tensor(total, dtype=torch.float64)).entropy())
    assert math.isclose(got, float(H), rel_tol=1e-12), (got, float(H))


def test_entropy_is_minus_the_mean_log_prob():
    """Monte Carlo: -mean log p(z) over exact samples, within a Bonferroni z-interval of its spread."""
    torch.manual_seed(0)  # statistical test (FAILURE_RATE 1e-4); after an RNG change, bump the seed once
    rate = torch.tensor([[1.0, 2.0, 0.3, 4.0, 2.0], [3.0, 1.0, 1.0, 0.5, 0.5]], dtype=torch.float64)
    d = ConstrainedPoisson(rate, torch.tensor([[30.0, 4.0]] * 2, dtype=torch.float64),
                           index=torch.tensor([0, 0, 0, 1, 1]))
    nlp = -d.log_prob(d.sample((20_000,)))
    assert bool(((nlp.mean(0) - d.entropy()).abs() <= mc_atol(nlp.std(0), 20_000)).all())


def test_entropy_gradcheck_in_rate():
    rate = torch.tensor([[1.0, 2.0, 0.3, 4.0, 2.0], [3.0, 1.0, 1.0, 0.5, 2.5]], dtype=torch.float64,
                        requires_grad=True)
    index = torch.tensor([0, 0, 0, 1, 2])  # a group of one: p = 1, no gradient through it

    def fn(rate):
        return ConstrainedPoisson(rate, torch.tensor([25.0, 3.0, 2.0], dtype=torch.float64), index=index).entropy()

    assert torch.autograd.gradcheck(fn, (rate,))
    # at a large total the gradient is that of the Gaussian limit 1/2 sum log p_i (+ O(1/k))
    r = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(ConstrainedPoisson(r, torch.tensor(1e6, dtype=torch.float64)).entropy(), r)
    r2 = r.detach().clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(0.5 * torch.log(r2 / r2.sum()).sum(), r2)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-6)  # the O(1/k) correction


def test_entropy_refuses_what_it_cannot_sum_naming_the_limit():
    d = ConstrainedPoisson(torch.ones(2, dtype=torch.float64), torch.tensor(1e13, dtype=torch.float64))
    with pytest.raises(ValueError, match=rf"ENTROPY_MAX_TERMS = {ENTROPY_MAX_TERMS}.*largest total is k = 1e\+13"):
        d.entropy()
    with pytest.raises(ValueError, match=r"entropy: total must hold non-negative integers.*\[2\.5\]"):
        ConstrainedPoisson(torch.ones(3), torch.tensor(2.5), validate_args=False).entropy()
    with pytest.raises(ValueError, match=r"entropy: rate must be positive and finite, got \[-1\.0\]"):
        ConstrainedPoisson(torch.tensor([1.0, -1.0]), torch.tensor(2.0), validate_args=False).entropy()
