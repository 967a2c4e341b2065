"""Results of the ``vae-latent`` study: the records from the units, Markdown and the claims (the figures, like
Fig. 4, are :mod:`.figures`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..palette import color
from ..claims import Claim, claims_section
from ..results import markdown_table, wall_time
from ..stats import EXACT_BESIDE_T, paired_ttest, paired_wilcoxon, sign_flip_test

__all__ = ["METRICS", "LABELS", "summarise", "paired_gap_curve", "claims", "gap_rows", "pair_gap_rows",
           "render_markdown"]

#: test metrics (nats per image, lower is better)
METRICS = {"nll": "test NLL (IS)", "nelbo": "test NELBO", "rec": "reconstruction loss"}
#: the paper's names of the estimators
LABELS = {"marginal_expectation": "Marginal Expectation", "pathwise": "pathwise (ours)",
          "constrained_reparam_independent": "Constrained Reparametrization (independent noise)",
          "constrained_marginal": "Constrained Marginal", "unconstrained_marginal": "Unconstrained Marginal",
          "constrained_layer": "Constrained Layer", "random": "Random", "unconstrained": "unconstrained VAE"}
#: the methods every other one is tested against
REFERENCES = ("marginal_expectation", "pathwise")


def _minutes(doc: dict[str, Any], seconds: float | None) -> str:
    """The run's wall time in minutes with its label (:func:`hardeq_studies.results.wall_time`)."""
    total, label = wall_time(doc, seconds)
    return f"{total / 60:.1f} min ({label})" if total is not None else "not recorded"


def _color(method: str) -> str:
    """The shared palette's colour; black for the unconstrained reference (its hash colour is taken)."""
    return "#000000" if method == "unconstrained" else color(method)


def _unit(units: dict[str, Any], constraint: str, method: str, trial: int, first: str) -> dict[str, Any]:
    """The unconstrained reference is trained once (under the first constraint) and shown under each."""
    return units[f"{first if method == 'unconstrained' else constraint}/{method}/{trial}"]


#: further pairs the paper's claims need (a - b)
CLAIM_PAIRS = (("unconstrained_marginal", "constrained_marginal"), ("constrained_marginal", "random"),
               ("unconstrained_marginal", "random"))
#: significance level of the claims' verdicts (two-sided paired t-test over trials)
ALPHA = 0.05


def _pairs(methods: list[str]) -> list[tuple[str, str]]:
    """Every method against each reference (Marginal Expectation, pathwise), then the claims' extra pairs."""
    out = [(ref, m) for ref in REFERENCES if ref in methods for m in methods
           if m != ref and not (ref == "pathwise" and m == "marginal_expectation")]
    return out + [(a, b) for a, b in CLAIM_PAIRS if a in methods and b in methods]


def paired_gap_curve(a: list[list[float]], b: list[list[float]]) -> dict[str, Any]:
    r"""Per epoch, the paired gap :math:`d_{t,e} = a_{t,e} - b_{t,e}` over trials ``t``: its mean and the 95%
    Student-t interval :math:`\bar d \pm t_{0.975, n-1}\, s_d/\sqrt n` (``None`` for one trial).

    Args:
        a, b: ``(trials, epochs)`` curves, paired by trial.
    Returns:
        ``{"mean": (epochs,), "ci_low": (epochs,) | None, "ci_high": ..., "per_trial": (trials, epochs)}``.
    """
    from scipy.stats import t as student_t

    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if d.ndim != 2:
        raise ValueError(f"a and b must be (trials, epochs) curves of the same shape, got {d.shape}.")
    n, mean = d.shape[0], d.mean(0)
    if n < 2:
        return {"mean": mean.tolist(), "ci_low": None, "ci_high": None, "per_trial": d.tolist()}
    half = float(student_t.ppf(0.975, n - 1)) * d.std(0, ddof=1) / np.sqrt(n)
    return {"mean": mean.tolist(), "ci_low": (mean - half).tolist(), "ci_high": (mean + half).tolist(),
            "per_trial": d.tolist()}


def summarise(result: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    units, methods, constraints, trials = result["units"], result["methods"], result["constraints"], result["trials"]
    first = constraints[0]
    records, per_trial, curves, significance = [], {}, {}, []
    epoch_s: dict[str, list[float]] = {}
    for c in constraints:
        per_trial[c], curves[c] = {}, {}
        for m in methods:
            us = [_unit(units, c, m, t, first) for t in trials]
            per_trial[c][m] = {k: [u["metrics"][k] for u in us] for k in METRICS}
            per_trial[c][m]["max_latent_residual"] = [u["metrics"]["max_latent_residual"] for u in us]
            per_trial[c][m]["diverged"] = ["diverged" in u["metrics"] for u in us]
            if all("posterior_std" in u["metrics"] for u in us):
                std = np.asarray([u["metrics"]["posterior_std"] for u in us])
                records.append({"dataset": c, "method": m, "metric": "posterior_std", "mean": float(std.mean()),
                                "std": float(std.std(ddof=1)) if std.size > 1 else 0.0, "n_seeds": int(std.size),
                                "paper": None})
            curves[c][m] = {"train_nelbo": np.mean([u["curve_train_nelbo"] for u in us], 0).tolist(),
                            "test_nelbo": np.mean([u["curve_test_nelbo"] for u in us], 0).tolist(),
                            "test_nelbo_std": np.std([u["curve_test_nelbo"] for u in us], 0, ddof=1).tolist()
                            if len(us) > 1 else None,
                            "test_nelbo_trials": [list(u["curve_test_nelbo"]) for u in us]}
            if m != "unconstrained" or c == first:
                epoch_s.setdefault(m, []).extend(s for u in us for s in u["epoch_seconds"])
            for k in METRICS:
                v = np.asarray(per_trial[c][m][k])
                records.append({"dataset": c, "method": m, "metric": k, "mean": float(v.mean()),
                                "std": float(v.std(ddof=1)) if v.size > 1 else 0.0, "n_seeds": int(v.size),
                                "paper": None})
            res = per_trial[c][m]["max_latent_residual"]
            records.append({"dataset": c, "method": m, "metric": "max_latent_residual", "mean": float(max(res)),
                            "std": 0.0, "n_seeds": len(res), "paper": None})
        if "pathwise" in methods:
            for m in methods:
                if m != "pathwise":
                    curves[c][m]["paired_gap_to_pathwise"] = paired_gap_curve(
                        curves[c][m]["test_nelbo_trials"], curves[c]["pathwise"]["test_nelbo_trials"])
        for a, b in _pairs(methods):
            for k in METRICS:
                x, y = per_trial[c][a][k], per_trial[c][b][k]
                significance.append({"dataset": c, "metric": k, "a": a, "b": b,
                                     "ttest": paired_ttest(x, y), "wilcoxon": paired_wilcoxon(x, y)})
    base = np.median(epoch_s.get("unconstrained", [np.nan]))
    timing = {"epoch_seconds_median": {m: float(np.median(v)) for m, v in epoch_s.items()},
              "ratio_to_unconstrained": {m: float(np.median(v) / base) for m, v in epoch_s.items()},
              "eval_seconds": float(np.mean([u["eval_seconds"] for u in units.values()]))}
    return {"records": records, "per_trial": per_trial, "curves": curves, "significance": significance,
            "timing": timing}


def _cell(doc: dict[str, Any], c: str, m: str, k: str) -> str:
    r = next((r for r in doc["records"] if r["dataset"] == c and r["method"] == m and r["metric"] == k), None)
    return "" if r is None else f"{r['mean']:.2f} ± {r['std']:.2f}"


def _rank(doc: dict[str, Any], c: str, k: str) -> list[str]:
    rs = [r for r in doc["records"] if r["dataset"] == c and r["metric"] == k]
    return [r["method"] for r in sorted(rs, key=lambda r: r["mean"])]


def render_markdown(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [f"# vae-latent ({doc['preset']} preset)", "",
             f"MLP VAE on binarised MNIST ({doc['data']['n_train']} training / {doc['data']['n_test']} test images), "
             f"latent z = {cfg['model']['latent']}, {cfg['epochs']} epochs, {len(cfg['trials'])} trials, "
             f"K = {cfg['importance_samples']} importance samples. Metrics in nats per image, lower is better; "
             "mean ± std over trials. The last column is the largest absolute residual |A z - k| of any latent "
             "sample drawn (float32; exactness is promised relative to |A||z| row by row, so a model whose "
             "latents grow large shows a larger absolute residual).", ""]
    for c in cfg["constraints_run"]:
        lines += [f"## Results (`{c}`)", "", f"Constraint `{c}`: {cfg['constraints'][c]['description']}.", ""]
        rows = []
        has_std = any(r["metric"] == "posterior_std" for r in doc["records"])
        for m in _rank(doc, c, "nll"):
            res = next(r["mean"] for r in doc["records"] if r["dataset"] == c and r["method"] == m
                       and r["metric"] == "max_latent_residual")
            rows.append([LABELS.get(m, m)] + [_cell(doc, c, m, k) for k in METRICS]
                        + ([_cell(doc, c, m, "posterior_std")] if has_std else [])
                        + ["n/a" if m == "unconstrained" else f"{res:.1e}"])
        lines += [markdown_table(["method"] + list(METRICS.values())
                                 + (["posterior std"] if has_std else []) + ["max |A z - k|"], rows)]
        diverged = [f"{LABELS.get(m, m)} ({sum(v['diverged'])} of {len(v['diverged'])} trials)"
                    for m, v in doc["per_trial"][c].items() if any(v.get("diverged", ()))]
        if diverged:
            lines += ["Diverged (a non-finite loss; metrics recorded as NaN, so the paired tests involving them are "
                      "NaN and decide nothing): " + ", ".join(diverged) + ".", ""]
        lines += [f"## Paired tests (`{c}`)", "",
                  "Paired tests over trials (same initialisation, data order and evaluation noise): "
                  "difference a - b of the mean, paired t-test p (Wilcoxon p in brackets).", ""]
        rows = []
        for s in doc["significance"]:
            if s["dataset"] != c:
                continue
            rows.append([LABELS.get(s["a"], s["a"]), LABELS.get(s["b"], s["b"]), METRICS[s["metric"]],
                         f"{s['ttest']['mean_diff']:+.2f}", f"{s['ttest']['p']:.3g} ({s['wilcoxon']['p']:.2g})"])
        lines += [markdown_table(["a", "b", "metric", "a - b", "p"], rows)]
        gap = gap_rows(doc, c)
        if gap:
            lines += [f"## Gap per epoch (`{c}`)", "",
                      "Test NELBO (one sample per image, the same noise for both) after each epoch, means over "
                      "trials, and the paired gap Marginal Expectation - pathwise with its 95% t-interval over "
                      "trials (positive: pathwise better).", "",
                      markdown_table(["epoch", "Marginal Expectation", "pathwise", "gap", "95% CI"], gap)]
        ind = pair_gap_rows(doc, c, "constrained_reparam_independent", "marginal_expectation")
        if ind:
            lines += [f"## Gap per epoch, independent-noise Constrained Reparametrization (`{c}`)", "",
                      "Test NELBO (one sample per image, the same noise for both) after each epoch, means over "
                      "trials, and the paired gap Constrained Reparametrization (independent noise) - Marginal "
                      "Expectation with its 95% t-interval over trials (positive: Marginal Expectation better). Their "
                      "expected gradients are equal (the library's estimator documentation), so only the extra "
                      "variance of the independent proxy can open a gap.", "",
                      markdown_table(["epoch", "Constrained Reparametrization (independent noise)",
                                      "Marginal Expectation", "gap", "95% CI"], ind)]
    lines += [claims_section(claims(doc), intro=(
        "Two-sided paired t-tests over trials, one per row, " + _exact_note(len(doc["config"]["trials"]))
        + " *Readings*: the paper does not say whether "
        "Constrained Reparametrization's proxy reuses the forward sample's noise (*shared noise*: it is then the "
        "pathwise gradient, identical in value and gradient, tested exactly in the library) or draws its own "
        "(*independent noise*: its expected gradient equals Marginal Expectation's, and its spread is larger); "
        "each reading has its rows."))]
    t = doc["timing"]
    ratios = t["ratio_to_unconstrained"]
    # the ratio needs the unconstrained VAE; a run without it (the cpu preset) has NaN ratios: leave the column out
    with_ratio = any(np.isfinite(r) for r in ratios.values())
    lines += ["## Time per epoch", "",
              markdown_table(["method", "s / epoch (median)"] + (["ratio to unconstrained"] if with_ratio else []),
                             [[LABELS.get(m, m), f"{v:.2f}"] + ([f"{ratios[m]:.2f}"] if with_ratio else [])
                              for m, v in t["epoch_seconds_median"].items()]),
              f"Wall time {_minutes(doc, t.get('total_s'))}; evaluation {t['eval_seconds']:.1f} s per model.", "",
              f"Command: `{doc.get('command', '')}`; git {doc['environment']['git'][:10]}"
              f"{' (dirty)' if doc['environment'].get('dirty') else ''}.", ""]
    return "\n".join(lines)


#: the paper's evidence for every claim (Fig. 4 only plots bars; no values are printed)
EVIDENCE = "Fig. 4 (bars of NLL / NELBO / reconstruction; 5 trials, 100 epochs)"


def _test(doc: dict[str, Any], c: str, a: str, b: str, k: str) -> dict[str, Any] | None:
    """The paired t-test of ``a - b`` (constraint ``c``, metric ``k``) from the significance list (its sign
    flipped when the list holds ``b - a``), or None."""
    for s in doc["significance"]:
        if s["dataset"] == c and s["metric"] == k and {s["a"], s["b"]} == {a, b}:
            sign = 1.0 if s["a"] == a else -1.0
            t = s["ttest"]
            return {"n": t["n"], "p": t["p"], "mean_diff": sign * t["mean_diff"], "name": "paired t"}
    return None


def _exact_test(doc: dict[str, Any], c: str, a: str, b: str, k: str,
                t: dict[str, Any]) -> dict[str, Any] | None:
    """The exact sign-flip test of ``a - b`` over the trials (:func:`hardeq_studies.stats.sign_flip_test`) beside
    the paired t-test ``t`` where there are at most :data:`EXACT_BESIDE_T` trials and the document holds the
    per-trial values, else None."""
    trials = doc.get("per_trial", {}).get(c, {})
    if int(t["n"]) > EXACT_BESIDE_T or a not in trials or b not in trials:  # (a document without per-trial values)
        return None
    return sign_flip_test(trials[a][k], trials[b][k])


def _exact_note(n: int) -> str:
    """What the claims table says of the exact test beside the t-test over ``n`` trials."""
    if n > EXACT_BESIDE_T:
        return "(more than 5 trials: the t-test alone)."
    return (f"each with the exact sign-flip test beside it (over {n} trials its smallest p is {2 / 2 ** n:.3g}); "
            "where the two disagree after Holm's adjustment the row is undecided.")


#: the method name of Constrained Reparametrization's independent-noise reading, as runs may record it
INDEPENDENT_CR = ("constrained_reparam_independent",)
#: the paper's estimators besides Marginal Expectation, with Constrained Reparametrization under each reading
#: (shared noise: it is the pathwise gradient, identical in value and gradient)
PAPER_RIVALS = ("constrained_marginal", "unconstrained_marginal", "constrained_layer", "random")


def _differs(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    return (f"{cfg['epochs']} epochs against the paper's 100 and K = {cfg['importance_samples']} importance samples "
            "(the paper gives no K), so the ordering after full training is not measured")


def _cr(doc: dict[str, Any]) -> dict[str, str | None]:
    """Constrained Reparametrization's method name in this run under each reading (None: not run)."""
    methods = doc["config"]["methods_run"]
    return {"shared noise": "pathwise" if "pathwise" in methods else None,
            "independent noise": next((m for m in INDEPENDENT_CR if m in methods), None)}


def _mean(doc: dict[str, Any], c: str, m: str, k: str) -> float | None:
    return next((r["mean"] for r in doc["records"] if r["dataset"] == c and r["method"] == m and r["metric"] == k),
                None)


def claims(doc: dict[str, Any]) -> list[Claim]:
    """The claims of Fig. 4, one row per claim, constraint, metric and (for Constrained Reparametrization) reading,
    each decided by one two-sided paired t-test over trials; no test appears in two rows.

    * "Marginal Expectation is best": against its closest rival on the metric among the paper's estimators, with
      CR read as shared noise (pathwise) and as independent noise (a row that says "not run in this result set"
      when the run has no independent-noise CR);
    * "Constrained Reparametrization trails Marginal Expectation", per reading, unless CR is already the closest
      rival above (then that row is this test, and it says so);
    * "Constrained Layer trails Marginal Expectation" likewise; "Unconstrained and Constrained Marginal tie" (a
      claim of no difference); "... beat Random"."""
    cfg = doc["config"]
    differs = _differs(doc)
    budget = f"{len(cfg['trials'])} trials and {cfg['epochs']} epochs do not separate them; more trials would"
    me, um, cm, rnd = "marginal_expectation", "unconstrained_marginal", "constrained_marginal", "random"
    methods = set(cfg["methods_run"])
    crs = _cr(doc)
    out: list[Claim] = []

    def row(text: str, a: str, b: str, c: str, k: str, *, lower: bool = True, reading: str = "",
            no_difference: bool = False) -> None:
        t = _test(doc, c, a, b, k)
        if t is None:
            out.append(Claim(f"{text} (`{c}`, {k})", EVIDENCE, "not run in this result set", reading=reading,
                             budget="not run in this result set"))
            return
        here = (f"{LABELS.get(a, a)} {_mean(doc, c, a, k):.2f} vs {LABELS.get(b, b)} {_mean(doc, c, b, k):.2f}; "
                f"a - b {t['mean_diff']:+.2f}")
        out.append(Claim(f"{text} (`{c}`, {k})", EVIDENCE, here, test=t, lower_is_better=lower, reading=reading,
                         no_difference=no_difference, differs=differs, budget=budget,
                         exact_test=_exact_test(doc, c, a, b, k, t)))

    for c in cfg["constraints_run"]:
        for k in METRICS:
            closest = {}
            for reading, cr in crs.items():
                rivals = [m for m in PAPER_RIVALS + ((cr,) if cr else ()) if m in methods]
                if cr is None:
                    out.append(Claim(f"Marginal Expectation is best (`{c}`, {k})", EVIDENCE,
                                     "not run in this result set (no independent-noise Constrained "
                                     "Reparametrization)", reading=reading, budget="not run in this result set"))
                    continue
                best = min(rivals, key=lambda m: _mean(doc, c, m, k))
                closest[reading] = best
                row("Marginal Expectation is best", me, best, c, k,
                    reading=reading + ("" if best != cr else "; the closest rival is CR, so this row is also "
                                       "'CR trails ME'"))
            for reading, cr in crs.items():
                if cr is not None and closest.get(reading) != cr:
                    row("Constrained Reparametrization trails Marginal Expectation", me, cr, c, k, reading=reading)
            if "constrained_layer" in methods and "constrained_layer" not in closest.values():
                row("Constrained Layer trails Marginal Expectation", me, "constrained_layer", c, k)
            if um in methods and cm in methods:
                row("Unconstrained and Constrained Marginal tie", um, cm, c, k, no_difference=True)
            for m in (um, cm):
                if m in methods and rnd in methods:
                    row(f"{LABELS[m]} beats Random", m, rnd, c, k)
    return out


def gap_rows(doc: dict[str, Any], c: str) -> list[list[str]]:
    """Per epoch: test NELBO of Marginal Expectation and pathwise (means over trials) and their paired gap."""
    curves = doc["curves"][c]
    if "paired_gap_to_pathwise" not in curves.get("marginal_expectation", {}):
        return []
    g = curves["marginal_expectation"]["paired_gap_to_pathwise"]
    rows = []
    for e, mean in enumerate(g["mean"]):
        ci = "" if g["ci_low"] is None else f"[{g['ci_low'][e]:.2f}, {g['ci_high'][e]:.2f}]"
        rows.append([str(e + 1), f"{curves['marginal_expectation']['test_nelbo'][e]:.2f}",
                     f"{curves['pathwise']['test_nelbo'][e]:.2f}", f"{mean:+.2f}", ci])
    return rows


def pair_gap_rows(doc: dict[str, Any], c: str, a: str, b: str) -> list[list[str]]:
    """Per epoch: test NELBO of ``a`` and ``b`` (means over trials) and their paired gap ``a - b`` with its 95%
    t-interval (:func:`paired_gap_curve` of the per-trial curves); empty when either was not run."""
    curves = doc["curves"].get(c, {})
    if a not in curves or b not in curves:
        return []
    g = paired_gap_curve(curves[a]["test_nelbo_trials"], curves[b]["test_nelbo_trials"])
    rows = []
    for e, mean in enumerate(g["mean"]):
        ci = "" if g["ci_low"] is None else f"[{g['ci_low'][e]:.2f}, {g['ci_high'][e]:.2f}]"
        rows.append([str(e + 1), f"{curves[a]['test_nelbo'][e]:.2f}", f"{curves[b]['test_nelbo'][e]:.2f}",
                     f"{mean:+.2f}", ci])
    return rows
