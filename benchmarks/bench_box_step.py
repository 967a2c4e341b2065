#!/usr/bin/env python
r"""Cost of the exact final steps of :mod:`hardeq.diffusion` against a small sampling run, CPU.

The denoiser is a small untrained ``diffusers.UNet2DModel`` (channels 16/32/32, one block per level, no
attention, about 0.27 M parameters for one channel: the ``diffusion`` study's ``cpu`` U-Net; the time does not
depend on the weights) on ``B x C x 32 x 32`` images. Timed (medians over repeats, after a warm-up):

* one model evaluation, and a 50-step DDIM loop = 50 evaluations;
* ``box_project`` (exact channel sums and ``[-1, 1]``) with an isotropic and with a per-pixel variance;
* ``to_uint8_exact`` (8-bit with exact integer channel totals) against plain ``(255 x).round()``;
* ``constrained_x0`` (the unboxed conditioned step) for comparison.

Each final step is reported as a share of the 50-step loop.

Usage::

    PYTHONPATH=src python benchmarks/bench_box_step.py                 # B = 32, C = 1 and 3, 1 thread
    PYTHONPATH=src python benchmarks/bench_box_step.py --batch 64 --threads 2
"""

# ruff: noqa: B023  (the closures are timed within their own loop iteration)
from __future__ import annotations

import argparse
import statistics
import time

import torch

from hardeq.diffusion import box_project, channel_sum_constraint, constrained_x0, to_uint8_exact


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def unet(channels: int) -> torch.nn.Module:
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    return UNet2DModel(sample_size=32, in_channels=channels, out_channels=channels, block_out_channels=(16, 32, 32),
                       layers_per_block=1, norm_num_groups=8,
                       down_block_types=("DownBlock2D",) * 3, up_block_types=("UpBlock2D",) * 3).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), batch {args.batch}, {args.steps}-step loop")
    print(f"{'C':>2} {'step':<34} {'ms':>9} {'share of loop':>14}")
    for C in (1, 3):
        shape = (args.batch, C, 32, 32)
        m = 32 * 32
        g = torch.Generator().manual_seed(0)
        x = 1.3 * torch.randn(shape, generator=g)  # a pre-clamp output: about 44% of the pixels outside [-1, 1]
        totals = torch.linspace(-0.5, 0.3, C) * m
        con = channel_sum_constraint(shape, totals)
        v_pix = torch.rand(shape, generator=g) + 0.1
        model = unet(C)
        t = torch.full((args.batch,), 500, dtype=torch.long)
        with torch.no_grad():
            t_model = median_time(lambda: model(x, t), max(3, args.repeats // 4))
        loop = args.steps * t_model
        x01 = box_project(x / 2 + 0.5, (totals + m) / 2, 1.0, 0.0, 1.0)
        rows = [
            ("model evaluation", t_model),
            ("box_project, isotropic", median_time(lambda: box_project(x, con, 1.0, -1.0, 1.0), args.repeats)),
            ("box_project, per-pixel variance", median_time(lambda: box_project(x, con, v_pix, -1.0, 1.0),
                                                            args.repeats)),
            ("to_uint8_exact", median_time(lambda: to_uint8_exact(x01), args.repeats)),
            ("plain (255 x).round() to uint8", median_time(lambda: (255 * x01).round().to(torch.uint8),
                                                           args.repeats)),
            ("constrained_x0 (unboxed, sample)", median_time(lambda: constrained_x0(x, con, 0.01), args.repeats)),
        ]
        for name, sec in rows:
            print(f"{C:>2} {name:<34} {1e3 * sec:>9.3f} {sec / loop:>13.3%}")
        print(f"{C:>2} {f'{args.steps}-step loop (model only)':<34} {1e3 * loop:>9.1f}")


if __name__ == "__main__":
    main()
