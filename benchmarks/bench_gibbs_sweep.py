"""The Gibbs sweep's budgets and method="auto"'s choice (issue 40).

--counts: ATen calls per sweep (count_calls; the difference between sample calls of 60 and 20 sweeps, / 40) and host
reads per sample call (the mode solved and cached first), for a grouped sum, a dense row and a rank-2 factor (the
augmentation), n = 50 / 400 / 4,000, 4 chains.

--auto: on a 6-coordinate problem with a strongly correlated full covariance (two seeds, two diagonal shares), the
method auto chooses and its pilot's scores, against the measured ESS per second (median over coordinates of the
multi-chain ESS, 32 chains x 100 draws after 20 burn-in steps, timed) of Gibbs and HMC.

    OMP_NUM_THREADS=1 python benchmarks/bench_gibbs_sweep.py --counts --auto
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch

import hardeq
from hardeq.bounds import blocked_gibbs, exact_hmc
from hardeq.bounds.choice import choose_method
from hardeq.testing import count_calls

F = torch.float64


def counts() -> None:
    for n, batch in ((50, 32), (400, 8), (4000, 2)):
        for kind in ("sum", "dense", "lowrank"):
            g = torch.Generator().manual_seed(0)
            loc = torch.randn(batch, n, generator=g, dtype=F) * 0.3 - 0.2
            k = torch.ones(batch, 1, dtype=F)
            con = (hardeq.SumConstraint(torch.zeros(n, dtype=torch.long), k)
                   if kind == "sum" else hardeq.LinearConstraint(torch.ones(1, n, dtype=F), k))
            extra = {"cov_factor": torch.randn(n, 2, generator=g, dtype=F) * 0.1} if kind == "lowrank" else {}
            t = hardeq.ConstrainedNormal(loc, 0.3, constraint=con, validate_args=False, **extra).truncate(0.0, 1.0)
            t.mode  # noqa: B018
            c = {}
            for sweeps in (20, 60):
                with count_calls() as cc:
                    t.sample((4,), method="gibbs", burn_in=sweeps - 1, generator=torch.Generator().manual_seed(1))
                c[sweeps] = cc
            print(f"| {n} | {batch} | {kind} | {(c[60].calls - c[20].calls) / 40:.2f} | {c[20].host_reads}, "
                  f"{c[60].host_reads} |")


def auto() -> None:
    warnings.simplefilter("ignore")
    for share in (0.02, 0.001):
        for seed in (0, 1):
            X = torch.randn(6, 6, generator=torch.Generator().manual_seed(seed), dtype=F)
            cov = X @ X.T + share * torch.eye(6, dtype=F)
            d = hardeq.ConstrainedNormal(torch.zeros(6, dtype=F), covariance_matrix=cov,
                                         constraint=hardeq.LinearConstraint(torch.ones(1, 6, dtype=F),
                                                                            torch.tensor([0.5], dtype=F)))
            t = d.truncate(-1.0, 1.0)
            tc = time.perf_counter()
            method, scores = choose_method(t.base, t._lo, t._hi, t.mode, num=3200, chains=32, burn_in=20,
                                           acceptance=float(t.acceptance.min()), threshold=0.1,
                                           generator=torch.Generator().manual_seed(0))
            pilot = time.perf_counter() - tc
            start = t.mode.expand(32, 6).contiguous()
            real = {}
            for name, run in (("gibbs", blocked_gibbs), ("hmc", exact_hmc)):
                t0 = time.perf_counter()
                r = run(t.base, t._lo, t._hi, start, num_samples=100, burn_in=20,
                        generator=torch.Generator().manual_seed(0))
                real[name] = float(r.ess.median()) / (time.perf_counter() - t0)
            print(f"| {share} | {seed} | {float(t.acceptance):.3f} | {method} | {scores['gibbs']:.0f} | "
                  f"{scores.get('hmc', 0.0):.0f} | {real['gibbs']:.0f} | {real['hmc']:.0f} | {pilot:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", action="store_true")
    parser.add_argument("--auto", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, load average {os.getloadavg()[0]:.1f}")
    if args.counts:
        print("| n | batch | case | ATen calls per sweep | host reads per call (20, 60 sweeps) |")
        counts()
    if args.auto:
        print("| diagonal share | seed | acceptance | auto | pilot Gibbs | pilot HMC | measured Gibbs ESS/s "
              "| measured HMC ESS/s | pilot s |")
        auto()


if __name__ == "__main__":
    main()
