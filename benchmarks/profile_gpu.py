#!/usr/bin/env python
r"""Where the time of the GPU targets goes: ``torch.profiler`` over a few calls of hardeq's side of B, C (batch 16),
D and sparse (the cases of ``benchmarks/bench_gpu.py``, same sizes), on one CUDA device.

For each case it writes the top operators by self CPU time and by self device time, and counts the calls that
synchronise the host with the device (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaMemcpy*`` that
return to the host, ``aten::item``, ``aten::_local_scalar_dense``): on a GPU, a call of a few milliseconds is
bounded by them and by the number of kernel launches, not by the arithmetic.

Usage::

    python benchmarks/profile_gpu.py --out OUT_DIR            # on a CUDA machine (about a minute)
    python benchmarks/profile_gpu.py --device cpu --smoke      # the same code at tiny sizes, on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import hardeq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_gpu import SIZES  # noqa: E402
from bench_sparse import flow_balance_matrix  # noqa: E402

DTYPE = torch.float32
SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "aten::item", "aten::_local_scalar_dense",
              "aten::nonzero", "aten::is_nonzero")


def case_b(dev, n, a, batch):
    g = torch.Generator().manual_seed(1)
    A = torch.randn(a, n, generator=g, dtype=DTYPE).to(dev)
    loc = torch.randn(batch, n, generator=g, dtype=DTYPE).to(dev)
    scale = (torch.rand(batch, n, generator=g, dtype=DTYPE) + 0.5).to(dev)
    k = torch.randn(batch, a, generator=g, dtype=DTYPE).to(dev)
    return lambda: hardeq.ConstrainedNormal(
        loc, scale, constraint=hardeq.LinearConstraint(A, k, validate_args=False), validate_args=False).sample()


def case_c(dev, n, a, batch):
    g = torch.Generator().manual_seed(3)
    A = (torch.randn(a, n, generator=g, dtype=DTYPE) / n ** 0.5).to(dev)
    loc = torch.randn(batch, n, generator=g, dtype=DTYPE).to(dev)
    scale = (torch.rand(batch, n, generator=g, dtype=DTYPE) + 0.5).to(dev)
    k = torch.randn(batch, a, generator=g, dtype=DTYPE).to(dev)
    return lambda: hardeq.ConstrainedNormal(
        loc, scale, constraint=hardeq.LinearConstraint(A, k, validate_args=False), validate_args=False).sample()


def case_d(dev, graphs, max_nodes):
    g = torch.Generator().manual_seed(4)
    sizes = torch.randint(1, max_nodes + 1, (graphs,), generator=g)
    batch = torch.repeat_interleave(torch.arange(graphs), sizes).to(dev)
    n = batch.numel()
    loc = torch.randn(n, generator=g, dtype=DTYPE).to(dev).requires_grad_()
    scale = (torch.rand(n, generator=g, dtype=DTYPE) + 0.5).to(dev).requires_grad_()
    totals = torch.randn(graphs, generator=g, dtype=DTYPE).to(dev)
    target = torch.randn(n, generator=g, dtype=DTYPE).to(dev)

    def step():
        d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.SumConstraint(batch, totals))
        ((d.rsample() - target) ** 2).sum().backward()
    return step


def case_sparse(dev, n, a, per_column, samples):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        A = flow_balance_matrix(a, n, per_column, 0, DTYPE).to(dev)
    g = torch.Generator().manual_seed(5)
    loc = torch.randn(n, generator=g, dtype=DTYPE).to(dev)
    scale = (torch.rand(n, generator=g, dtype=DTYPE) + 0.5).to(dev)
    k0 = (torch.randn(a, generator=g, dtype=DTYPE) * 10).to(dev)
    shift = [0]

    def conditioned():
        shift[0] += 1
        c = hardeq.SparseConstraint(A, k0 + shift[0])
        return hardeq.ConstrainedNormal(loc, scale, constraint=c).sample((samples,))
    return conditioned


def profile_case(name: str, fn, dev: torch.device, calls: int, rows: int) -> dict:
    for _ in range(3):  # warm: caches of A's constants, cuBLAS/cuSOLVER handles, allocator
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    device_key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    syncs = {e.key: e.count // calls for e in events if any(s in e.key for s in SYNC_NAMES)}
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    table_cpu = events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
    table_dev = events.table(sort_by=device_key, row_limit=rows, max_name_column_width=60)
    return {"case": name, "calls": calls, "syncs_per_call": syncs, "kernel_launches_per_call": launches / calls,
            "cpu_table": table_cpu, "device_table": table_dev}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny sizes")
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--out", type=Path, default=None, help="folder for profile.json and profile.txt")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    sizes = SIZES["smoke" if args.smoke else "full"]
    c = sizes["C"]
    cases = {"B": case_b(dev, **sizes["B"]), "C16": case_c(dev, c["n"], c["a"], c["batches"][0]),
             "D": case_d(dev, **sizes["D"]), "sparse": case_sparse(dev, **sizes["sparse"])}
    records, text = [], []
    for name, fn in cases.items():
        r = profile_case(name, fn, dev, args.calls, args.rows)
        records.append(r)
        head = (f"== {name}: host syncs per call {r['syncs_per_call']}, "
                f"kernel launches per call {r['kernel_launches_per_call']:.0f}")
        text += [head, "-- by self CPU time", r["cpu_table"], "-- by self device time", r["device_table"], ""]
        print(head, flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile.json").write_text(json.dumps(records, indent=1) + "\n")
        (args.out / "profile.txt").write_text("\n".join(text) + "\n")
    return records


if __name__ == "__main__":
    main()
