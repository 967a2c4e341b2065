"""The training and sampling stages of a ``diffusion`` run, each a function with one job: the denoiser
(:func:`train_denoiser_stage`, cached per settings), the feature classifier (:func:`train_classifier_stage`) and
the samples (:func:`sampling_stage`: one resumable block per (seed, group, chunk), :func:`sample_blocks`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..harness import atomic_torch_save, fingerprint, load_checkpoint
from .data import ImageData, quantize, to_model
from .metrics import Reference
from .model import build_unet, classifier_outputs, count_parameters, train_classifier, train_denoiser
from .plan import _chunks, _group_sizes
from .sampling import Variant

__all__ = ["Denoiser", "Classifier", "Samples", "train_denoiser_stage", "train_classifier_stage", "sampling_stage",
           "sample_blocks", "sample_group_fn"]


@dataclass
class Denoiser:
    """The trained denoiser: ``unet`` (EMA weights, eval mode, on the device), the forward process ``betas``
    ``(T,)`` float64, ``train_id`` (what the training depends on: the cache key), ``trained``
    (:func:`~.model.train_denoiser`'s result) and the stage's timing."""

    unet: nn.Module
    betas: Tensor
    train_id: dict[str, Any]
    trained: dict[str, Any]
    timing: dict[str, float]


def train_denoiser_stage(s: dict[str, Any], data: ImageData, *, preset: str, checkpoint_dir: Path, resume: bool,
                         retrain: bool, device: torch.device, say: Callable[[str], None]) -> Denoiser:
    """Train the denoiser once per (data, model, training) settings, kept in
    ``CHECKPOINTS/diffusion-DATASET-PRESET-denoiser.pt``: a complete checkpoint of the same settings is reused, an
    interrupted one continued with ``resume``; ``retrain`` deletes it first."""
    from hardeq.diffusion import make_betas

    seed, ds = int(s["seed"]), s["dataset"]
    d, tr = s["diffusion"], s["train"]
    betas = make_betas(int(d["num_train_timesteps"]), float(d["beta_start"]), float(d["beta_end"]), d["beta_schedule"])
    abar = torch.cumprod(1 - betas, 0)
    torch.manual_seed(seed)
    unet = build_unet(s["unet"], data.shape[0])
    train_id = {"dataset": ds, "data": s["data"], "diffusion": d, "unet": s["unet"], "seed": seed,
                "train": {k: v for k, v in tr.items() if k not in ("checkpoint_every", "log_every")},
                "totals": [round(float(t), 9) for t in data.totals]}
    t1 = time.perf_counter()
    unet_path = Path(checkpoint_dir) / f"diffusion-{ds}-{preset}-denoiser.pt"
    if retrain:
        unet_path.unlink(missing_ok=True)
    trained = train_denoiser(unet, to_model(data.train), abar, tr, steps=int(tr["steps"]), seed=seed,
                             checkpoint_path=unet_path, resume=resume,
                             run_id=train_id, device=device, log=say)
    unet.load_state_dict(trained["ema"])
    unet.to(device).eval()
    timing = {"train_s": time.perf_counter() - t1, "train_compute_s": trained["seconds"],
              "train_s_per_step": trained["seconds"] / max(1, int(tr["steps"]))}
    say(f"[diffusion] denoiser: {count_parameters(unet):,} parameters, {tr['steps']} steps "
        f"({'cached' if trained['cached'] else 'trained'}, {trained['seconds']:.0f} s of training)")
    return Denoiser(unet, betas, train_id, trained, timing)


@dataclass
class Classifier:
    """The feature classifier of the classifier Fréchet distance and score: ``net`` (eval mode), ``reference``
    (its feature statistics of the test images), ``accuracy`` on them, the training ``seconds`` (of the run that
    trained it), whether it came from the cache, and the stage's wall time."""

    net: nn.Module
    reference: Reference
    accuracy: float
    seconds: float
    cached: bool
    wall_s: float


def train_classifier_stage(s: dict[str, Any], data: ImageData, *, preset: str, checkpoint_dir: Path, retrain: bool,
                           device: torch.device, say: Callable[[str], None]) -> Classifier:
    """Train the classifier on the 8-bit training images (or load ``CHECKPOINTS/diffusion-DATASET-PRESET-classifier.pt``
    when its fingerprint matches and not ``retrain``) and compute its reference statistics on the test images."""
    from .model import SmallCNN

    t1 = time.perf_counter()
    seed, ds = int(s["seed"]), s["dataset"]
    train_u8, test_u8 = quantize(to_model(data.train)), quantize(to_model(data.test))
    cl_id = {"dataset": ds, "data": s["data"], "classifier": s["classifier"], "seed": seed}
    cl_path = Path(checkpoint_dir) / f"diffusion-{ds}-{preset}-classifier.pt"
    net = SmallCNN(data.shape[0], tuple(s["classifier"]["widths"]), int(s["classifier"]["features"])).to(device)
    cached = False
    if cl_path.exists() and not retrain:
        ck = load_checkpoint(cl_path)
        if ck.get("fingerprint") == fingerprint(cl_id):
            net.load_state_dict(ck["state"])
            net.eval()
            cached, cl_seconds = True, float(ck["seconds"])
    if not cached:
        net, cl_seconds = train_classifier(train_u8, data.train_labels, s["classifier"], seed=seed, device=device)
        state = {k: v.cpu() for k, v in net.state_dict().items()}
        atomic_torch_save({"fingerprint": fingerprint(cl_id), "state": state, "seconds": cl_seconds}, cl_path)
    test_feats, test_probs = classifier_outputs(net, test_u8)
    accuracy = float((test_probs.argmax(1) == data.test_labels).float().mean())
    out = Classifier(net, Reference.from_features(test_feats), accuracy, cl_seconds, cached,
                     time.perf_counter() - t1)
    say(f"[diffusion] classifier: test accuracy {accuracy:.4f} ({'cached' if cached else f'{cl_seconds:.0f} s'})")
    return out


@dataclass
class Samples:
    """The sampled images: ``results[f"seed{si}/{group}/chunk{j}"]`` (:func:`~.sampling.sample_group`'s result
    with ``"seconds"`` and ``"n"``), ``sizes`` (images per group), ``chunk``, and the stage's timing."""

    results: dict[str, Any]
    sizes: dict[str, int]
    chunk: int
    timing: dict[str, Any]

    def collect(self, v: Variant, si: int, n: int) -> dict[str, Tensor]:
        """The first ``n`` images of variant ``v`` under noise seed ``si`` (its group's chunks, concatenated)."""
        parts = [self.results[f"seed{si}/{v.group}/chunk{j}"]["variants"][v.key]
                 for j in range(len(_chunks(self.sizes[v.group], self.chunk)))]
        return {k: torch.cat([p[k] for p in parts])[:n] for k in parts[0]}


def sampling_stage(s: dict[str, Any], data: ImageData, denoiser: Denoiser, tables: dict[str, dict[str, Any]], *,
                   preset: str, checkpoint_dir: Path, resume: bool, device: torch.device,
                   say: Callable[[str], None]) -> Samples:
    """Sample every group in chunks (:func:`~.sampling.sample_group`), one resumable block per (seed, group,
    chunk), each saved atomically to its own file in ``CHECKPOINTS/diffusion-DATASET-PRESET-samples/``
    (:func:`sample_blocks`)."""
    seed, sm = int(s["seed"]), s["sampling"]
    sizes = _group_sizes(tables)
    seeds, chunk = int(s["seeds"]), int(sm["chunk"])
    model_totals = data.constraint_totals()
    blocks: dict[str, tuple[int, Callable[[], Any]]] = {}
    for si in range(seeds):
        for group, n_group in sizes.items():
            for j, n in enumerate(_chunks(n_group, chunk)):
                noise_seed = seed * 1_000_003 + si * 10_007 + j

                def compute(group: str = group, n: int = n, noise_seed: int = noise_seed) -> dict[str, Any]:
                    ts = time.perf_counter()
                    res = sample_group_fn(denoiser.unet, group, shape=data.shape, n=n, full=chunk,
                                          totals=data.totals, model_totals=model_totals, seed=noise_seed,
                                          betas=denoiser.betas, ddim_steps=int(sm["ddim_steps"]),
                                          eta=float(sm["eta"]), deterministic=bool(sm["deterministic"]),
                                          device=device)
                    return {"variants": res, "seconds": time.perf_counter() - ts, "n": n}

                blocks[f"seed{si}/{group}/chunk{j}"] = (n, compute)
    # what a block's images depend on (besides its key and size): a longer run reuses the chunks it shares; format 3
    # adds the DDPM group's "+u8" row, which format-2 blocks (8-bit images of the other rows only) cannot give
    sample_id = {"train": fingerprint(denoiser.train_id), "seed": seed, "chunk": chunk, "format": 3,
                 **{k: sm[k] for k in ("ddim_steps", "eta", "deterministic")}}
    t1 = time.perf_counter()
    done = [0]

    def on_block(key: str, res: dict[str, Any]) -> None:
        done[0] += 1
        say(f"[diffusion] sampled {done[0]}/{len(blocks)} {key}: {res['n']} images in {res['seconds']:.1f} s; "
            f"elapsed {time.perf_counter() - t1:.0f} s")

    results = sample_blocks(blocks, Path(checkpoint_dir) / f"diffusion-{s['dataset']}-{preset}-samples", resume=resume,
                            run_id=sample_id, on_block=on_block)
    timing: dict[str, Any] = {"sampling_s": time.perf_counter() - t1}
    group_seconds: dict[str, float] = {}
    for key, res in results.items():
        g = key.split("/")[1]
        group_seconds[g] = group_seconds.get(g, 0.0) + float(res["seconds"])
    timing["sampling_s_by_group"] = group_seconds
    T = int(s["diffusion"]["num_train_timesteps"])
    evals = {"ddpm": seeds * sizes.get("ddpm", 1) * (T + 3),  # the trajectory and 3 last steps
             "ddim": seeds * sizes.get("ddim", 1) * int(sm["ddim_steps"])}
    timing["ms_per_image_step"] = {g: 1e3 * group_seconds.get(g, math.nan) / max(1, e) for g, e in evals.items()}
    return Samples(results, sizes, chunk, timing)


def sample_blocks(blocks: dict[str, tuple[int, Callable[[], Any]]], folder: Path, *, resume: bool, run_id: Any,
                  on_block: Callable[[str, Any], None] | None = None) -> dict[str, Any]:
    """Compute the sampling blocks ``key -> (n, compute)`` in order, each saved atomically to ``folder/KEY.pt``
    (``/`` in keys written as ``-``, spaces dropped) with the fingerprint of ``(run_id, key, n)``; with ``resume``
    a block whose file holds the same fingerprint is loaded instead of recomputed, so a resumed run with more
    images per variant reuses the chunks it shares with the earlier one (a file of other settings raises
    ``ValueError``). Like :func:`hardeq_studies.harness.run_blocks`, but one file per block."""
    out: dict[str, Any] = {}
    for key, (n, compute) in blocks.items():
        path = Path(folder) / (key.replace("/", "-").replace(" ", "") + ".pt")
        block_hash = fingerprint({"run": run_id, "key": key, "n": n})
        if resume and path.exists():
            ck = load_checkpoint(path)
            if ck.get("fingerprint") == block_hash:
                out[key] = ck["result"]
                continue
            if ck.get("n") == n or ck.get("key") != key:
                raise ValueError(f"checkpoint {path} belongs to a run with other settings; remove {folder} or run "
                                 "without --resume.")
        out[key] = compute()
        atomic_torch_save({"fingerprint": block_hash, "key": key, "n": n, "result": out[key]}, path)
        if on_block is not None:
            on_block(key, out[key])
    return out


def sample_group_fn(*args: Any, **kwargs: Any) -> Any:
    """Indirection for :func:`~.sampling.sample_group` (tests may count calls)."""
    from .sampling import sample_group

    return sample_group(*args, **kwargs)


def _curve(losses: Tensor, points: int = 50) -> list[list[float]]:
    """The training loss averaged over ``points`` equal windows: ``[[last step of window, mean loss], ...]``."""
    n = losses.shape[0]
    if n == 0:
        return []
    edges = np.linspace(0, n, min(points, n) + 1).astype(int)
    return [[int(b), float(losses[a:b].mean())] for a, b in zip(edges[:-1], edges[1:]) if b > a]
