"""Reporting the ``chemical`` study: Markdown tables, paired significance tests and learning-curve figures,
all from the results document (``OUT/chemical.json``) alone."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..figures import save_png
from ..palette import color, integer_epochs, linestyle, mark_off_scale
from ..claims import Claim, claims_section
from ..results import markdown_table, wall_time
from ..stats import paired_wilcoxon

__all__ = ["summarize", "significance", "significance_table", "claims", "paper_claims", "hypotheses", "plot_curves",
           "render_markdown"]

#: the paper's method and the methods its Table 1 says it beats
PAPER_METHOD = "ours"
PAPER_RIVALS = ("KKT-hPINN", "NN", "PINN", "ECNN", "CL")
#: hard methods meet the balances to float32 round-off: |Ay - b| below this (scaled units; coefficients ~100)
ROUND_OFF = 1e-4


def _wall(doc: Mapping[str, Any], seconds: float | None) -> str:
    """The run's wall time in seconds with its label (:func:`hardeq_studies.results.wall_time`)."""
    total, label = wall_time(doc, seconds)
    return f"{total:.0f} s ({label})" if total is not None else "not recorded"


def _fmt(mean: float | None, std: float | None, unit: float = 1e-4) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "–"
    return f"{mean / unit:.3g} ± {std / unit:.2g}"


def summarize(records: Sequence[Mapping[str, Any]], methods: Sequence[str], datasets: Sequence[str]) -> str:
    """Markdown tables: test MSE (x 1e-4) next to the paper's, constraint violation, and diagnostics."""
    idx = {(r["dataset"], r["method"], r["metric"]): r for r in records}
    lines = ["### Test MSE (scaled outputs, x 1e-4; mean ± std over seeds) — here vs paper", ""]
    header = ["method"] + [f"{d} (here)" for d in datasets] + [f"{d} (paper)" for d in datasets]
    rows = []
    for m in methods:
        here = [_fmt(idx[(d, m, "test_mse")]["mean"], idx[(d, m, "test_mse")]["std"])
                if (d, m, "test_mse") in idx else "–" for d in datasets]
        paper = [_fmt(idx[(d, m, "test_mse")].get("paper"), idx[(d, m, "test_mse")].get("paper_std"))
                 if (d, m, "test_mse") in idx else "–" for d in datasets]
        rows.append([m] + here + paper)
    lines.append(markdown_table(header, rows))
    extra = [("violation", "Mean absolute constraint violation on the test set (scaled units)", 1.0, ".2e"),
             ("test_mse_last_epoch", "Test MSE after the last epoch (x 1e-4; the reference code's effective "
              "choice)", 1e-4, ".3g"),
             ("val_mse", "Validation MSE at the selected epoch (x 1e-4)", 1e-4, ".3g"),
             ("best_epoch", "Selected (best-validation) epoch", 1.0, ".0f"),
             ("mean_log_variance", "Mean predicted log-variance (ours*; scaled units)", 1.0, ".2f")]
    for metric, title, unit, spec in extra:
        if not any(k[2] == metric for k in idx):
            continue
        rows = []
        for m in methods:
            row = [m]
            for d in datasets:
                r = idx.get((d, m, metric))
                row.append("–" if r is None else f"{r['mean'] / unit:{spec}} ± {r['std'] / unit:{spec}}")
            rows.append(row)
        lines += ["", f"### {title}", "", markdown_table(["method"] + list(datasets), rows)]
    return "\n".join(lines)


def significance(per_seed: Mapping[str, Mapping[str, Mapping[str, Sequence[float]]]], methods: Sequence[str],
                 reference: str = "KKT-hPINN", metric: str = "test_mse") -> list[dict[str, Any]]:
    """Paired two-sided Wilcoxon signed-rank tests over seeds of every ``ours*`` method against ``reference``.

    Args:
        per_seed: ``{dataset: {method: {metric: [value per seed]}}}`` (the results document's ``per_seed``).
        methods: the methods to compare (those without ``ours`` in the name are skipped).

    Returns:
        One dict per data set and method: ``dataset, method, reference, metric`` and the fields of
        :func:`~hardeq_studies.stats.paired_wilcoxon` (``wins``: seeds where the method is lower).
    """
    rows = []
    for dataset, by_method in per_seed.items():
        if reference not in by_method:
            continue
        ref = by_method[reference][metric]
        for m in methods:
            if not m.startswith("ours") or m not in by_method:
                continue
            rows.append({"dataset": dataset, "method": m, "reference": reference, "metric": metric,
                         **paired_wilcoxon(by_method[m][metric], ref)})
    return rows


def significance_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one line per method, one column per data set: median ratio, wins / n, p."""
    if not rows:
        return ""
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    idx = {(r["dataset"], r["method"]): r for r in rows}
    out = []
    for m in methods:
        cells = [m]
        for d in datasets:
            r = idx.get((d, m))
            cells.append("–" if r is None else
                         f"{r['median_ratio']:.3g}x, {r['wins']}/{r['n']}, p = {r['p']:.2g}")
        out.append(cells)
    ref, metric = rows[0]["reference"], rows[0]["metric"]
    return (f"### Paired test against {ref} ({metric}; two-sided Wilcoxon signed-rank over seeds)\n\n"
            f"Cell: median over seeds of (method / {ref}), seeds where the method is lower / seeds, p-value. "
            f"With 10 seeds the smallest possible p is 0.002 (all 10 seeds one way).\n\n"
            + markdown_table(["method"] + datasets, out))


#: the design choice of this study that explains a result of ours against the paper's
DESIGN = ("ours's variance head, this study's reading of the paper (whose code is not public); docs/chemical.md shows "
          "that choice decides the comparison: ours-sg, the same model with the variance's gradient stopped in the "
          "mean's loss, ties KKT-hPINN")


def paper_claims(doc: Mapping[str, Any]) -> list[Claim]:
    """The paper's claims: per data set, "ours has a lower test MSE than each baseline" (paired Wilcoxon over
    seeds), and "every hard method meets the balances" (largest mean |violation| against :data:`ROUND_OFF`, next
    to the unconstrained NN's)."""
    per_seed = doc.get("per_seed", {})
    idx = {(r["dataset"], r["method"], r["metric"]): r for r in doc["records"]}
    rows = []
    for dataset, by_method in per_seed.items():
        if PAPER_METHOD not in by_method:
            continue
        ours = by_method[PAPER_METHOD]["test_mse"]
        for rival in PAPER_RIVALS:
            if rival not in by_method:
                continue
            test = paired_wilcoxon(ours, by_method[rival]["test_mse"])
            mine, theirs = idx[(dataset, PAPER_METHOD, "test_mse")], idx[(dataset, rival, "test_mse")]
            paper = (f"{_fmt(mine['paper'], mine.get('paper_std'))} vs {_fmt(theirs['paper'], theirs.get('paper_std'))}"
                     if mine.get("paper") is not None and theirs.get("paper") is not None else "–")
            rows.append(Claim(f"{dataset}: ours beats {rival} (test MSE)", paper,
                              f"{_fmt(mine['mean'], mine['std'])} vs {_fmt(theirs['mean'], theirs['std'])}; "
                              f"lower in {test['wins']}/{test['n']} seeds", test=test, design=DESIGN))
    hard = [m for m in doc["config"]["methods_run"] if m not in ("NN", "PINN")]
    for dataset in per_seed:
        worst = max((idx[(dataset, m, "violation")]["mean"], m) for m in hard if (dataset, m, "violation") in idx)
        nn = idx.get((dataset, "NN", "violation"))
        here = f"largest {worst[0]:.1e} ({worst[1]})" + (f"; NN {nn['mean']:.1e}" if nn else "")
        if worst[0] < ROUND_OFF:
            rows.append(Claim(f"{dataset}: hard methods meet the balances", "exact by construction", here,
                              construction=f"exact conditioning; measured below the float32 round-off bound "
                                           f"{ROUND_OFF:g}"))
        else:  # a hard method off its balances is a defect of this implementation, not evidence about the paper
            rows.append(Claim(f"{dataset}: hard methods meet the balances", "exact by construction", here,
                              budget=f"{worst[1]} violates by more than the round-off bound {ROUND_OFF:g}: a defect "
                                     "to fix before this row can be read"))
    return rows


def hypotheses(doc: Mapping[str, Any]) -> list[Claim]:
    """This repository's hypotheses tested in the same run (the non-negative flows' "bounds help"), which are in
    the study's Holm family; ``[]`` for a run without them."""
    from ..bounds_claims import as_hypotheses
    from .bounds import claims as bound_claims

    return as_hypotheses(bound_claims(doc)) if doc.get("nonnegative_flows") else []


def claims(doc: Mapping[str, Any]) -> str:
    """``## Claims of the paper``: :func:`paper_claims`, Holm-adjusted in one family with :func:`hypotheses`."""
    rows = paper_claims(doc)
    note = ("Test MSE x 1e-4 on the scaled outputs, mean ± std over seeds. \"ours\" is the paper's method (expected "
            "L2 loss); the variants `ours-*` are this study's additions and are tested against KKT-hPINN above.")
    return claims_section(rows, note, family=hypotheses(doc),
                          family_where="in the section on non-negative flows") if rows else ""


def plot_curves(curves: Mapping[str, Any], out: Path, prefix: str = "chemical",
                variance_floor: float = 1e-8) -> list[Path]:
    """One PNG per data set: training and validation MSE per epoch (mean over seeds), one line per method in
    its fixed colour (:func:`hardeq_studies.palette.color`), and the mean predicted log-variance of ``ours*``.

    Methods whose final MSE is more than 100 times the median method's do not set the y-range, so that one
    diverging method does not flatten the others; a curve that then ends outside the range is labelled
    "off scale" in the legend and at the edge of the panel.
    """
    from ..extras import require

    matplotlib = require("matplotlib", "chemical", purpose="the chemical study's figures")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, per_method in curves.items():
        has_lv = any("val_log_var" in c for c in per_method.values())
        fig, axes = plt.subplots(1, 3 if has_lv else 2, figsize=(17 if has_lv else 11, 4.4))
        for ax, split in zip(axes, ("train", "val")):
            finals = {m: c[split][-1] for m, c in per_method.items() if split in c and c[split]}
            ref = float(np.median(list(finals.values()))) if finals else 1.0
            shown = [m for m, v in finals.items() if np.isfinite(v) and v <= 100 * ref]
            values = np.concatenate([np.asarray(per_method[m][split][min(5, len(per_method[m][split]) - 1):])
                                     for m in shown]) if shown else np.array([1.0])
            values = values[np.isfinite(values) & (values > 0)]
            lo, hi = (values.min() / 1.5, values.max() * 1.5) if values.size else (None, None)
            slot = 0
            for m, c in per_method.items():
                if split not in c:
                    continue
                last = c[split][-1]
                off = lo is not None and not (np.isfinite(last) and lo <= last <= hi)
                ax.plot(np.arange(1, len(c[split]) + 1), c[split], lw=1.2, ls=linestyle(m), color=color(m),
                        label=f"{m} (off scale)" if off else m)
                if off:
                    mark_off_scale(ax, m, above=not (np.isfinite(last) and last < lo), slot=slot)
                    slot += 1
            if lo is not None:
                ax.set_ylim(lo, hi)
            ax.set_yscale("log")
            ax.set_xlabel("epoch")
            integer_epochs(ax)
            ax.set_ylabel("MSE (scaled outputs)")
            ax.set_title(f"{name}: {'training' if split == 'train' else 'validation'} MSE (mean over seeds)")
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=7, ncol=2)
        if has_lv:
            ax = axes[2]
            for m, c in per_method.items():
                if "val_log_var" in c:
                    ax.plot(np.arange(1, len(c["val_log_var"]) + 1), c["val_log_var"], lw=1.2, ls=linestyle(m),
                            color=color(m), label=m)
            ax.axhline(math.log(variance_floor), color="gray", lw=0.8, ls=":",
                       label=f"log {variance_floor:g} (variance floor)")
            ax.set_xlabel("epoch")
            integer_epochs(ax)
            ax.set_ylabel("mean predicted log-variance")
            ax.set_title(f"{name}: ours* predicted log-variance (validation)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = Path(out) / f"{prefix}.{name}.png"
        save_png(fig, path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def _nonnegative(doc: Mapping[str, Any]) -> str:
    """The non-negative-flows section (chemical/bounds.py) and a blank line, or "" for a run without it."""
    from .bounds import markdown

    lines = markdown(doc, family=paper_claims(doc))
    return "\n".join(lines).lstrip("\n") + "\n\n" if lines else ""


def render_markdown(doc: Mapping[str, Any]) -> str:
    """``chemical.md``: the run's settings and environment, the tables and the paired tests."""
    cfg, env, timing = doc["config"], doc["environment"], doc.get("timing", {})
    datasets, methods = cfg["datasets_run"], cfg["methods_run"]
    units = {k: v for k, v in timing.items() if k != "total_s"}
    cpu = doc.get("cpu_timing", {})
    git = f"git {env.get('git', '?')[:12]}" + (" (uncommitted changes)" if env.get("dirty") else "")
    table = summarize(doc["records"], methods, datasets)
    sig = significance_table(significance(doc.get("per_seed", {}), methods,
                                          reference=cfg.get("significance", {}).get("reference", "KKT-hPINN")))
    return (f"# chemical — mass-balance surrogates ({doc['preset']} preset)\n\n"
            + (f"Command: `{doc['command']}`\n\n" if doc.get("command") else
               f"Command: `hardeq reproduce chemical --{doc['preset']}` (reconstructed: this results file "
               f"predates recorded commands)\n\n")
            + f"{len(cfg['seeds'])} seeds x {cfg['epochs']} epochs, dtype {cfg['dtype_run']}, world size "
            f"{cfg['world_size']}; wall time {_wall(doc, timing.get('total_s'))} "
            f"({', '.join(f'{k} {v:.0f} s' for k, v in units.items())}; CPU time "
            f"{', '.join(f'{k} {v:.0f} s' for k, v in cpu.items())}). Environment: torch {env['torch']}, "
            f"{env['device']}, {env['threads']} threads, {git}.\n\n"
            f"{table}\n{sig}\n{claims(doc)}\n{_nonnegative(doc)}Learning curves: "
            + ", ".join(f"`chemical.{d}.png`" for d in datasets)
            + ". Protocol and discussion: docs/chemical.md.\n")
