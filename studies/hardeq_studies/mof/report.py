"""Reporting the mof study from its results document alone: the Table 5 comparison, the ensemble NLLs three
ways, paired tests, the neutrality check, learning curves and a parity plot."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..figures import save_png
from ..extras import require
from ..palette import color as palette_color
from ..palette import integer_epochs
from ..results import markdown_table
from .evaluate import PAPER_ORDER

__all__ = ["render_markdown", "plot_curves", "plot_parity"]


def _num(x: float | None, spec: str) -> str:
    if x is None or (isinstance(x, float) and (math.isnan(x))):
        return "–"
    if abs(x) >= 1e5:
        return f"{x:.2e}"
    return f"{x:{spec}}"


def _cell(rec: Mapping[str, Any] | None, spec: str) -> str:
    if rec is None:
        return "–"
    return f"{_num(rec['mean'], spec)} ± {_num(rec['std'], spec)}"


def _paper(rec: Mapping[str, Any] | None, spec: str, metric: str, method: str) -> str:
    if rec is None or rec.get("paper") is None:
        return "–"
    if metric == "nll" and method.startswith("closed-form"):
        return "> 1e7"
    return f"{_num(rec['paper'], spec)} ± {_num(rec.get('paper_std'), spec)}"


def render_markdown(doc: Mapping[str, Any], brief: bool = False) -> str:
    """``mof.md``: tables of MAD and NLL next to the paper's, ensemble NLLs, tests and run facts."""
    idx = {(r["method"], r["metric"]): r for r in doc["records"]}
    methods = [m for m in PAPER_ORDER if (m, "mad") in idx]
    s = doc["config"]["settings"]
    lines = [f"# mof: charge-neutral MOF partial charges (preset `{doc['preset']}`)", "",
             f"{s['splits']} split(s), at most {s['epochs']} epochs; n = values per row (two initialisations per "
             "split for single models, one per split for ensembles and baselines). Mean ± std (sample std).", ""]
    rows = []
    for m in methods:
        mad, nll = idx.get((m, "mad")), idx.get((m, "nll"))
        rows.append([m, _cell(mad, ".4f"), _paper(mad, ".4f", "mad", m), _cell(nll, ".1f"),
                     _paper(nll if nll is not None else {"paper": None}, ".1f", "nll", m), mad["n_seeds"]])
    lines.append(markdown_table(["method", "MAD (here)", "MAD (paper)", "NLL (here)", "NLL (paper)", "n"], rows))
    if brief:
        return "\n".join(lines)
    lines += ["", "NLL: negative log-density of the DDEC charges of each test MOF's first n - 1 atoms under the "
              "predicted Gaussian (the ICML code's convention; = the density on the plane, "
              "`ConstrainedNormal.log_prob`, minus 0.5 log n), summed per MOF and averaged over MOFs. "
              "Ensembles in this column use the ICML code's covariance (S1 + S2)/4.", ""]
    ens = [m for m in methods if m.endswith("ensemble")]
    if ens:
        lines += ["## Ensemble NLL: the ICML code's (S1 + S2)/4 against the mixture", ""]
        rows = [[m, _cell(idx.get((m, "nll")), ".1f"), _cell(idx.get((m, "nll_moment")), ".1f"),
                 _cell(idx.get((m, "nll_mixture")), ".1f")] for m in ens]
        lines.append(markdown_table(["ensemble", "(S1+S2)/4", "moment-matched (S1+S2)/2 + dd^T/4",
                                     "exact mixture"], rows))
    diag = [m for m in methods if (m, "mean_log_variance") in idx]
    if diag:
        lines += ["", "## Variance head diagnostics (single models)", ""]
        rows = [[m, _cell(idx.get((m, "mean_log_variance")), ".2f"), _cell(idx.get((m, "median_graph_nll")), ".1f"),
                 _cell(idx.get((m, "max_graph_nll")), ".1f"), _cell(idx.get((m, "median_abs_z")), ".3g"),
                 _cell(idx.get((m, "frac_abs_z_gt_10")), ".2g")]
                for m in diag]
        lines.append(markdown_table(["method", "mean log variance of the head", "median per-MOF NLL",
                                     "largest per-MOF NLL", "median abs z", "share of atoms with abs z > 10"], rows))
        lines += ["", "z = (prediction - DDEC) / conditional standard deviation of the atom; a calibrated "
                  "Gaussian has median abs z = 0.674 and essentially no abs z > 10."]
    sig = doc.get("significance") or []
    if sig:
        lines += ["", "## Paired two-sided Wilcoxon signed-rank tests", "",
                  "Pairs: (split, initialisation) for single models, splits for ensembles; "
                  "wins = pairs with a < b.", ""]
        rows = [[t["a"], t["b"], t["metric"], t["n"], t["wins"], _num(t["median_diff"], ".4g"),
                 _num(t["p"], ".3g")] for t in sig]
        lines.append(markdown_table(["a", "b", "metric", "n", "wins (a < b)", "median a - b", "p"], rows))
    data = doc.get("data", {})
    lines += ["", "## Checks and facts", "",
              f"- Largest |sum of predicted charges| of any MOF, any method, any split: "
              f"{doc.get('max_abs_prediction_sum', float('nan')):.2e} e.",
              f"- Labels: largest |sum of DDEC charges| of a MOF in the file "
              f"{data.get('max_abs_charge_sum', float('nan')):.2e} e "
              f"(mean {data.get('mean_abs_charge_sum', float('nan')):.1e}); labels are projected onto the plane "
              f"(largest per-atom shift {data.get('max_label_shift', float('nan')):.1e} e).",
              f"- Data: {data.get('num_graphs')} graphs, {data.get('num_atoms')} atoms, "
              f"mean {data.get('atoms_mean', 0):.1f} "
              f"atoms per graph (median {data.get('atoms_median')}, max {data.get('atoms_max')}).",
              f"- Split redraws (rejected shuffles): {doc.get('redraws')}; "
              f"test size (graphs, atoms): {doc.get('test_size')}.",
              f"- Best epochs: {doc.get('best_epoch')}; early-stopped at: {doc.get('stopped_epoch')} (0: never).",
              f"- Wall time {doc.get('timing', {}).get('total_s', float('nan')):.0f} s "
              f"(training {doc.get('timing', {}).get('train_s', float('nan')):.0f} s); device "
              f"{doc['environment'].get('device')}, {s.get('jobs')} process(es) x {s.get('threads')} thread(s); "
              f"git {doc['environment'].get('git', '?')[:10]} (dirty: {doc['environment'].get('dirty')}).",
              f"- Command: `{doc.get('command')}`.", ""]
    return "\n".join(lines)


#: this study's methods drawn in the colours of their closest relatives in :mod:`hardeq_studies.palette`
#: (KKT = KKT-hPINN, CL = CL, closed-form = ours-L1, likelihood = ours-NLL; variance takes ECNN's orange)
_COLOR_OF = {"KKT": "KKT-hPINN", "CL": "CL", "closed-form": "ours-L1", "likelihood": "ours-NLL", "variance": "ECNN",
             "Element-mean variance": "NN"}


def color(method: str) -> str:
    """The palette colour of ``method`` (see ``_COLOR_OF``)."""
    return palette_color(_COLOR_OF.get(method, method))


def _pyplot():
    require("matplotlib", "graphs", purpose="the mof study's figures").use("Agg")
    return require("matplotlib.pyplot", "graphs", purpose="the mof study's figures")


def plot_curves(curves: Mapping[str, Mapping[str, list]], out: Path) -> Path:
    """``mof_curves.png``: training and validation MAD, validation NLL and mean log-variance per epoch."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [("val_mad", "validation MAD (solid), training MAD (dotted)", True),
              ("val_nll", "validation NLL per MOF", False), ("val_log_var", "mean log-variance of the head", False)]
    for ax, (key, title, log) in zip(axes, panels):
        for m, c in curves.items():
            ys = c.get(key)
            if not ys:
                continue
            xs = [i + 1 for i, v in enumerate(ys) if v is not None]
            ax.plot(xs, [v for v in ys if v is not None], color=color(m), label=m)
            if key == "val_mad" and c.get("train_mad"):
                t = c["train_mad"]
                ax.plot([i + 1 for i, v in enumerate(t) if v is not None], [v for v in t if v is not None],
                        color=color(m), ls=":")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("epoch")
        integer_epochs(ax)
        if log:
            ax.set_yscale("log")
        if key == "val_nll":
            ax.set_yscale("symlog", linthresh=100)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = Path(out) / "mof_curves.png"
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return path


def plot_parity(parity: Mapping[str, Any], out: Path) -> Path:
    """``mof_parity.png``: predicted vs DDEC charges on a random sample of test atoms of one split."""
    plt = _pyplot()
    preds = parity["pred"]
    fig, axes = plt.subplots(1, len(preds), figsize=(3.2 * len(preds), 3.3), sharex=True, sharey=True)
    axes = [axes] if len(preds) == 1 else list(axes)
    x = parity["ddec"]
    lo, hi = min(x) - 0.1, max(x) + 0.1
    for ax, (m, p) in zip(axes, preds.items()):
        ax.plot([lo, hi], [lo, hi], color="0.6", lw=0.8)
        ax.scatter(x, p, s=3, alpha=0.5, color=color(m))
        ax.set_title(f"{m}\nMAD {parity['mad_full_split'][m]:.4f} (whole test split)", fontsize=8)
        ax.set_xlabel("DDEC charge (e)")
    axes[0].set_ylabel("predicted charge (e)")
    fig.suptitle(f"split {parity['split']}: {len(x)} random test atoms", fontsize=9)
    fig.tight_layout()
    path = Path(out) / "mof_parity.png"
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return path
