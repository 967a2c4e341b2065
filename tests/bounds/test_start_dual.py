"""The chains' start where rows share coordinates, built without a host read (hardeq.bounds.start_dual.dual_start),
and the truncated law's use of it: a fresh Gibbs sample costs the sampler's 2 reads, the start is certified with
them (the volume check folded into that read), and where the certificate fails sampling falls back to the full
volume check and the exact mode (their reads, their precise errors)."""

from __future__ import annotations

import pytest
import torch

import hardeq
import hardeq.bounds.start_dual as start_dual
from hardeq.bounds.start_dual import dual_start
from hardeq.linalg.device import forced
from hardeq.testing import count_calls

F = torch.float64


def _polytope(seed: int, n: int, a: int, dtype: torch.dtype, batch: int = 4):
    """A law whose box meets the plane with volume by construction: ``k = A x`` for ``x`` strictly inside the box."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(a, n, generator=g, dtype=F)
    lo = -torch.rand(n, generator=g, dtype=F)
    hi = 1.0 + 2.0 * torch.rand(n, generator=g, dtype=F)
    hi[: n // 4] = float("inf")  # some coordinates unbounded above
    x = lo + (hi.clamp(max=3.0) - lo) * (0.1 + 0.8 * torch.rand(batch, n, generator=g, dtype=F))
    loc = 3.0 * torch.randn(batch, n, generator=g, dtype=F)
    scale = 0.3 + torch.rand(batch, n, generator=g, dtype=F)
    con = hardeq.LinearConstraint(A.to(dtype), (x @ A.T).to(dtype))
    return hardeq.ConstrainedNormal(loc.to(dtype), scale.to(dtype), constraint=con), lo.to(dtype), hi.to(dtype)


def _worst_row(d, z):
    A, k = d.constraint.A.double(), d.constraint.k.double()
    z = z.double()
    return ((z @ A.T - k).abs() / (z.abs() @ A.abs().T + k.abs())).amax().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("seed,n,a", [(0, 12, 3), (1, 30, 8), (2, 60, 20), (3, 8, 5)])
def test_in_the_box_on_the_plane_without_a_host_read(seed, n, a, dtype):
    d, lo, hi = _polytope(seed, n, a, dtype)
    d.conditioner  # noqa: B018  (the untruncated law's own setup, not counted)
    with count_calls() as count:
        z, met = dual_start(d, lo, hi)
    assert count.host_reads == 0, count.host_read_names
    assert z.shape == (4, n) and z.dtype == dtype and met.shape == (4,)
    assert bool(((z >= lo) & (z <= hi)).all())                       # the box: exactly, always
    assert bool(met.all())                                            # these cases converge well within the steps
    assert _worst_row(d, z) <= torch.finfo(dtype).eps ** 0.5          # what met certifies (float64, before the cast)


def test_met_is_honest_when_the_steps_do_not_suffice(monkeypatch):
    """With no Newton step the point is the clipped untruncated solution: still in the box, and ``met`` says
    whether it is on the plane."""
    monkeypatch.setattr(start_dual, "DUAL_START_STEPS", 0)
    monkeypatch.setattr(start_dual, "POLISH_STEPS", 0)
    d, lo, hi = _polytope(1, 30, 8, F)
    z, met = dual_start(d, lo, hi)
    assert bool(((z >= lo) & (z <= hi)).all())
    A, k = d.constraint.A, d.constraint.k
    worst = ((z @ A.T - k).abs() / (z.abs() @ A.abs().T + k.abs())).amax(-1)
    assert (worst <= torch.finfo(F).eps ** 0.5).tolist() == met.tolist()
    assert not bool(met.all())  # (the clipped solution misses the plane here: the fallback below is exercised)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_fresh_gibbs_sample_where_rows_share_coordinates_reads_twice(profile, dtype):
    """Before: the volume check's and the mode's dual Newton solves read the host each iteration (13-59 reads)."""
    with forced(profile):
        d, lo, hi = _polytope(4, 30, 6, dtype)
        base = hardeq.ConstrainedNormal(d.loc, d.stddev, constraint=d.constraint, validate_args=False)
        base.conditioner  # noqa: B018
        reads = []
        for sweeps in (20, 60):
            fresh = base.truncate(lo, hi)
            with count_calls() as count:
                z = fresh.sample((16,), method="gibbs", burn_in=sweeps - 1,
                                 generator=torch.Generator().manual_seed(1))
            reads.append(count.host_reads)
            assert bool(((z >= lo) & (z <= hi)).all()) and bool(base.constraint.check(z).all())
            assert fresh._cache.get("volume") is True and "mode" not in fresh._cache  # certified with that read
    assert reads[0] == reads[1] <= 2, reads


def test_a_failed_start_falls_back_to_the_exact_mode(monkeypatch):
    """No step: the start's certificate fails in the sampler's read; sampling runs the full volume check and the
    exact mode, then draws from there: the same law (the draws are feasible and the chains started at the mode)."""
    monkeypatch.setattr(start_dual, "DUAL_START_STEPS", 0)
    monkeypatch.setattr(start_dual, "POLISH_STEPS", 0)
    d, lo, hi = _polytope(1, 30, 8, F)
    t = d.truncate(lo, hi)
    z = t.sample((32,), method="gibbs", generator=torch.Generator().manual_seed(0))
    assert bool(((z >= lo) & (z <= hi)).all()) and bool(d.constraint.check(z).all())
    assert "mode" in t._cache and "start" not in t._cache and t._cache.get("volume") is True
    torch.testing.assert_close(t._chain_start(), t._compute_mode())


def test_no_volume_still_refused_by_name_through_sampling():
    """z0 + z1 + z3 = 1 and z1 - z2 + z3 = 1 with z >= 0 force z0 = z2 = 0 (a face): the sync-free start cannot be
    certified strictly inside, and the full check names the face, for every method."""
    A = torch.tensor([[1., 1, 0, 1], [0, 1, -1, 1]], dtype=F)
    d = hardeq.ConstrainedNormal(torch.full((4,), 0.3, dtype=F), 1.0,
                                 constraint=hardeq.LinearConstraint(A, torch.tensor([1., 1.], dtype=F)))
    for method in ("gibbs", "auto", "hmc", "rejection"):
        with pytest.raises(ValueError, match=r"has no volume on the plane .*coordinates 0, 2 sit at a bound"):
            d.truncate(0.0, 1.0).sample((4,), method=method)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_training_step_where_rows_share_coordinates_adds_two_reads(profile):
    """A fresh law per step, persistent chains: the volume check rides on the chains' start read (before: 60-110
    reads per step, the full volume check's dual Newton solve)."""
    from hardeq.bounds import PersistentChains

    torch.manual_seed(0)
    n, batch, a = 30, 8, 3
    with forced(profile):
        head = torch.nn.Linear(8, 2 * n).double()
        x = torch.randn(batch, 8, dtype=F)
        A = torch.rand(a, n, dtype=F)
        y = torch.distributions.Dirichlet(torch.ones(n, dtype=F)).sample((batch,))
        con = hardeq.LinearConstraint(A, y @ A.T)

        def step(chains):
            with count_calls() as count:
                out = head(x)
                base = hardeq.ConstrainedNormal(out[:, :n], out[:, n:].exp(), constraint=con, validate_args=False)
                law = base if chains is None else base.truncate(0.0, 1.0, training=chains)
                law.log_prob(y).mean().backward()
            return count.host_reads

        plain = step(None)
        chains = PersistentChains(sweeps=4)
        reads = [step(chains) for _ in range(3)]
    assert chains.steps == 3 and max(reads) <= plain + 2, (reads, plain)


def test_training_step_on_a_face_is_refused_by_name():
    from hardeq.bounds import PersistentChains

    A = torch.tensor([[1., 1, 0, 1], [0, 1, -1, 1]], dtype=F)
    loc = torch.full((4,), 0.3, dtype=F, requires_grad=True)
    d = hardeq.ConstrainedNormal(loc, 1.0, constraint=hardeq.LinearConstraint(A, torch.tensor([1., 1.], dtype=F)))
    t = d.truncate(0.0, 1.0, training=PersistentChains(sweeps=2))
    with pytest.raises(ValueError, match=r"has no volume on the plane .*coordinates 0, 2 sit at a bound"):
        t.log_prob(torch.tensor([0., .5, 0., .5], dtype=F))


def test_training_step_falls_back_where_the_start_fails(monkeypatch):
    from hardeq.bounds import PersistentChains

    d, lo, hi = _polytope(1, 30, 8, F)
    y = d.truncate(lo, hi).sample((), method="gibbs", generator=torch.Generator().manual_seed(2))  # (data)
    monkeypatch.setattr(start_dual, "DUAL_START_STEPS", 0)
    monkeypatch.setattr(start_dual, "POLISH_STEPS", 0)
    loc = d.loc.clone().requires_grad_()
    law = hardeq.ConstrainedNormal(loc, d.stddev, constraint=d.constraint).truncate(lo, hi,
                                                                                    training=PersistentChains(sweeps=3))
    law.log_prob(y).sum().backward()
    assert loc.grad is not None and bool(torch.isfinite(loc.grad).all())
    # the dual start failed its certificate: dropped, the full volume check ran, and the data started the chains
    assert law._cache.get("volume") is True and "start" not in law._cache


def test_an_empty_polytope_is_named_through_every_method():
    """z0 + z1 = 1.5 and z0 - z1 + z3 / 2 = 1.3 in [0, 1]^4: each row alone can be met in the box, together not
    (their sum gives z0 = 1.4 - z3 / 4, and z0 <= 1 needs z3 >= 1.6): the sync-free start's certificate fails, and
    the full volume check names the polytope empty."""
    A = torch.tensor([[1., 1, 0, 0], [1, -1, 0, 0.5]], dtype=F)
    d = hardeq.ConstrainedNormal(torch.zeros(4, dtype=F), 1.0,
                                 constraint=hardeq.LinearConstraint(A, torch.tensor([1.5, 1.3], dtype=F)))
    for method in ("gibbs", "auto", "hmc", "rejection"):
        with pytest.raises(ValueError, match=r"is empty for batch element \(\): no point of the plane lies in the box"):
            d.truncate(0.0, 1.0).sample((3,), method=method)
