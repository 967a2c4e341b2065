"""Seed (and method) vectorisation of the training harness vs a plain per-seed loop.

Trains the chemical study's MLP (2 x 32 ReLU, Adam, batch 16, validation pass every epoch) on one data set
for a few epochs, three ways, and reports wall and CPU seconds and their ratios (measured in one run):

* ``loop``: a plain PyTorch loop per seed -- ``nn.Sequential`` of ``nn.Linear``, ``torch.optim.Adam``, one
  ``randperm`` per epoch -- the way the reference code trains (NN only: MSE; ``ours``: the same loop with
  ``ConstrainedNormal`` and the expected L2 loss);
* ``harness, 1 member``: the harness with one member per run, looped over seeds (isolates vectorisation);
* ``harness, vectorised``: all seeds as one batched model.

With ``--all-methods`` it also times every method x every seed as one model (what ``--full`` runs) against
one harness run per (method, seed), and extrapolates the per-step cost to the full protocol.

Usage::

    python benchmarks/bench_seed_vectorisation.py --dataset cstr --epochs 3 --seeds 10 [--all-methods]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn


def _timed(fn):
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def plain_loop(data, method: str, seeds, epochs: int, dtype, floor: float) -> None:
    """One ordinary training script per seed (NN or ours), with a validation pass per epoch."""
    from hardeq import ConstrainedNormal, LinearConstraint

    tr, va = data.tensors("train", dtype), data.tensors("val", dtype)
    B = torch.as_tensor(data.B, dtype=dtype)
    A = torch.as_tensor(data.A, dtype=dtype)
    b = torch.as_tensor(data.b, dtype=dtype)
    n = B.shape[1]
    out = n if method == "NN" else 2 * n
    N = tr["x"].shape[0]

    def predict(net, x, y=None):
        o = net(x)
        if method == "NN":
            return o, None if y is None else (o - y).square().mean()
        d = ConstrainedNormal(o[..., :n], torch.sqrt(torch.exp(o[..., n:]) + floor),
                              constraint=LinearConstraint(B, b - x @ A.T, validate_args=False), validate_args=False)
        return d.mean, None if y is None else d.expected_l2(y).mean()

    for seed in seeds:
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(tr["x"].shape[1], 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                            nn.Linear(32, out)).to(dtype)
        opt = torch.optim.Adam(net.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(seed)
        best = float("inf")
        for _ in range(epochs):
            perm = torch.randperm(N, generator=gen)
            for j in range(0, N, 16):
                idx = perm[j: j + 16]
                _, loss = predict(net, tr["x"][idx], tr["y"][idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
            with torch.no_grad():
                pred, _ = predict(net, va["x"])
                best = min(best, float((pred - va["y"]).square().mean()))


def harness_run(data, config, methods, seeds, epochs: int, dtype) -> None:
    from hardeq_studies.chemical.models import build_model
    from hardeq_studies.chemical.run import make_task
    from hardeq_studies.harness import TrainConfig, train

    _, task = make_task(data.name, config, methods, len(seeds), dtype, torch.device("cpu"))
    member_seeds = task.member_seeds(seeds)
    model = build_model(task, data.x.shape[1], seeds, config["model"], dtype=dtype, device=torch.device("cpu"))
    cfg = TrainConfig(epochs=epochs, batch_size=config["train"]["batch_size"], lr=config["train"]["lr"])
    train(model, task, data.tensors("train", dtype), data.tensors("val", dtype), cfg, member_seeds,
          progress=False)


def main() -> None:
    from hardeq_studies.chemical import data as chemical

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="cstr", choices=["cstr", "plant", "distillation"])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--all-methods", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = chemical.load_config()
    data = chemical.load_dataset(args.dataset, config)
    seeds = list(range(args.seeds))
    n_train = data.splits["train"].stop
    steps = -(-n_train // config["train"]["batch_size"]) * args.epochs
    print(f"# data set {args.dataset}: n_train={n_train}, n_out={data.y.shape[1]}, batch=16, epochs={args.epochs} "
          f"({steps} steps), seeds={args.seeds}, dtype={args.dtype}, device=cpu, threads={args.threads}")
    print("| methods | way | members per model | wall s | CPU s | wall ratio (vs vectorised) |")
    print("|---|---|---|---|---|---|")
    rows = []
    floor = config["ours"]["variance_floor"]
    for method in ("NN", "ours"):
        t_loop = _timed(lambda m=method: plain_loop(data, m, seeds, args.epochs, dtype, floor))
        t_one = _timed(lambda m=method: [harness_run(data, config, [m], [s], args.epochs, dtype) for s in seeds])
        t_vec = _timed(lambda m=method: harness_run(data, config, [m], seeds, args.epochs, dtype))
        for way, t, m in (("plain loop per seed", t_loop, 1), ("harness, 1 member, loop over seeds", t_one, 1),
                          ("harness, seeds vectorised", t_vec, args.seeds)):
            rows.append((method, way, m, t, t[0] / t_vec[0]))
    if args.all_methods:
        methods = config["methods"]
        t_vec = _timed(lambda: harness_run(data, config, methods, seeds, args.epochs, dtype))
        t_per_method = _timed(lambda: [harness_run(data, config, [m], seeds, args.epochs, dtype) for m in methods])
        t_one = _timed(lambda: [harness_run(data, config, [m], [s], args.epochs, dtype)
                                for m in methods for s in seeds])
        label = f"all {len(methods)}"
        rows += [(label, "harness, 1 member per run", 1, t_one, t_one[0] / t_vec[0]),
                 (label, "harness, seeds vectorised, loop over methods", args.seeds, t_per_method,
                  t_per_method[0] / t_vec[0]),
                 (label, "harness, seeds x methods vectorised", args.seeds * len(methods), t_vec, 1.0)]
    for method, way, m, (wall, cpu), ratio in rows:
        print(f"| {method} | {way} | {m} | {wall:.2f} | {cpu:.2f} | {ratio:.1f}x |")
    if args.all_methods:
        per_step_cpu = t_vec[1] / steps
        total = sum(-(-chemical.load_dataset(d, config).splits["train"].stop // 16) for d in config["datasets"])
        print(f"\nCPU per step, all methods x {args.seeds} seeds: {per_step_cpu * 1e3:.2f} ms (incl. validation); "
              f"full protocol: {total} steps/epoch x 1000 epochs -> ~{per_step_cpu * total * 1000 / 60:.0f} CPU "
              f"minutes (assuming {args.dataset}'s per-step cost for every data set).")


if __name__ == "__main__":
    main()
