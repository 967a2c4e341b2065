"""method="auto" picks the sampler with the most effective samples per modelled second on a short pilot
(hardeq.bounds.choice): exact HMC on a small problem with a strongly correlated full covariance (measured there:
HMC 1,650-1,930 ESS/s against augmented Gibbs 170-1,160), blocked Gibbs on the long-only portfolio (means far below 0
in most coordinates, where HMC's trajectories bounce without end), rejection where its acceptance is high; and the
same generator gives the same choice and the same draws."""

from __future__ import annotations

import torch

import hardeq
from hardeq.bounds.choice import choose_method

F = torch.float64


def _dense():
    X = torch.randn(6, 6, generator=torch.Generator().manual_seed(1), dtype=F)
    d = hardeq.ConstrainedNormal(torch.zeros(6, dtype=F), covariance_matrix=X @ X.T + 0.02 * torch.eye(6, dtype=F),
                                 constraint=hardeq.LinearConstraint(torch.ones(1, 6, dtype=F),
                                                                    torch.tensor([0.5], dtype=F)))
    return d.truncate(-1.0, 1.0)


def _portfolio(batch=4, n=50):
    loc = torch.randn(batch, n, generator=torch.Generator().manual_seed(1), dtype=F) * 3 - 4
    total = hardeq.SumConstraint(torch.zeros(n, dtype=torch.long), torch.ones(batch, 1, dtype=F))
    return hardeq.ConstrainedNormal(loc, 0.5, constraint=total).truncate(0.0, 1.0)


def _choose(t, seed, num=64):
    return choose_method(t.base, t._lo, t._hi, t.mode, num=num, chains=num, acceptance=float(t.acceptance.min()),
                         threshold=0.1, generator=torch.Generator().manual_seed(seed), burn_in=20)


def test_auto_picks_hmc_on_a_small_correlated_problem():
    t = _dense()
    assert float(t.acceptance) < 0.1                          # rejection does not apply
    method, scores = _choose(t, 0)
    assert method == "hmc" and scores["hmc"] > scores["gibbs"], scores
    info = t.sample_with_info((16,), burn_in=20, generator=torch.Generator().manual_seed(0))
    assert info.method == "hmc"
    z = info.samples
    assert bool(((z >= -1) & (z <= 1)).all())


def test_auto_picks_gibbs_where_coordinates_press_on_walls():
    t = _portfolio()
    method, scores = _choose(t, 0)
    assert method == "gibbs" and scores["gibbs"] > scores.get("hmc", 0.0), scores
    info = t.sample_with_info((8,), burn_in=20, generator=torch.Generator().manual_seed(0))
    assert info.method == "gibbs" and bool(((info.samples >= 0) & (info.samples <= 1)).all())


def test_auto_picks_rejection_where_it_accepts_most():
    d = hardeq.ConstrainedNormal(torch.zeros(4, dtype=F), 0.2,
                                 constraint=hardeq.SumConstraint(torch.zeros(4, dtype=torch.long),
                                                                 torch.tensor([0.0], dtype=F)))
    t = d.truncate(-1.0, 1.0)
    assert float(t.acceptance) > 0.9
    assert _choose(t, 0)[0] == "rejection"


def test_the_same_generator_gives_the_same_choice_and_draws():
    for t in (_dense(), _portfolio(batch=2, n=20)):
        a, b = _choose(t, 7), _choose(t, 7)
        assert a == b
        one = t.sample_with_info((6,), burn_in=10, generator=torch.Generator().manual_seed(3))
        two = t.sample_with_info((6,), burn_in=10, generator=torch.Generator().manual_seed(3))
        assert one.method == two.method and torch.equal(one.samples, two.samples)


def test_an_hmc_choice_whose_chains_cannot_move_falls_back_to_gibbs(monkeypatch):
    """Finding A's thin polytope (a box of width 1e-9 in one coordinate against a conditional sd near 0.2): were the
    pilot to pick HMC, every trajectory would be capped and the chains stuck; auto then samples with Gibbs, whose
    draws move (the sd of z0 over 24 draws, 3 sweeps from the mode, is far from 0)."""
    import hardeq.bounds.choice as choice

    monkeypatch.setattr(choice, "choose_method", lambda *args, **kwargs: ("hmc", {}))
    B = torch.tensor([[.5, .1, 0, .2], [.1, .4, .1, 0], [0, .1, .3, .1], [.2, 0, .1, .5]], dtype=F)
    d = hardeq.ConstrainedNormal(torch.full((4,), .3, dtype=F), covariance_matrix=B @ B.T + .05 * torch.eye(4, dtype=F),
                                 constraint=hardeq.SumConstraint(torch.zeros(4, dtype=torch.long),
                                                                 torch.tensor([1.2], dtype=F)))
    hi = torch.ones(4, dtype=F)
    hi[1] = 1e-9
    info = d.truncate(0.0, hi).sample_with_info((24,), burn_in=2, generator=torch.Generator().manual_seed(0))
    assert info.method == "gibbs"
    assert float(info.samples[:, 0].std()) > 0.05
    assert bool(((info.samples >= 0) & (info.samples <= hi)).all())
