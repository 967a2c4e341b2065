r"""The measured cost of the ``diffusion`` study's stages on this machine, and the wall time it projects for a preset.

:func:`measure_cost` times each unit of work on the preset's own networks (an untrained U-Net of the preset's
shape: the time of a forward pass does not depend on the weights), in one process, on ``threads`` intra-op
threads, and records the machine's load average beside the numbers (on a shared machine the load inflates every
time). :func:`project_wall` multiplies the units by the counts a preset implies:

* training: ``train.steps`` optimiser steps at ``train.batch_size`` (seconds per step);
* DDPM: ``seeds x n_ddpm x (T + 3)`` model evaluations per image (the trajectory and the three extra last steps,
  :func:`~.sampling.sample_group`), at the chunk's batch size;
* DDIM: ``seeds x ddim_steps`` evaluations per image of every DDIM group, its size from the tables;
* Inception: the reference images (once; cached), and every image set with an FID (``seeds x n`` per row and
  the real images beside them);
* the paired bootstrap of the FIDs: ``replicates x seeds`` distances per row in a test.

Run it with ``python -m hardeq_studies.diffusion.cost --preset cpu`` (it prints the ``cost`` entry: the measured
units and the projected seconds per stage); the ``cpu`` preset's ``cost`` entry in ``config.json`` holds a
measurement, which the report prints.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["measure_cost", "project_wall"]


def _median_time(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall and CPU (this process) seconds of ``fn()`` over ``repeats`` calls."""
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return sorted(wall)[len(wall) // 2], sorted(cpu)[len(cpu) // 2]


def _put(out: dict[str, Any], key: str, times: tuple[float, float], scale: float = 1.0) -> None:
    """``out[key]`` = wall seconds, ``out[key + "_cpu"]`` = CPU seconds, both times ``scale``."""
    out[key], out[key + "_cpu"] = times[0] * scale, times[1] * scale


def measure_cost(s: dict[str, Any], *, ddim_images: int = 200, ddpm_steps: int = 10, train_steps: int = 3,
                 inception_images: int = 100, fid_n: int = 1000, threads: int | None = None) -> dict[str, Any]:
    """Seconds per unit of work for the settings ``s`` (:func:`~.run.settings`), on the CPU.

    Measures: one training step (``train_steps`` steps at ``train.batch_size``, median), DDIM sampling of
    ``ddim_images`` images in one batch with the preset's ``ddim_steps`` (the whole loop, as a run does), the
    model evaluation of a DDPM step at the chunk's batch (median of ``ddpm_steps``), the Inception features of
    ``inception_images`` images (when the network is installed), and one Fréchet distance plus one bootstrap
    replicate of a set of ``fid_n`` features against a reference, 2048-d (Inception) and the classifier's (random
    features: the time depends on the sizes only). Returns the units, the load average before and after, the
    threads and the machine."""
    from hardeq.diffusion import DDIMOptions, channel_sum_constraint, ddim_sample, make_betas

    from .metrics import Reference, _Resampler, frechet_to_reference
    from .model import build_unet

    if threads is not None:
        torch.set_num_threads(int(threads))
    load_before = os.getloadavg()
    d, tr, sm = s["diffusion"], s["train"], s["sampling"]
    torch.manual_seed(0)
    C = 3 if s["dataset"] == "cifar10" else 1
    unet = build_unet(s["unet"], C)
    betas = make_betas(int(d["num_train_timesteps"]), float(d["beta_start"]), float(d["beta_end"]), d["beta_schedule"])
    out: dict[str, Any] = {}
    # training step: forward + backward + Adam at the preset's batch
    opt = torch.optim.Adam(unet.parameters(), lr=1e-4)
    B = int(tr["batch_size"])
    x = torch.randn(B, C, 32, 32)

    def train_step() -> None:
        t = torch.randint(0, betas.shape[0], (B,))
        loss = (unet(x, t).sample - x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    unet.train()
    _put(out, "train_s_per_step", _median_time(train_step, train_steps))
    unet.eval()
    # DDIM: a whole loop of ddim_images images, one batch
    con = channel_sum_constraint((ddim_images, C, 32, 32), torch.zeros(C))
    opts = DDIMOptions(num_steps=int(sm["ddim_steps"]), betas=betas)
    ddim = _median_time(lambda: ddim_sample(unet, (ddim_images, C, 32, 32), opts, constraint=con,
                                            generator=torch.Generator().manual_seed(0)), 1)
    out["ddim_images"] = ddim_images
    _put(out, "ms_per_image_step", ddim, 1e3 / (ddim_images * int(sm["ddim_steps"])))
    # DDPM: model evaluations at the chunk's batch
    chunk = int(sm["chunk"])
    xc = torch.randn(chunk, C, 32, 32)
    tt = torch.full((chunk,), 500, dtype=torch.long)
    with torch.no_grad():
        _put(out, "ddpm_ms_per_image_step", _median_time(lambda: unet(xc, tt).sample, ddpm_steps), 1e3 / chunk)
    # Inception features
    try:
        from .metrics import InceptionFeatures

        net = InceptionFeatures("cpu", int(s["fid"]["batch_size"]))
        imgs = torch.randint(0, 256, (inception_images, C, 32, 32), dtype=torch.uint8)
        _put(out, "inception_s_per_image", _median_time(lambda: net(imgs), 1), 1 / inception_images)
    except Exception as e:  # noqa: BLE001 - the network is optional; the cost is then not measured
        out["inception_s_per_image"] = out["inception_s_per_image_cpu"] = None
        out["inception_note"] = f"not measured: {e}"
    # one FID of fid_n features against a reference, and one bootstrap replicate (a resampled set), for the
    # 2048-d Inception features and the classifier's features
    g = torch.Generator().manual_seed(0)
    out["fid_n"] = fid_n
    for name, dim in (("fid", 2048), ("classifier_fd", int(s["classifier"]["features"]))):
        ref = Reference.from_features(torch.randn(max(4096, 2 * dim), dim, generator=g, dtype=torch.float64))
        f = torch.randn(fid_n, dim, generator=g)
        w = torch.bincount(torch.randint(0, fid_n, (fid_n,), generator=g), minlength=fid_n)
        _put(out, f"{name}_s", _median_time(lambda f=f, ref=ref: frechet_to_reference(f, ref), 3))
        resampler = _Resampler(f, ref)
        _put(out, f"{name}_replicate_s", _median_time(lambda r=resampler, w=w: r.distance(w), 5))
    out["load_before"] = [round(v, 2) for v in load_before]
    out["load_after"] = [round(v, 2) for v in os.getloadavg()]
    out["threads"] = torch.get_num_threads()
    out["cpus"] = os.cpu_count()
    out["machine"] = platform.machine()
    out["torch"] = torch.__version__
    out["date"] = datetime.date.today().isoformat()
    return out


def project_wall(s: dict[str, Any], cost: dict[str, Any], tables: dict[str, dict[str, Any]], *,
                 basis: str = "cpu") -> dict[str, float]:
    """Projected seconds per stage of a run of ``s`` from the measured ``cost`` (:func:`measure_cost`) and the
    preset's ``tables`` (:func:`~.run.tables_of`): ``train``, ``ddpm``, ``ddim``, ``inception_reference``,
    ``inception`` (the FID sets), ``fid_bootstrap``, ``classifier_bootstrap`` and ``total`` (training included; the
    cached denoiser of an earlier run of the same settings saves it).

    ``basis="cpu"`` uses the CPU seconds of the measuring process (the wall time on an otherwise idle core, at the
    measured threads), ``"wall"`` the wall seconds as measured (inflated by the machine's load)."""
    from .run import _group_sizes

    if basis == "cpu":
        cost = {k[:-4]: v for k, v in cost.items() if k.endswith("_cpu")} | {"fid_n": cost["fid_n"]}

    seeds = int(s["seeds"])
    T = int(s["diffusion"]["num_train_timesteps"])
    sizes = _group_sizes(tables)
    out = {"train": cost["train_s_per_step"] * int(s["train"]["steps"])}
    out["ddpm"] = seeds * sizes.get("ddpm", 0) * (T + 3) * cost["ddpm_ms_per_image_step"] / 1e3
    ddim_images = sum(n for g, n in sizes.items() if g != "ddpm")
    out["ddim"] = seeds * ddim_images * int(s["sampling"]["ddim_steps"]) * cost["ms_per_image_step"] / 1e3
    per_image = cost.get("inception_s_per_image")
    fid = s["fid"]
    fid_images, fid_sets = 0, 0
    if fid.get("inception") and per_image is not None:
        real_sizes = set()
        for t in tables.values():
            if t["fid"]:
                fid_images += len(t["fid_rows"]) * seeds * t["n"]
                real_sizes.add(t["n"])
                fid_sets += len(t["fid_rows"]) + 1  # and the real images
        fid_images += sum(real_sizes) * seeds  # real images of one size are shared by the tables
        out["inception_reference"] = per_image * (int(fid["n_reference"]) + int(fid["n_noise"]))
        out["inception"] = per_image * fid_images
    else:
        out["inception_reference"] = out["inception"] = 0.0
    # the bootstraps: every set of a table (its rows and the real images) in every replicate and seed; a
    # replicate's time scales as m^3 in the distinct rows m ~ 0.63 n (Inception) or as n d^2 (classifier)
    ratio = lambda n: (n / cost["fid_n"]) ** 3  # noqa: E731
    out["fid_bootstrap"] = sum((len(t["fid_rows"]) + 1) * seeds * int(fid.get("bootstrap", 0))
                               * cost["fid_replicate_s"] * ratio(t["n"]) for t in tables.values() if t["fid"])
    out["classifier_bootstrap"] = sum((len(t["variants"]) + 1) * seeds * int(s["classifier_bootstrap"])
                                      * cost["classifier_fd_replicate_s"] * t["n"] / cost["fid_n"]
                                      for t in tables.values())
    out["total"] = sum(out.values())
    return out


def main(argv: list[str] | None = None) -> int:
    from .data import load_config
    from .run import settings, tables_of

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu")
    p.add_argument("--dataset", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--ddim-images", type=int, default=200)
    args = p.parse_args(argv)
    s = settings(load_config(), args.preset, args.dataset)
    cost = measure_cost(s, ddim_images=args.ddim_images, threads=args.threads)
    proj = project_wall(s, cost, tables_of(s))
    wall = project_wall(s, cost, tables_of(s), basis="wall")
    print(json.dumps({"measured": cost, "projected_s": {k: round(v, 1) for k, v in proj.items()},
                      "projected_h": round(proj["total"] / 3600, 2),
                      "projected_h_at_measured_load": round(wall["total"] / 3600, 2)}, indent=1))
    return 0 if all(math.isfinite(v) for v in proj.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
