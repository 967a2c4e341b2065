"""Seeded fuzz: every conditioned vector meets ``A z = k`` to round-off, for every structure.

Criterion (issue 8): ``max_i |A z - k|_i <= tol * max_i (|A| |z|)_i`` per sample, evaluated in float64, with
``tol = 1e-5`` (float32) and ``1e-12`` (float64); for samples ``condition(loc + F eps)`` and the conditional mean
``condition(loc)``. Cases: n in 2..40, scale ratios up to 1e8 (log-uniform scales over up to eight decades),
loc and k of random magnitude (up to 1e3 times the scales), diagonal / full / low-rank covariance, dense
``LinearConstraint`` and grouped ``SumConstraint`` (groups of one included), batched and not.
"""

from __future__ import annotations

import math

import pytest
import torch

import hardeq
from hardeq.linalg.conditioning import Conditioner
from hardeq.linalg.covariance import DiagonalCovariance, FullCovariance, LowRankCovariance

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
CASES_PER_GROUP = 250
STRUCTURES = ["diag", "full", "lowrank"]
KINDS = ["dense", "grouped"]


def make_case(g: torch.Generator, dtype: torch.dtype, structure: str, kind: str):
    """One random problem; returns (Conditioner, loc, noise, A_dense, description)."""
    def u(lo, hi):
        return lo + (hi - lo) * float(torch.rand((), generator=g, dtype=torch.float64))

    n = int(torch.randint(2, 41, (), generator=g))
    a = int(torch.randint(1, n, (), generator=g))
    batch = (int(torch.randint(2, 4, (), generator=g)),) if torch.rand((), generator=g) < 0.5 else ()
    decades = u(0, 8)  # scale ratio up to 1e8
    centre = u(-3, 3)
    scale = 10 ** (centre + decades * (torch.rand(batch + (n,), generator=g, dtype=torch.float64) - 0.5))
    if structure == "diag":
        cov = DiagonalCovariance(scale.to(dtype))
        F = torch.diag_embed(scale)
    elif structure == "full":
        L = torch.randn(batch + (n, n), generator=g, dtype=torch.float64).tril(-1) * 0.3
        L = (L + torch.diag_embed(torch.ones(batch + (n,), dtype=torch.float64))) * scale.unsqueeze(-1)
        cov = FullCovariance(L.to(dtype))
        F = L
    else:
        r = int(torch.randint(1, 4, (), generator=g))
        W = torch.randn(batch + (n, r), generator=g, dtype=torch.float64) * scale.unsqueeze(-1) * u(0.01, 3)
        cov = LowRankCovariance(W.to(dtype), scale.to(dtype))
        F = torch.cat([torch.diag_embed(scale), W], -1)
    off = 10 ** u(-2, 3)  # loc off the plane by up to 1e3 scales
    loc = (torch.randn(batch + (n,), generator=g, dtype=torch.float64) * off * 10 ** centre).to(dtype)
    k_mag = 10 ** u(-3, 3)
    if kind == "dense":
        A = torch.randn(a, n, generator=g, dtype=torch.float64) * 10 ** (u(-1, 1))
        k = (torch.randn(batch + (a,), generator=g, dtype=torch.float64) * k_mag).to(dtype)
        con = hardeq.LinearConstraint(A.to(dtype), k, validate_args=False)
    else:
        # every group non-empty; small groups (and groups of one) are common
        index = torch.cat([torch.arange(a), torch.randint(0, a, (n - a,), generator=g)])
        index = index[torch.randperm(n, generator=g)]
        k = (torch.randn(batch + (a,), generator=g, dtype=torch.float64) * k_mag).to(dtype)
        con = hardeq.SumConstraint(index, k)
    cond = Conditioner(cov, con)
    noise = torch.randn((3,) + batch + (F.shape[-1],), generator=g, dtype=dtype)
    desc = f"{dtype} {structure} {kind} n={n} a={a} batch={batch} decades={decades:.1f} off={off:.1e}"
    return cond, loc, noise, con.dense_matrix().double(), desc


def relative_residual(A: torch.Tensor, k: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``max_i |A z - k|_i / max_i (|A| |z|)_i`` per vector, in float64."""
    z64 = z.double()
    res = (z64 @ A.mT - k.double()).abs().amax(-1)
    size = (z64.abs() @ A.abs().mT).amax(-1)
    return res / size


def run_group(dtype, structure, kind, cases=CASES_PER_GROUP, seed=0):
    """Worst relative residual over ``cases`` random problems, and the description of the worst case."""
    g = torch.Generator().manual_seed(seed * 1000 + STRUCTURES.index(structure) * 10 + KINDS.index(kind)
                                      + (0 if dtype == torch.float64 else 500))
    worst, worst_desc, failures = 0.0, "", 0
    for _ in range(cases):
        cond, loc, noise, A, desc = make_case(g, dtype, structure, kind)
        z = cond.condition(loc + cond.cov.sqrt_matvec(noise))
        mean = cond.condition(loc)
        k = cond.constraint.k
        rel = torch.cat([relative_residual(A, k, z).reshape(-1), relative_residual(A, k, mean).reshape(-1)])
        assert bool(torch.isfinite(z).all()) and bool(torch.isfinite(mean).all()), desc
        m = float(rel.max())
        failures += int(m > TOL[dtype])
        if m > worst:
            worst, worst_desc = m, desc
    return worst, worst_desc, failures


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny problems: a second OpenMP thread only adds synchronisation (and stalls on a
    loaded machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_every_sample_meets_the_constraint_to_round_off(dtype, structure, kind):
    worst, desc, failures = run_group(dtype, structure, kind)
    assert failures == 0, f"{failures} of {CASES_PER_GROUP} cases exceed {TOL[dtype]:g}; worst {worst:.2e} ({desc})"


def test_singleton_group_with_huge_scale_returns_k_exactly():
    """The issue's worst case: a group of one with scale 1.2e8 returned 0 where k = 0.3755 (ulp(z_hat) = 8)."""
    index = torch.tensor([0, 1, 1, 1])
    k = torch.tensor([0.3755, -2.0])
    scale = torch.tensor([1.2e8, 1.0, 3.0, 0.5])
    cond = Conditioner(DiagonalCovariance(scale), hardeq.SumConstraint(index, k))
    torch.manual_seed(0)
    z = cond.condition(torch.zeros(4) + scale * torch.randn(64, 4))
    assert bool((z[:, 0] == k[0]).all()), z[:, 0]
    assert float(relative_residual(cond.constraint.dense_matrix().double(), k, z).max()) <= TOL[torch.float32]


if __name__ == "__main__":  # report: worst relative residual per dtype / structure / constraint
    import time

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    for dt in (torch.float32, torch.float64):
        for st in STRUCTURES:
            for kd in KINDS:
                w, d, f = run_group(dt, st, kd)
                print(f"{str(dt):14s} {st:8s} {kd:8s} cases={CASES_PER_GROUP} failures={f} worst={w:.2e}  ({d})")
    print(f"{time.perf_counter() - t0:.1f} s; {math.prod([2, 3, 2]) * CASES_PER_GROUP} cases")
