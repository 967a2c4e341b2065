"""Results of the ``vae-latent`` study: the records from the units, Markdown, and the figures (like Fig. 4)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..figures import save_png
from ..palette import color
from ..results import markdown_table
from ..stats import paired_ttest, paired_wilcoxon

__all__ = ["METRICS", "LABELS", "summarise", "render_markdown", "plot_metrics", "plot_curves"]

#: test metrics (nats per image, lower is better)
METRICS = {"nll": "test NLL (IS)", "nelbo": "test NELBO", "rec": "reconstruction loss"}
#: the paper's names of the estimators
LABELS = {"marginal_expectation": "Marginal Expectation", "pathwise": "pathwise (ours)",
          "constrained_reparam_independent": "Constrained Reparametrization",
          "constrained_marginal": "Constrained Marginal", "unconstrained_marginal": "Unconstrained Marginal",
          "constrained_layer": "Constrained Layer", "random": "Random", "unconstrained": "unconstrained VAE"}
#: the methods every other one is tested against
REFERENCES = ("marginal_expectation", "pathwise")


def _color(method: str) -> str:
    """The shared palette's colour; black for the unconstrained reference (its hash colour is taken)."""
    return "#000000" if method == "unconstrained" else color(method)


def _unit(units: dict[str, Any], constraint: str, method: str, trial: int, first: str) -> dict[str, Any]:
    """The unconstrained reference is trained once (under the first constraint) and shown under each."""
    return units[f"{first if method == 'unconstrained' else constraint}/{method}/{trial}"]


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
            if all("posterior_std" in u["metrics"] for u in us):
                std = np.asarray([u["metrics"]["posterior_std"] for u in us])
                records.append({"dataset": c, "method": m, "metric": "posterior_std", "mean": float(std.mean()),
                                "std": float(std.std(ddof=1)) if std.size > 1 else 0.0, "n_seeds": int(std.size),
                                "paper": None})
            curves[c][m] = {"train_nelbo": np.mean([u["curve_train_nelbo"] for u in us], 0).tolist(),
                            "test_nelbo": np.mean([u["curve_test_nelbo"] for u in us], 0).tolist(),
                            "test_nelbo_std": np.std([u["curve_test_nelbo"] for u in us], 0, ddof=1).tolist()
                            if len(us) > 1 else None}
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
        for ref in REFERENCES:
            if ref not in methods:
                continue
            for m in methods:
                if m == ref or (ref == "pathwise" and m == "marginal_expectation"):
                    continue
                for k in METRICS:
                    a, b = per_trial[c][ref][k], per_trial[c][m][k]
                    significance.append({"dataset": c, "metric": k, "a": ref, "b": m,
                                         "ttest": paired_ttest(a, b), "wilcoxon": paired_wilcoxon(a, b)})
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
             "mean ± std over trials. Every latent sample of every constrained model satisfied its constraint "
             "(largest residual in the last column).", ""]
    for c in cfg["constraints_run"]:
        lines += [f"## Constraint `{c}`: {cfg['constraints'][c]['description']}", ""]
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
        lines += ["Paired tests over trials (same initialisation, data order and evaluation noise): "
                  "difference a - b of the mean, paired t-test p (Wilcoxon p in brackets).", ""]
        rows = []
        for s in doc["significance"]:
            if s["dataset"] != c:
                continue
            rows.append([LABELS.get(s["a"], s["a"]), LABELS.get(s["b"], s["b"]), METRICS[s["metric"]],
                         f"{s['ttest']['mean_diff']:+.2f}", f"{s['ttest']['p']:.3g} ({s['wilcoxon']['p']:.2g})"])
        lines += [markdown_table(["a", "b", "metric", "a - b", "p"], rows)]
    t = doc["timing"]
    lines += ["## Time per epoch", "",
              markdown_table(["method", "s / epoch (median)", "ratio to unconstrained"],
                             [[LABELS.get(m, m), f"{v:.2f}", f"{t['ratio_to_unconstrained'][m]:.2f}"]
                              for m, v in t["epoch_seconds_median"].items()]),
              f"Total wall time {t['total_s'] / 60:.1f} min; evaluation {t['eval_seconds']:.1f} s per model.", "",
              f"Command: `{doc.get('command', '')}`; git {doc['environment']['git'][:10]}"
              f"{' (dirty)' if doc['environment'].get('dirty') else ''}.", ""]
    return "\n".join(lines)


def plot_metrics(doc: dict[str, Any], out: Path) -> Path:
    """Bars of the three test metrics per constraint (mean ± std over trials), like the paper's Fig. 4."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = doc["config"]
    cs, methods = cfg["constraints_run"], cfg["methods_run"]
    fig, axes = plt.subplots(len(cs), len(METRICS), figsize=(4.2 * len(METRICS), 3.4 * len(cs)), squeeze=False)
    for i, c in enumerate(cs):
        for j, (k, label) in enumerate(METRICS.items()):
            ax = axes[i, j]
            recs = {r["method"]: r for r in doc["records"] if r["dataset"] == c and r["metric"] == k}
            means = [recs[m]["mean"] for m in methods]
            ax.bar(range(len(methods)), means, yerr=[recs[m]["std"] for m in methods],
                   color=[_color(m) for m in methods], capsize=3)
            lo, hi = 0.9 * min(means), 1.6 * float(np.median(means))  # diverged runs would hide the rest
            ax.set_ylim(lo, hi)
            for pos, v in enumerate(means):
                if v > hi:
                    ax.text(pos, hi, f"{v:.0f}↑", ha="center", va="top", fontsize=7)
            ax.set_xticks(range(len(methods)), [LABELS.get(m, m) for m in methods], rotation=60, ha="right",
                          fontsize=7)
            ax.set_title(f"{c}: {label}", fontsize=9)
    fig.tight_layout()
    path = Path(out) / "vae-latent.png"
    save_png(fig, path, dpi=120)
    plt.close(fig)
    return path


def plot_curves(doc: dict[str, Any], out: Path) -> Path:
    """Test NELBO per epoch (mean over trials), one panel per constraint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..palette import integer_epochs

    cfg = doc["config"]
    cs = cfg["constraints_run"]
    fig, axes = plt.subplots(1, len(cs), figsize=(6 * len(cs), 4), squeeze=False)
    for ax, c in zip(axes[0], cs):
        lasts = []
        for m in cfg["methods_run"]:
            y = doc["curves"][c][m]["test_nelbo"]
            ax.plot(range(1, len(y) + 1), y, color=_color(m), label=LABELS.get(m, m),
                    ls="--" if m == "pathwise" else "-")
            lasts.append(y[-1])
        lo, hi = min(lasts) - 5, 1.6 * float(np.median(lasts))
        ax.set_ylim(lo, hi)
        off = [LABELS.get(m, m) for m in cfg["methods_run"] if doc["curves"][c][m]["test_nelbo"][-1] > hi]
        if off:
            ax.text(0.99, 0.97, "off scale: " + ", ".join(off), transform=ax.transAxes, ha="right", va="top",
                    fontsize=7)
        integer_epochs(ax)
        ax.set_xlabel("epoch")
        ax.set_ylabel("test NELBO (1 sample, nats)")
        ax.set_title(f"constraint {c}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(out) / "vae-latent_curves.png"
    save_png(fig, path, dpi=120)
    plt.close(fig)
    return path
