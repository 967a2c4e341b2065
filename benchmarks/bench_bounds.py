#!/usr/bin/env python
r"""Truncated Gaussians on a plane: ``hardeq.bounds.blocked_gibbs`` and ``hardeq.bounds.exact_hmc`` against BoTorch's
``LinearEllipticalSliceSampler`` and ``tmg-hmc``, in effective samples per second of the least-mixing coordinate.

The problems (one per ``n`` and constraint): ``z ~ N(mu, sigma^2 I)`` with ``mu_i = 0.1``, ``sigma = 0.5``, given
``A z = k`` and ``0 <= z <= 1`` (the mean a fifth of a standard deviation from the face ``z = 0``):

* ``sum``: one sum-to-total row, ``sum_i z_i = 0.1 n`` (``SumConstraint``);
* ``dense``: ``a = 8`` rows, ``A`` standard normal (seed 0), ``k = A (0.1 * 1)`` (``LinearConstraint``).

Every sampler starts its chains at ``z0 = 0.1 * 1`` (on the plane, inside the box), runs ``burn_in`` iterations
and then ``draws`` kept iterations; the time is the wall time of all of them (set-up excluded: hardeq's
factorisation, and the competitors' dense null-space reformulation, are timed separately and printed).
``min ESS`` is the multi-chain effective sample size (``hardeq.bounds.effective_sample_size``, Stan's
estimator) of the least-mixing coordinate of ``z``; ``ESS/s = min ESS / time``.

* **gibbs**: ``blocked_gibbs`` (random-partition blocked Gibbs, ``method="gibbs"``) with 64 chains,
  ``--gibbs-burn-in`` sweeps then ``--gibbs-draws`` kept sweeps (its sweeps are cheap: it gets more of them).
* **hmc**: ``exact_hmc`` with 64 chains, travel time uniform in ``[pi/8, pi/2]`` (up to ``--hmc-max-n``: at
  n = 1,000 with the sum constraint one iteration takes a minute on a loaded core).
* **BoTorch** ``LinearEllipticalSliceSampler`` (Wu & Gardner 2024), 64 chains, the same burn-in as HMC, and as many
  draws as fit in the longer of the two hardeq times (at most ``--botorch-budget`` s, at least gibbs' number of
  draws): its steps are cheap and its chains slow. It has no equality constraints
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

The samplers of one problem run one after another in one process (gibbs, hmc, BoTorch, tmg-hmc), so that their
ratios share the machine's load.

Usage (one torch thread; the same seed everywhere)::

    PYTHONPATH=src python benchmarks/bench_bounds.py --sizes 100 1000        # the README's HMC run
    PYTHONPATH=src python benchmarks/bench_bounds.py --sizes 100 1000 10000 --hmc-max-n 100 --skip-tmg --skip-cost
    PYTHONPATH=src python benchmarks/bench_bounds.py --sizes 10000 --skip-cost # HMC at 10,000: hours on one core
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
from hardeq.testing import sum_conditioned_truncated_means
from hardeq.bounds import blocked_gibbs, effective_sample_size, exact_hmc

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


def run_gibbs(dist, z0, chains, burn_in, draws, seed, thin=1):
    dist.sample((1,))  # factorisation done (cached) before timing: the recorded draws are conditioned with it
    start = z0.expand(chains, -1).contiguous()
    t = time.perf_counter()
    res = blocked_gibbs(dist, 0.0, 1.0, start, num_samples=draws, burn_in=burn_in, thin=thin,
                        generator=torch.Generator().manual_seed(seed))
    seconds = time.perf_counter() - t                   # includes its ESS / R-hat, computed in chunks of coordinates
    z = res.samples
    feasible = bool(((z >= 0) & (z <= 1)).all()) and bool(dist.constraint.check(z).all())
    return float(res.ess.min()), seconds, float(res.rhat.max()), feasible


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


def portfolio_case(args):
    """The portfolio study's long-only rule on a synthetic case of its shape: 133 windows x 50 weights in [0, 1]
    summing to 1, sd 0.016, the mean 6 sd below 0 in 38 weights (the other 12 spread over [0.02, 0.14] plus a
    window's jitter), ``truncated.sample((16,), burn_in=50)`` as ``long_only_weights`` calls it (``auto``), then
    ESS and R-hat of 16 chains x ``--portfolio-draws`` sweeps per window, and the error of the 16-draw truncated
    mean against the exact mean (the law of independent truncated normals conditioned on their sum, by FFT)."""
    from hardeq.bounds import truncated_mode

    K, n, sd, draws, burn_in = 133, 50, 0.016, 16, 50
    g = torch.Generator().manual_seed(0)
    loc = torch.cat([torch.full((K, 38), -6 * sd, dtype=torch.float64),
                     torch.linspace(0.02, 0.14, 12, dtype=torch.float64).expand(K, 12)
                     + 0.01 * torch.randn(K, 12, generator=g, dtype=torch.float64)], dim=-1)
    con = hardeq.SumConstraint(torch.zeros(n, dtype=torch.long), torch.ones(1, dtype=torch.float64))
    truncated = hardeq.ConstrainedNormal(loc, torch.full((n,), sd, dtype=torch.float64), constraint=con).truncate(
        0.0, 1.0)
    t = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        info = truncated.sample_with_info((draws,), burn_in=burn_in)
    seconds = time.perf_counter() - t
    z = info.samples
    ok = bool(((z >= 0) & (z <= 1)).all()) and bool(con.check(z).all())
    print(f"\n## Portfolio long-only case ({K} windows x {n} weights, 38 means at -6 sd, sd {sd}): "
          f"sample(({draws},), burn_in={burn_in})")
    print(f"method {info.method}, {seconds:.2f} s (mode and pilot included), feasible {ok}")
    start = truncated_mode(truncated.base, truncated.lower, truncated.upper).expand(draws, K, n)
    t = time.perf_counter()
    res = blocked_gibbs(truncated.base, 0.0, 1.0, start, num_samples=args.portfolio_draws, burn_in=burn_in,
                        generator=torch.Generator().manual_seed(1))
    seconds = time.perf_counter() - t
    per_sweep = res.ess / (draws * args.portfolio_draws)
    print(f"{draws} chains x {args.portfolio_draws} draws after {burn_in} sweeps, all windows at once: "
          f"{seconds:.2f} s; ESS per draw (min / median over windows and weights) {float(per_sweep.min()):.3f} / "
          f"{float(per_sweep.median()):.3f}, min ESS {float(res.ess.min()):.0f} of {draws * args.portfolio_draws}, "
          f"max R-hat {float(res.rhat.max()):.3f}")
    exact = torch.tensor(np.stack([sum_conditioned_truncated_means(loc[w].numpy(), np.full(n, sd), 1.0, 0.0, 0.3, 2e-5)
                                   for w in range(4)]))
    err = (z[:, :4].mean(0) - exact).abs()
    var = res.samples[:, :, :4].reshape(-1, 4, n).var(0)
    ratio = (err / (var / draws).sqrt().clamp_min(1e-12)).amax()
    print(f"first 4 windows: |16-draw mean - exact| max {float(err.max()):.2e} (largest {float(ratio):.1f} iid "
          "standard errors of a 16-draw mean)")
    if args.portfolio_hmc:
        import warnings

        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            hmc = truncated.sample_with_info((draws,), method="hmc", burn_in=burn_in,
                                             generator=torch.Generator().manual_seed(0))
        print(f"the same call with method='hmc': {time.perf_counter() - t:.1f} s, min ESS (nan: 1 draw per chain) "
              f"{float(hmc.ess.min()):.1f}")


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
    ap.add_argument("--gibbs-draws", type=int, default=1000, help="kept sweeps of the Gibbs sampler")
    ap.add_argument("--gibbs-burn-in", type=int, default=100, help="sweeps of the Gibbs sampler discarded first")
    ap.add_argument("--gibbs-large-draws", type=int, default=200,
                    help="kept Gibbs sweeps at n >= 10,000 (64 x 200 x 10,000 float64 draws: 1 GB)")
    ap.add_argument("--gibbs-large-burn-in", type=int, default=100, help="Gibbs burn-in sweeps at n >= 10,000")
    ap.add_argument("--gibbs-large-thin", type=int, default=1, help="Gibbs thinning at n >= 10,000")
    ap.add_argument("--hmc-max-n", type=int, default=1000, help="largest n at which exact HMC runs")
    ap.add_argument("--skip-tmg", action="store_true", help="do not run tmg-hmc")
    ap.add_argument("--portfolio", action="store_true", help="only the portfolio long-only case (see portfolio_case)")
    ap.add_argument("--portfolio-draws", type=int, default=200, help="draws per chain for the portfolio ESS")
    ap.add_argument("--portfolio-hmc", action="store_true", help="also time method='hmc' on the portfolio case")
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--cost-sizes", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--cost-max-full", type=int, default=1000, help="largest n with the box on every coordinate "
                    "in the cost table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.portfolio:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average "
              f"{os.getloadavg()[0]:.1f}")
        portfolio_case(args)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f}, float64, box [0, 1], mu = {LOC}, sigma = {SCALE}")
    print(f"{'n':>6} {'A':>5} {'sampler':>8} {'chains':>6} {'draws':>6} {'time s':>8} {'min ESS':>8} {'ESS/s':>9} "
          f"{'vs BoTorch':>10}  note")
    for n in args.sizes:
        for kind in args.kinds:
            dist, A, z0 = problem(n, kind)
            draws = args.draws if n < 1000 else args.large_draws
            burn = args.burn_in if n < 1000 else max(2, args.burn_in // 10)
            g_draws = args.gibbs_draws if n < 10000 else args.gibbs_large_draws
            g_burn = args.gibbs_burn_in if n < 10000 else args.gibbs_large_burn_in
            g_thin = 1 if n < 10000 else args.gibbs_large_thin
            essg, secg, rhat_g, okg = run_gibbs(dist, z0, args.chains, g_burn, g_draws, seed=0, thin=g_thin)
            rate_g = essg / secg
            rows = [("gibbs", args.chains, g_draws, secg, essg, rate_g,
                     f"burn-in {g_burn} sweeps, thin {g_thin}, max R-hat {rhat_g:.3f}, feasible {okg}")]
            secs = [secg]
            if n <= args.hmc_max_n:
                samples, sec, bounces, ok = run_hardeq(dist, z0, args.chains, burn, draws, seed=0)
                ess, rate_h = min_ess_rate(samples, sec)
                rows.append(("hmc", args.chains, draws, sec, ess, rate_h, f"{bounces:.0f} bounces/trajectory, "
                             f"feasible {ok}"))
                secs.append(sec)
            else:
                rows.append(("hmc", args.chains, 0, math.nan, math.nan, math.nan,
                             f"not run (n > --hmc-max-n = {args.hmc_max_n})"))
            rate_b = None
            if n <= args.botorch_max_n:
                t = time.perf_counter()
                N, mean_y, cov_y, A_ineq, b_ineq = null_space_problem(dist, A, z0)
                setup = time.perf_counter() - t
                zb, secb, okb = run_botorch(N, mean_y, cov_y, A_ineq, b_ineq, z0, args.chains, burn,
                                            max(draws, g_draws), seed=0, budget=min(max(secs), args.botorch_budget))
                essb, rate_b = min_ess_rate(zb, secb)
                rows.append(("BoTorch", args.chains, zb.shape[0], secb, essb, rate_b,
                             f"null-space set-up {setup:.1f} s not timed; feasible {okb}"))
                if args.skip_tmg:
                    pass
                else:
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
            for name, ch, dr, sec_, ess_, rate, note in rows:
                vs = rate / rate_b if rate_b else math.nan
                print(f"{n:>6} {kind:>5} {name:>8} {ch:>6} {dr:>6} {sec_:>8.2f} {ess_:>8.1f} {rate:>9.2f} "
                      f"{vs:>10.2f}  {note}", flush=True)
            print(f"{n:>6} {kind:>5} load average {os.getloadavg()[0]:.1f}", flush=True)
    if not args.skip_cost:
        cost_table(args)


if __name__ == "__main__":
    main()
