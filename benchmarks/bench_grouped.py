#!/usr/bin/env python
r"""Target D alone, with its per-kernel profile: a ragged PyG batch of 128 graphs (1-155 nodes, n = 9,502),
``ConstrainedNormal(loc, scale, constraint=SumConstraint(batch, totals)).rsample()`` + a squared loss + ``backward()``
with default validation, against ``loc + scale * randn`` + the same loss + ``backward()`` (target <= 3x).

The same problem as section D of ``bench_targets.py``, both of its rows: the same ``batch`` tensor every step, and a
new (equal) ``batch`` tensor every step, as a PyG ``DataLoader`` gives (both sides then pay the copy that stands in
for the loader's). The variants run interleaved in one process, in a new random order every round (one warm-up
call each); reported are the medians of ``time.perf_counter`` and their ratios, plus:

* the medians of ``time.thread_time`` (CPU time of this thread: on a loaded machine, the time the process is
  descheduled does not count; the two ratios agree on a quiet machine);
* with ``--against REV``, the same steps with the library of git revision ``REV`` (its ``src/hardeq`` extracted and
  imported as a second package), interleaved with the others: the quotient of the two medians is the change, and it
  moves much less with the load than either ratio;
* with ``--profile``, the torch profiler's table of one hardeq step (operators by self CPU time, calls per step).

Usage::

    PYTHONPATH=src python benchmarks/bench_grouped.py --threads 1 --repeats 1000 --profile
    PYTHONPATH=src python benchmarks/bench_grouped.py --threads 1 --repeats 1500 --against HEAD~3
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

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


def library_at(rev: str):
    """The ``hardeq`` package of git revision ``rev`` of this repository, imported as ``hardeq_at_<rev>`` (its
    ``src/hardeq`` extracted to a temporary directory; the package imports itself relatively)."""
    root = Path(__file__).resolve().parents[1]
    data = subprocess.run(["git", "-C", str(root), "archive", rev, "src/hardeq"], check=True,
                          capture_output=True).stdout
    name = "hardeq_at_" + "".join(c if c.isalnum() else "_" for c in rev)
    target = Path(tempfile.mkdtemp(prefix="bench_grouped_"))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(target, filter="data")
    (target / "src" / "hardeq").rename(target / name)
    sys.path.insert(0, str(target))
    return importlib.import_module(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--against", metavar="REV", help="also time the library of this git revision, interleaved")
    parser.add_argument("--profile", action="store_true", help="print the per-operator profile of one hardeq step")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batch, loc, scale, totals, target = problem()
    n = batch.numel()

    def base():
        ((loc + scale * torch.randn(n, dtype=loc.dtype) - target) ** 2).sum().backward()

    def base_fresh():
        batch.clone()
        base()

    def step(lib, fresh: bool):
        def run():
            index = batch.clone() if fresh else batch
            d = lib.ConstrainedNormal(loc, scale, constraint=lib.SumConstraint(index, totals))
            ((d.rsample() - target) ** 2).sum().backward()
        return run

    fns = {"base": base, "hardeq": step(hardeq, False), "base_fresh": base_fresh, "hardeq_fresh": step(hardeq, True)}
    if args.against:
        other = library_at(args.against)
        fns.update(against=step(other, False), against_fresh=step(other, True))
    load_before = os.getloadavg()
    for fn in fns.values():
        fn()
    wall = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    order, rng = list(fns), random.Random(0)
    for _ in range(args.repeats):
        rng.shuffle(order)
        for name in order:
            fn = fns[name]
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            cpu[name].append(time.thread_time() - c0)
            wall[name].append(time.perf_counter() - t0)
    mw = {k: statistics.median(v) for k, v in wall.items()}
    mc = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"n = {n}, 128 graphs, float32, {torch.get_num_threads()} thread(s), {args.repeats} interleaved rounds")
    for label, m in (("wall (perf_counter)", mw), ("cpu (thread_time)", mc)):
        print(f"{label} medians, ms:", ", ".join(f"{k} {v * 1e3:.3f}" for k, v in m.items()))
        rows = [("same batch", "", "base"), ("new batch every step", "_fresh", "base_fresh")]
        for row, suffix, ref in rows:
            line = f"  {row}: hardeq {m['hardeq' + suffix] / m[ref]:.2f}x (goal <= 3)"
            if args.against:
                line += (f", {args.against} {m['against' + suffix] / m[ref]:.2f}x, this / {args.against} "
                         f"{m['hardeq' + suffix] / m['against' + suffix]:.3f}")
            print(line)
    c = hardeq.SumConstraint(batch, totals)
    z = hardeq.ConstrainedNormal(loc, scale, constraint=c).rsample((8,)).detach()
    print(f"samples exact per row: {bool(c.check(z, rtol=2.5e-6).all())}")
    print(f"load average before {load_before}, after {os.getloadavg()}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        steps = 50
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                fns["hardeq"]()
        print(f"\nper-operator profile of {steps} hardeq steps (self CPU; divide the calls by {steps}):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=48))


if __name__ == "__main__":
    main()
