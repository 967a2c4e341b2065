"""Make docs/figures/bounds_plane.png: a Gaussian on the plane z1 + z2 + z3 = k (n = 3, one sum constraint), the box
[0, 1]^3 cut from it, the truncated density, its mode, exact HMC draws and one HMC trajectory with its reflections.

Run from the repository root: ``python docs/figures/bounds_plane.py`` (needs matplotlib; a few seconds). The
density is evaluated here independently of the library (the conditional Gaussian on the plane in closed form);
the mode and the draws come from ``ConstrainedNormal(...).truncate(0, 1)`` and ``hardeq.bounds.exact_hmc``; the
trajectory is traced with the same analytic solution the sampler uses (docs/bounds.md), reflections included.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

import hardeq
from hardeq.bounds import exact_hmc

OUT = Path(__file__).resolve().parent / "bounds_plane.png"
MU = np.array([1.15, -0.1, 0.15])
VAR = np.array([0.16, 0.09, 0.25])
K = 1.2


def plane_basis() -> np.ndarray:
    """Orthonormal basis (2, 3) of the null space of 1^T."""
    q, _ = np.linalg.qr(np.array([[1.0, 1.0, 1.0], [1.0, -1.0, 0.0], [1.0, 1.0, -2.0]]).T)
    return q[:, 1:].T


def conditional(mu: np.ndarray, var: np.ndarray, k: float) -> tuple[np.ndarray, np.ndarray]:
    """Mean and covariance of N(mu, diag var) given sum z = k, in closed form."""
    s = var.sum()
    mean = mu + var * (k - mu.sum()) / s
    cov = np.diag(var) - np.outer(var, var) / s
    return mean, cov


def trajectory(x0: np.ndarray, v0: np.ndarray, cov: np.ndarray, lo: np.ndarray, hi: np.ndarray, T: float,
               steps: int = 400) -> np.ndarray:
    """Points of one exact HMC trajectory of deviation x (from the conditional mean) for time T, reflecting the
    velocity on the walls' normals projected onto the plane (v <- v - 2 v_i / w_ii w_i, w_i = cov e_i)."""
    pts, t_left, x, v = [x0.copy()], T, x0.copy(), v0.copy()
    for _ in range(100):
        R = np.hypot(x, v)
        phi = np.arctan2(v, x)
        best, wall = t_left, None
        for i in range(3):
            for c, sign in ((lo[i], -1), (hi[i], 1)):
                if R[i] <= abs(c):
                    continue
                alpha = math.acos(max(-1.0, min(1.0, c / R[i])))
                t = (phi[i] - sign * alpha) % (2 * math.pi)
                if 1e-9 < t < best:
                    best, wall = t, i
        ts = np.linspace(0, best, max(2, int(steps * best / T)))
        pts += [x * math.cos(t) + v * math.sin(t) for t in ts[1:]]
        x, v = x * math.cos(best) + v * math.sin(best), v * math.cos(best) - x * math.sin(best)
        t_left -= best
        if wall is None:
            break
        w = cov[:, wall]
        v = v - 2 * v[wall] / w[wall] * w
    return np.array(pts)


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    P = plane_basis()  # plane coordinates u = P (z - c0), c0 = (k/3) 1
    c0 = np.full(3, K / 3)
    mean, cov = conditional(MU, VAR, K)
    # the truncated density on a grid of the plane
    g = np.linspace(-1.0, 1.2, 400)
    U1, U2 = np.meshgrid(g, g)
    Z = c0 + U1[..., None] * P[0] + U2[..., None] * P[1]  # (400, 400, 3)
    C2 = P @ cov @ P.T  # the conditional covariance in plane coordinates (full rank, 2 x 2)
    d = (Z - mean) @ P.T
    quad = np.einsum("...i,ij,...j->...", d, np.linalg.inv(C2), d)
    dens = np.exp(-0.5 * quad)
    inside = ((Z >= 0) & (Z <= 1)).all(-1)
    dens = np.where(inside, dens, np.nan)
    # the hexagon: the box's edges on the plane
    hexagon = []
    for i in range(3):
        for b in (0.0, 1.0):
            for j in range(3):
                if j == i:
                    continue
                for c in (0.0, 1.0):
                    z = np.empty(3)
                    z[i], z[j] = b, c
                    z[3 - i - j] = K - b - c
                    if -1e-12 <= z[3 - i - j] <= 1 + 1e-12:
                        hexagon.append(P @ (z - c0))
    hexagon = np.array(hexagon)
    centre = hexagon.mean(0)
    hexagon = hexagon[np.argsort(np.arctan2(hexagon[:, 1] - centre[1], hexagon[:, 0] - centre[0]))]
    # the library: the truncated law, its mode and exact HMC draws of 4 chains
    dist = hardeq.ConstrainedNormal(torch.tensor(MU), torch.tensor(VAR).sqrt(),
                                    constraint=hardeq.SumConstraint(torch.zeros(3, dtype=torch.long),
                                                                    torch.tensor([K], dtype=torch.float64)))
    trunc = dist.truncate(0.0, 1.0)
    mode = trunc.mode.numpy()
    start = trunc.mode.expand(4, 3)
    res = exact_hmc(dist, torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64), start,
                    num_samples=150, burn_in=20, generator=torch.Generator().manual_seed(0))
    draws = res.samples.reshape(-1, 3).numpy()
    assert ((draws >= 0) & (draws <= 1)).all() and np.abs(draws.sum(1) - K).max() < 1e-12
    # one trajectory, traced here
    rng = np.random.default_rng(3)
    v0 = np.sqrt(VAR) * rng.standard_normal(3)
    v0 = v0 - VAR * v0.sum() / VAR.sum()  # (I - K A) Sigma^(1/2) eps: a centred draw of the conditional
    path = trajectory(draws[-1] - mean, v0, cov, -mean, 1 - mean, 2.5) + mean  # from an interior draw
    fig, ax = plt.subplots(figsize=(6.2, 5.4))
    im = ax.pcolormesh(U1, U2, dens, cmap="Blues", shading="auto")
    fig.colorbar(im, ax=ax, label="truncated density (unnormalised)")
    ax.fill(hexagon[:, 0], hexagon[:, 1], fill=False, color="k", lw=1.5, label="box [0, 1]^3 on the plane")
    pd = (draws - c0) @ P.T
    ax.scatter(pd[:, 0], pd[:, 1], s=4, color="#333333", alpha=0.6, label=f"exact HMC draws (4 chains, "
                                                                          f"{len(draws)})")
    pp = (path - c0) @ P.T
    ax.plot(pp[:, 0], pp[:, 1], color="#ff7f0e", lw=1.4, label="one HMC trajectory (reflections)")
    pm, pc = P @ (mode - c0), P @ (mean - c0)
    ax.plot(*pc, marker="x", color="#d62728", ms=10, mew=2.5, ls="", label="untruncated conditional mean")
    ax.plot(*pm, marker="*", color="k", ms=13, ls="", label="mode (truncate(0, 1).mode)")
    ax.set_xlabel("plane coordinate 1")
    ax.set_ylabel("plane coordinate 2")
    ax.set_title("N(mu, diag v) on z1 + z2 + z3 = 1.2, truncated to [0, 1]^3", fontsize=10)
    ax.set_aspect("equal")
    ax.set_xlim(-0.8, max(0.85, pc[0] + 0.1))
    ax.set_ylim(-0.9, 0.9)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
