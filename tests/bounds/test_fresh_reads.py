"""Host reads of a fresh truncated law, counted with hardeq.testing.count_calls: what a training loop pays per step,
where every step builds a new distribution. Making the law (``truncate``) costs one read (check_box_and_polytope,
which refuses what check_bounds and check_polytope refuse, with their messages); a fresh ``sample(method="gibbs")``
on a grouped sum or one row costs the sampler's 2 reads, whatever the number of sweeps (the chains start at
hardeq.bounds.start.feasible_start, not at the mode, a QP); a training step (persistent chains) adds at most 2 reads
to those of the untruncated ``log_prob`` step (the law's check and the Gibbs run), none per sweep. A fresh
``sample`` with the default ``method="auto"`` adds ONE read to the sampler's (the acceptance, the Gibbs pilot's score
and checks, read together), plus, on the CPU, the untruncated conditioner's refinement guard in the acceptance pilot
(under the GPU profile, hardeq.linalg.device.forced("gpu"), the conditioner is static and that check deferred)."""

from __future__ import annotations

import pytest
import torch

import hardeq
from hardeq.bounds import PersistentChains, check_bounds, check_polytope
from hardeq.bounds.polytope import check_box_and_polytope
from hardeq.linalg.device import forced
from hardeq.testing import count_calls

F = torch.float64


def _base(kind, n, dtype):
    g = torch.Generator().manual_seed(0)
    loc = (torch.randn(8, n, generator=g, dtype=F) * 0.3 - 0.2).to(dtype)
    k = torch.ones(8, 1, dtype=dtype)
    con = (hardeq.SumConstraint(torch.zeros(n, dtype=torch.long), k) if kind == "sum"
           else hardeq.LinearConstraint(torch.ones(1, n, dtype=dtype), k))
    extra = {"cov_factor": (torch.randn(n, 2, generator=g, dtype=F) * 0.1).to(dtype)} if kind == "lowrank" else {}
    return hardeq.ConstrainedNormal(loc, 0.3, constraint=con, validate_args=False, **extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("kind", ["sum", "dense", "lowrank"])
def test_fresh_gibbs_sample_reads(kind, dtype):
    base = _base(kind, 50, dtype)
    base.conditioner  # noqa: B018  (the untruncated law's own setup, not counted here)
    with count_calls() as made:
        base.truncate(0.0, 1.0)
    assert made.host_reads <= 1, made.host_read_names
    reads = []
    for sweeps in (20, 60):
        fresh = base.truncate(0.0, 1.0)
        with count_calls() as count:
            z = fresh.sample((64,), method="gibbs", burn_in=sweeps - 1, generator=torch.Generator().manual_seed(1))
        assert z.shape == (64, 8, 50) and bool(((z >= 0) & (z <= 1)).all())
        reads.append(count.host_reads)
    assert reads[0] == reads[1], reads                         # none per sweep
    assert reads[0] <= 2, reads


@pytest.mark.parametrize("profile,budget", [("cpu", 4), ("gpu", 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("kind", ["sum", "dense"])
def test_fresh_auto_sample_reads(kind, dtype, profile, budget):
    """Where the cap rules HMC's pilot out (these cases), auto = the Gibbs run's 2 reads + 1 for the decision (+ 1 on
    the CPU: the acceptance pilot's conditioner guard), whatever the number of sweeps; the choice and the draws are
    those of the same generator again."""
    with forced(profile):
        base = _base(kind, 50, dtype)
        base.conditioner  # noqa: B018  (the untruncated law's own setup, not counted here)
        reads, infos = [], []
        for sweeps in (20, 60, 60):
            fresh = base.truncate(0.0, 1.0)
            with count_calls() as count:
                info = fresh.sample_with_info((64,), burn_in=sweeps - 1, generator=torch.Generator().manual_seed(1))
            z = info.samples
            assert z.shape == (64, 8, 50) and bool(((z >= 0) & (z <= 1)).all())
            reads.append(count.host_reads)
            infos.append(info)
    assert infos[0].method == "gibbs", infos[0].method
    assert reads[0] == reads[1] == reads[2], reads             # none per sweep
    assert reads[0] <= budget, reads
    assert infos[1].method == infos[2].method and torch.equal(infos[1].samples, infos[2].samples)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_training_step_reads(dtype):
    """The portfolio head's step (n = 50, batch 32, one dense sum row, a fresh law per step, persistent chains)."""
    torch.manual_seed(0)
    n, batch = 50, 32
    head = torch.nn.Linear(8, 2 * n).to(dtype)
    x = torch.randn(batch, 8, dtype=dtype)
    y = torch.distributions.Dirichlet(torch.ones(n, dtype=F)).sample((batch,)).to(dtype)
    con = hardeq.LinearConstraint(torch.ones(1, n, dtype=dtype), torch.ones(batch, 1, dtype=dtype))

    def step(chains):
        with count_calls() as count:
            out = head(x)
            base = hardeq.ConstrainedNormal(out[:, :n], out[:, n:].exp(), constraint=con, validate_args=False)
            (base if chains is None else base.truncate(0.0, 1.0, training=chains)).log_prob(y).mean().backward()
        return count.host_reads

    plain = step(None)
    for sweeps in (4, 16):
        chains = PersistentChains(sweeps=sweeps)
        reads = [step(chains) for _ in range(3)]
        assert chains.steps == 3
        assert max(reads) <= plain + 2, (reads, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_box_and_polytope_one_read_same_errors(dtype):
    n = 6
    total = hardeq.SumConstraint(torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([[1.0, 2.0]], dtype=dtype))
    lo, hi = torch.zeros(1, n, dtype=dtype), torch.ones(1, n, dtype=dtype)
    rtol = 1e-5 if dtype == torch.float32 else 1e-12
    with count_calls() as count:
        check_box_and_polytope(total, lo, hi, rtol)
    assert count.host_reads == 1, count.host_read_names
    nan_lo = lo.clone()
    nan_lo[0, 2] = float("nan")
    bad = [(nan_lo, hi, total), (lo, torch.full_like(hi, -float("inf")), total), (hi, hi, total),
           (lo, hi, total.with_k(torch.tensor([[4.0, 2.0]], dtype=dtype))),     # group 0 cannot reach 4: empty
           (lo, hi, total.with_k(torch.tensor([[1.0, 3.0]], dtype=dtype)))]     # group 1 at its top: a face
    for lower, upper, con in bad:
        with pytest.raises(ValueError) as separate:
            check_bounds(lower, upper)
            check_polytope(con, lower, upper, rtol)
        with pytest.raises(ValueError) as together:
            check_box_and_polytope(con, lower, upper, rtol)
        assert str(together.value) == str(separate.value)
