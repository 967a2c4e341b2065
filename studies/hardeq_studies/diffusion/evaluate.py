"""The evaluation stage of a ``diffusion`` run (:func:`evaluate_stage`): per table and row the violation rate and
residuals of the float output and of the saved 8-bit images, pixels outside ``[0, 1]``, the classifier Fréchet
distance and score, the Inception FID (reference statistics cached on disk, :func:`_inception_reference`), the
paired tests of :func:`~.plan.comparisons`, and what an FID of the run can decide (:func:`fid_protocol`)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..harness import atomic_torch_save, load_checkpoint
from .data import ImageData, quantize, to_model
from .metrics import (
    InceptionFeatures,
    Reference,
    bootstrap_frechet,
    classifier_score,
    frechet_to_reference,
)
from .model import classifier_outputs
from .plan import REAL, comparisons
from .stages import Classifier, Samples

__all__ = ["Evaluation", "evaluate_stage", "fid_protocol"]


def _wilcoxon_over_images(a: list[Tensor], b: list[Tensor]) -> dict[str, Any]:
    """Paired Wilcoxon signed-rank test over images (pooled over seeds) of per-image values ``a - b``."""
    from ..stats import paired_wilcoxon

    x, y = torch.cat(a).double().numpy(), torch.cat(b).double().numpy()
    return {**paired_wilcoxon(x, y), "mean_a": float(x.mean()), "mean_b": float(y.mean()),
            "test": "Wilcoxon signed-rank over images"}


def _stats(values: list[float]) -> tuple[float, float | None]:
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), (float(a.std(ddof=1)) if a.size > 1 else None)


def _real_subset(data: ImageData, n: int, seed: int) -> Tensor:
    idx = torch.randperm(data.train.shape[0], generator=torch.Generator().manual_seed(10_007 + seed))[:n]
    return quantize(to_model(data.train[idx]))


class _InceptionCache:
    """The Inception network with its ``reference`` statistics, and the features per (image set, seed) computed so
    far. The image sets of a key are prefixes of one another (the first ``n`` of the same stream), so only the
    rows not computed yet go through the network. ``seconds``: time spent on the sets' features and FIDs."""

    def __init__(self, inception: InceptionFeatures, reference: Reference) -> None:
        self.inception = inception
        self.reference = reference
        self.features: dict[tuple[str, int], Tensor] = {}
        self.seconds = 0.0

    def __call__(self, key: str, si: int, images: Tensor) -> Tensor:
        have = self.features.get((key, si), torch.empty(0, 2048))
        if have.shape[0] < images.shape[0]:
            have = torch.cat([have, self.inception(images[have.shape[0]:])])
            self.features[(key, si)] = have
        return have[:images.shape[0]]


@dataclass
class Evaluation:
    """The evaluation's output: ``records`` (one per table, row and metric), ``significance`` (the paired tests
    of :func:`comparisons`), the Inception ``checks`` and the stage's timing."""

    records: list[dict[str, Any]]
    significance: list[dict[str, Any]]
    checks: list[dict[str, Any]]
    timing: dict[str, float]


def _record(records: list[dict[str, Any]], common: dict[str, Any], metric: str, values: list[float],
            **extra: Any) -> None:
    """Append the record of one metric of one row: mean and std over the noise seeds, the per-seed values, the
    paper's value (``paper=``, default None) and any ``extra`` fields."""
    mean, std = _stats(values)
    records.append({**common, "metric": metric, "mean": mean, "std": std, "per_seed": values,
                    "paper": extra.pop("paper", None), **extra})


def _image_records(records: list[dict[str, Any]], common: dict[str, Any], per: list[dict[str, Tensor]],
                   base: list[dict[str, Tensor]] | None, base_label: str, tol: float, pv: dict[str, Any]) -> None:
    """The per-image metrics of one sampled row (``per``: one entry per noise seed): constraint violations and
    residuals of the float output and of the saved 8-bit images, pixels out of range, the difference to the
    projection (deterministic DDPM row) and the mean change against the table's baseline ``base``."""
    res = [p["residual"] for p in per]
    _record(records, common, "violation_rate", [float((r > tol).any(-1).double().mean()) for r in res],
            paper=pv.get("violation_rate"), tolerance=tol)
    _record(records, common, "max_residual", [float(r.max()) for r in res])
    _record(records, common, "mean_residual", [float(r.mean()) for r in res])
    _record(records, common, "out_of_range", [float(p["out_of_range"].double().mean()) for p in per])
    res8 = [p["residual_u8"] for p in per]
    _record(records, common, "violation_rate_u8", [float((r > 0).any(-1).double().mean()) for r in res8])
    _record(records, common, "max_residual_u8", [float(r.max()) for r in res8])
    if "diff_to_projection" in per[0]:
        _record(records, common, "max_abs_diff_to_projection", [float(p["diff_to_projection"].max()) for p in per])
    if base is not None:
        _record(records, common, "mean_abs_change", [float((p["images"].float() - b["images"].float()).abs().mean()
                                                           / 255) for p, b in zip(per, base)], baseline=base_label)


def _evaluate_table(tk: str, t: dict[str, Any], s: dict[str, Any], data: ImageData, samples: Samples,
                    classifier: Classifier, inc: _InceptionCache | None,
                    real_cache: dict[tuple[int, int], Tensor], paper: dict[str, Any], records: list[dict[str, Any]],
                    significance: list[dict[str, Any]]) -> None:
    """Append the records and paired tests of table ``tk`` (its variants against its first, the baseline)."""
    seed, seeds, ds, tol = int(s["seed"]), int(s["seeds"]), s["dataset"], float(s["tolerance"])
    n, variants = t["n"], t["variants"]
    base = variants[0]
    per = {v.key: [samples.collect(v, si, n) for si in range(seeds)] for v in variants}
    reals = []
    for si in range(seeds):
        if (n, si) not in real_cache:
            real_cache[(n, si)] = _real_subset(data, n, seed + si)
        reals.append(real_cache[(n, si)])
    cl_ref = classifier.reference
    cl_feats: dict[str, list[Tensor]] = {}
    cl_probs: dict[str, list[Tensor]] = {}
    for v in variants:
        outs = [classifier_outputs(classifier.net, p["images"]) for p in per[v.key]]
        cl_feats[v.label], cl_probs[v.label] = [o[0] for o in outs], [o[1] for o in outs]
    outs = [classifier_outputs(classifier.net, r) for r in reals]
    cl_feats[REAL], cl_probs[REAL] = [o[0] for o in outs], [o[1] for o in outs]
    comp = comparisons(tk, variants)
    label_of = {v.key: v.label for v in variants}
    set_pairs = [(label_of[a], label_of[b]) for a, b in comp["set"]]
    boot = bootstrap_frechet(cl_feats, cl_ref, baseline=base.label, replicates=int(s["classifier_bootstrap"]),
                             seed=seed + 17, pairs=set_pairs)
    inc_boot: dict[str, dict[str, Any]] = {}
    inc_vals: dict[str, list[float]] = {}
    if t["fid"] and inc is not None:  # inc is None only when no table has t["fid"]
        inc_ref = inc.reference
        ti = time.perf_counter()
        feats = {v.label: [inc(v.key, si, per[v.key][si]["images"]) for si in range(seeds)] for v in variants
                 if v.key in t["fid_rows"]}
        feats[REAL] = [inc(f"real{si}", si, reals[si]) for si in range(seeds)]
        inc_vals = {k: [frechet_to_reference(f, inc_ref) for f in fs] for k, fs in feats.items()}
        inc_boot = bootstrap_frechet(feats, inc_ref, baseline=base.label if base.label in feats else None,
                                     replicates=int(s["fid"]["bootstrap"]), seed=seed + 23,
                                     pairs=[(a, b) for a, b in set_pairs if a in feats and b in feats])
        inc.seconds += time.perf_counter() - ti
    pt = paper.get(tk, {})
    for label, v in [(v.label, v) for v in variants] + [(REAL, None)]:
        common = {"dataset": ds, "table": tk, "method": label, "n_seeds": seeds, "n_samples": n,
                  "variant": v.key if v is not None else "real", "exact": v.exact if v is not None else None}
        pv = pt.get(label, {})
        if v is not None:
            _image_records(records, common, per[v.key], per[base.key] if v.key != base.key else None, base.label,
                           tol, pv)
        sampled_vs_base = base.label if v is not None and label != base.label else None
        b = boot.get(label, {})
        _record(records, common, "classifier_fd", [frechet_to_reference(f, cl_ref) for f in cl_feats[label]],
                bootstrap_std=b.get("std"),
                ci95_diff=[b["diff_lo"], b["diff_hi"]] if "diff_lo" in b and v is not None else None,
                baseline=sampled_vs_base)
        _record(records, common, "classifier_score", [classifier_score(p) for p in cl_probs[label]])
        _record(records, common, "classifier_confidence", [float(p.max(1).values.double().mean())
                                                           for p in cl_probs[label]])
        if label in inc_vals:
            b = inc_boot.get(label, {})
            _record(records, common, "fid", inc_vals[label], paper=pv.get("fid"), bootstrap_std=b.get("std"),
                    ci95_diff=[b["diff_lo"], b["diff_hi"]] if "diff_lo" in b and v is not None else None,
                    baseline=sampled_vs_base)
        if "inception_score" in pv and pv["inception_score"] is not None:
            records.append({**common, "metric": "inception_score", "mean": None, "std": None,
                            "paper": pv["inception_score"][0], "paper_std": pv["inception_score"][1],
                            "note": "not available: the Inception TorchScript has no logits layer"})
    for kind in ("residual", "residual_u8"):
        for a, b in comp[kind]:
            va, vb = ([p[kind].max(-1).values for p in per[k]] for k in (a, b))
            significance.append({"table": tk, "a": label_of[a], "b": label_of[b], "metric": kind,
                                 **_wilcoxon_over_images(va, vb)})
    set_means = {"classifier_fd": {lab: _stats([frechet_to_reference(f, cl_ref) for f in fs])[0]
                                   for lab, fs in cl_feats.items()},
                 "fid": {lab: _stats(vals)[0] for lab, vals in inc_vals.items()}}
    for metric, bt in (("classifier_fd", boot), ("fid", inc_boot)):
        for a, b in set_pairs:
            vs = bt.get(a, {}).get("vs", {}).get(b)
            if vs is None:
                continue
            ma, mb = set_means[metric][a], set_means[metric][b]
            significance.append({"table": tk, "a": a, "b": b, "metric": metric, "n": n * seeds,
                                 "test": "paired bootstrap over images", "mean_a": ma, "mean_b": mb,
                                 "mean_diff": ma - mb, "ci95": [vs["diff_lo"], vs["diff_hi"]],
                                 "p": vs["p"], "replicates": vs["replicates"],
                                 "p_floor": 2 / (vs["replicates"] + 1)})


def evaluate_stage(s: dict[str, Any], data: ImageData, tables: dict[str, dict[str, Any]], samples: Samples,
                   classifier: Classifier, *, paper: dict[str, Any], cache: Path, device: torch.device,
                   say: Callable[[str], None]) -> Evaluation:
    """The metrics of every table: violation rate and residuals, share of pixels outside ``[0, 1]``, classifier
    Fréchet distance and score, Inception FID (with its reference statistics cached in ``cache``), paired tests
    against the table's unconstrained sampler."""
    t1 = time.perf_counter()
    checks: list[dict[str, Any]] = []
    inc = None
    if any(t["fid"] for t in tables.values()):
        inception = InceptionFeatures(device, int(s["fid"]["batch_size"]))
        inc_ref, checks = _inception_reference(inception, data, s, cache, say)
        inc = _InceptionCache(inception, inc_ref)
    timing = {"inception_reference_s": time.perf_counter() - t1}
    records: list[dict[str, Any]] = []
    significance: list[dict[str, Any]] = []
    real_cache: dict[tuple[int, int], Tensor] = {}
    for tk, t in tables.items():
        _evaluate_table(tk, t, s, data, samples, classifier, inc, real_cache, paper, records, significance)
    timing["metrics_s"] = time.perf_counter() - t1
    timing["inception_s"] = inc.seconds if inc is not None else 0.0
    return Evaluation(records, significance, checks, timing)


def fid_protocol(s: dict[str, Any], tables: dict[str, dict[str, Any]], records: list[dict[str, Any]],
                 data: ImageData) -> dict[str, Any] | None:
    """What an FID of this run can decide: per table with an FID the images per noise seed, the noise seeds, the
    rows with an FID, the real-vs-real FID at the same sizes (``n`` real training images per seed against the same
    reference: the FID of a perfect sampler at this budget) and the bootstrap's replicates and p-value floor;
    ``None`` without the Inception FID."""
    fid = s["fid"]
    if not any(t["fid"] for t in tables.values()):
        return None
    R = int(fid["bootstrap"])
    real = {r["table"]: r for r in records if r["metric"] == "fid" and r["variant"] == "real"}
    split = fid.get("reference_split", "test")
    pool = data.test if split == "test" else data.train
    return {"n_reference": min(int(fid["n_reference"]), pool.shape[0]), "reference_split": split,
            "seeds": int(s["seeds"]), "bootstrap_replicates": R, "p_floor": 2 / (R + 1) if R >= 2 else None,
            "rows": fid.get("rows", "all"),
            "tables": {k: {"n_per_seed": t["n"], "rows": [v.label for v in t["variants"] if v.key in t["fid_rows"]],
                           "real_vs_real": {"mean": real[k]["mean"], "std": real[k]["std"],
                                            "per_seed": real[k]["per_seed"]} if k in real else None}
                       for k, t in tables.items() if t["fid"]}}


def _inception_reference(inception: InceptionFeatures, data: ImageData, s: dict[str, Any], cache: Path,
                         say: Callable[[str], None]) -> tuple[Reference, list[dict[str, Any]]]:
    """Reference statistics of ``n_reference`` real images of the reference split (cached on disk, keyed by the
    data set, split, count and a hash of the 8-bit images) and the FID sanity checks computed with them."""
    f = s["fid"]
    split = f.get("reference_split", "test")
    pool = data.test if split == "test" else data.train
    n_ref = min(int(f["n_reference"]), pool.shape[0])
    idx = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(4242))[:n_ref]
    images = quantize(to_model(pool[idx]))
    digest = hashlib.sha256(images.numpy().tobytes()).hexdigest()[:16]
    path = cache / f"inception-ref-{data.name}-{split}-{n_ref}-{digest}.pt"
    if path.exists():
        ck = load_checkpoint(path)
        say(f"[diffusion] Inception reference statistics: cached ({path.name})")
        return Reference.from_state(ck["reference"]), ck["checks"]
    ts = time.perf_counter()
    feats = inception(images)
    ref = Reference.from_features(feats)
    half = n_ref // 2
    checks = [{"check": "reference vs itself", "fid": frechet_to_reference(feats, ref), "n": n_ref,
               "expected": "0 (up to round-off)"},
              {"check": "two disjoint halves of the reference images", "n": half,
               "fid": frechet_to_reference(feats[:half], Reference.from_features(feats[half:2 * half])),
               "expected": "small (sampling noise of the real data at this n)"}]
    gen = torch.Generator().manual_seed(99)
    noise = torch.randint(0, 256, (int(f["n_noise"]), *data.shape), generator=gen, dtype=torch.uint8)
    checks.append({"check": "uniform noise images vs the reference", "n": int(f["n_noise"]),
                   "fid": frechet_to_reference(inception(noise), ref), "expected": "very large (hundreds)"})
    seconds = time.perf_counter() - ts
    for c in checks:
        c["reference"] = f"{n_ref} real {split} images"
    atomic_torch_save({"reference": ref.state(), "checks": checks, "seconds": seconds}, path)
    say(f"[diffusion] Inception reference statistics of {n_ref} images: {seconds:.0f} s; checks "
        + ", ".join(f"{c['check']}: {c['fid']:.3g}" for c in checks))
    return ref, checks
