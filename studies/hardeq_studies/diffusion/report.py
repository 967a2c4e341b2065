"""Reporting the ``diffusion`` study: ``diffusion.md`` from the results document alone, the schedule and
training-loss figures from it, and the sample grids (written by the run, from the samples)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..figures import save_png
from ..extras import require
from ..palette import color
from ..claims import ALPHA, Claim, claims_section
from ..results import markdown_table, wall_time

__all__ = ["paper_table", "render_markdown", "protocol_sections", "plot_schedules", "plot_training", "save_grids",
           "claims", "GRID_FILES"]

#: the sample-grid figures the run writes (table -> file), and the real-vs-constrained grid
GRID_FILES = {"3": "diffusion-samples-table3.png", "4": "diffusion-samples-table4.png",
              "6": "diffusion-samples-table9.png", "7": "diffusion-samples-table10.png",
              "grid": "diffusion-real-vs-constrained.png"}
#: this study's table keys -> the paper's table numbers in its source order (the schedule tables are 9 and 10)
PAPER_TABLES = {"3": "3", "4": "4", "6": "9", "7": "10"}


def _wall(doc: Mapping[str, Any], seconds: float | None) -> str:
    """The run's wall time in seconds with its label (:func:`hardeq_studies.results.wall_time`)."""
    total, label = wall_time(doc, seconds)
    return f"{total:.0f} s ({label})" if total is not None else "not recorded"


def paper_table(key: str) -> str:
    """The paper's number of the table this study's key ``key`` reproduces (``"6"`` -> ``"9"``)."""
    return PAPER_TABLES.get(str(key), str(key))


#: the metrics of a row
METRICS = ("violation_rate", "max_residual", "mean_residual", "out_of_range", "violation_rate_u8",
           "max_residual_u8", "max_abs_diff_to_projection", "mean_abs_change", "fid",
           "inception_score", "classifier_fd", "classifier_score", "classifier_confidence")
_METRIC_NAMES = {"violation_rate": "violation rate", "violation_rate_u8": "8-bit violation rate",
                 "residual": "abs(sum - k)", "residual_u8": "8-bit abs(sum - T)",
                 "max_residual": "max |sum - k|", "out_of_range":
                 "pixels outside [0, 1]", "fid": "FID", "classifier_fd": "classifier FD",
                 "classifier_score": "classifier score", "mean_abs_change": "mean |change|"}


def _pyplot():
    require("matplotlib", "diffusion", purpose="the diffusion study's figures").use("Agg")
    return require("matplotlib.pyplot", "diffusion", purpose="the diffusion study's figures")


def _fmt(x: float | None, spec: str = ".3g") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:{spec}}"


def _index(doc: Mapping[str, Any]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(r["table"], r["method"], r["metric"]): r for r in doc["records"]}


def _cell(rec: Mapping[str, Any] | None, spec: str = ".3g", *, boot: bool = False) -> str:
    if rec is None or rec.get("mean") is None:
        return "–"
    text = _fmt(rec["mean"], spec)
    if rec.get("std") is not None:
        text += f" ± {_fmt(rec['std'], spec)}"
    elif boot and rec.get("bootstrap_std") is not None:
        text += f" ± {_fmt(rec['bootstrap_std'], spec)}"
    return text


def _ci(rec: Mapping[str, Any] | None, spec: str = ".3g") -> str:
    if rec is None or not rec.get("ci95_diff"):
        return "–"
    lo, hi = rec["ci95_diff"]
    return f"[{_fmt(lo, spec)}, {_fmt(hi, spec)}]"


def _paper_entry(doc: Mapping[str, Any], table: str, label: str) -> dict[str, Any]:
    """The paper's values of a row (config ``paper.tables``), ``{}`` when the paper has none."""
    return dict(doc["config"].get("paper", {}).get("tables", {}).get(table, {}).get(label, {}))


def _paper(doc: Mapping[str, Any], table: str, label: str, metric: str, spec: str = ".3f") -> str:
    """The paper's value of ``metric`` for a row, read from the config (so it is printed whether or not this run
    computed the metric); the Inception Score as ``mean ± std`` where the paper gives the std."""
    v = _paper_entry(doc, table, label).get(metric)
    if v is None:
        return "–"
    if isinstance(v, (list, tuple)):
        return _fmt(v[0], spec) + (f" ± {_fmt(v[1], spec)}" if len(v) > 1 and v[1] is not None else "")
    return _fmt(v, spec)


def _rows(doc: Mapping[str, Any], table: str) -> list[str]:
    meta = doc["tables"][table]
    return [v["label"] for v in meta["variants"]] + ["real images (train split)"]


def _sig(doc: Mapping[str, Any], table: str, a: str, b: str, metric: str) -> dict[str, Any] | None:
    for r in doc.get("significance", []):
        if (r["table"], r["a"], r["b"], r["metric"]) == (table, a, b, metric):
            return r
    return None


def _boot_text(r: Mapping[str, Any]) -> str:
    lo, hi = r["ci95"]
    return (f"paired bootstrap, n = {r['n']} images, 95% CI [{_fmt(lo, '.3g')}, {_fmt(hi, '.3g')}], "
            f"p = {_fmt(r['p'], '.2g')}")


def _fid_context(doc: Mapping[str, Any], table: str, metric: str, r: Mapping[str, Any]) -> str:
    """What a set-metric comparison of this run rests on: the sample and reference sizes, the real-vs-real
    distance at the same size, the number of trained models and noise seeds, and the bootstrap's smallest p."""
    idx = _index(doc)
    s = doc["config"]["settings"]
    name = _METRIC_NAMES[metric]
    real = idx.get((table, "real images (train split)", metric))
    n_ref = s.get("fid", {}).get("n_reference") if metric == "fid" else None
    parts = [f"{name} of {r['n']} samples per row" + (f" against a {n_ref:,}-image reference" if n_ref else "")
             + " (the paper: 50,000 samples)"]
    if real is not None and real.get("mean") is not None:
        parts.append(f"{r['n']} real images score {_fmt(real['mean'], '.3g')} against the same reference")
    parts.append(f"one trained model and {s.get('seeds', 1)} noise seed(s)")
    reps = _replicates(doc, metric, r)
    if reps:
        parts.append(f"a {reps}-replicate bootstrap, whose p cannot go below {_p_floor(reps):.3g}")
    return "; ".join(parts)


def _replicates(doc: Mapping[str, Any], metric: str, r: Mapping[str, Any]) -> int | None:
    s = doc["config"]["settings"]
    reps = r.get("replicates") or (s.get("fid", {}).get("bootstrap") if metric == "fid"
                                   else s.get("classifier_bootstrap"))
    return int(reps) if reps else None


def _p_floor(replicates: int) -> float:
    """The smallest two-sided p of a bootstrap with ``replicates`` replicates (run.py records it as ``p_floor``
    with each test; older JSONs lack that field)."""
    return 2 / (replicates + 1)


def _weak_denoiser(doc: Mapping[str, Any], table: str, metric: str) -> str:
    """Why FID differences of this run mean nothing (the baseline scores more than half of uniform noise's FID),
    or ""."""
    base = _index(doc).get((table, doc["tables"][table]["baseline"], metric))
    noise = next((c for c in doc.get("checks", []) if c["check"].startswith("uniform noise")), None)
    if metric == "fid" and base and noise and base.get("mean") is not None and base["mean"] > 0.5 * noise["fid"]:
        return (f"the baseline's samples score {_fmt(base['mean'], '.3g')} against {_fmt(noise['fid'], '.3g')} "
                "for uniform noise: the denoiser is too weak for FID differences to mean anything")
    return ""


def _quality_differs(doc: Mapping[str, Any]) -> str:
    """How this run's protocol differs from the paper's in ways that could decide an image-quality claim, and
    which way each could move it (said in every informative FID verdict), from the run's own JSON."""
    s, model = doc["config"]["settings"], doc.get("model", {})
    params = model.get("parameters")
    size = f"{params / 1e6:.2g} M-parameter " if params else ""
    steps = model.get("train_steps") or s.get("train", {}).get("steps")
    dataset = {"mnist": "MNIST", "cifar10": "CIFAR-10"}.get(s.get("dataset"), s.get("dataset"))
    return ("the protocol differs from the paper's where it could decide this: one "
            f"{size}U-Net trained {steps:,} steps on {dataset} "
            "(the paper: 35.7 M parameters, 800k steps, CIFAR-10), whose x0-predictions the constraint moves further "
            "than a good model's, and the conditioned steps' variance beta_t, this study's choice (the paper does not "
            "specify it), whose extra noise can raise FID")


def _boot_claim(doc: Mapping[str, Any], table: str, metric: str, claim: str, paper: str, here: str,
                r: Mapping[str, Any]) -> Claim:
    """A set-metric claim ("``a`` is not worse than / beats ``b``", lower is better) from a paired bootstrap of
    ``a - b``. It is *undecided (not informative at this budget)* where the denoiser is too weak for FID
    differences to mean anything; :func:`claims` also marks it so where the bootstrap's smallest p, Holm-adjusted
    over the family, cannot reach the level. Otherwise its verdict reads the test, with :func:`_quality_differs`:
    a significant result against the paper is *not reproduced at this budget*, never *refuted*."""
    lo, hi = r["ci95"]
    test = {"n": r["n"], "p": r["p"], "mean_diff": r["mean_diff"], "name": "paired bootstrap over images"}
    context = _fid_context(doc, table, metric, r)
    weak = _weak_denoiser(doc, table, metric)
    return Claim(claim, paper, here + f"; 95% CI of the difference [{_fmt(lo, '.3g')}, {_fmt(hi, '.3g')}]; "
                 + context, test=test, uninformative=weak and f"{weak}; {context}", differs=_quality_differs(doc),
                 extra={"replicates": _replicates(doc, metric, r), "context": context})


def _floor_decides(out: list[Claim], alpha: float = ALPHA) -> list[Claim]:
    """The bootstrap claims of ``out`` marked *not informative* where their smallest possible p, times the
    number of tested claims, cannot reach ``alpha``: Holm multiplies the smallest p by that number and never lowers
    a later one below it, so every adjusted p would sit above the level and the floor would be the verdict."""
    m = sum(c.test is not None for c in out)
    marked = []
    for c in out:
        reps = c.extra.get("replicates")
        if reps and not c.uninformative and _p_floor(reps) * m >= alpha:
            c = replace(c, uninformative=f"{c.extra['context']}; Holm over {m} tested claims cannot bring that floor "
                                         f"below {alpha}")
        marked.append(c)
    return marked


def _claims_note(doc: Mapping[str, Any]) -> str:
    """The note under the claims table: what the pairs are, and what the FID rows of this run can decide."""
    seeds = int(doc["config"]["settings"].get("seeds", 1))
    found = claims(doc)
    boot = [c for c in found if c.extra.get("context")]
    if boot and all(c.uninformative for c in boot):
        fid = ("No FID row of this run can decide a claim (each verdict says why: the bootstrap's smallest p, "
               "Holm-adjusted, cannot reach the level, or the denoiser is too weak), so each is *undecided (not "
               "informative at this budget)*, its p shown for the record.")
    elif boot:
        fid = ("The FID rows are decided by their Holm-adjusted p; a significant result against the paper is *not "
               "reproduced at this budget*, never *refuted*, because the protocol differs from the paper's where it "
               "could decide image quality (each verdict says how). The real-images row gives the FID of real "
               "images at the same sample and reference sizes, the floor any sampler's FID sits on here.")
    else:
        fid = ""
    return ("The pairs here are images, not seeds (" + (f"{seeds} noise seeds, their images pooled" if seeds > 1
                                                         else "one noise seed")
            + "; every row of a table starts from the same noise): Wilcoxon signed-rank over images for the "
            "residuals; paired bootstrap over images for FID and classifier FD (the FID where this run computed it, "
            "else the classifier FD). There is one trained model, so the spread over training is not in any test. "
            "The exactness rows hold by construction and carry no test. " + fid + f" Samplers: {STEP_NOTE}.")


def _title(meta: Mapping[str, Any]) -> str:
    """A table's title with the paper's table number in its source order (the JSON keeps the study's keys)."""
    return re.sub(r"paper Table (\d+)", lambda m: f"paper Table {paper_table(m.group(1))}", meta["title"])


def _rate(idx: Mapping[tuple[str, str, str], Any], table: str, label: str, metric: str) -> float | None:
    r = idx.get((table, label, metric))
    return None if r is None else r.get("mean")


def _set_metric(doc: Mapping[str, Any], table: str) -> str:
    return "fid" if doc["tables"].get(table, {}).get("fid") else "classifier_fd"


def _exact(rates: Mapping[str, float | None]) -> bool:
    return all(v == 0 for v in rates.values())


#: how the project's conditioned steps differ from a fully specified protocol (said where the results are read)
STEP_NOTE = ("conditioned steps draw an exact sample of N(x0_hat, beta_t I) given the constraint; the paper does not "
             "specify this step variance, so beta_t is this study's choice; every sampler runs with "
             "`clip_sample=False` (no clipping of x0_hat to [-1, 1], unlike standard DDPM), so that the conditioned "
             "output is exact before any clipping")
#: a defect, not evidence about the paper: an exact step measured off its constraint
DEFECT = "a defect of this implementation: the step is exact by construction, so this row must be fixed, not read"


def claims(doc: Mapping[str, Any]) -> list[Claim]:
    """The paper's claims (and the box-exact step's), each decided from the run's paired tests."""
    idx = _index(doc)
    out: list[Claim] = []
    tables = doc["tables"]
    heads = {tk: meta["variants"][1]["label"] for tk, meta in tables.items() if tk in ("3", "4")}
    det = {"3": "DDPM + ours (last step, deterministic)"}
    box = {"3": "DDPM + ours + box (last step)"}
    if "4" in tables:
        labels4 = [v["label"] for v in tables["4"]["variants"]]
        det["4"] = next((lb for lb in labels4 if lb.endswith(", deterministic)")), None)
        box["4"] = next((lb for lb in labels4 if " + box (" in lb), None)
    # 1. violation about 1 -> 0: the conditioned last step is exact by construction
    for tk, ours in heads.items():
        base = tables[tk]["baseline"]
        r = _sig(doc, tk, ours, base, "residual")
        if r is None:
            continue
        v_ours, v_base = _rate(idx, tk, ours, "violation_rate"), _rate(idx, tk, base, "violation_rate")
        claim = (f"{ours}: violation rate about 1 -> 0 (Table {paper_table(tk)})",
                 f"{_paper(doc, tk, base, 'violation_rate', '.4g')} -> "
                 f"{_paper(doc, tk, ours, 'violation_rate', '.4g')}",
                 f"{_fmt(v_base, '.4g')} -> {_fmt(v_ours, '.4g')}; mean abs(sum - k) "
                 f"{_fmt(r['mean_b'], '.3g')} -> {_fmt(r['mean_a'], '.3g')}")
        out.append(Claim(*claim, construction="the last step is exact conditioning; measured violation rate 0")
                   if v_ours == 0 else Claim(*claim, outcome="against", differs=DEFECT))
    # 2. end placement
    ends = [r for r in doc.get("significance", []) if r["table"] == "6" and r["metric"] == "residual"]
    if ends:
        def viol(label: str) -> str:
            return f"{label[len('DDIM + ours ('):-1]}: {_fmt(_rate(idx, '6', label, 'violation_rate'), '.4g')}"

        rates = "; ".join(f"{viol(r['b'])} vs {viol(r['a'])}" for r in ends)
        end_rates = {r["a"]: _rate(idx, "6", r["a"], "violation_rate") for r in ends}
        claim = (f"the conditioned steps must include the last one for exactness (Table {paper_table('6')})",
                 "Start 4 Space 1/2/3: violation 0.9999; the end-placed schedules: 0", f"violation rate {rates}")
        out.append(Claim(*claim, construction="a conditioned last step is exact; an unconditioned DDIM step after "
                                              "the last conditioned one moves the image off the plane")
                   if _exact(end_rates) else Claim(*claim, outcome="against", differs=DEFECT))
    # 3. FID not worse
    for tk, rows in (("3", [heads.get("3"), det.get("3")]), ("4", [heads.get("4"), det.get("4")])):
        if tk not in tables:
            continue
        metric, base = _set_metric(doc, tk), tables[tk]["baseline"]
        for lab in rows:
            r = _sig(doc, tk, lab, base, metric) if lab else None
            if r is None:
                continue
            out.append(_boot_claim(
                doc, tk, metric, f"{lab}: {_METRIC_NAMES[metric]} not worse than {base} (Table {paper_table(tk)})",
                f"FID {_paper(doc, tk, heads[tk], 'fid')} vs {_paper(doc, tk, base, 'fid')}"
                + (" (the paper samples its conditioned steps; this row takes their mean)"
                   if lab == det.get(tk) else ""),
                f"{_METRIC_NAMES[metric]} {_fmt(r['mean_a'], '.4g')} vs {_fmt(r['mean_b'], '.4g')} "
                f"(difference {_fmt(r['mean_diff'], '.3g')})", r))
    # 4. the deterministic DDPM last step is the projection
    rec = idx.get(("3", det["3"], "max_abs_diff_to_projection"))
    if rec is not None:
        out.append(Claim(f"{det['3']} vs DDPM + projection (Table 3)", "not in the paper",
                         f"largest abs difference of the outputs from the same noise: {_fmt(rec['mean'], '.2g')} "
                         "(model units)",
                         construction="equal: DDPM's last step returns x0_hat with variance 0, and the conditional "
                                      "mean of an isotropic Gaussian is the orthogonal projection; decides nothing "
                                      "about a distribution-aware benefit"))
    # 5. conditioning inside the loop vs projecting after sampling (DDIM)
    if "4" in tables:
        metric = _set_metric(doc, "4")
        for lab in (det.get("4"), heads.get("4")):
            r = _sig(doc, "4", lab, "DDIM + projection", metric) if lab else None
            if r is not None:
                out.append(_boot_claim(
                    doc, "4", metric, f"{lab} beats DDIM + projection (Table 4)", "not compared in the paper",
                    f"{_METRIC_NAMES[metric]} {_fmt(r['mean_a'], '.4g')} vs {_fmt(r['mean_b'], '.4g')} "
                    f"(difference {_fmt(r['mean_diff'], '.3g')})", r))
    # 6. box-exact and 8-bit exact
    for tk in ("3", "4"):
        lab, ours = box.get(tk), heads.get(tk)
        r = _sig(doc, tk, lab, ours, "residual_u8") if lab and ours else None
        if r is None:
            continue
        vals = {m: _rate(idx, tk, lab, m) for m in ("violation_rate", "out_of_range", "violation_rate_u8")}
        claim = (f"{lab}: exact in float, inside [0, 1] and exact as saved 8-bit images (Table {paper_table(tk)})",
                 "not in the paper (hardeq's box-exact last step and to_uint8_exact)",
                 f"violation rate {_fmt(vals['violation_rate'], '.4g')}, pixels outside [0, 1] "
                 f"{_fmt(vals['out_of_range'], '.4g')}, 8-bit violation rate "
                 f"{_fmt(vals['violation_rate_u8'], '.4g')} (sampled ours: "
                 f"{_fmt(_rate(idx, tk, ours, 'violation_rate_u8'), '.4g')}); 8-bit abs(sum - T) "
                 f"{_fmt(r['mean_b'], '.4g')} -> {_fmt(r['mean_a'], '.4g')} grey levels")
        out.append(Claim(*claim, construction="the box mode and `to_uint8_exact` meet the totals exactly; "
                                              "measured 0 on every count")
                   if _exact(vals) else Claim(*claim, outcome="against", differs=DEFECT))
    return _floor_decides(out)


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
    lines.append(claims_section(claims(doc), note=_claims_note(doc)))

    def tm(key: str) -> str:
        return _fmt(timing.get(key), ".0f")

    per_step = ", ".join(f"{k}: {_fmt(v, '.3f')} ms per image and step"
                         for k, v in timing.get("ms_per_image_step", {}).items())
    lines += ["## Run", "",
              f"- command: `{doc.get('command', '')}`; device {doc['environment']['device']}, "
              f"{doc['environment']['threads']} thread(s); git {doc['environment']['git'][:12]}"
              f"{' (uncommitted changes)' if doc['environment'].get('dirty') else ''}.",
              f"- time: total {_wall(doc, timing.get('total_s'))}; data {tm('data_s')} s; training "
              f"{tm('train_compute_s')} s "
              f"({_fmt(timing.get('train_s_per_step'), '.3f')} s/step{', cached' if model.get('cached') else ''}); "
              f"classifier {tm('classifier_s')} s; sampling {tm('sampling_s')} s ({per_step}); "
              f"metrics {tm('metrics_s')} s (Inception {tm('inception_s')} s).",
              f"- images sampled per seed: {', '.join(f'{k}: {v}' for k, v in doc.get('group_sizes', {}).items())}.",
              ""]
    if out is not None:
        figs = [f for f in (*GRID_FILES.values(), "diffusion-schedules.png", "diffusion-training.png")
                if (Path(out) / f).exists()]
        if figs:
            lines += ["## Figures", ""] + [f"- [{f}]({f})" for f in figs] + [""]
    return "\n".join(lines)


def plot_schedules(doc: Mapping[str, Any], out: Path) -> Path | None:
    """Violation rate and classifier FD (± bootstrap std) of every schedule of the paper's Tables 9 and 10."""
    idx = _index(doc)
    tabs = [tk for tk in ("6", "7") if tk in doc["tables"]]
    if not tabs:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(tabs), figsize=(5.5 * len(tabs), 6), squeeze=False)
    for j, tk in enumerate(tabs):
        labels = _rows(doc, tk)[:-1]
        short = [lb.replace("DDIM + ours (", "").rstrip(")") for lb in labels]
        for i, metric in enumerate(("violation_rate", "classifier_fd")):
            ax = axes[i][j]
            vals = [idx.get((tk, lb, metric), {}).get("mean") for lb in labels]
            err = [idx.get((tk, lb, metric), {}).get("std") or idx.get((tk, lb, metric), {}).get("bootstrap_std") or 0
                   for lb in labels]
            exact = {v["label"]: v["exact"] for v in doc["tables"][tk]["variants"]}
            colors = ["#7f7f7f" if i_ == 0 else (color("ours") if exact.get(lb) else "#ff9896")
                      for i_, lb in enumerate(labels)]
            ax.bar(range(len(labels)), [v if v is not None else 0 for v in vals], yerr=err, color=colors)
            for i_, lb in enumerate(labels):
                if i_ and not exact.get(lb):
                    ax.patches[i_].set_hatch("//")
            ax.set_xticks(range(len(labels)), short, rotation=60, ha="right", fontsize=7)
            ax.set_ylabel({"violation_rate": "violation rate (share of images)",
                           "classifier_fd": "classifier FD (feature units)"}.get(metric, _METRIC_NAMES[metric]))
            if i == 1:
                ax.set_xlabel("conditioning schedule of DDIM + ours")
            if i == 0:
                ax.set_title(f"Table {paper_table(tk)} (grey: unconstrained DDIM; hatched: last step not conditioned)",
                             fontsize=8)
    fig.tight_layout()
    path = Path(out) / "diffusion-schedules.png"
    save_png(fig, path, dpi=120)
    plt.close(fig)
    return path


def plot_training(doc: Mapping[str, Any], out: Path) -> Path | None:
    curve = doc["model"].get("loss_curve") or []
    if not curve:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([c[0] for c in curve], [c[1] for c in curve], color="#1f77b4")
    ax.set_xlabel("training step")
    ax.set_ylabel("epsilon MSE (window mean)")
    ax.set_yscale("log")
    ax.set_title("denoiser training loss")
    fig.tight_layout()
    path = Path(out) / "diffusion-training.png"
    save_png(fig, path, dpi=120)
    plt.close(fig)
    return path


def _strip(images: Tensor, count: int, pad: int = 2) -> Tensor:
    """``count`` 8-bit images side by side (float ``(H, W', C)`` in [0, 1], white padding)."""
    x = images[:count].float() / 255
    n, c, h, w = x.shape
    strip = torch.ones(c, h, count * (w + pad) - pad)
    for i in range(n):
        strip[:, :, i * (w + pad): i * (w + pad) + w] = x[i]
    return strip.permute(1, 2, 0)


def save_grids(grids: Mapping[str, Tensor], tables: Mapping[str, Any], out: Path, *, per_row: int = 12) -> list[Path]:
    """The sample figures: per table one row per variant (the same noise in every column) under a row of real
    images, and an 8 x 8 grid of real images next to the two constrained samplers."""
    from ..images import save_grid

    plt = _pyplot()
    paths = []
    for tk, meta in tables.items():
        rows = [("real (test)", grids["real"])] + [(v["label"], grids[v["key"]]) for v in meta["variants"]
                                                   if v["key"] in grids]
        count = min(per_row, *(r[1].shape[0] for r in rows))
        fig, axes = plt.subplots(len(rows), 1, figsize=(0.55 * count + 2.6, 0.62 * len(rows) + 0.3), squeeze=False)
        for ax, (label, imgs) in zip(axes[:, 0], rows):
            strip = _strip(imgs, count).numpy()
            ax.imshow(strip[..., 0] if strip.shape[-1] == 1 else strip, cmap="gray", vmin=0, vmax=1,
                      interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=7)
        fig.suptitle(f"Table {tk}: same noise in every column", fontsize=8)
        fig.tight_layout()
        path = Path(out) / GRID_FILES[tk]
        save_png(fig, path, dpi=110)
        plt.close(fig)
        paths.append(path)
    panels = [("real (test)", grids["real"])]
    for tk in ("3", "4"):
        if tk in tables and tables[tk]["variants"][1]["key"] in grids:
            v = tables[tk]["variants"][1]
            panels.append((v["label"], grids[v["key"]]))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.7), squeeze=False)
    tmp = Path(out) / ".diffusion-grid-tmp.png"
    for ax, (label, imgs) in zip(axes[0], panels):
        save_grid(imgs[:64].float() / 255, tmp, nrow=8)
        ax.imshow(plt.imread(tmp))
        ax.set_title(label, fontsize=8)
        ax.axis("off")
    tmp.unlink(missing_ok=True)
    fig.tight_layout()
    path = Path(out) / GRID_FILES["grid"]
    save_png(fig, path, dpi=120)
    plt.close(fig)
    paths.append(path)
    return paths
