#!/usr/bin/env python
r"""Sampling overhead of the constrained steps of :mod:`hardeq.diffusion` (study ``diffusion``), CPU.

The denoiser is the ``diffusion`` study's small U-Net (the ``cpu`` preset's ``diffusers.UNet2DModel``: channels
16/32/32, 0.27 M parameters; untrained weights: the time does not depend on them) on 32 x 32 one-channel
images (MNIST's shape), with the per-image brightness constraint (:func:`~hardeq.diffusion.channel_sum_constraint`).
Two samplers, each against its unconstrained run measured in the same process:

* **DDPM last step**: ``ddpm_sample(model, shape, DDPMOptions())`` (T = 1000 steps) against the same call with
  ``constraint=c``, whose last step is an exact conditional sample (one :func:`constrained_x0`);
* **DDIM Start 3 End 3**: ``ddim_sample(model, shape, DDIMOptions(num_steps=50))`` against the same call with
  ``constraint=c, schedule=StartEnd(3, 3)`` (six conditioned :math:`\hat x_0`-predictions and the recomputed
  :math:`\varepsilon`).

Two measurements per sampler:

1. **whole loop**: the median wall time of the two complete loops, repeat rounds interleaved (after the
   per-step timings, which warm the model up), and their ratio. On a shared machine the noise of a many-second
   loop is larger than the overhead itself (about 0.01-1 %), so this ratio can come out below 1;
2. **per step**: the medians of one model evaluation and of the extra work of one conditioned step (the
   conditioning of :math:`\hat x_0`, plus DDIM's recomputation of :math:`\varepsilon`), timed over many
   repeats; the overhead is then ``conditioned steps x extra / (loop steps x evaluation)``.

The goal is an overhead of at most 2 % of the sampling time.

Usage::

    .venv/bin/python benchmarks/bench_diffusion.py                      # batch 32, 1 thread, 2 rounds
    .venv/bin/python benchmarks/bench_diffusion.py --threads 2 --json benchmarks/diffusion.json
    .venv/bin/python benchmarks/bench_diffusion.py --quick              # smoke run (T = 100, 1 round)

Results and their interpretation: benchmarks/README.md, section "Constrained diffusion sampling".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time

import torch

import hardeq
from hardeq.diffusion import (
    DDIMOptions,
    DDPMOptions,
    StartEnd,
    channel_sum_constraint,
    constrained_x0,
    ddim_sample,
    ddpm_sample,
    make_betas,
)

UNET = {"block_out_channels": [16, 32, 32], "layers_per_block": 1, "attention": [], "dropout": 0.0,
        "norm_num_groups": 8, "attention_head_dim": 8}
TOTAL = 102.4378  # MNIST's mean pixel sum in [0, 1]; the model space total is 2 k - 1024


def _median_time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _interleaved(fns: dict[str, callable], rounds: int) -> dict[str, float]:
    """Median wall time of each function over ``rounds`` interleaved rounds (the per-step timings before
    have warmed the model up)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of the whole loops")
    p.add_argument("--steps-T", type=int, default=1000, help="DDPM steps (train timesteps)")
    p.add_argument("--ddim-steps", type=int, default=50)
    p.add_argument("--step-repeats", type=int, default=30, help="repeats of the per-step timings")
    p.add_argument("--quick", action="store_true", help="T = 100, 1 round, 10 step repeats")
    p.add_argument("--json", help="also write the measurements to this file")
    args = p.parse_args()
    if args.quick:
        args.steps_T, args.rounds, args.step_repeats = 100, 1, 10
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from hardeq_studies.diffusion.model import build_unet, count_parameters

    model = build_unet(UNET, 1).eval()
    B, T = args.batch, args.steps_T
    shape = (B, 1, 32, 32)
    con = channel_sum_constraint(shape, torch.tensor([2 * TOTAL - 1024]))
    betas = make_betas(T)
    sched = StartEnd(3, 3)
    n_cond = len(sched.steps(args.ddim_steps))
    machine = (f"cpu={platform.processor() or platform.machine()}, logical_cpus={os.cpu_count()}, "
               f"torch_threads={torch.get_num_threads()}, python={platform.python_version()}, "
               f"torch={torch.__version__}, "
               f"hardeq={hardeq.__version__}, loadavg_at_start={' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"Machine: {machine}")
    print(f"U-Net: {count_parameters(model):,} parameters; batch {B}; DDPM T = {T}; DDIM {args.ddim_steps} steps, "
          f"{sched.label} ({n_cond} conditioned steps)\n")

    def seeded() -> torch.Generator:
        return torch.Generator().manual_seed(1)

    with torch.no_grad():
        # per-step components
        x = torch.randn(shape)
        t = torch.full((B,), 500, dtype=torch.long)
        t_eval = _median_time(lambda: model(x, t).sample, args.step_repeats)
        gen = torch.Generator().manual_seed(2)
        scale = math.sqrt(float(betas[0]))
        t_cond = _median_time(lambda: constrained_x0(x, con, scale, gen), max(args.step_repeats, 100))
        t_eps = _median_time(lambda: (x - 0.5 * x) / 0.7, max(args.step_repeats, 100))
        out = {"machine": machine, "batch": B, "T": T, "ddim_steps": args.ddim_steps, "schedule": repr(sched),
               "per_step": {"model_eval_s": t_eval, "constrained_x0_s": t_cond, "eps_recompute_s": t_eps}}
        est_ddpm = t_cond / (T * t_eval)
        est_ddim = n_cond * (t_cond + t_eps) / (args.ddim_steps * t_eval)
        # whole loops
        ddpm_opts = DDPMOptions(betas=betas)
        ddim_opts = DDIMOptions(num_steps=args.ddim_steps, betas=betas)
        ddpm = _interleaved({
            "unconstrained": lambda: ddpm_sample(model, shape, ddpm_opts, generator=seeded()),
            "constrained": lambda: ddpm_sample(model, shape, ddpm_opts, constraint=con, generator=seeded())},
            args.rounds)
        ddim = _interleaved({
            "unconstrained": lambda: ddim_sample(model, shape, ddim_opts, generator=seeded()),
            "constrained": lambda: ddim_sample(model, shape, ddim_opts, constraint=con, schedule=sched,
                                               generator=seeded())}, args.rounds)
    rows = [("DDPM, constrained last step", T, 1, ddpm, est_ddpm),
            (f"DDIM, {sched.label}", args.ddim_steps, n_cond, ddim, est_ddim)]
    print(f"Per step (median of {args.step_repeats}+ calls): model evaluation {1e3 * t_eval:.2f} ms, "
          f"constrained_x0 {1e3 * t_cond:.3f} ms, DDIM epsilon recomputation {1e3 * t_eps:.3f} ms\n")
    print("| sampler | loop steps | conditioned steps | unconstrained s | constrained s | whole-loop ratio | "
          "per-step overhead estimate | goal <= 2 % |")
    print("|---|---|---|---|---|---|---|---|")
    out["rows"] = []
    for name, steps, nc, times, est in rows:
        ratio = times["constrained"] / times["unconstrained"]
        print(f"| {name} | {steps} | {nc} | {times['unconstrained']:.2f} | {times['constrained']:.2f} | "
              f"{ratio:.4f} | {100 * est:.4f} % | {'yes' if est <= 0.02 else 'no'} |")
        out["rows"].append({"sampler": name, "loop_steps": steps, "conditioned_steps": nc,
                            "unconstrained_s": times["unconstrained"], "constrained_s": times["constrained"],
                            "whole_loop_ratio": ratio, "overhead_estimate": est, "rounds": args.rounds})
    print(f"\nloadavg at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
