"""The ``diffusion`` study's claims (:func:`claims`): the paper's Tables 3, 4, 9 and 10 and this repository's own
rows, each decided from the run's paired tests by :mod:`hardeq_studies.claims`, and the note under the table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..claims import ALPHA, Claim
from .report_format import (
    _METRIC_NAMES, STEP_NOTE, _exact, _fmt, _index, _paper, _rate, _set_metric, _sig, paper_table,
)

__all__ = ["claims", "claims_note", "DEFECT", "DET_DDPM", "U8_DDPM"]

#: the deterministic DDPM row (the conditioned last step's mean), and the sampled step rounded to exact 8 bits
DET_DDPM = "DDPM + ours (last step, deterministic)"
U8_DDPM = "DDPM + ours (last step) + to_uint8_exact"


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
    seeds = int(s.get("seeds", 1))
    per = int(r["n"]) // max(seeds, 1)
    ref = f" against a {n_ref:,}-image reference" if n_ref else ""
    parts = [(f"each row's {name} is the mean of {seeds} {name}s of {per:,} samples, one per noise seed," if seeds > 1
              else f"{name} of {per:,} samples per row") + ref + " (the paper: one of 50,000 samples)"]
    if real is not None and real.get("mean") is not None:
        values = real.get("per_seed") or [real["mean"]]
        parts.append(f"{per:,} real images score {' / '.join(f'{v:.2f}' for v in values)} against the same "
                     "reference" + (" (one per seed)" if len(values) > 1 else ""))
    parts.append(f"one trained model and {seeds} noise seed(s)")
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


def _quality_differs(doc: Mapping[str, Any], step_noise: bool = True) -> str:
    """How this run's protocol differs from the paper's in ways that could decide an image-quality claim, and
    which way each could move it (said in every informative FID verdict), from the run's own JSON. Without
    ``step_noise`` (a row that takes the conditioned step's mean) the step variance is not among the reasons."""
    s, model = doc["config"]["settings"], doc.get("model", {})
    params = model.get("parameters")
    size = f"{params / 1e6:.2g} M-parameter " if params else ""
    steps = model.get("train_steps") or s.get("train", {}).get("steps")
    dataset = {"mnist": "MNIST", "cifar10": "CIFAR-10"}.get(s.get("dataset"), s.get("dataset"))
    return ("the protocol differs from the paper's where it could decide this: one "
            f"{size}U-Net trained {steps:,} steps on {dataset} "
            "(the paper: 35.7 M parameters, 800k steps, CIFAR-10), whose x0-predictions the constraint moves further "
            "than a good model's" + (", and the conditioned steps' variance beta_t, this study's choice (the paper "
                                     "does not specify it), whose extra noise can raise FID" if step_noise else ""))


def _deterministic_fid(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The FID of DDPM's deterministic conditioned last step, from the run: that row's outputs equal DDPM +
    projection's (``max_abs_diff_to_projection`` 0), so its FID is the projection row's. ``None`` when the run
    does not show that equality or has no FID of the projection row. Returns the row's FID record, DDPM's, and
    the paired bootstrap of ``projection - DDPM`` where the run recorded one."""
    idx = _index(doc)
    det = idx.get(("3", DET_DDPM, "max_abs_diff_to_projection"))
    proj, base = idx.get(("3", "DDPM + projection", "fid")), idx.get(("3", "DDPM", "fid"))
    if det is None or det.get("mean") != 0 or proj is None or base is None:
        return None
    return {"row": proj, "base": base, "boot": _sig(doc, "3", "DDPM + projection", "DDPM", "fid")
            or _sig(doc, "3", DET_DDPM, "DDPM", "fid")}


def _last_step_noise(doc: Mapping[str, Any], table: str, metric: str, r: Mapping[str, Any]) -> str:
    """The design reason of a sampled DDPM last step's worse FID, where the run shows it (the same step without its
    noise, :func:`_deterministic_fid`, costs less than a quarter of it); "" otherwise."""
    det = _deterministic_fid(doc) if table == "3" and metric == "fid" else None
    if det is None:
        return ""
    cost = det["row"]["mean"] - det["base"]["mean"]
    if not r["mean_diff"] > 0 or not cost < 0.25 * r["mean_diff"]:
        return ""
    beta0 = doc["config"]["settings"].get("diffusion", {}).get("beta_start")
    var = f"beta_0 = {beta0:g}" if beta0 is not None else "beta_0"
    return (f"the conditioned last step samples N(x0_hat, {var} I) (this study's step variance: the paper does not "
            "specify it, and DDPM's own is 0 at t = 0, where a point mass cannot be conditioned), noise that plain "
            f"DDPM does not add at t = 0; the same step without it (the deterministic row) scores FID "
            f"{_fmt(det['row']['mean'], '.4g')} against DDPM's {_fmt(det['base']['mean'], '.4g')} "
            f"({cost:+.2g}), the sampled one {_fmt(r['mean_a'], '.4g')} ({r['mean_diff']:+.3g})")


def _deterministic_claim(doc: Mapping[str, Any]) -> Claim | None:
    """"DDPM + ours (last step, deterministic): FID not worse than DDPM" from the run's JSON
    (:func:`_deterministic_fid`): its paired bootstrap over images where the run recorded one, else a paired
    t-test over the noise seeds' FIDs with the exact sign-flip test beside it."""
    from ..stats import paired_ttest, sign_flip_test

    det = _deterministic_fid(doc)
    if det is None:
        return None
    row, base, boot = det["row"], det["base"], det["boot"]
    lo_hi = row.get("ci95_diff")
    here = (f"FID {_fmt(row['mean'], '.4g')} vs {_fmt(base['mean'], '.4g')} (difference "
            f"{row['mean'] - base['mean']:+.2g}" + (f"; 95% paired-bootstrap CI over images [{_fmt(lo_hi[0], '.2g')}, "
                                                    f"{_fmt(lo_hi[1], '.2g')}]" if lo_hi else "")
            + "), read from DDPM + projection, whose images these are (max abs difference 0)")
    claim = f"{DET_DDPM}: FID not worse than DDPM (Table {paper_table('3')})"
    paper = (f"FID {_paper(doc, '3', 'DDPM + ours (last step)', 'fid')} vs {_paper(doc, '3', 'DDPM', 'fid')} "
             "(the paper samples its conditioned step; this row takes its mean)")
    reading = "the conditioned step's mean: no last-step noise"
    if boot is not None:
        test = {"n": boot["n"], "p": boot["p"], "mean_diff": boot["mean_diff"], "name": "paired bootstrap over images"}
        return Claim(claim, paper, here, test=test, differs=_quality_differs(doc, step_noise=False), reading=reading,
                     extra={"replicates": boot.get("replicates"), "context": _fid_context(doc, "3", "fid", boot)})
    a, b = row.get("per_seed") or [], base.get("per_seed") or []
    if len(a) < 2 or len(a) != len(b):
        return None
    t = {**paired_ttest(a, b), "name": "paired t over noise seeds"}
    flip = sign_flip_test(a, b)
    here += f"; per noise seed {', '.join(f'{x:.2f} vs {y:.2f}' for x, y in zip(a, b))}"
    return Claim(claim, paper, here, test=t, exact_test=flip, differs=_quality_differs(doc, step_noise=False),
                 reading=reading,
                 budget=f"{len(a)} noise seeds, each a {row.get('n_samples', '?')}-image FID; a paired bootstrap over "
                        "images (recorded by runs from this version on) or more seeds would decide it")


def _boot_claim(doc: Mapping[str, Any], table: str, metric: str, claim: str, paper: str, here: str,
                r: Mapping[str, Any], hypothesis: bool = False) -> Claim:
    """A set-metric claim ("``a`` is not worse than / beats ``b``", lower is better) from a paired bootstrap of
    ``a - b``. It is *undecided (not informative at this budget)* where the denoiser is too weak for FID
    differences to mean anything; :func:`claims` also marks it so where the bootstrap's smallest p, Holm-adjusted
    over the family, cannot reach the level. Otherwise its verdict reads the test: a significant result against
    the paper *differs by design* where the run shows the design choice that explains it
    (:func:`_last_step_noise`), else it is *not reproduced at this budget* (:func:`_quality_differs`), never
    *refuted*."""
    lo, hi = r["ci95"]
    test = {"n": r["n"], "p": r["p"], "mean_diff": r["mean_diff"], "name": "paired bootstrap over images"}
    context = _fid_context(doc, table, metric, r)
    weak = _weak_denoiser(doc, table, metric)
    return Claim(claim, paper, here + f"; 95% CI of the difference [{_fmt(lo, '.3g')}, {_fmt(hi, '.3g')}]; "
                 + context, test=test, uninformative=weak and f"{weak}; {context}", differs=_quality_differs(doc),
                 design=_last_step_noise(doc, table, metric, r), hypothesis=hypothesis,
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


def claims_note(doc: Mapping[str, Any]) -> str:
    """The note under the claims table: what the pairs are, and what the FID rows of this run can decide."""
    seeds = int(doc["config"]["settings"].get("seeds", 1))
    found = claims(doc)
    boot = [c for c in found if c.extra.get("context")]
    if boot and all(c.uninformative for c in boot):
        fid = ("No FID row of this run can decide a claim (each verdict says why: the bootstrap's smallest p, "
               "Holm-adjusted, cannot reach the level, or the denoiser is too weak), so each is *undecided (not "
               "informative at this budget)*, its p shown for the record.")
    elif boot:
        fid = ("The FID rows are decided by their Holm-adjusted p. A significant result against the paper *differs "
               "by design* where the run shows the design choice that explains it (the sampled DDPM last step's "
               "noise, beside the deterministic row that leaves it out), else it is *not reproduced at this "
               "budget*, never *refuted*, because the protocol differs from the paper's where it could decide image "
               "quality (each verdict says how). The real-images row gives the FID of real images at the same "
               "sample and reference sizes, the floor any sampler's FID sits on here.")
    else:
        fid = ""
    return ("The pairs here are images, not seeds (" + (f"{seeds} noise seeds, their images pooled" if seeds > 1
                                                         else "one noise seed")
            + "; every row of a table starts from the same noise): Wilcoxon signed-rank over images for the "
            "residuals; paired bootstrap over images for FID and classifier FD (the FID where this run computed it, "
            "else the classifier FD), or a paired t-test over the noise seeds' FIDs where the run recorded no "
            "bootstrap of that pair (it says so). There is one trained model, so the spread over training is not in "
            "any test. "
            "The exactness rows hold by construction and carry no test. " + fid + f" Samplers: {STEP_NOTE}.")


#: a defect, not evidence about the paper: an exact step measured off its constraint
DEFECT = "a defect of this implementation: the step is exact by construction, so this row must be fixed, not read"


def claims(doc: Mapping[str, Any]) -> list[Claim]:
    """The paper's claims (and the box-exact step's), each decided from the run's paired tests."""
    idx = _index(doc)
    out: list[Claim] = []
    tables = doc["tables"]
    heads = {tk: meta["variants"][1]["label"] for tk, meta in tables.items() if tk in ("3", "4")}
    det = {"3": DET_DDPM}
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
    for tk, rows in (("3", [heads.get("3"), det.get("3"), U8_DDPM]), ("4", [heads.get("4"), det.get("4")])):
        if tk not in tables:
            continue
        metric, base = _set_metric(doc, tk), tables[tk]["baseline"]
        for lab in rows:
            r = _sig(doc, tk, lab, base, metric) if lab else None
            if r is None:
                if lab == det.get("3") and tk == "3" and metric == "fid" and _deterministic_claim(doc) is not None:
                    out.append(_deterministic_claim(doc))  # type: ignore[arg-type]
                continue
            out.append(_boot_claim(
                doc, tk, metric, f"{lab}: {_METRIC_NAMES[metric]} not worse than {base} (Table {paper_table(tk)})",
                f"FID {_paper(doc, tk, heads[tk], 'fid')} vs {_paper(doc, tk, base, 'fid')}"
                + (" (the paper samples its conditioned steps; this row takes their mean)"
                   if lab == det.get(tk) else "")
                + (" (not in the paper: its sampled step, rounded to 8-bit images that meet the totals exactly)"
                   if lab == U8_DDPM else ""),
                f"{_METRIC_NAMES[metric]} {_fmt(r['mean_a'], '.4g')} vs {_fmt(r['mean_b'], '.4g')} "
                f"(difference {_fmt(r['mean_diff'], '.3g')})", r, hypothesis=lab == U8_DDPM))
    # 4. the deterministic DDPM last step is the projection
    rec = idx.get(("3", det["3"], "max_abs_diff_to_projection"))
    if rec is not None:
        out.append(Claim(f"{det['3']} vs DDPM + projection (Table 3)", "not in the paper",
                         f"largest abs difference of the outputs from the same noise: {_fmt(rec['mean'], '.2g')} "
                         "(model units)", hypothesis=True, tie=rec.get("mean") == 0,
                         construction="DDPM's last step returns x0_hat with variance 0, and the conditional "
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
                    f"(difference {_fmt(r['mean_diff'], '.3g')})", r, hypothesis=True))
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
        out.append(Claim(*claim, hypothesis=True, construction="the box mode and `to_uint8_exact` meet the totals "
                                                               "exactly; measured 0 on every count")
                   if _exact(vals) else Claim(*claim, outcome="against", differs=DEFECT, hypothesis=True))
    return _floor_decides(out)
