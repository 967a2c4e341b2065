"""The mof study's figures, from its results document and curves alone: learning curves, the parity plot of the
first split, and every model's smoothed validation MAD with the step whose parameters were kept."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..extras import require
from ..figures import save_png
from ..palette import color as palette_color
from ..palette import integer_epochs

__all__ = ["color", "plot_curves", "plot_parity", "plot_stopping"]


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
    panels = [("val_mad", "validation MAD (solid), training MAD (dotted)", True, "MAD (e per atom, log scale)"),
              ("val_nll", "validation NLL per MOF", False, "NLL per MOF (nats, symlog scale)"),
              ("val_log_var", "mean log-variance of the head", False, "mean log-variance (log e^2)")]
    for ax, (key, title, log, ylabel) in zip(axes, panels):
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
        ax.set_xlabel("epoch (a harness round: one validation)")
        ax.set_ylabel(ylabel, fontsize=8)
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


def plot_stopping(models: Mapping[str, Mapping[str, Any]], out: Path) -> Path | None:
    """``mof_stopping.png``: per method, every model's smoothed validation MAD against the data epochs it saw
    (thin lines, one per model and split) with a dot at its best step, the step whose parameters were kept;
    ``None`` (no file) when the run recorded no smoothed curve (runs before smoothed early stopping)."""
    units = {k: u for k, u in models.items() if u.get("val_mad_smooth")}
    if not units:
        return None
    plt = _pyplot()
    methods = list(dict.fromkeys(m for u in units.values() for m in u["methods"]))
    fig, axes = plt.subplots(1, len(methods), figsize=(3.3 * len(methods), 3.4), sharey=True, squeeze=False)
    for ax, m in zip(axes[0], methods):
        for u in units.values():
            per_epoch = float(u.get("steps_per_epoch") or u["round"])
            for i, name in enumerate(u["methods"]):
                if name != m:
                    continue
                ys = u["val_mad_smooth"][i]
                pts = [((r + 1) * u["round"] / per_epoch, y) for r, y in enumerate(ys) if y is not None]
                ax.plot([x for x, _ in pts], [y for _, y in pts], color=color(m), lw=0.6, alpha=0.6)
                best = u["best_step"][i] / per_epoch
                at = min(pts, key=lambda p: abs(p[0] - best)) if pts else None
                if at is not None:
                    ax.plot([at[0]], [at[1]], "o", color="black", ms=2.5)
        ax.set_title(m, fontsize=9)
        ax.set_xlabel("data epochs")
        ax.set_yscale("log")
    axes[0][0].set_ylabel("smoothed validation MAD (e)")
    fig.suptitle("smoothed validation MAD per model and split; dot: the best step (the parameters kept)", fontsize=9)
    fig.tight_layout()
    path = Path(out) / "mof_stopping.png"
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return path
