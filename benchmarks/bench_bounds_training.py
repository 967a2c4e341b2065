#!/usr/bin/env python
r"""One optimiser step through the truncated law: the long-only portfolio head in training mode.

The problem (issue "Bounds v2", item 1): ``n = 50`` weights, batch 32, ``LinearConstraint(torch.ones(1, 50),
ones(32, 1))`` (one sum row, dense), ``truncate(0, 1)``, a random ``nn.Linear(8, 100)`` giving ``loc`` and the
log-scales, Dirichlet(1) targets, Adam, float64, from a random start. ``training=PersistentChains()`` (4 chains, 4
sweeps of blocked Gibbs per step: ``hardeq.bounds.training``) against the default mode, which estimates ``log Z``
each step (subset simulation where the box is improbable; before this work one such step did not finish in 600 s,
so the default mode is run only with ``--default``).

Prints the seconds of each step (the first is from the random start, with the chains starting at the data).

Usage: ``python benchmarks/bench_bounds_training.py [--steps 10] [--threads 1] [--default]``
"""

from __future__ import annotations

import argparse
import time

import torch

import hardeq
from hardeq.bounds import PersistentChains


def steps(num: int, training: bool, seed: int = 0) -> list[float]:
    torch.manual_seed(seed)
    n, batch = 50, 32
    f64 = torch.float64
    head = torch.nn.Linear(8, 2 * n).double()
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    x = torch.randn(batch, 8, dtype=f64)
    y = torch.distributions.Dirichlet(torch.ones(n, dtype=f64)).sample((batch,))
    con = hardeq.LinearConstraint(torch.ones(1, n, dtype=f64), torch.ones(batch, 1, dtype=f64))
    chains = PersistentChains() if training else False
    times = []
    for _ in range(num):
        start = time.perf_counter()
        out = head(x)
        d = hardeq.ConstrainedNormal(out[:, :n], out[:, n:].exp(), constraint=con).truncate(0.0, 1.0,
                                                                                              training=chains)
        loss = -d.log_prob(y).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--default", action="store_true", help="also time the default mode (log Z every step)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    t = steps(args.steps, True)
    print(f"training=PersistentChains(): first step {t[0]:.3f} s, median {sorted(t)[len(t) // 2]:.3f} s, "
          f"all {[round(s, 3) for s in t]}")
    if args.default:
        t = steps(1, False)
        print(f"default mode (log Z estimated): first step {t[0]:.1f} s")


if __name__ == "__main__":
    main()
