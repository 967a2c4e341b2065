"""final="sample_box" for 16 CIFAR-sized images: the wall time of the last step's sample of the truncated law.

16 images of 3 x 32 x 32, the channel totals as constraint (3 groups of 1,024 pixels), the last step's prediction
x0 uniform in [-1.2, 1.2] (so that about a sixth of the pixels lie outside the box [-1, 1]), totals those of x0
clamped into the box, standard deviation 0.01, float32: hardeq.diffusion.box.sampled_last_step, which draws one
sample per image with TruncatedConstrainedNormal.sample() (method="auto"). One thread; the median of --repeats runs
after one warm-up, in wall time and in the process's CPU time (on a shared, loaded machine the CPU time is the
closer to what a quiet one would take), and the sampler auto chose.

    OMP_NUM_THREADS=1 python benchmarks/bench_sample_box.py --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import hardeq
from hardeq.diffusion.box import sampled_last_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(16, 3, 32, 32, generator=g) * 2.4 - 1.2
    index = torch.arange(3).repeat_interleave(32 * 32)
    k = x0.clamp(-1.0, 1.0).flatten(1).reshape(16, 3, -1).sum(-1)
    con = hardeq.SumConstraint(index, k)
    times, cpu = [], []
    for r in range(args.repeats + 1):
        t, c = time.perf_counter(), time.process_time()
        y = sampled_last_step(x0, con, 0.01, (-1.0, 1.0), generator=torch.Generator().manual_seed(r))
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        assert bool(((y >= -1) & (y <= 1)).all())
    flat = x0.flatten(1)
    dist = hardeq.ConstrainedNormal(flat, 0.01, constraint=con, validate_args=False).truncate(-1.0, 1.0)
    method = dist.sample_with_info(generator=torch.Generator().manual_seed(0)).method
    print(f"16 x (3, 32, 32), std 0.01, float32, 1 thread: median {statistics.median(times[1:]):.2f} s "
          f"(runs {', '.join(f'{t:.2f}' for t in times[1:])}; warm-up {times[0]:.2f} s), CPU time median "
          f"{statistics.median(cpu[1:]):.2f} s; method {method}; "
          f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
