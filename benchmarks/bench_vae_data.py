"""Training-step time of the vae-data models: unconstrained Gaussian observation vs ours (conditioned on sum x = 100).

For each model (the appendix-C VAE, Ladder VAE, Graph VAE at full size, batch 128), one training step is
forward + loss + backward + Adam. The variants' repeat rounds are interleaved in one process and the ratio of the
medians is reported. The conditioning itself (building the ConstrainedNormal and its ``log_prob``) is also timed
on its own, forward + backward, against the unconstrained ``Independent(Normal).log_prob``, to show where the extra
time goes.

    .venv/bin/python benchmarks/bench_vae_data.py --threads 1 --repeats 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hardeq_studies.vae_data.models import MODELS
from hardeq_studies.vae_data.run import observation, pixel_sum_constraint


def _step(model, opt, x, variant, constraint):
    mean, log_var, kl = model(x)
    loss = (-observation(variant, mean, log_var, constraint).log_prob(x) + kl).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _obs_only(mean, log_var, x, variant, constraint):
    m, v = mean.detach().requires_grad_(), log_var.detach().requires_grad_()
    observation(variant, m, v, constraint).log_prob(x).sum().backward()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--json", type=Path, default=None, help="also write the numbers to this JSON file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    c = pixel_sum_constraint(100.0)
    x = torch.rand(args.batch, 784)
    x = x / x.sum(-1, keepdim=True) * 100
    rows = {}
    for name, cls in MODELS.items():
        models = {v: cls() for v in ("unconstrained", "ours")}
        models["ours"].load_state_dict(models["unconstrained"].state_dict())
        opts = {v: torch.optim.Adam(m.parameters(), 1e-4) for v, m in models.items()}
        times = {v: [] for v in models}
        for v in models:  # warm-up
            _step(models[v], opts[v], x, v, c)
        for _ in range(args.repeats):
            for v in models:
                t0 = time.perf_counter()
                _step(models[v], opts[v], x, v, c)
                times[v].append(time.perf_counter() - t0)
        med = {v: statistics.median(t) for v, t in times.items()}
        with torch.no_grad():
            mean, log_var, _ = models["unconstrained"](x)
        obs = {v: [] for v in models}
        for _ in range(args.repeats):
            for v in models:
                t0 = time.perf_counter()
                _obs_only(mean, log_var, x, v, c)
                obs[v].append(time.perf_counter() - t0)
        obs_med = {v: statistics.median(t) for v, t in obs.items()}
        rows[name] = {"step_ms": {v: 1e3 * t for v, t in med.items()}, "ratio": med["ours"] / med["unconstrained"],
                      "observation_ms": {v: 1e3 * t for v, t in obs_med.items()},
                      "observation_extra_share_of_step": (obs_med["ours"] - obs_med["unconstrained"])
                      / med["unconstrained"]}
        r = rows[name]
        print(f"{name:7s} step: unconstrained {r['step_ms']['unconstrained']:.1f} ms, ours {r['step_ms']['ours']:.1f} "
              f"ms, ratio {r['ratio']:.3f}; observation log_prob fwd+bwd: {r['observation_ms']['unconstrained']:.2f}"
              f" vs {r['observation_ms']['ours']:.2f} ms (extra = {100 * r['observation_extra_share_of_step']:.1f}% "
              "of a step)", flush=True)
    if args.json is None:
        return
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"threads": args.threads, "repeats": args.repeats, "batch": args.batch,
                                    "torch": torch.__version__, "models": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
