r"""Running the ``diffusion`` study: settings of a preset, then four stages, each a function with one job and each
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

import copy
import hashlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from ..harness import atomic_torch_save, fingerprint, load_checkpoint
from .data import ImageData, load_data, quantize, to_model
from .metrics import (
    InceptionFeatures,
    Reference,
    bootstrap_frechet,
    classifier_score,
    describe_inception,
    frechet_to_reference,
)
from .model import build_unet, classifier_outputs, count_parameters, train_classifier, train_denoiser
from .sampling import Variant, ddim_variants, ddpm_variants, describe_samplers, parse_schedule

__all__ = ["settings", "tables_of", "comparisons", "run", "TABLE_TITLES", "Denoiser", "Classifier", "Samples",
           "Evaluation", "train_denoiser_stage", "train_classifier_stage", "sampling_stage", "evaluate_stage"]

TABLE_TITLES = {"3": "DDPM and the constrained last step (paper Table 3)",
                "4": "DDIM and conditioned x0-predictions (paper Table 4)",
                "6": "conditioning schedules of DDIM (paper Table 9)",
                "7": "Start N End N (paper Table 10)"}
REAL = "real images (train split)"
#: the unconstrained samplers, the constrained DDPM step and the projections they are compared with: with
#: ``fid.rows = "deciding"`` only these rows (and the headline DDIM schedule, and the real images) get an FID
DECIDING = ("ddpm", "ddpm+ours", "ddpm+project", "ddim", "ddim+project")


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def settings(config: dict[str, Any], preset: str, dataset: str | None = None) -> dict[str, Any]:
    """The protocol of ``preset``: ``config["protocol"]`` overridden by the preset's entries and then by the
    preset's ``datasets[DATASET]`` entries (``dataset``: the preset's when None)."""
    if preset not in config["presets"]:
        raise ValueError(f"preset must be one of {sorted(config['presets'])}, got {preset!r}.")
    p = {k: v for k, v in config["presets"][preset].items() if k not in ("description", "duration")}
    per_dataset = p.pop("datasets", {})
    s = _merge(config["protocol"], p)
    if dataset is not None:
        s["dataset"] = dataset
    s = _merge(s, per_dataset.get(s["dataset"], {}))
    s.setdefault("seeds", 1)
    return s


def tables_of(s: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The comparisons: per table its variants (baseline first), the number of images ``n`` per noise seed, whether
    the Inception FID is computed (``fid``) and for which rows (``fid_rows``: every row, or with ``fid.rows =
    "deciding"`` the rows that decide the paper's claims, :data:`DECIDING` and the headline schedule)."""
    sm = s["sampling"]
    head = sm["headline"]
    ddpm = ddpm_variants()
    ddim = {v.key: v for v in ddim_variants(sorted({head, *s["tables"]["6"], *s["tables"]["7"]}),
                                            int(sm["ddim_steps"]), head)}
    fid_tables = set(s["fid"]["tables"]) if s["fid"].get("inception") else set()

    def sched(text: str) -> Variant:
        return ddim[f"ddim@{parse_schedule(text)!r}"]

    out = {"3": {"variants": ddpm, "n": int(sm["n_ddpm"])},
           "4": {"variants": [ddim["ddim"], sched(head), ddim[sched(head).key + "+det"],
                              ddim[sched(head).key + "+box"], ddim["ddim+project"], ddim["ddim+project+clip"]],
                 "n": int(sm["n_ddim"])},
           "6": {"variants": [ddim["ddim"], *[sched(t) for t in s["tables"]["6"]]], "n": int(sm["n_sweep"])},
           "7": {"variants": [ddim["ddim"], *[sched(t) for t in s["tables"]["7"]]], "n": int(sm["n_sweep"])}}
    deciding = {*DECIDING, sched(head).key}
    every_row = s["fid"].get("rows", "all") == "all"
    for k, t in out.items():
        t["fid"] = k in fid_tables
        t["title"] = TABLE_TITLES[k]
        t["fid_rows"] = [v.key for v in t["variants"] if t["fid"] and (every_row or v.key in deciding)]
    return out


def comparisons(table: str, variants: list[Variant]) -> dict[str, list[tuple[str, str]]]:
    """The paired comparisons ``(a, b)`` (variant keys; ``a - b``) of a table, per kind: ``"residual"`` (the
    largest channel residual of the float output, paired Wilcoxon over images), ``"residual_u8"`` (the same on
    the saved 8-bit images) and ``"set"`` (FID and classifier FD, paired bootstrap over images). Only pairs
    whose variants are both in the table."""
    keys = {v.key for v in variants}
    head = next((v.key for v in variants if v.key.startswith("ddim@") and v.post is None), None)
    out: dict[str, list[tuple[str, str]]] = {"residual": [], "residual_u8": [], "set": []}
    if table == "3":
        out["residual"] = [("ddpm+ours", "ddpm"), ("ddpm+ours+box", "ddpm")]
        out["residual_u8"] = [("ddpm+ours+box", "ddpm+ours"), ("ddpm+ours+box", "ddpm+project+clip")]
        out["set"] = [("ddpm+ours", "ddpm"), ("ddpm+ours+det", "ddpm"), ("ddpm+ours+box", "ddpm"),
                      ("ddpm+ours", "ddpm+project"), ("ddpm+ours+det", "ddpm+project")]
    elif table == "4" and head is not None:
        out["residual"] = [(head, "ddim"), (head + "+box", "ddim")]
        out["residual_u8"] = [(head + "+box", head), (head + "+box", "ddim+project+clip")]
        out["set"] = [(head, "ddim"), (head + "+det", "ddim"), (head + "+box", "ddim"), (head, "ddim+project"),
                      (head + "+det", "ddim+project")]
    elif table == "6":  # end placement: End N Space s against Start N Space s
        out["residual"] = [(k.replace("StartSpaced", "EndSpaced"), k) for k in sorted(keys) if "StartSpaced" in k]
    return {kind: [(a, b) for a, b in pairs if a in keys and b in keys] for kind, pairs in out.items()}


def _wilcoxon_over_images(a: list[Tensor], b: list[Tensor]) -> dict[str, Any]:
    """Paired Wilcoxon signed-rank test over images (pooled over seeds) of per-image values ``a - b``."""
    from ..stats import paired_wilcoxon

    x, y = torch.cat(a).double().numpy(), torch.cat(b).double().numpy()
    return {**paired_wilcoxon(x, y), "mean_a": float(x.mean()), "mean_b": float(y.mean()),
            "test": "Wilcoxon signed-rank over images"}


def _group_sizes(tables: dict[str, dict[str, Any]]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for t in tables.values():
        for v in t["variants"]:
            sizes[v.group] = max(sizes.get(v.group, 0), t["n"])
    return sizes


def _chunks(n: int, chunk: int) -> list[int]:
    return [min(chunk, n - i) for i in range(0, n, chunk)]


def _stats(values: list[float]) -> tuple[float, float | None]:
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), (float(a.std(ddof=1)) if a.size > 1 else None)


def _real_subset(data: ImageData, n: int, seed: int) -> Tensor:
    idx = torch.randperm(data.train.shape[0], generator=torch.Generator().manual_seed(10_007 + seed))[:n]
    return quantize(to_model(data.train[idx]))


# ----------------------------------------------------------------------------------------------------- stages
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
    # what a block's images depend on (besides its key and size): a longer run reuses the chunks it shares
    sample_id = {"train": fingerprint(denoiser.train_id), "seed": seed, "chunk": chunk, "format": 2,
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
