"""The ``vae-data`` study's figures, from its results document alone: the data before and after water-filling
(like the paper's Fig. 5), each variant's reconstructions, and the training curves, one panel per model and
objective."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..figures import save_png
from ..palette import color
from .report import MODEL_LABELS, ORDER, _density_on

__all__ = ["plot_images", "plot_curves"]


def plot_images(doc: dict[str, Any], out: Path) -> list[Path]:
    """``vae-data_data.png``: original test images above their water-filled versions (like the paper's Fig. 5);
    ``vae-data_reconstructions.png``: the data and each variant's reconstruction, per model (first trial)."""
    import torch

    from ..images import load_mnist

    out = Path(out)
    filled = torch.tensor(doc["images"]["originals"]).reshape(-1, 28, 28)
    raw, _ = load_mnist("test")
    raw = raw[: filled.shape[0]].to(torch.float32) / 255.0
    p1 = _labelled_grid([raw, filled], ["MNIST test image", "water-filled to sum 100"], out / "vae-data_data.png",
                        "MNIST test images and their water-filled\nversions (pixel sum 100)")
    rows, labels = [filled], ["data (water-filled)"]
    for model, by_v in doc["images"]["reconstructions"].items():
        for v in ORDER:
            if v in by_v:
                rows.append(torch.tensor(by_v[v]).reshape(-1, 28, 28))
                labels.append(f"{MODEL_LABELS.get(model, model)}: {v}")
    p2 = _labelled_grid(rows, labels, out / "vae-data_reconstructions.png",
                        "Reconstructions (observation mean), first trial;\nrows: the data, then one variant each")
    (out / "vae-data_reconstructions.txt").write_text("rows, top to bottom:\n" + "\n".join(labels) + "\n")
    return [p1, p2]


def _labelled_grid(rows: list[Any], labels: list[str], path: Path, title: str) -> Path:
    """A grid of grey images in [0, 1], one row per entry of ``rows`` (each ``(n, 28, 28)``), each row labelled
    on the left; pixel intensity 0 (black) .. 1 (white)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pad, h = 2, rows[0].shape[-2]
    n = max(r.shape[0] for r in rows)
    grid = np.ones((len(rows) * (h + pad) + pad, n * (h + pad) + pad))
    for i, r in enumerate(rows):
        for j, img in enumerate(np.clip(np.asarray(r, dtype=np.float64), 0.0, 1.0)):
            grid[pad + i * (h + pad): pad + i * (h + pad) + h, pad + j * (h + pad): pad + j * (h + pad) + h] = img
    label_in = 0.075 * max(len(lb) for lb in labels) + 0.3  # inches for the row labels at 8 pt
    per_px = 0.42 / (h + pad)  # inches per grid pixel: one 28-pixel image and its gap in 0.42 in
    img_w, img_h = grid.shape[1] * per_px, grid.shape[0] * per_px
    width, height = label_in + img_w + 0.15, img_h + 0.75
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((label_in / width, 0.1 / height, img_w / width, img_h / height))
    ax.imshow(grid, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
    ax.set_yticks([pad + i * (h + pad) + h / 2 for i in range(len(rows))], labels, fontsize=8)
    ax.set_xticks([])
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    fig.text(0.5, 1 - 0.1 / height, title, ha="center", va="top", fontsize=9, wrap=True)
    save_png(fig, path, dpi=100)
    plt.close(fig)
    return path


def plot_curves(doc: dict[str, Any], out: Path) -> Path:
    """Training loss per epoch (mean over trials): one panel per model and training objective, since the
    likelihood (-log p(x | z) + KL, :data:`~.run.LIKELIHOOD`) on R^784, the same on the plane (a density of
    another dimension, other units) and the sampled squared error (1/2 ||x~ - x||^2 + KL, :data:`~.run.SAMPLED`)
    are different quantities and never share an axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..palette import integer_epochs
    from .run import SAMPLED

    objectives = (("likelihood on R^784", "-log p(x | z) + KL per image",
                   lambda v: v not in SAMPLED and _density_on(v) == "R^784"),
                  ("likelihood on the plane", "-log p(x | z) + KL per image (plane)",
                   lambda v: v not in SAMPLED and _density_on(v) == "plane"),
                  ("sampled squared error", "1/2 ||x~ - x||^2 + KL per image", lambda v: v in SAMPLED))
    panels = [(model, name, label, [v for v in doc["curves"].get(model, {}) if keep(v)])
              for model in doc["config"]["models_run"] for name, label, keep in objectives]
    panels = [p for p in panels if p[3]]
    models = list(dict.fromkeys(p[0] for p in panels))  # one row per model, one column per objective it trained
    cols = max(sum(p[0] == m for p in panels) for m in models)
    fig, axes = plt.subplots(len(models), cols, figsize=(5 * cols, 3.4 * len(models)), squeeze=False)
    slots = []
    for r, m in enumerate(models):
        mine = [p for p in panels if p[0] == m]
        slots += [(axes[r][c], p) for c, p in enumerate(mine)]
        for c in range(len(mine), cols):
            axes[r][c].axis("off")
    for ax, (model, name, label, variants) in slots:
        for v in variants:
            y = doc["curves"][model][v]
            ax.plot(range(1, len(y) + 1), y, label=v, color=color(v), marker="o", ms=3)
        integer_epochs(ax)
        ax.set_xlabel("epoch")
        ax.set_ylabel(f"training loss: {label}", fontsize=8)
        ax.set_title(f"{MODEL_LABELS.get(model, model)}, {name}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(out) / "vae-data_curves.png"
    save_png(fig, path, dpi=120)
    plt.close(fig)
    return path
