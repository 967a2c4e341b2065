"""The ``diffusion`` study's figures: the conditioning schedules and the training loss (drawn from the results
document) and the sample grids (written by the run, from the samples)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..extras import require
from ..figures import save_png
from ..palette import color
from .report_format import _METRIC_NAMES, _index, _rows, paper_table

__all__ = ["GRID_FILES", "plot_schedules", "plot_training", "save_grids"]

#: the sample-grid figures the run writes (table -> file), and the real-vs-constrained grid
GRID_FILES = {"3": "diffusion-samples-table3.png", "4": "diffusion-samples-table4.png",
              "6": "diffusion-samples-table9.png", "7": "diffusion-samples-table10.png",
              "grid": "diffusion-real-vs-constrained.png"}
def _pyplot():
    require("matplotlib", "diffusion", purpose="the diffusion study's figures").use("Agg")
    return require("matplotlib.pyplot", "diffusion", purpose="the diffusion study's figures")


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
