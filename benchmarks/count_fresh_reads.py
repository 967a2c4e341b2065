#!/usr/bin/env python
"""Host reads and ATen calls of a *fresh* truncated law (what a training step pays: a new law every step), counted
with ``hardeq.testing.count_calls``: ``truncate(0, 1)``, then the first ``sample((64,))`` with ``method="gibbs"``
and ``"auto"`` (n = 50, batch 8; a grouped sum, a dense row, a dense row with a rank-2 factor), and the portfolio
head's training step (n = 50, batch 32, one dense sum row, ``PersistentChains``, 4 and 16 sweeps) against the
untruncated ``log_prob`` step. The numbers are in benchmarks/README.md ("The GPU-shaped Gibbs sweep").

Usage: ``python benchmarks/count_fresh_reads.py``
"""

from __future__ import annotations

import torch

import hardeq
from hardeq.bounds import PersistentChains
from hardeq.testing import count_calls

F = torch.float64


def _base(kind: str, dtype: torch.dtype, n: int = 50, batch: int = 8) -> hardeq.ConstrainedNormal:
    g = torch.Generator().manual_seed(0)
    loc = (torch.randn(batch, n, generator=g, dtype=F) * 0.3 - 0.2).to(dtype)
    k = torch.ones(batch, 1, dtype=dtype)
    con = (hardeq.SumConstraint(torch.zeros(n, dtype=torch.long), k) if kind == "sum"
           else hardeq.LinearConstraint(torch.ones(1, n, dtype=dtype), k))
    extra = {"cov_factor": (torch.randn(n, 2, generator=g, dtype=F) * 0.1).to(dtype)} if kind == "lowrank" else {}
    return hardeq.ConstrainedNormal(loc, 0.3, constraint=con, validate_args=False, **extra)


def sampling(dtype: torch.dtype) -> None:
    for kind in ("sum", "dense", "lowrank"):
        row = []
        for method in ("gibbs", "auto"):
            base = _base(kind, dtype)
            base.conditioner  # noqa: B018  (the untruncated law's own setup)
            with count_calls() as made:
                d = base.truncate(0.0, 1.0)
            with count_calls() as first:
                d.sample((64,), method=method, generator=torch.Generator().manual_seed(1))
            row.append(f"{method}: truncate {made.host_reads} reads, first sample {first.host_reads} reads / "
                       f"{first.calls} calls")
        print(f"{str(dtype):14s} {kind:8s} " + " | ".join(row))


def training(dtype: torch.dtype, sweeps: int, steps: int = 3) -> None:
    torch.manual_seed(0)
    n, batch = 50, 32
    head = torch.nn.Linear(8, 2 * n).to(dtype)
    x = torch.randn(batch, 8, dtype=dtype)
    y = torch.distributions.Dirichlet(torch.ones(n, dtype=F)).sample((batch,)).to(dtype)
    con = hardeq.LinearConstraint(torch.ones(1, n, dtype=dtype), torch.ones(batch, 1, dtype=dtype))
    chains = PersistentChains(sweeps=sweeps)
    counts = []
    for truncated in (False,) + (True,) * steps:
        with count_calls() as count:
            out = head(x)
            base = hardeq.ConstrainedNormal(out[:, :n], out[:, n:].exp(), constraint=con, validate_args=False)
            (base.truncate(0.0, 1.0, training=chains) if truncated else base).log_prob(y).mean().backward()
        counts.append((count.host_reads, count.calls))
    print(f"{str(dtype):14s} training step, {sweeps:2d} sweeps: untruncated {counts[0][0]} reads / {counts[0][1]} "
          f"calls; truncated steps (reads, calls) {counts[1:]}")


def main() -> None:
    torch.set_num_threads(1)
    for dtype in (F, torch.float32):
        sampling(dtype)
    for dtype in (F, torch.float32):
        for sweeps in (4, 16):
            training(dtype, sweeps)


if __name__ == "__main__":
    main()
