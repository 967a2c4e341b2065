#!/usr/bin/env python
r"""Target D alone, with its per-kernel profile: a ragged PyG batch of 128 graphs (1-155 nodes, n = 9,502),
``ConstrainedNormal(loc, scale, constraint=SumConstraint(batch, totals)).rsample()`` + a squared loss + ``backward()``
with default validation, against ``loc + scale * randn`` + the same loss + ``backward()`` (target <= 3x).

The same problem and timing as section D of ``bench_targets.py`` (the two variants interleaved in one process, one
warm-up call, the ratio of the two medians of ``time.perf_counter``), plus:

* the medians of ``time.thread_time`` (CPU time of this thread: on a loaded machine, the time the process is
  descheduled does not count; the two ratios agree on a quiet machine);
* with ``--profile``, the torch profiler's table of one hardeq step (operators by self CPU time, calls per step).

Usage::

    PYTHONPATH=src python benchmarks/bench_grouped.py --threads 1 --repeats 200 --profile
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import hardeq


def problem(graphs: int = 128, max_nodes: int = 155, dtype: torch.dtype = torch.float32):
    """Section D's inputs (the same generator seed): ``batch``, ``loc``, ``scale`` (leaves with gradients),
    ``totals``, ``target``."""
    g = torch.Generator().manual_seed(4)
    sizes = torch.randint(1, max_nodes + 1, (graphs,), generator=g)
    batch = torch.repeat_interleave(torch.arange(graphs), sizes)
    n = batch.numel()
    loc = torch.randn(n, generator=g, dtype=dtype).requires_grad_()
    scale = (torch.rand(n, generator=g, dtype=dtype) + 0.5).requires_grad_()
    totals = torch.randn(graphs, generator=g, dtype=dtype)
    target = torch.randn(n, generator=g, dtype=dtype)
    return batch, loc, scale, totals, target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="print the per-operator profile of one hardeq step")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batch, loc, scale, totals, target = problem()
    n = batch.numel()

    def base():
        ((loc + scale * torch.randn(n, dtype=loc.dtype) - target) ** 2).sum().backward()

    def constrained():
        d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.SumConstraint(batch, totals))
        ((d.rsample() - target) ** 2).sum().backward()

    fns = {"base": base, "hardeq": constrained}
    load_before = os.getloadavg()
    for fn in fns.values():
        fn()
    wall = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            cpu[name].append(time.thread_time() - c0)
            wall[name].append(time.perf_counter() - t0)
    mw = {k: statistics.median(v) for k, v in wall.items()}
    mc = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"n = {n}, 128 graphs, float32, {torch.get_num_threads()} thread(s), {args.repeats} interleaved repeats")
    print(f"wall (perf_counter) medians: unconstrained {mw['base'] * 1e3:.3f} ms, hardeq {mw['hardeq'] * 1e3:.3f} ms, "
          f"ratio {mw['hardeq'] / mw['base']:.2f}x (goal <= 3)")
    print(f"cpu (thread_time) medians:   unconstrained {mc['base'] * 1e3:.3f} ms, hardeq {mc['hardeq'] * 1e3:.3f} ms, "
          f"ratio {mc['hardeq'] / mc['base']:.2f}x")
    c = hardeq.SumConstraint(batch, totals)
    z = hardeq.ConstrainedNormal(loc, scale, constraint=c).rsample((8,)).detach()
    print(f"samples exact per row: {bool(c.check(z, rtol=2.5e-6).all())}")
    print(f"load average before {load_before}, after {os.getloadavg()}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        steps = 50
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                constrained()
        print(f"\nper-operator profile of {steps} hardeq steps (self CPU; divide the calls by {steps}):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=48))


if __name__ == "__main__":
    main()
