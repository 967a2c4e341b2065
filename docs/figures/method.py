"""Make docs/figures/method.png, the landing page's picture: sample-then-repair against condition-then-sample.

Two outputs ``z = (z1, z2)`` with one constraint ``z1 + z2 = 1`` (a line). A network has predicted the Gaussian
``N(mu, diag(v))``; the first coordinate is the uncertain one. Left: sample, then repair by the orthogonal
projection onto the line (``hardeq.baselines.KKTProjection``, KKT-hPINN). Middle: condition the Gaussian on the
line (``hardeq.ConstrainedNormal``) and sample the conditional exactly. Right: where each puts ``z1`` on the
line. The repair splits every correction equally between the coordinates, whatever their variances; the
conditional moves the uncertain coordinate, so the two laws differ, and only the second is ``p(z | A z = k)``
(with a density, closed-form losses and KL).

Run from the repository root: ``python docs/figures/method.py [OUT.png]`` (needs matplotlib; 8-19 s measured on
the 2-core machine at load average 5-8; tests/test_docs_site.py runs it into a temporary folder).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch

import hardeq
from hardeq.baselines import KKTProjection

OUT = Path(__file__).resolve().parent / "method.png"
MU = torch.tensor([1.1, 0.9], dtype=torch.float64)
SCALE = torch.tensor([0.45, 0.12], dtype=torch.float64)
A = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
K = torch.tensor([1.0], dtype=torch.float64)
SAMPLES = 4000


def main(out: Path = OUT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = torch.Generator().manual_seed(0)
    y = MU + SCALE * torch.randn(SAMPLES, 2, generator=g, dtype=torch.float64)     # sample ...
    repaired = KKTProjection(A)(y, K)                                               # ... then repair
    dist = hardeq.ConstrainedNormal(MU, SCALE, constraint=hardeq.LinearConstraint(A, K))
    torch.manual_seed(0)
    z = dist.sample((SAMPLES,))                                                     # condition, then sample
    assert float((repaired @ A.T - K).abs().max()) < 1e-12 and float((z @ A.T - K).abs().max()) < 1e-12

    fig, axes = plt.subplots(1, 3, figsize=(13, 4.3), gridspec_kw={"width_ratios": [1, 1, 1.15]})
    grid = np.linspace(-0.6, 2.6, 300)
    X, Y = np.meshgrid(grid, grid)
    density = np.exp(-0.5 * (((X - float(MU[0])) / float(SCALE[0])) ** 2 + ((Y - float(MU[1])) / float(SCALE[1])) ** 2))
    for ax, title in ((axes[0], "sample, then repair\n(project each sample onto A z = k)"),
                      (axes[1], "condition, then sample (hardeq)\n(exact draws of N(mu, Sigma | A z = k))")):
        ax.contour(X, Y, density, levels=[math.exp(-4.5), math.exp(-2), math.exp(-0.5)], colors="0.6",
                   linewidths=0.8)
        ax.plot(grid, 1 - grid, color="k", lw=1.2)
        ax.plot(*MU.tolist(), "k+", ms=10, mew=1.5)
        ax.annotate("network's N(mu, Sigma)", (1.05, 1.45), fontsize=8, color="0.3")
        ax.annotate("the line A z = k:\nz1 + z2 = 1", (-0.5, -0.45), fontsize=8)
        ax.set(xlim=(-0.6, 2.6), ylim=(-0.6, 1.7), xlabel="z1 (uncertain: sd 0.45)", ylabel="z2 (sd 0.12)",
               title=title)
        ax.set_aspect("equal")
        ax.title.set_fontsize(10)
    shown = slice(0, 14)
    axes[0].plot(y[:300, 0], y[:300, 1], ".", color="0.7", ms=2)
    for a, b in zip(y[shown], repaired[shown]):
        axes[0].annotate("", b.tolist(), a.tolist(), arrowprops={"arrowstyle": "->", "color": "tab:orange",
                                                                 "lw": 0.8})
    axes[0].plot(repaired[:300, 0], repaired[:300, 1], ".", color="tab:orange", ms=3)
    axes[1].plot(z[:300, 0], z[:300, 1], ".", color="tab:blue", ms=3)
    for ax, target, colour in ((axes[0], KKTProjection(A)(MU, K), "tab:orange"), (axes[1], dist.mean, "navy")):
        ax.annotate("", target.tolist(), MU.tolist(), arrowprops={"arrowstyle": "->", "color": colour, "lw": 2})

    bins = np.linspace(-0.8, 2.2, 61)
    axes[2].hist(repaired[:, 0].numpy(), bins=bins, density=True, color="tab:orange", alpha=0.55,
                 label="repaired samples: a law of its own")
    axes[2].hist(z[:, 0].numpy(), bins=bins, density=True, color="tab:blue", alpha=0.55,
                 label="hardeq samples")
    mean, sd = float(dist.mean[0]), math.sqrt(float(dist.variance[0]))
    line = np.linspace(-0.8, 2.2, 400)
    axes[2].plot(line, np.exp(-0.5 * ((line - mean) / sd) ** 2) / (sd * math.sqrt(2 * math.pi)), color="navy",
                 lw=1.5, label="p(z1 | A z = k), closed form")
    axes[2].set(xlabel="z1 on the line", ylabel="density", title="where each puts z1")
    axes[2].title.set_fontsize(10)
    axes[2].legend(fontsize=8, loc="upper right", frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
