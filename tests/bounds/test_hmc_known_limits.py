"""Exact HMC where a trajectory can bounce without end: a coordinate on a wall its Gaussian pulls it into hops
off that wall every 2|v|/g, so the bounces of a trajectory grow like 1/|v| (infinite in expectation). Found by the
portfolio study's long-only variant at its `cpu` preset (sp500-50, the trained `ours` head, test window 21: the
mean about -0.09 with standard deviation 0.016 in 38 of 50 weights, box [0, 1], sum one), whose first trajectory
hit the walls over 15,000 times. A trajectory reaching ``max_bounces`` is now rejected (the chain stays put),
which keeps the stationary law exact; these tests check both the cost bound and the law.
"""

import warnings

import pytest
import torch
from scipy import stats

import hardeq
from hardeq.bounds import ChainStuck, exact_hmc


@pytest.mark.slow
def test_the_portfolio_case_refuses_copies_and_auto_moves():
    torch.manual_seed(0)
    n = 50
    loc = torch.cat([torch.full((38,), -0.09), torch.linspace(0.05, 0.4, 12)]).double().expand(8, n)
    scale = torch.full((n,), 0.016, dtype=torch.float64)
    c = hardeq.SumConstraint(torch.zeros(n, dtype=torch.long), torch.ones(1, dtype=torch.float64))
    truncated = hardeq.ConstrainedNormal(loc, scale, constraint=c).truncate(0.0, 1.0)
    assert int((truncated.mode[0] <= 0).sum()) >= 38
    # from the mode every trajectory of some chain is capped: its draws would be copies of the mode, so HMC refuses
    # (naming the pressed coordinate) instead of returning them
    lo, hi = torch.zeros(8, n, dtype=torch.float64), torch.ones(8, n, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the capped fraction may exceed 1% here
        with pytest.raises(ChainStuck, match=r"never moved.*No direction is thin.*standard deviations outside"):
            exact_hmc(truncated.base, lo, hi, truncated.mode.expand(16, 8, n).contiguous(), num_samples=1, burn_in=5)
        # the distribution starts a sum row's chains inside the polytope (bounds.start.feasible_start), off the
        # pressed faces: there they move, and no draw is a copy of another chain's
        hmc = truncated.sample_with_info((16,), method="hmc", burn_in=5).samples
    assert bool(((hmc >= 0) & (hmc <= 1)).all()) and float((hmc.sum(-1) - 1).abs().max()) <= 1e-12 * n
    assert bool(((hmc[1:] - hmc[:1]).abs().amax(-1) > 0).all())
    # auto picks Gibbs, which has no bounces
    info = truncated.sample_with_info((16,), burn_in=5)
    assert info.method == "gibbs" and bool(((info.samples >= 0) & (info.samples <= 1)).all())
    assert float((info.samples.sum(-1) - 1).abs().max()) <= 1e-12 * n


def test_rejecting_capped_trajectories_keeps_the_law():
    """A 2-D plane in R^3 (sum = 1), box [0, 1], the mean outside the box in two coordinates, and a cap of 2
    bounces, so that many trajectories are rejected: the last draws of 4000 independent chains (burn-in 40) against
    exact iid draws by rejection from the untruncated conditional, two-sample KS per coordinate (Bonferroni over 3
    at level 1e-3). Without the rejection's reversibility the capped chains would pile up where they start."""
    g = torch.Generator().manual_seed(7)
    loc = torch.tensor([-0.3, -0.2, 0.6], dtype=torch.float64)
    scale = torch.tensor([0.3, 0.25, 0.4], dtype=torch.float64)
    c = hardeq.SumConstraint(torch.zeros(3, dtype=torch.long), torch.ones(1, dtype=torch.float64))
    d = hardeq.ConstrainedNormal(loc, scale, constraint=c)
    lower, upper = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    start = d.truncate(lower, upper).mode.expand(4000, 3).contiguous()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = exact_hmc(d, lower, upper, start, num_samples=1, burn_in=40, max_bounces=2, generator=g)
    assert res.capped > 0.05 * res.trajectories  # the cap binds often
    assert any("max_bounces" in str(w.message) for w in caught)
    hmc = res.samples[0]
    torch.manual_seed(11)
    z = d.sample((200_000,))
    exact = z[((z >= 0) & (z <= 1)).all(-1)][:4000]
    assert exact.shape[0] == 4000
    for i in range(3):
        p = stats.ks_2samp(hmc[:, i].numpy(), exact[:, i].numpy()).pvalue
        assert p > 1e-3 / 3, (i, p)
