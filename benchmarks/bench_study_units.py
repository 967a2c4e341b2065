"""CPU cost of one training step of the studies' units at their `cpu` settings, to project a `cpu` run's wall time.

Each measurement is CPU time of the calling thread (``time.thread_time``) with one torch thread, so it does not
depend much on how loaded a shared machine is (wall time on a machine with a load average of 7 is about 3x
larger); the load average is printed beside it. Medians over the measured steps, after 3 warm-up steps.

* ``vae-data``: one training step (forward, the variant's loss, backward, Adam) of each ``model:variant``, batch 128,
  the appendix-C networks, the preset's observation model; x 469 steps = one epoch of 60,000 images.
* ``vae-latent``: one training step of each estimator (the appendix-B VAE, batch 128, latent constraint ``sum``);
  x 469 = one epoch; and the K-sample evaluation of 1,000 test images (x 10 for the 10,000).
* ``mof``: one unit (``--group``) of the cpu preset trained for ``--steps`` steps (validation every 50), CPU seconds
  per model and optimiser step, the data loading included.

    .venv/bin/python benchmarks/bench_study_units.py vae-data vae:ours ladder:ours graph:ours
    .venv/bin/python benchmarks/bench_study_units.py vae-latent pathwise constrained_reparam_independent unconstrained
    .venv/bin/python benchmarks/bench_study_units.py mof --group likelihood --steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _median_step(step, batches) -> float:
    times = []
    for i, xb in enumerate(batches):
        t0 = time.thread_time()
        step(xb)
        if i >= 3:
            times.append(time.thread_time() - t0)
    return statistics.median(times)


def vae_data(specs: list[str], steps: int) -> list[dict]:
    from hardeq_studies.vae_data import run as r

    s = r.settings(r.load_config(), "cpu")
    train_x, _ = r.brightness_mnist("train", float(s["data"]["total"]), limit=128 * (steps + 3))
    order = r.cl_order(r.cl_pixel(train_x))
    c = r.pixel_sum_constraint(float(s["data"]["total"]))
    out = []
    for spec in specs:
        model_name, variant = spec.split(":")
        torch.manual_seed(0)
        model = r._build_model(model_name, s)
        opt = torch.optim.Adam(model.parameters(), lr=float(s["train"]["lr"]))

        def step(xb, model=model, opt=opt, variant=variant):
            mean, log_var, kl = model(xb)
            loss = (r.training_loss(variant, mean, log_var, xb, c, order) + kl).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        sec = _median_step(step, train_x.split(128))
        out.append({"study": "vae-data", "unit": spec, "cpu_s_per_step": sec, "cpu_s_per_epoch": sec * 469,
                    "load": _load()})
    return out


def vae_latent(methods: list[str], steps: int) -> list[dict]:
    from hardeq_studies.vae_latent import run as r

    s = r.settings(r.load_config(), "cpu")
    train_x = r.binarised_mnist("train", 128 * (steps + 3), 0)
    test_x = r.binarised_mnist("test", 1000, int(s["eval"]["seed"]))
    latent = int(s["model"]["latent"])
    out = []
    for m in methods:
        constraint = None if m == "unconstrained" else r.build_constraint("sum", s["constraints"]["sum"], latent)
        torch.manual_seed(0)
        model = r.VAE(latent, list(s["model"]["hidden"]), constraint)
        opt = torch.optim.Adam(model.parameters(), lr=float(s["train"]["lr"]))

        def step(xb, model=model, opt=opt, m=m):
            xb = torch.bernoulli(xb)
            q = model.posterior(xb)
            loss = (-model.log_likelihood(xb, r._sample(q, m)) + model.latent.kl(q)).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        sec = _median_step(step, train_x.split(128))
        t0 = time.thread_time()
        r.evaluate(model, test_x, int(s["importance_samples"]), 0, int(s["eval"]["chunk"]))
        ev = time.thread_time() - t0
        out.append({"study": "vae-latent", "unit": m, "cpu_s_per_step": sec, "cpu_s_per_epoch": sec * 469,
                    "cpu_s_eval_1000_images": ev, "K": int(s["importance_samples"]), "load": _load()})
    return out


def mof(group: str, steps: int) -> list[dict]:
    import tempfile
    from pathlib import Path

    from hardeq_studies.mof.data import load_config
    from hardeq_studies.mof.run import group_settings, run_unit
    from hardeq_studies.mof.task import unit_methods

    config = load_config()
    s = {**config["presets"]["cpu"], "splits": 1, "steps": steps}
    s["patience"] = {g: 10**6 for g in config["groups"]}  # no early stop: the cost of the whole budget
    with tempfile.TemporaryDirectory() as d:
        t0 = time.thread_time()
        run_unit(config, s, 0, group, checkpoint_dir=Path(d), resume=False, threads=1)
        sec = time.thread_time() - t0
    models = len(unit_methods(group_settings(config, s, group)))
    return [{"study": "mof", "unit": group, "models": models, "steps": steps, "cpu_s": sec,
             "cpu_s_per_model_step": sec / (models * steps), "load": _load()}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", choices=["vae-data", "vae-latent", "mof"])
    p.add_argument("units", nargs="*", help="model:variant (vae-data) or estimator ids (vae-latent)")
    p.add_argument("--steps", type=int, default=30, help="measured steps (mof: the unit's optimiser steps)")
    p.add_argument("--group", default="likelihood", help="mof: the method group of the unit")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.study == "vae-data":
        rows = vae_data(args.units, args.steps)
    elif args.study == "vae-latent":
        rows = vae_latent(args.units, args.steps)
    else:
        rows = mof(args.group, args.steps)
    for row in rows:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
