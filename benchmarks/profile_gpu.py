#!/usr/bin/env python
r"""Where the time of the GPU targets goes: ``torch.profiler`` over a few calls of hardeq's side of B, C (batch 16),
D and sparse (the cases of ``benchmarks/bench_gpu.py``, same sizes), on one CUDA device.

The cases are the ``hardeq`` calls of ``bench_gpu.make_*``. For each case it writes the top operators by self CPU
time and by self device time, and counts the calls that synchronise the host with the device
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaMemcpy*`` that return to the host, ``aten::item``,
``aten::_local_scalar_dense``): on a GPU, a call of a few milliseconds is bounded by them and by the number of kernel
launches, not by the arithmetic.

Usage::

    python benchmarks/profile_gpu.py --out OUT_DIR            # on a CUDA machine (about a minute)
    python benchmarks/profile_gpu.py --device cpu --smoke      # the same code at tiny sizes, on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_gpu import SIZES, make_b, make_c, make_d, make_sparse  # noqa: E402

DTYPE = torch.float32
SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "aten::item", "aten::_local_scalar_dense",
              "aten::nonzero", "aten::is_nonzero")


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
    cases = {"B": make_b(dev, **sizes["B"]).hardeq, "C16": make_c(dev, c["n"], c["a"], c["batches"][0]).hardeq,
             "D": make_d(dev, **sizes["D"]).hardeq, "sparse": make_sparse(dev, **sizes["sparse"]).hardeq}
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
