"""Reporting the ``diffusion`` study: ``diffusion.md`` from the results document alone. The claims are decided in
:mod:`.verdicts`, the figures drawn in :mod:`.figures`, the shared formatting is :mod:`.report_format`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..claims import claims_section
from ..results import markdown_table
from .figures import GRID_FILES, plot_schedules, plot_training, save_grids
from .report_format import (
    _METRIC_NAMES, METRICS, STEP_NOTE, _cell, _ci, _fmt, _index, _paper, _rows, _title, _wall, paper_table,
)
from .verdicts import U8_DDPM, claims, claims_note

__all__ = ["paper_table", "render_markdown", "protocol_sections", "plot_schedules", "plot_training", "save_grids",
           "claims", "GRID_FILES"]


def _significance_section(doc: Mapping[str, Any]) -> list[str]:
    sig = doc.get("significance", [])
    if not sig:
        return []
    rows = []
    for r in sig:
        if "ci95" in r:
            test = f"{_fmt(r['mean_diff'], '.3g')} [{_fmt(r['ci95'][0], '.3g')}, {_fmt(r['ci95'][1], '.3g')}]"
        else:
            test = f"median {_fmt(r['median_diff'], '.3g')}; {r['wins']}/{r['n']} images lower"
        rows.append([paper_table(r["table"]), r["a"], r["b"], _METRIC_NAMES.get(r["metric"], r["metric"]),
                     _fmt(r["mean_a"], ".4g"), _fmt(r["mean_b"], ".4g"), test, r["test"], r["n"],
                     _fmt(r["p"], ".2g")])
    return ["## Paired comparisons", "",
            "a - b per pair of rows sampled from the same noise: for the residuals a Wilcoxon signed-rank test over "
            "images (per image the largest channel residual: float output in [0, 1] units, or the saved 8-bit image "
            "in grey levels), for FID and classifier FD a paired bootstrap over images (difference of the "
            "distances and its 95% interval).", "",
            markdown_table(["table", "a", "b", "metric", "value a", "value b", "difference a - b", "test", "n", "p"],
                           rows)]


def protocol_sections(doc: Mapping[str, Any]) -> list[str]:
    """The tables that say what this run's evidence can decide: the samplers' step variance and clipping (and why),
    the FID's sizes beside the real-vs-real FID at the same sizes and the bootstrap's p floor, and the measured
    cost of the preset with the wall time it projects. Each only when the document records it."""
    lines: list[str] = []
    samplers = doc.get("samplers")
    if samplers:
        lines += ["## Samplers: step variance and clipping", ""]
        rows = [[name, d["loop"], d["step_variance"], f"{d['conditioned_step']} of N(x0_hat, "
                 f"{d['conditioned_step_variance']} I) given the constraint", "no" if not d["clip_sample"] else "yes"]
                for name, d in samplers.items()]
        lines.append(markdown_table(["sampler", "loop", "unconditioned step variance", "conditioned step",
                                     "clips x0 (clip_sample)"], rows))
        first = next(iter(samplers.values()))
        lines += [f"Why no clipping: {first['clip_reason']}", "",
                  f"Why beta_t at the conditioned steps: {first['variance_reason']}.", ""]
    fp = doc.get("fid_protocol")
    if fp:
        floor = _fmt(fp["p_floor"], ".2g") if fp.get("p_floor") is not None else "–"
        lines += ["## What the FID can decide at this budget", "",
                  f"FID against {fp['n_reference']:,} real {fp['reference_split']} images; {fp['seeds']} noise "
                  f"seed(s); paired bootstrap over images with {fp['bootstrap_replicates']:,} replicates (smallest "
                  f"possible p: {floor}). The real-vs-real FID is that of real training images at the same size "
                  "against the same reference: what a perfect sampler scores here, so FID differences far below it "
                  "decide little.", ""]
        rows = []
        for tk, t in fp["tables"].items():
            rr = t.get("real_vs_real") or {}
            rows.append([tk, t["n_per_seed"], fp["seeds"], ", ".join(t["rows"]),
                         _cell({"mean": rr.get("mean"), "std": rr.get("std")}, ".2f")])
        lines.append(markdown_table(["table", "images per seed", "seeds", "rows with an FID",
                                     "real-vs-real FID"], rows))
    cost = doc["config"]["settings"].get("cost")
    if cost:
        m = cost["measured"]
        lines += ["## Measured cost of this preset", "",
                  f"Measured on {m['date']} ({m['machine']}, {m['cpus']} CPUs, {m['threads']} thread(s), load "
                  f"average {m['load_before'][0]:.1f} before and {m['load_after'][0]:.1f} after; "
                  f"`python -m hardeq_studies.diffusion.cost`): training {_fmt(m['train_s_per_step'], '.2f')} s per "
                  f"step; DDPM {_fmt(m['ddpm_ms_per_image_step'], '.2f')} ms and DDIM "
                  f"{_fmt(m['ms_per_image_step'], '.2f')} ms per image and step; Inception "
                  f"{_fmt(m['inception_s_per_image'], '.3f')} s per image; one FID of {m['fid_n']} images "
                  f"{_fmt(m['fid_s'], '.2f')} s. {cost.get('note', '')}", ""]
        rows = [[k, _fmt(v / 60, ".0f")] for k, v in cost["projected_s"].items()]
        lines.append(markdown_table(["stage", "projected minutes"], rows))
    return lines


def time_accounting(doc: Mapping[str, Any]) -> list[str]:
    """What the stages of the run cost, as recorded with their results (a cached sampling block keeps the seconds
    it took when computed, in whichever leg), beside the recorded legs: a stage that came from a cache says so,
    and stage time beyond the legs' sum is said to be unrecorded legs. Durations only from the JSON."""
    timing, model = doc.get("timing", {}), doc.get("model", {})
    groups = timing.get("sampling_s_by_group") or {}
    if not groups:
        return []
    per_step = ", ".join(f"{k}: {_fmt(v, '.3f')} ms" for k, v in timing.get("ms_per_image_step", {}).items())
    sampled = sum(groups.values())
    stages = {"data": timing.get("data_s", 0.0), "classifier": timing.get("classifier_s", 0.0),
              "sampling blocks": sampled, "metrics": timing.get("metrics_s", 0.0)}
    train = f"training {_fmt(timing.get('train_compute_s'), '.0f')} s ({_fmt(timing.get('train_s_per_step'), '.3f')} " \
            "s/step)"
    if model.get("cached"):
        train += (": the denoiser came from the cache, trained by an earlier run whose time is in none of this run's "
                  "legs")
    else:
        stages["training"] = timing.get("train_compute_s", 0.0)
    total = sum(stages.values())
    legs = doc.get("resumed_legs") or []
    lines = [f"- stages as recorded with their results: sampling blocks {sampled:,.0f} s in all ({per_step} per "
             f"image and step), whichever leg computed them; {train}. Data, classifier, sampling blocks and metrics"
             + (" and training" if "training" in stages else "") + f" sum to {total:,.0f} s."]
    if legs and total > sum(legs):
        lines.append(f"- those stages exceed the {len(legs)} recorded legs ({sum(legs):,.0f} s) by "
                     f"{total - sum(legs):,.0f} s: time of legs the JSON does not record, so the run took at least "
                     f"{total:,.0f} s.")
    return lines


def pending_row_cost(doc: Mapping[str, Any]) -> list[str]:
    """``## What the pending row costs``: for a run without the row ``DDPM + ours (last step) + to_uint8_exact``
    (:data:`~.verdicts.U8_DDPM`), what a resumed run that adds it takes, from this run's own recorded times: the
    DDPM group sampled again (its cached blocks hold the 8-bit images of the other rows, not the float output the
    row needs), the metrics as before plus the new row's Inception images at this run's seconds per image, data
    and classifier; with the denoiser retrained (training is not in the repository) and with the DDIM blocks
    sampled again too. ``[]`` for a run that has the row or lacks the times."""
    timing, fp = doc.get("timing", {}), doc.get("fid_protocol") or {}
    groups = timing.get("sampling_s_by_group") or {}
    labels = [v["label"] for v in doc.get("tables", {}).get("3", {}).get("variants", [])]
    if U8_DDPM in labels or "ddpm" not in groups or not fp.get("tables") or not timing.get("inception_s"):
        return []
    seeds = int(fp["seeds"])
    sizes = {t["n_per_seed"] for t in fp["tables"].values()}
    images = sum(len(t["rows"]) * t["n_per_seed"] * seeds for t in fp["tables"].values()) + sum(sizes) * seeds
    per_image = timing["inception_s"] / images
    n3 = fp["tables"].get("3", {}).get("n_per_seed", 0) * seeds
    new = n3 * per_image
    ddpm, ddim = groups["ddpm"], sum(v for k, v in groups.items() if k != "ddpm")
    base = ddpm + timing.get("metrics_s", 0.0) + new + timing.get("data_s", 0.0) + timing.get("classifier_s", 0.0)
    train = timing.get("train_compute_s", 0.0)

    def s_h(x: float) -> str:
        return f"{x:,.0f} s ({x / 3600:.1f} h)"

    return ["## What the pending row costs", "",
            f"The row {U8_DDPM} (the sampled last step saved through `to_uint8_exact`) is not in this run. A resumed "
            "run that adds it needs, at this run's recorded rates: the DDPM group sampled again, "
            f"{ddpm:,.0f} s (its cached blocks hold 8-bit images of the other rows, not the float output the row "
            f"needs); the metrics as before, {timing.get('metrics_s', 0.0):,.0f} s, plus the row's {n3:,} Inception "
            f"images at {per_image:.3f} s each ({timing['inception_s']:,.0f} s for this run's {images:,}), "
            f"{new:,.0f} s; data and classifier "
            f"{timing.get('data_s', 0.0) + timing.get('classifier_s', 0.0):,.0f} s. That is {s_h(base)} with the "
            f"denoiser and the DDIM blocks cached, {s_h(base + train)} with the denoiser retrained "
            f"({train:,.0f} s), and {s_h(base + train + ddim)} from nothing (the DDIM blocks {ddim:,.0f} s).", ""]


def render_markdown(doc: Mapping[str, Any], out: Path | None = None) -> str:
    """``diffusion.md``: the tables next to the paper's values, the FID checks, the claims, run facts."""
    idx = _index(doc)
    s = doc["config"]["settings"]
    data, model, timing = doc["data"], doc["model"], doc.get("timing", {})
    ds = data["dataset"]
    seeds = s.get("seeds", 1)
    fid_on = any(t["fid"] for t in doc["tables"].values())
    lines = [f"# diffusion: brightness-constrained {ds.upper() if ds == 'mnist' else 'CIFAR-10'} "
             f"(preset `{doc['preset']}`)", "",
             "One denoiser is trained once; every variant below is a sampling-time change of the same weights, "
             "and every variant of a table starts from the same noise (image i of every row shares x_T). "
             f"{seeds} noise seed(s); with one seed the ± is a bootstrap std over images (set metrics) and "
             "differences carry a paired bootstrap 95% CI; with several, ± is the std over seeds.", "",
             f"**Constraint.** {data['constraint']}: k = {', '.join(f'{t:.4f}' for t in data['totals'])} "
             f"(pixels in [0, 1]). The model works in [-1, 1] (y = 2x - 1), where the constraint is "
             f"sum y = 2k - {data['shape'][1] * data['shape'][2]} = "
             f"{', '.join(f'{t:.4f}' for t in data['model_totals'])}. An image violates it when "
             f"|sum x - k| > {s['tolerance']:g} for a channel, measured on the unclipped float output.", ""]
    if ds == "mnist":
        lines += ["**Not comparable with the paper's numbers.** The paper's tables are CIFAR-10 at 50,000 samples "
                  "with a 35.7 M-parameter U-Net; this run is MNIST with a small denoiser and far fewer samples. "
                  "The paper's values are printed next to ours for the direction of each effect only.", ""]
    else:
        lines += ["**CIFAR-10 from a JPEG (q75) copy**: lossy, so FIDs are not comparable with published "
                  "CIFAR-10 FIDs.", ""]
    acc = model["classifier"]["test_accuracy"]
    lines += ["## Setup", "",
              f"- data: {data['source']}; {data['n_train']} training and {data['n_test']} test images; "
              f"{data['water_fill']}.",
              f"- denoiser: diffusers `UNet2DModel`, {model['parameters']:,} parameters (channels "
              f"{'/'.join(str(c) for c in model['unet']['block_out_channels'])}, {model['unet']['layers_per_block']} "
              f"res block(s) per level), epsilon-prediction, linear betas {s['diffusion']['beta_start']:g}.."
              f"{s['diffusion']['beta_end']:g}, T = {s['diffusion']['num_train_timesteps']}; {model['train_steps']} "
              f"steps at batch {s['train']['batch_size']}, EMA {s['train']['ema_decay']:g} (samples use the EMA "
              f"weights); final training loss {model['final_loss']:.4f}"
              f"{' (loaded from the cached checkpoint)' if model.get('cached') else ''}.",
              f"- samplers: DDPM over all T steps; DDIM {s['sampling']['ddim_steps']} steps, eta = "
              f"{s['sampling']['eta']:g}; {STEP_NOTE} (rows marked deterministic take the conditional mean "
              "instead of a sample).",
              f"- feature classifier (small CNN, {model['classifier']['features']}-d features) trained on the "
              f"brightness-constrained training images: test accuracy {acc:.4f}. Classifier FD = Fréchet distance "
              "to its features of the real test images; classifier score = the Inception-Score formula with this "
              "CNN's class probabilities (not the Inception Score).",
              "- images for FID, the classifier and the 8-bit violation are the 8-bit images a user saves: for the "
              "box-exact rows (ours + box) `to_uint8_exact` onto the totals (largest-remainder rounding), for the "
              "others the image clipped to [0, 1] and rounded. An 8-bit image violates the constraint when a "
              "channel's integer sum differs from round(255 k) (the closest total 8 bits can hold).",
              "- DDPM's own last step is deterministic (variance 0) and returns x0_hat, and the conditional mean of "
              "the isotropic Gaussian N(x0_hat, beta_0 I) given A x = k is the orthogonal projection of x0_hat: the "
              "row `DDPM + ours (last step, deterministic)` therefore equals `DDPM + projection` up to round-off "
              "(its largest difference is printed), and decides nothing about a distribution-aware benefit. The "
              "DDIM Start 3 End 3 deterministic row conditions three early steps too, so it differs from DDIM + "
              "projection."]
    if fid_on and model.get("inception"):
        inc = model["inception"]
        lines.append(f"- FID: {inc['weights']} (SHA-1 {inc['sha1']}), {inc['input']}; reference: "
                     f"{doc['checks'][0]['reference'] if doc.get('checks') else '–'}. **Inception Score: "
                     f"{inc['inception_score']}** (the paper's IS values are printed; ours are not computed).")
    else:
        lines.append("- FID: not computed in this run (no Inception network requested); IS: not available (the "
                     "Inception TorchScript used for FID has no logits layer).")
    lines.append("")
    for tk in ("3", "4"):
        meta = doc["tables"].get(tk)
        if meta is None:
            continue
        how = (f"DDPM over all T = {s['diffusion']['num_train_timesteps']} steps; the rows share each image's "
               "trajectory up to the last step" if tk == "3" else f"DDIM {s['sampling']['ddim_steps']} steps")
        lines += [f"## Table {paper_table(tk)}: {_title(meta)}", "",
                  f"{how}; n = {meta['n']} images per row and seed; baseline for the differences: "
                  f"{meta['baseline']}. Violation rate on the float output (paper: its violation rate) and on the "
                  "saved 8-bit images; max abs(sum - k) in [0, 1] units, the 8-bit one in grey levels.", ""]
        header = ["method", "violation rate", "paper", "8-bit violation rate", "max abs(sum - k)",
                  "max 8-bit abs(sum - T)", "pixels outside [0,1]"]
        if meta["fid"]:
            header += ["FID", "Δ FID 95% CI"]
        header += ["paper FID", "paper IS", "classifier FD", "Δ CFD 95% CI", "classifier score", "mean abs change"]
        rows = []
        for label in _rows(doc, tk):
            g = {m: idx.get((tk, label, m)) for m in METRICS}.get
            row = [label, _cell(g("violation_rate"), ".4g"), _paper(doc, tk, label, "violation_rate", ".4g"),
                   _cell(g("violation_rate_u8"), ".4g"), _cell(g("max_residual"), ".2g"),
                   _cell(g("max_residual_u8"), ".4g"), _cell(g("out_of_range"), ".2g")]
            if meta["fid"]:
                row += [_cell(g("fid"), ".2f", boot=True), _ci(g("fid"), ".2f")]
            row += [_paper(doc, tk, label, "fid"), _paper(doc, tk, label, "inception_score"),
                    _cell(g("classifier_fd"), ".3g", boot=True), _ci(g("classifier_fd")),
                    _cell(g("classifier_score"), ".3f"), _cell(g("mean_abs_change"), ".3g")]
            rows.append(row)
        lines.append(markdown_table(header, rows))
        diff = idx.get((tk, "DDPM + ours (last step, deterministic)", "max_abs_diff_to_projection"))
        if diff is not None:
            lines += [f"DDPM + ours (last step, deterministic) vs DDPM + projection: largest abs difference of the "
                      f"float outputs {_fmt(diff['mean'], '.2g')} (model units; equal by construction).", ""]
    for tk in ("6", "7"):
        meta = doc["tables"].get(tk)
        if meta is None:
            continue
        lines += [f"## Table {paper_table(tk)}: {_title(meta)}", "",
                  f"DDIM {s['sampling']['ddim_steps']} steps, n = {meta['n']} images per row and seed (the first n of "
                  f"the noise stream of Table 4); differences against {meta['baseline']}.", ""]
        header = ["schedule", "conditioned steps include the last", "violation rate", "paper violation",
                  "8-bit violation rate", "pixels outside [0,1]"]
        if meta["fid"]:
            header += ["FID", "Δ FID 95% CI"]
        header += ["paper FID", "paper IS", "classifier FD", "Δ CFD 95% CI", "classifier score"]
        rows = []
        exact = {v["label"]: v["exact"] for v in meta["variants"]}
        for label in _rows(doc, tk):
            g = {m: idx.get((tk, label, m)) for m in METRICS}.get
            row = [label, {True: "yes", False: "no"}.get(exact.get(label), "–") if "ours" in label else "–",
                   _cell(g("violation_rate"), ".4g"), _paper(doc, tk, label, "violation_rate", ".4g"),
                   _cell(g("violation_rate_u8"), ".4g"), _cell(g("out_of_range"), ".2g")]
            if meta["fid"]:
                row += [_cell(g("fid"), ".2f", boot=True), _ci(g("fid"), ".2f")]
            row += [_paper(doc, tk, label, "fid"), _paper(doc, tk, label, "inception_score"),
                    _cell(g("classifier_fd"), ".3g", boot=True),
                    _ci(g("classifier_fd")), _cell(g("classifier_score"), ".3f")]
            rows.append(row)
        lines.append(markdown_table(header, rows))
    if doc.get("checks"):
        lines += ["## FID sanity checks", "",
                  "Computed with the same network, preprocessing and reference statistics as the tables.", ""]
        rows = [[c["check"], c["n"], _fmt(c["fid"], ".4g"), c["expected"]] for c in doc["checks"]]
        lines.append(markdown_table(["check", "n", "FID", "expected"], rows))
    lines += protocol_sections(doc)
    lines += _significance_section(doc)
    lines.append(claims_section(claims(doc), note=claims_note(doc)))

    def tm(key: str) -> str:
        return _fmt(timing.get(key), ".0f")

    lines += ["## Run", "",
              f"- command: `{doc.get('command', '')}`; device {doc['environment']['device']}, "
              f"{doc['environment']['threads']} thread(s); git {doc['environment']['git'][:12]}"
              f"{' (uncommitted changes)' if doc['environment'].get('dirty') else ''}.",
              f"- time: {_wall(doc, timing.get('total_s'))}. The last leg: data {tm('data_s')} s; denoiser "
              f"{tm('train_s')} s ({'loaded from the cache' if model.get('cached') else 'trained'}); classifier "
              f"{tm('classifier_s')} s; sampling {tm('sampling_s')} s; metrics {tm('metrics_s')} s (Inception "
              f"{tm('inception_s')} s).",
              *time_accounting(doc),
              f"- images sampled per seed: {', '.join(f'{k}: {v}' for k, v in doc.get('group_sizes', {}).items())}.",
              ""]
    lines += pending_row_cost(doc)
    if out is not None:
        figs = [f for f in (*GRID_FILES.values(), "diffusion-schedules.png", "diffusion-training.png")
                if (Path(out) / f).exists()]
        if figs:
            lines += ["## Figures", ""] + [f"- [{f}]({f})" for f in figs] + [""]
    return "\n".join(lines)
