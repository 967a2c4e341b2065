r"""Running the ``diffusion`` study: settings of a preset (:mod:`.plan`), then the stages (:mod:`.stages`,
:mod:`.evaluate`), each a function with one job and each
timed, which :func:`run` chains:

1. data (:func:`~.data.load_data`);
2. :func:`train_denoiser_stage`: the denoiser, trained once per (data, model, training) settings and kept in
   ``CHECKPOINTS/diffusion-DATASET-PRESET-denoiser.pt``: a complete checkpoint of the same settings is reused
   (the evaluation alone is then cheap), an interrupted one is continued with ``--resume``;
3. :func:`train_classifier_stage`: the feature classifier (cached the same way);
4. :func:`sampling_stage`: sampling in chunks (:func:`~.sampling.sample_group`), one resumable block per (seed,
   group, chunk), each saved atomically to its own file in ``CHECKPOINTS/diffusion-DATASET-PRESET-samples/``
   (:func:`sample_blocks`; one file per block keeps the paper preset's 50,000-image runs from rewriting gigabytes
   per block);
5. :func:`evaluate_stage`: violation rate and residuals, share of pixels outside ``[0, 1]``, classifier Fréchet
   distance and classifier score, Inception FID (with its reference statistics cached in ``CHECKPOINTS/cache``),
   paired tests against the table's unconstrained sampler.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .data import ImageData, load_data, quantize, to_model
from .evaluate import Evaluation, evaluate_stage, fid_protocol
from .metrics import describe_inception
from .model import count_parameters
from .plan import DECIDING, REAL, TABLE_TITLES, _group_sizes, comparisons, settings, tables_of
from .sampling import describe_samplers
from .stages import (
    Classifier, Denoiser, Samples, _curve, sample_blocks, sample_group_fn, sampling_stage, train_classifier_stage,
    train_denoiser_stage,
)

__all__ = ["settings", "tables_of", "comparisons", "run", "TABLE_TITLES", "REAL", "DECIDING", "Denoiser",
           "Classifier", "Samples", "Evaluation", "train_denoiser_stage", "train_classifier_stage", "sampling_stage",
           "evaluate_stage", "fid_protocol", "sample_blocks", "sample_group_fn", "_group_sizes"]


def run(s: dict[str, Any], *, preset: str, checkpoint_dir: Path, paper: dict[str, Any] | None = None,
        resume: bool = False, retrain: bool = False, device: torch.device | str = "cpu", progress: bool = True,
        log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Everything but the report, for the settings ``s`` (:func:`settings`): the stages data, denoiser
    (:func:`train_denoiser_stage`), classifier (:func:`train_classifier_stage`), sampling (:func:`sampling_stage`)
    and evaluation (:func:`evaluate_stage`).

    ``paper``: the paper's values per table and row label (config ``paper.tables``). ``retrain`` ignores the
    cached denoiser and classifier. Returns ``{"records", "significance", "tables", "checks", "data", "model",
    "timing", "grids", "group_sizes"}`` (``significance``: the paired tests of :func:`comparisons`; ``grids``:
    8-bit images for the figures, not written to the JSON)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    say = log if progress else (lambda msg: None)
    device = torch.device(device)
    ckdir = Path(checkpoint_dir)
    t0 = time.perf_counter()
    ds = s["dataset"]
    data = load_data(ds, train_limit=s["data"]["train_limit"], test_limit=s["data"]["test_limit"],
                     cache_dir=ckdir / "cache", seed=int(s["seed"]))
    timing: dict[str, Any] = {"data_s": time.perf_counter() - t0}
    say(f"[diffusion] {ds}: {data.train.shape[0]} training images, channel sums "
        f"{[round(float(t), 3) for t in data.totals]} ({timing['data_s']:.0f} s)")
    denoiser = train_denoiser_stage(s, data, preset=preset, checkpoint_dir=ckdir, resume=resume, retrain=retrain,
                                    device=device, say=say)
    timing.update(denoiser.timing)
    classifier = train_classifier_stage(s, data, preset=preset, checkpoint_dir=ckdir, retrain=retrain, device=device,
                                        say=say)
    timing["classifier_s"] = classifier.wall_s
    tables = tables_of(s)
    samples = sampling_stage(s, data, denoiser, tables, preset=preset, checkpoint_dir=ckdir, resume=resume,
                             device=device, say=say)
    timing.update(samples.timing)
    ev = evaluate_stage(s, data, tables, samples, classifier, paper=paper or {}, cache=ckdir / "cache",
                        device=device, say=say)
    timing.update(ev.timing)
    timing["total_s"] = time.perf_counter() - t0
    return {"records": ev.records, "significance": ev.significance, "tables": _table_meta(tables),
            "checks": ev.checks, "data": data.describe(), "samplers": describe_samplers(s),
            "fid_protocol": fid_protocol(s, tables, ev.records, data),
            "model": _model_facts(s, denoiser, classifier, any(t["fid"] for t in tables.values())),
            "timing": timing, "grids": _grids(data, tables, samples), "group_sizes": samples.sizes}


def _table_meta(tables: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {k: {"title": t["title"], "n": t["n"], "fid": t["fid"], "baseline": t["variants"][0].label,
                "fid_rows": [v.label for v in t["variants"] if v.key in t["fid_rows"]],
                "variants": [{"key": v.key, "label": v.label, "exact": v.exact, "group": v.group}
                             for v in t["variants"]]} for k, t in tables.items()}


def _model_facts(s: dict[str, Any], denoiser: Denoiser, classifier: Classifier, fid: bool) -> dict[str, Any]:
    losses = denoiser.trained["losses"]
    return {"parameters": count_parameters(denoiser.unet), "unet": s["unet"], "train_steps": int(s["train"]["steps"]),
            "cached": denoiser.trained["cached"], "final_loss": float(losses[-max(1, len(losses) // 20):].mean()),
            "loss_curve": _curve(losses),
            "classifier": {"test_accuracy": classifier.accuracy, "features": int(s["classifier"]["features"]),
                           "widths": s["classifier"]["widths"], "seconds": classifier.seconds,
                           "cached": classifier.cached},
            "inception": describe_inception() if fid else None}


def _grids(data: ImageData, tables: dict[str, dict[str, Any]], samples: Samples) -> dict[str, Tensor]:
    """8-bit images for the figures: 64 real test images and the first (up to) 64 of every variant."""
    grids = {"real": quantize(to_model(data.test[:64]))}
    for t in tables.values():
        for v in t["variants"]:
            grids.setdefault(v.key, samples.collect(v, 0, min(t["n"], 64))["images"])
    return grids
