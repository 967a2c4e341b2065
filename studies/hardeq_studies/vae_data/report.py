"""Results of the ``vae-data`` study: records from the units, Markdown beside the paper's Table 2, and figures
(the data before/after water-filling like the paper's Fig. 5, reconstructions, training curves)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..figures import save_png
from ..palette import color
from ..results import markdown_table
from ..stats import paired_ttest

__all__ = ["METRICS", "summarise", "render_markdown", "plot_images", "plot_curves"]

#: per-image test metrics; LL and ELBO in nats (higher is better), RL a sum of squared pixel errors
METRICS = {"ll": "LL (IS)", "elbo": "ELBO", "rl": "RL", "violation": "violation (1e-3)",
           "violation_tol1": "violation (1.0)"}
MODEL_LABELS = {"vae": "VAE", "ladder": "Ladder VAE", "graph": "Graph VAE"}
#: the display order; ``unconstrained+cond`` is the unconstrained model conditioned at evaluation
ORDER = ("unconstrained", "unconstrained+cond", "cl", "ours", "ours-me", "ours-pathwise")
PLANE = {"unconstrained": "R^784", "cl": "R^784", "unconstrained+cond": "plane", "ours": "plane",
         "ours-me": "plane", "ours-pathwise": "plane"}
#: paired comparisons (a, b, metric) reported
COMPARISONS = (("ours", "unconstrained+cond", "ll"), ("ours", "unconstrained+cond", "elbo"),
               ("ours", "unconstrained+cond", "rl"), ("ours", "unconstrained", "rl"), ("ours", "cl", "rl"),
               ("ours", "ours-me", "ll"), ("ours-pathwise", "ours-me", "ll"), ("ours-pathwise", "ours-me", "rl"))


def summarise(result: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    units, trials = result["units"], result["trials"]
    per_trial: dict[str, dict[str, dict[str, list[float]]]] = {}
    curves: dict[str, dict[str, list[float]]] = {}
    epoch_s: dict[str, dict[str, float]] = {}
    images = {"originals": np.round(result["originals"][:8].numpy(), 3).tolist(), "reconstructions": {}}
    records = []
    for key, unit in units.items():
        model, variant, trial = key.split("/")
        curves.setdefault(model, {}).setdefault(variant, []).append(unit["curve_train_loss"])
        epoch_s.setdefault(model, {}).setdefault(variant, [])
        epoch_s[model][variant] = list(epoch_s[model][variant]) + list(unit["epoch_seconds"])
        for v, m in unit["metrics"].items():
            row = per_trial.setdefault(model, {}).setdefault(v, {})
            for k in list(METRICS) + ["max_sum_deviation"]:
                row.setdefault(k, []).append(m[k])
            if int(trial) == trials[0]:
                images["reconstructions"].setdefault(model, {})[v] = np.round(
                    m["reconstructions"][:8].numpy(), 3).tolist()
    paper = config["paper"]
    cols = paper["columns"]
    for model, by_v in per_trial.items():
        for v, row in by_v.items():
            for k in METRICS:
                x = np.asarray(row[k], dtype=np.float64)
                pv = paper["values"].get(model, {}).get(v)
                records.append({"dataset": model, "method": v, "metric": k, "mean": float(x.mean()),
                                "std": float(x.std(ddof=1)) if x.size > 1 else 0.0, "n_seeds": int(x.size),
                                "paper": pv[cols.index(k)][0] if pv and k in cols else None,
                                "paper_std": pv[cols.index(k)][1] if pv and k in cols else None,
                                "density_on": PLANE[v]})
            records.append({"dataset": model, "method": v, "metric": "max_sum_deviation",
                            "mean": float(max(row["max_sum_deviation"])), "std": 0.0,
                            "n_seeds": len(row["max_sum_deviation"]), "paper": None})
    significance = []
    for model, by_v in per_trial.items():
        for a, b, k in COMPARISONS:
            if a in by_v and b in by_v:
                significance.append({"dataset": model, "a": a, "b": b, "metric": k,
                                     "ttest": paired_ttest(by_v[a][k], by_v[b][k])})
    timing = {"epoch_seconds_median": {m: {v: float(np.median(s)) for v, s in d.items()} for m, d in epoch_s.items()},
              "eval_seconds": float(np.mean([u["eval_seconds"] for u in units.values()]))}
    timing["ratio_ours_to_unconstrained"] = {
        m: d["ours"] / d["unconstrained"] for m, d in timing["epoch_seconds_median"].items()
        if "ours" in d and "unconstrained" in d}
    curves_mean = {m: {v: np.mean(c, 0).tolist() for v, c in d.items()} for m, d in curves.items()}
    return {"records": records, "per_trial": per_trial, "curves": curves_mean, "significance": significance,
            "timing": timing, "images": images}


def _rec(doc: dict[str, Any], model: str, v: str, k: str) -> dict[str, Any] | None:
    return next((r for r in doc["records"] if r["dataset"] == model and r["method"] == v and r["metric"] == k), None)


def _fmt(r: dict[str, Any] | None, digits: int = 2) -> str:
    return "" if r is None else f"{r['mean']:.{digits}f} ± {r['std']:.{digits}f}"


def render_markdown(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [f"# vae-data ({doc['preset']} preset)", "",
             f"MNIST rescaled to pixel sum {cfg['data']['total']:g} by water-filling ({doc['data']['n_train']} "
             f"training / {doc['data']['n_test']} test images); {cfg['epochs']} epochs, {len(cfg['trials'])} trials, "
             f"K = {cfg['importance_samples']} importance samples. LL and ELBO: nats per image (higher is better); "
             "RL: squared error of the reconstruction (the observation's mean) summed over the 784 pixels; "
             "violation: share of reconstructions with |sum - 100| above the tolerance. `density on`: LL/ELBO of "
             "R^784 rows and plane rows are in different units and are not comparable; compare `ours` with "
             "`unconstrained+cond` (the unconstrained model conditioned at evaluation).", ""]
    for model in cfg["models_run"]:
        lines += [f"## {MODEL_LABELS.get(model, model)}", ""]
        rows = []
        for v in ORDER:
            if _rec(doc, model, v, "ll") is None:
                continue
            paper = [_rec(doc, model, v, k) for k in ("ll", "elbo", "rl", "violation")]
            pcol = " / ".join(f"{r['paper']:.2f}" for r in paper if r and r["paper"] is not None) or "-"
            dev = _rec(doc, model, v, "max_sum_deviation")["mean"]
            rows.append([v, PLANE[v]] + [_fmt(_rec(doc, model, v, k), 3 if k.startswith("viol") else 2)
                                         for k in METRICS] + [f"{dev:.1e}", pcol])
        lines += [markdown_table(["variant", "density on"] + list(METRICS.values())
                                 + ["max abs(sum - 100)", "paper LL / ELBO / RL / violation"], rows)]
    lines += ["## Paired tests over trials", "",
              "Same initialisation, data order and evaluation noise per trial; a - b of the mean and the paired "
              "t-test p.", ""]
    lines += [markdown_table(["model", "a", "b", "metric", "a - b", "p"],
                             [[MODEL_LABELS.get(s["dataset"], s["dataset"]), s["a"], s["b"], METRICS[s["metric"]],
                               f"{s['ttest']['mean_diff']:+.3f}", f"{s['ttest']['p']:.3g}"]
                              for s in doc["significance"]])]
    t = doc["timing"]
    paper_t = cfg["paper"]["seconds_per_epoch"]
    rows = []
    for model, d in t["epoch_seconds_median"].items():
        ratio = t["ratio_ours_to_unconstrained"].get(model)
        pt = paper_t.get(model)
        rows.append([MODEL_LABELS.get(model, model)] + [f"{d[v]:.1f}" if v in d else "" for v in
                                                        ("unconstrained", "cl", "ours")]
                    + [f"{100 * (ratio - 1):+.1f}%" if ratio else "",
                       f"{pt[0]} vs {pt[1]} ({100 * (pt[1] / pt[0] - 1):+.1f}%)" if pt else ""])
    lines += ["## Seconds per epoch (median; measured in this run, 1 thread)", "",
              markdown_table(["model", "unconstrained", "+CL", "ours", "ours vs unconstrained",
                              "paper (Table 10, GPU)"], rows),
              f"Total wall time {t['total_s'] / 60:.1f} min; evaluation {t['eval_seconds']:.1f} s per model.", "",
              f"Command: `{doc.get('command', '')}`; git {doc['environment']['git'][:10]}"
              f"{' (dirty)' if doc['environment'].get('dirty') else ''}.", ""]
    return "\n".join(lines)


def plot_images(doc: dict[str, Any], out: Path) -> list[Path]:
    """``vae-data_data.png``: original test images above their water-filled versions (like the paper's Fig. 5);
    ``vae-data_reconstructions.png``: the data and each variant's reconstruction, per model (first trial)."""
    import torch

    from ..images import load_mnist, save_grid

    out = Path(out)
    filled = torch.tensor(doc["images"]["originals"]).reshape(-1, 28, 28)
    raw, _ = load_mnist("test")
    raw = raw[: filled.shape[0]].to(torch.float32) / 255.0
    p1 = save_grid(torch.cat([raw, filled]), out / "vae-data_data.png", nrow=filled.shape[0], scale=3)
    rows, labels = [filled], ["data"]
    for model, by_v in doc["images"]["reconstructions"].items():
        for v in ORDER:
            if v in by_v:
                rows.append(torch.tensor(by_v[v]).reshape(-1, 28, 28))
                labels.append(f"{model}/{v}")
    p2 = save_grid(torch.cat(rows), out / "vae-data_reconstructions.png", nrow=filled.shape[0], scale=2)
    (out / "vae-data_reconstructions.txt").write_text("rows, top to bottom:\n" + "\n".join(labels) + "\n")
    return [p1, p2]


def plot_curves(doc: dict[str, Any], out: Path) -> Path:
    """Training loss per epoch (mean over trials), one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..palette import integer_epochs

    models = doc["config"]["models_run"]
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        for v, y in doc["curves"].get(model, {}).items():
            ax.plot(range(1, len(y) + 1), y, label=v, color=color(v), marker="o", ms=3)
        integer_epochs(ax)
        ax.set_xlabel("epoch")
        ax.set_ylabel("training loss per image")
        ax.set_title(MODEL_LABELS.get(model, model))
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(out) / "vae-data_curves.png"
    save_png(fig, path, dpi=120)
    plt.close(fig)
    return path
