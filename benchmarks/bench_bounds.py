#!/usr/bin/env python
r"""Truncated Gaussians on a plane: ``hardeq.bounds.exact_hmc`` against BoTorch's ``LinearEllipticalSliceSampler``
and ``tmg-hmc``, in effective samples per second of the least-mixing coordinate.

The problems (one per ``n`` and constraint): ``z ~ N(mu, sigma^2 I)`` with ``mu_i = 0.1``, ``sigma = 0.5``, given
``A z = k`` and ``0 <= z <= 1`` (the mean a fifth of a standard deviation from the face ``z = 0``):

* ``sum``: one sum-to-total row, ``sum_i z_i = 0.1 n`` (``SumConstraint``);
* ``dense``: ``a = 8`` rows, ``A`` standard normal (seed 0), ``k = A (0.1 * 1)`` (``LinearConstraint``).

Every sampler starts its chains at ``z0 = 0.1 * 1`` (on the plane, inside the box), runs ``burn_in`` iterations
and then ``draws`` kept iterations; the time is the wall time of all of them (set-up excluded: hardeq's
factorisation, and the competitors' dense null-space reformulation, are timed separately and printed).
``min ESS`` is the multi-chain effective sample size (``hardeq.bounds.effective_sample_size``, Stan's
estimator) of the least-mixing coordinate of ``z``; ``ESS/s = min ESS / time``.

* **hardeq**: ``exact_hmc`` with 64 chains, travel time uniform in ``[pi/8, pi/2]``.
* **BoTorch** ``LinearEllipticalSliceSampler`` (Wu & Gardner 2024), 64 chains, the same burn-in, and as many
  draws as fit in hardeq's time (at most ``--botorch-budget`` s, at least hardeq's number of draws): its steps
  are cheap and its chains slow. It has no equality constraints
  (only fixed features), so they are eliminated by hand: ``z = z0 + N y`` with ``N`` an orthonormal basis of the
  null space of ``A`` (``n x (n - a)``, from a dense SVD/QR), ``y ~ N(N^T(mu_bar - z0), N^T Sigma_bar N)`` and the box
  as ``2n`` inequalities ``[N; -N] y <= [1 - z0; z0]``. Dense ``O(n^2)`` memory; at ``n = 10,000`` the matrices
  alone take several GB and every step costs ``O(n^2)`` per chain, so it is not run there (the table says so).
* **tmg-hmc** (``TMGSampler``, exact HMC, Pakman & Paninski 2014): one chain per sampler, the same null-space
  reformulation, each of the ``2n`` walls added as a linear constraint; chains are run one after another
  (``--tmg-chains``, default 4) within ``--tmg-budget`` seconds per problem; problems whose single draw would
  exceed the budget are skipped (the table says so). tmg-hmc 1.0.4 handles axis-aligned boxes, but on this
  null-space form (dense wall normals) at n >= 10 every trajectory it retries ends with a violated constraint and
  its retry recursion exceeds Python's limit (``RecursionError``; the table says so); at n = 5 it runs.

Second table: the cost of one HMC iteration (64 trajectories) relative to one untruncated draw of 64 samples
(``dist.sample((64,))``, the same plane), against ``n`` (box on every coordinate) and, at ``n = 1,000``, against the
number ``m`` of coordinates that carry the box (the others unbounded); with the mean bounces per trajectory.

Usage (one torch thread; the same seed everywhere)::

    PYTHONPATH=src python benchmarks/bench_bounds.py --sizes 100 1000        # the README's run
    PYTHONPATH=src python benchmarks/bench_bounds.py --sizes 10000 --skip-cost # hours on one core (see README)
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time

import numpy as np
import torch

import hardeq
from hardeq.bounds import effective_sample_size, exact_hmc

LOC, SCALE = 0.1, 0.5


def problem(n: int, kind: str, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    z0 = torch.full((n,), LOC, dtype=dtype)
    if kind == "sum":
        con = hardeq.SumConstraint(torch.zeros(n, dtype=torch.long), torch.tensor([LOC * n], dtype=dtype))
        A = torch.ones(1, n, dtype=dtype)
    else:
        A = torch.randn(8, n, generator=g, dtype=dtype)
        con = hardeq.LinearConstraint(A, A @ z0)
    dist = hardeq.ConstrainedNormal(torch.full((n,), LOC, dtype=dtype), SCALE, constraint=con)
    return dist, A, z0


def min_ess_rate(samples: torch.Tensor, seconds: float) -> tuple[float, float]:
    """``samples`` ``(draws, chains, n)`` -> (min ESS over coordinates, min ESS per second)."""
    ess = effective_sample_size(samples)
    return float(ess.min()), float(ess.min()) / seconds


def run_hardeq(dist, z0, chains, burn_in, draws, seed):
    dist.sample((1,))  # factorisation done (cached) before timing
    start = z0.expand(chains, -1).contiguous()
    t = time.perf_counter()
    res = exact_hmc(dist, 0.0, 1.0, start, num_samples=draws, burn_in=burn_in,
                    generator=torch.Generator().manual_seed(seed))
    seconds = time.perf_counter() - t
    feasible = bool(((res.samples >= 0) & (res.samples <= 1)).all())
    return res.samples, seconds, res.bounces / res.trajectories, feasible


def null_space_problem(dist, A, z0):
    """Dense reformulation for the competitors: orthonormal ``N`` (n x d), the law of ``y`` and the box in ``y``."""
    n = A.shape[1]
    Q, _ = torch.linalg.qr(A.T, mode="complete")          # (n, n); the last n - a columns span null(A)
    N = Q[:, A.shape[0]:].contiguous()
    var = torch.full((n,), SCALE**2, dtype=A.dtype)
    prec_y = N.T @ (N / var[:, None])                      # N^T Sigma^-1 N, (d, d)
    cov_y = torch.linalg.inv(prec_y)
    cov_y = (cov_y + cov_y.T) / 2
    mean_y = N.T @ (dist.mean - z0)
    A_ineq = torch.cat([N, -N])                            # [N; -N] y <= [1 - z0; z0]
    b_ineq = torch.cat([1 - z0, z0]).unsqueeze(-1)
    return N, mean_y, cov_y, A_ineq, b_ineq


def run_botorch(N, mean_y, cov_y, A_ineq, b_ineq, z0, chains, burn_in, draws, seed, budget, max_values=2e7):
    """At least ``draws`` draws after ``burn_in``, and more while the time stays below ``budget`` seconds (at
    most ``max_values`` stored numbers): its steps are cheap and its chains slow, so equal draws would leave it
    short of its burn-in."""
    from botorch.utils.probability.lin_ess import LinearEllipticalSliceSampler

    torch.manual_seed(seed)
    d = N.shape[1]
    t = time.perf_counter()
    sampler = LinearEllipticalSliceSampler(inequality_constraints=(A_ineq, b_ineq),
                                           interior_point=torch.zeros(d, 1, dtype=N.dtype),
                                           mean=mean_y.unsqueeze(-1), covariance_matrix=cov_y,
                                           burnin=burn_in, num_chains=chains)
    probe = 5
    ys = [sampler.draw(probe)]
    per_draw = (time.perf_counter() - t) / (burn_in + probe)
    total = max(draws, min(int(budget / per_draw) - burn_in, int(max_values // (chains * d))))
    if total > probe:
        ys.append(sampler.draw(total - probe))
    y = torch.cat(ys).reshape(-1, chains, d)
    seconds = time.perf_counter() - t
    z = z0 + y @ N.T
    feasible = bool(((z >= -1e-9) & (z <= 1 + 1e-9)).all())
    return z, seconds, feasible


def run_tmg(N, mean_y, cov_y, A_ineq, b_ineq, z0, chains, burn_in, draws, budget, seed):
    from tmg_hmc import TMGSampler

    np.random.seed(seed)
    d = N.shape[1]
    cov = cov_y.numpy()
    out, t0 = [], time.perf_counter()
    for c in range(chains):
        sampler = TMGSampler(mean_y.numpy()[:, None], cov)
        for row, bound in zip(A_ineq.numpy(), b_ineq.squeeze(-1).numpy()):
            sampler.add_constraint(f=-row[:, None], c=float(bound), sparse=False)    # bound - row . y >= 0
        t = time.perf_counter()
        try:
            y = sampler.sample(np.zeros(d), n_samples=draws, burn_in=burn_in)
        except RecursionError:  # every retry of a trajectory ended outside the polytope (see the docstring)
            return "failed", time.perf_counter() - t, c + 1
        out.append(y)
        if c == 0 and (time.perf_counter() - t) * chains > budget:
            return None, time.perf_counter() - t, c + 1
    seconds = time.perf_counter() - t0
    y = torch.from_numpy(np.stack(out, axis=1))                # (draws, chains, d)
    return z0 + y @ N.T, seconds, chains


def cost_table(args):
    print("\n## Cost of one HMC iteration (64 trajectories) vs one untruncated draw of 64 (sum constraint)")
    print(f"{'n':>7} {'m boxed':>8} {'bounces/traj':>13} {'HMC iter ms':>12} {'draw ms':>9} {'ratio':>8}")
    settings = [(n, n) for n in args.cost_sizes if n <= args.cost_max_full]
    settings += [(n, m) for n in args.cost_sizes for m in (0, 10, 100) if n >= 1000]
    for n, m in settings:
        dist, _, z0 = problem(n, "sum")
        dist.sample((64,))
        lower = torch.full((n,), -math.inf, dtype=torch.float64)
        upper = torch.full((n,), math.inf, dtype=torch.float64)
        lower[:m], upper[:m] = 0.0, 1.0
        iters = max(2, min(20, int(2e5 // max(n, 100 * m))))
        t = time.perf_counter()
        res = exact_hmc(dist, lower, upper, z0.expand(64, -1).contiguous(), num_samples=iters, burn_in=0,
                        generator=torch.Generator().manual_seed(1))
        hmc = (time.perf_counter() - t) / iters
        reps = 20
        t = time.perf_counter()
        for _ in range(reps):
            dist.sample((64,))
        draw = (time.perf_counter() - t) / reps
        print(f"{n:>7} {m:>8} {res.bounces / res.trajectories:>13.1f} {1e3 * hmc:>12.2f} {1e3 * draw:>9.3f} "
              f"{hmc / draw:>8.0f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--kinds", nargs="+", default=["sum", "dense"])
    ap.add_argument("--chains", type=int, default=64)
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--burn-in", type=int, default=20)
    ap.add_argument("--large-draws", type=int, default=10, help="draws at n >= 1,000 (each iteration is long)")
    ap.add_argument("--tmg-chains", type=int, default=4)
    ap.add_argument("--tmg-budget", type=float, default=300.0, help="seconds per problem for tmg-hmc")
    ap.add_argument("--botorch-max-n", type=int, default=2000, help="largest n for the dense BoTorch reformulation")
    ap.add_argument("--botorch-budget", type=float, default=120.0,
                    help="BoTorch runs for min(hardeq's time, this) seconds, at least as many draws as hardeq")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--cost-sizes", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--cost-max-full", type=int, default=1000, help="largest n with the box on every coordinate "
                    "in the cost table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f}, float64, box [0, 1], mu = {LOC}, sigma = {SCALE}")
    print(f"{'n':>6} {'A':>5} {'sampler':>8} {'chains':>6} {'draws':>6} {'time s':>8} {'min ESS':>8} {'ESS/s':>9} "
          f"{'vs BoTorch':>10}  note")
    for n in args.sizes:
        for kind in args.kinds:
            dist, A, z0 = problem(n, kind)
            draws = args.draws if n < 1000 else args.large_draws
            burn = args.burn_in if n < 1000 else max(2, args.burn_in // 10)
            samples, sec, bounces, ok = run_hardeq(dist, z0, args.chains, burn, draws, seed=0)
            ess, rate_h = min_ess_rate(samples, sec)
            rows = [("hardeq", args.chains, draws, sec, ess, rate_h, f"{bounces:.0f} bounces/trajectory, "
                     f"feasible {ok}")]
            rate_b = None
            if n <= args.botorch_max_n:
                t = time.perf_counter()
                N, mean_y, cov_y, A_ineq, b_ineq = null_space_problem(dist, A, z0)
                setup = time.perf_counter() - t
                zb, secb, okb = run_botorch(N, mean_y, cov_y, A_ineq, b_ineq, z0, args.chains, burn, draws, seed=0,
                                            budget=min(sec, args.botorch_budget))
                essb, rate_b = min_ess_rate(zb, secb)
                rows.append(("BoTorch", args.chains, zb.shape[0], secb, essb, rate_b,
                             f"null-space set-up {setup:.1f} s not timed; feasible {okb}"))
                zt, sect, used = run_tmg(N, mean_y, cov_y, A_ineq, b_ineq, z0, args.tmg_chains, burn, draws,
                                         args.tmg_budget, seed=0)
                if isinstance(zt, str):
                    rows.append(("tmg-hmc", used, draws, math.nan, math.nan, math.nan,
                                 f"failed after {sect:.1f} s: RecursionError (every retried trajectory ended "
                                 "outside the polytope)"))
                elif zt is None:
                    rows.append(("tmg-hmc", used, draws, math.nan, math.nan, math.nan,
                                 f"not run: one chain took {sect:.0f} s, {args.tmg_chains} exceed the "
                                 f"{args.tmg_budget:.0f} s budget"))
                else:
                    esst, ratet = min_ess_rate(zt, sect)
                    rows.append(("tmg-hmc", used, draws, sect, esst, ratet, "chains one after another"))
            else:
                rows.append(("BoTorch", args.chains, 0, math.nan, math.nan, math.nan,
                             f"not run: dense null-space form needs 2n x (n-a) = {2 * n}x{n - A.shape[0]} "
                             f"inequalities and O(n^2) per step"))
                rows.append(("tmg-hmc", 1, 0, math.nan, math.nan, math.nan, "not run: same dense form, 2n walls"))
            for name, ch, dr, sec_, ess_, rate, note in rows:
                vs = rate_h / rate_b if (name == "hardeq" and rate_b) else (rate / rate_b if rate_b else math.nan)
                print(f"{n:>6} {kind:>5} {name:>8} {ch:>6} {dr:>6} {sec_:>8.2f} {ess_:>8.1f} {rate:>9.2f} "
                      f"{vs:>10.2f}  {note}", flush=True)
    if not args.skip_cost:
        cost_table(args)


if __name__ == "__main__":
    main()
