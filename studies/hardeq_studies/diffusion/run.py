r"""Running the ``diffusion`` study: settings of a preset, training (cached), sampling (resumable), evaluation.

Phases, each timed:

1. data (:func:`~.data.load_data`);
2. the denoiser, trained once per (data, model, training) settings and kept in
   ``CHECKPOINTS/diffusion-DATASET-PRESET-denoiser.pt``: a complete checkpoint of the same settings is reused
   (the evaluation alone is then cheap), an interrupted one is continued with ``--resume``;
3. the feature classifier (cached the same way);
4. sampling in chunks (:func:`~.sampling.sample_group`), one resumable block per (seed, group, chunk), each
   saved atomically to its own file in ``CHECKPOINTS/diffusion-DATASET-PRESET-samples/`` (:func:`sample_blocks`;
   one file per block keeps the paper preset's 50,000-image runs from rewriting gigabytes per block);
5. metrics: violation rate and residuals, share of pixels outside ``[0, 1]``, classifier Fréchet distance and
   classifier score, Inception FID (with its reference statistics cached in ``CHECKPOINTS/cache``), paired
   bootstraps against the table's unconstrained sampler.
"""

from __future__ import annotations

import copy
import hashlib
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

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
from .sampling import Variant, ddim_variants, ddpm_variants, parse_schedule

__all__ = ["settings", "tables_of", "comparisons", "run", "TABLE_TITLES"]

TABLE_TITLES = {"3": "DDPM and the constrained last step (paper Table 3)",
                "4": "DDIM and conditioned x0-predictions (paper Table 4)",
                "6": "conditioning schedules of DDIM (paper Table 9)",
                "7": "Start N End N (paper Table 10)"}
REAL = "real images (train split)"


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
    """The comparisons: per table its variants (baseline first), the number of images ``n`` and whether the
    Inception FID is computed."""
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
    for k, t in out.items():
        t["fid"] = k in fid_tables
        t["title"] = TABLE_TITLES[k]
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
                      ("ddpm+ours+det", "ddpm+project")]
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


def run(s: dict[str, Any], *, preset: str, checkpoint_dir: Path, paper: dict[str, Any] | None = None,
        resume: bool = False, retrain: bool = False, device: torch.device | str = "cpu", progress: bool = True,
        log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Everything but the report, for the settings ``s`` (:func:`settings`).

    ``paper``: the paper's values per table and row label (config ``paper.tables``). ``retrain`` ignores the
    cached denoiser and classifier. Returns ``{"records", "significance", "tables", "checks", "data", "model",
    "timing", "grids", "group_sizes"}`` (``significance``: the paired tests of :func:`comparisons`; ``grids``:
    8-bit images for the figures, not written to the JSON)."""
    from hardeq.diffusion import make_betas

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    say = log if progress else (lambda msg: None)
    device = torch.device(device)
    ckdir = Path(checkpoint_dir)
    cache = ckdir / "cache"
    seed = int(s["seed"])
    ds = s["dataset"]
    timing: dict[str, Any] = {}
    t0 = time.perf_counter()

    # 1. data -------------------------------------------------------------------------------------------------
    data = load_data(ds, train_limit=s["data"]["train_limit"], test_limit=s["data"]["test_limit"], cache_dir=cache,
                     seed=seed)
    C = data.shape[0]
    totals, mtotals = data.totals, data.constraint_totals()
    timing["data_s"] = time.perf_counter() - t0
    say(f"[diffusion] {ds}: {data.train.shape[0]} training images, channel sums {[round(float(t), 3) for t in totals]}"
        f" ({timing['data_s']:.0f} s)")

    # 2. denoiser ---------------------------------------------------------------------------------------------
    d = s["diffusion"]
    betas = make_betas(int(d["num_train_timesteps"]), float(d["beta_start"]), float(d["beta_end"]), d["beta_schedule"])
    abar = torch.cumprod(1 - betas, 0)
    torch.manual_seed(seed)
    unet = build_unet(s["unet"], C)
    tr = s["train"]
    train_id = {"dataset": ds, "data": s["data"], "diffusion": d, "unet": s["unet"], "seed": seed,
                "train": {k: v for k, v in tr.items() if k not in ("checkpoint_every", "log_every")},
                "totals": [round(float(t), 9) for t in totals]}
    t1 = time.perf_counter()
    unet_path = ckdir / f"diffusion-{ds}-{preset}-denoiser.pt"
    if retrain:
        unet_path.unlink(missing_ok=True)
    trained = train_denoiser(unet, to_model(data.train), abar, tr, steps=int(tr["steps"]), seed=seed,
                             checkpoint_path=unet_path, resume=resume,
                             run_id=train_id, device=device, log=say)
    unet.load_state_dict(trained["ema"])
    unet.to(device).eval()
    timing["train_s"] = time.perf_counter() - t1
    timing["train_compute_s"] = trained["seconds"]
    timing["train_s_per_step"] = trained["seconds"] / max(1, int(tr["steps"]))
    say(f"[diffusion] denoiser: {count_parameters(unet):,} parameters, {tr['steps']} steps "
        f"({'cached' if trained['cached'] else 'trained'}, {trained['seconds']:.0f} s of training)")

    # 3. classifier -------------------------------------------------------------------------------------------
    t1 = time.perf_counter()
    train_u8, test_u8 = quantize(to_model(data.train)), quantize(to_model(data.test))
    cl_id = {"dataset": ds, "data": s["data"], "classifier": s["classifier"], "seed": seed}
    cl_path = ckdir / f"diffusion-{ds}-{preset}-classifier.pt"
    from .model import SmallCNN

    net = SmallCNN(C, tuple(s["classifier"]["widths"]), int(s["classifier"]["features"])).to(device)
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
    cl_ref = Reference.from_features(test_feats)
    timing["classifier_s"] = time.perf_counter() - t1
    say(f"[diffusion] classifier: test accuracy {accuracy:.4f} ({'cached' if cached else f'{cl_seconds:.0f} s'})")

    # 4. sampling ---------------------------------------------------------------------------------------------
    tables = tables_of(s)
    sm = s["sampling"]
    sizes = _group_sizes(tables)
    seeds = int(s["seeds"])
    chunk = int(sm["chunk"])
    blocks: dict[str, tuple[int, Callable[[], Any]]] = {}
    for si in range(seeds):
        for group, n_group in sizes.items():
            for j, n in enumerate(_chunks(n_group, chunk)):
                noise_seed = seed * 1_000_003 + si * 10_007 + j

                def compute(group=group, n=n, noise_seed=noise_seed) -> dict[str, Any]:
                    ts = time.perf_counter()
                    res = sample_group_fn(unet, group, shape=data.shape, n=n, full=chunk, totals=totals,
                                          model_totals=mtotals, seed=noise_seed, betas=betas,
                                          ddim_steps=int(sm["ddim_steps"]), eta=float(sm["eta"]),
                                          deterministic=bool(sm["deterministic"]), device=device)
                    return {"variants": res, "seconds": time.perf_counter() - ts, "n": n}

                blocks[f"seed{si}/{group}/chunk{j}"] = (n, compute)
    # what a block's images depend on (besides its key and size): a longer run reuses the chunks it shares
    sample_id = {"train": fingerprint(train_id), "seed": seed, "chunk": chunk, "format": 2,
                 **{k: sm[k] for k in ("ddim_steps", "eta", "deterministic")}}
    t1 = time.perf_counter()
    done = [0]

    def on_block(key: str, res: dict[str, Any]) -> None:
        done[0] += 1
        say(f"[diffusion] sampled {done[0]}/{len(blocks)} {key}: {res['n']} images in {res['seconds']:.1f} s; "
            f"elapsed {time.perf_counter() - t1:.0f} s")

    results = sample_blocks(blocks, ckdir / f"diffusion-{ds}-{preset}-samples", resume=resume, run_id=sample_id,
                            on_block=on_block)
    timing["sampling_s"] = time.perf_counter() - t1
    group_seconds: dict[str, float] = {}
    for key, res in results.items():
        g = key.split("/")[1]
        group_seconds[g] = group_seconds.get(g, 0.0) + float(res["seconds"])
    timing["sampling_s_by_group"] = group_seconds
    T = int(d["num_train_timesteps"])
    evals = {"ddpm": seeds * sizes.get("ddpm", 1) * (T + 3),  # the trajectory and 3 last steps
             "ddim": seeds * sizes.get("ddim", 1) * int(sm["ddim_steps"])}
    timing["ms_per_image_step"] = {g: 1e3 * group_seconds.get(g, math.nan) / max(1, e) for g, e in evals.items()}

    # assemble: per variant, per seed, the first n images of its group's chunks
    def collect(v: Variant, si: int, n: int) -> dict[str, Tensor]:
        parts = [results[f"seed{si}/{v.group}/chunk{j}"]["variants"][v.key] for j in range(len(_chunks(sizes[v.group],
                                                                                                      chunk)))]
        return {k: torch.cat([p[k] for p in parts])[:n] for k in parts[0]}

    # 5. metrics ----------------------------------------------------------------------------------------------
    t1 = time.perf_counter()
    tol = float(s["tolerance"])
    inception = None
    fid_tables = [k for k, t in tables.items() if t["fid"]]
    checks: list[dict[str, Any]] = []
    inc_ref = None
    if fid_tables:
        inception = InceptionFeatures(device, int(s["fid"]["batch_size"]))
        inc_ref, checks = _inception_reference(inception, data, s, cache, say)
    timing["inception_reference_s"] = time.perf_counter() - t1
    records: list[dict[str, Any]] = []
    significance: list[dict[str, Any]] = []
    paper = paper or {}
    inc_cache: dict[tuple[str, int], Tensor] = {}
    real_cache: dict[tuple[int, int], Tensor] = {}

    def inc_features(key: str, si: int, images: Tensor) -> Tensor:
        """Inception features of ``images``; the image sets of a key are prefixes of one another (the first n
        of the same stream), so only the rows not computed yet go through the network."""
        have = inc_cache.get((key, si), torch.empty(0, 2048))
        if have.shape[0] < images.shape[0]:
            have = torch.cat([have, inception(images[have.shape[0]:])])
            inc_cache[(key, si)] = have
        return have[:images.shape[0]]

    t_inc = 0.0
    for tk, t in tables.items():
        n, variants = t["n"], t["variants"]
        base = variants[0]
        per: dict[str, list[dict[str, Tensor]]] = {v.key: [collect(v, si, n) for si in range(seeds)] for v in variants}
        reals = []
        for si in range(seeds):
            if (n, si) not in real_cache:
                real_cache[(n, si)] = _real_subset(data, n, seed + si)
            reals.append(real_cache[(n, si)])
        cl_feats: dict[str, list[Tensor]] = {}
        cl_probs: dict[str, list[Tensor]] = {}
        for v in variants:
            outs = [classifier_outputs(net, p["images"]) for p in per[v.key]]
            cl_feats[v.label], cl_probs[v.label] = [o[0] for o in outs], [o[1] for o in outs]
        outs = [classifier_outputs(net, r) for r in reals]
        cl_feats[REAL], cl_probs[REAL] = [o[0] for o in outs], [o[1] for o in outs]
        comp = comparisons(tk, variants)
        label_of = {v.key: v.label for v in variants}
        set_pairs = [(label_of[a], label_of[b]) for a, b in comp["set"]]
        boot = bootstrap_frechet(cl_feats, cl_ref, baseline=base.label, replicates=int(s["classifier_bootstrap"]),
                                 seed=seed + 17, pairs=set_pairs)
        inc_boot: dict[str, dict[str, float]] = {}
        inc_vals: dict[str, list[float]] = {}
        if t["fid"]:
            ti = time.perf_counter()
            feats = {v.label: [inc_features(v.key, si, per[v.key][si]["images"]) for si in range(seeds)]
                     for v in variants}
            feats[REAL] = [inc_features(f"real{si}", si, reals[si]) for si in range(seeds)]
            inc_vals = {k: [frechet_to_reference(f, inc_ref) for f in fs] for k, fs in feats.items()}
            inc_boot = bootstrap_frechet(feats, inc_ref, baseline=base.label, replicates=int(s["fid"]["bootstrap"]),
                                         seed=seed + 23, pairs=set_pairs)
            t_inc += time.perf_counter() - ti
        pt = paper.get(tk, {})
        rows = [(v.label, v) for v in variants] + [(REAL, None)]
        for label, v in rows:
            common = {"dataset": ds, "table": tk, "method": label, "n_seeds": seeds, "n_samples": n,
                      "variant": v.key if v is not None else "real", "exact": v.exact if v is not None else None}
            pv = pt.get(label, {})

            def rec(metric: str, values: list[float], common: dict[str, Any] = common, **extra: Any) -> None:
                mean, std = _stats(values)
                records.append({**common, "metric": metric, "mean": mean, "std": std, "per_seed": values,
                                "paper": extra.pop("paper", None), **extra})

            if v is not None:
                res = [p["residual"] for p in per[v.key]]
                rec("violation_rate", [float((r > tol).any(-1).double().mean()) for r in res],
                    paper=pv.get("violation_rate"), tolerance=tol)
                rec("max_residual", [float(r.max()) for r in res])
                rec("mean_residual", [float(r.mean()) for r in res])
                rec("out_of_range", [float(p["out_of_range"].double().mean()) for p in per[v.key]])
                res8 = [p["residual_u8"] for p in per[v.key]]
                rec("violation_rate_u8", [float((r > 0).any(-1).double().mean()) for r in res8])
                rec("max_residual_u8", [float(r.max()) for r in res8])
                if "diff_to_projection" in per[v.key][0]:
                    rec("max_abs_diff_to_projection", [float(p["diff_to_projection"].max()) for p in per[v.key]])
                if v.key != base.key:
                    rec("mean_abs_change", [float((p["images"].float() - b["images"].float()).abs().mean() / 255)
                                            for p, b in zip(per[v.key], per[base.key])], baseline=base.label)
            cf = [frechet_to_reference(f, cl_ref) for f in cl_feats[label]]
            b = boot.get(label, {})
            rec("classifier_fd", cf, bootstrap_std=b.get("std"),
                ci95_diff=[b["diff_lo"], b["diff_hi"]] if "diff_lo" in b and v is not None else None,
                baseline=base.label if v is not None and label != base.label else None)
            rec("classifier_score", [classifier_score(p) for p in cl_probs[label]])
            rec("classifier_confidence", [float(p.max(1).values.double().mean()) for p in cl_probs[label]])
            if t["fid"]:
                b = inc_boot.get(label, {})
                rec("fid", inc_vals[label], paper=pv.get("fid"), bootstrap_std=b.get("std"),
                    ci95_diff=[b["diff_lo"], b["diff_hi"]] if "diff_lo" in b and v is not None else None,
                    baseline=base.label if v is not None and label != base.label else None)
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
                                     "p": vs["p"], "replicates": int(s["fid"]["bootstrap"] if metric == "fid"
                                                                     else s["classifier_bootstrap"])})
    timing["metrics_s"] = time.perf_counter() - t1
    timing["inception_s"] = t_inc
    timing["total_s"] = time.perf_counter() - t0

    grids = {"real": quantize(to_model(data.test[:64]))}
    for t in tables.values():
        for v in t["variants"]:
            grids.setdefault(v.key, collect(v, 0, min(t["n"], 64))["images"])
    table_meta = {k: {"title": t["title"], "n": t["n"], "fid": t["fid"], "baseline": t["variants"][0].label,
                      "variants": [{"key": v.key, "label": v.label, "exact": v.exact, "group": v.group}
                                   for v in t["variants"]]} for k, t in tables.items()}
    model_facts = {"parameters": count_parameters(unet), "unet": s["unet"], "train_steps": int(tr["steps"]),
                   "cached": trained["cached"], "final_loss": float(trained["losses"][-max(1, len(trained["losses"])
                                                                                          // 20):].mean()),
                   "loss_curve": _curve(trained["losses"]),
                   "classifier": {"test_accuracy": accuracy, "features": int(s["classifier"]["features"]),
                                  "widths": s["classifier"]["widths"], "seconds": cl_seconds, "cached": cached},
                   "inception": describe_inception() if fid_tables else None}
    return {"records": records, "significance": significance, "tables": table_meta, "checks": checks,
            "data": data.describe(), "model": model_facts, "timing": timing, "grids": grids, "group_sizes": sizes}


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
