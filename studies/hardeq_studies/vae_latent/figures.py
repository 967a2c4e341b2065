"""The ``vae-latent`` study's figures, from its results document alone: the test metrics per estimator, the
learning curves, and the paired gap between Marginal Expectation and pathwise per epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..figures import save_png
from .report import LABELS, METRICS, _color, gap_rows

__all__ = ["plot_metrics", "plot_curves", "plot_gap"]


def _tick_label(method: str) -> str:
    """A method's name under its bar; a long one (Constrained Reparametrization (independent noise)) on lines of
    at most 20 characters, so that the rotated labels leave the panels their height."""
    import textwrap

    label = LABELS.get(method, method)
    return label if len(label) <= 24 else textwrap.fill(label, 20)


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
            lo, hi = 0.9 * float(np.nanmin(means)), 1.6 * float(np.nanmedian(means))  # diverged runs: off scale
            ax.set_ylim(lo, hi)
            for pos, v in enumerate(means):
                if v > hi:  # off scale: the value in a box inside the axes, clear of the frame
                    ax.text(pos, lo + 0.9 * (hi - lo), f"{v:.0f}\n(off\nscale)", ha="center", va="top", fontsize=7,
                            zorder=5, bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "0.6"})
            ax.set_xticks(range(len(methods)), [_tick_label(m) for m in methods], rotation=60, ha="right",
                          fontsize=7)
            ax.set_ylabel(f"{label} (nats per image,\nlower is better)", fontsize=8)
            ax.set_title(f"{c}: {label}, mean ± std over {len(cfg['trials'])} trials", fontsize=9)
    return _save(fig, out, "vae-latent.png")


def _finish_epoch_axes(ax: Any, c: str, ylabel: str) -> None:
    """Integer epochs on x, the labels, the constraint as title and the legend of one epoch panel."""
    from ..palette import integer_epochs

    integer_epochs(ax)
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.set_title(f"constraint {c}")
    ax.legend(fontsize=7)


def _save(fig: Any, out: Path, name: str) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(out) / name
    save_png(fig, path, dpi=120)
    plt.close(fig)
    return path


def plot_curves(doc: dict[str, Any], out: Path) -> Path:
    """Test NELBO per epoch (mean over trials), one panel per constraint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        lo, hi = float(np.nanmin(lasts)) - 5, 1.6 * float(np.nanmedian(lasts))
        ax.set_ylim(lo, hi)
        off = [LABELS.get(m, m) for m in cfg["methods_run"] if not doc["curves"][c][m]["test_nelbo"][-1] <= hi]
        if off:
            ax.text(0.99, 0.97, "off scale: " + ", ".join(off), transform=ax.transAxes, ha="right", va="top",
                    fontsize=7)
        _finish_epoch_axes(ax, c, "test NELBO (1 sample, nats)")
    return _save(fig, out, "vae-latent_curves.png")


# ------------------------------------------------------------------------------------------------ the claims


def plot_gap(doc: dict[str, Any], out: Path) -> Path | None:
    """The paired test-NELBO gap Marginal Expectation - pathwise per epoch: every trial (thin) and the mean
    with its 95% t-interval over trials (band), one panel per constraint; ``None`` (no file) when the run
    recorded no per-epoch gap."""
    cs = [c for c in doc["config"]["constraints_run"] if gap_rows(doc, c)]
    if not cs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(len(cs), 1), figsize=(5.5 * max(len(cs), 1), 3.8), squeeze=False)
    for ax, c in zip(axes[0], cs):
        g = doc["curves"][c]["marginal_expectation"]["paired_gap_to_pathwise"]
        x = np.arange(1, len(g["mean"]) + 1)
        for trial in g["per_trial"]:
            ax.plot(x, trial, color=_color("marginal_expectation"), lw=0.7, alpha=0.5)
        ax.plot(x, g["mean"], color="#000000", lw=2, label="mean over trials")
        if g["ci_low"] is not None:
            ax.fill_between(x, g["ci_low"], g["ci_high"], color="#000000", alpha=0.15, label="95% t-interval")
        ax.axhline(0, color="#888888", lw=0.8)
        _finish_epoch_axes(ax, c, "test NELBO gap, ME - pathwise (nats)")
    return _save(fig, out, "vae-latent_gap.png")
