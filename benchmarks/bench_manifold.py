"""Nonlinear constraints h(z) = k: the law error of ``method="linearised"``, the error of the Laplace normaliser,
and ``method="manifold_hmc"``'s acceptance, effective sample size and speed, on circles and a sphere whose exact
restricted law comes from numerical integration (scipy.integrate).

    python benchmarks/bench_manifold.py [--draws 20000] [--chains 16] [--hmc-draws 500]

Prints Markdown tables (docs/nonlinear.md and benchmarks/README.md quote them). CPU, one thread, float64.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np
import scipy.integrate as si
import scipy.stats
import torch

from hardeq import ConstrainedNormal, NonlinearConstraint

CASES = {  # name: (mu, sigma, radius)
    "circle A (wide)": ((0.6, 0.2), (0.5, 1.0), 1.0),
    "circle B (concentrated)": ((0.9, 0.3), (0.15, 0.2), 1.0),
    "circle C (mean far out)": ((3.0, 0.0), (0.5, 0.5), 1.0),
    "sphere D": ((0.8, -0.3, 0.5), (0.6, 1.0, 0.4), 1.2),
}


def _density(mu: np.ndarray, sigma: np.ndarray, r: float):
    n = len(mu)

    def point(*angles: float) -> np.ndarray:
        if n == 2:
            (t,) = angles
            return r * np.array([np.cos(t), np.sin(t)])
        u, v = angles
        return r * np.array([np.sin(u) * np.cos(v), np.sin(u) * np.sin(v), np.cos(u)])

    def dens(*angles: float) -> float:  # N(z) / |J| w.r.t. the surface measure, |J| = 2r constant; times the area
        z = point(*angles)          # element r dt (circle) or r^2 sin u du dv (sphere), up to constants
        w = np.exp(-0.5 * np.sum(((z - mu) / sigma) ** 2))
        return w if n == 2 else w * np.sin(angles[0])
    return point, dens


def exact_summary(mu: np.ndarray, sigma: np.ndarray, r: float) -> dict[str, object]:
    """Exact log Z (of N(z; mu, Sigma) / sqrt(det J J^T) over the manifold), mean, sd and the CDF of the last
    coordinate (circle: of the angle)."""
    n = len(mu)
    point, dens = _density(mu, sigma, r)
    gauss = (2 * np.pi) ** (-n / 2) / np.prod(sigma)
    if n == 2:
        def integ(f):
            return si.quad(lambda t: f(t) * dens(t), -np.pi, np.pi, epsabs=0, epsrel=1e-11, limit=400)[0]
        raw = integ(lambda t: 1.0)
        log_z = math.log(raw * r * gauss / (2 * r))
        grid = np.linspace(-np.pi, np.pi, 8001)
        vals = np.array([dens(t) for t in grid])
        cdf = np.concatenate([[0.0], np.cumsum((vals[1:] + vals[:-1]) / 2 * np.diff(grid))])
        cdf /= cdf[-1]
    else:
        def integ(f):
            return si.dblquad(lambda v, u: f(u, v) * dens(u, v), 0, np.pi, 0, 2 * np.pi, epsabs=0, epsrel=1e-9)[0]
        raw = integ(lambda u, v: 1.0)
        log_z = math.log(raw * r * r * gauss / (2 * r))
        grid = np.linspace(-r, r, 201)
        cdf = np.array([0.0] + [si.dblquad(lambda v, u: dens(u, v), np.arccos(min(1.0, t / r)), np.pi, 0, 2 * np.pi,
                                           epsrel=1e-8)[0] / raw for t in grid[1:-1]] + [1.0])
    mean = np.array([integ(lambda *a, i=i: point(*a)[i]) for i in range(n)]) / raw
    second = np.array([integ(lambda *a, i=i: point(*a)[i] ** 2) for i in range(n)]) / raw
    return {"log_z": log_z, "mean": mean, "sd": np.sqrt(second - mean ** 2), "grid": grid, "cdf": cdf}


def statistic(draws: np.ndarray) -> np.ndarray:
    """What the CDF describes: the angle (circle) or the last coordinate (sphere)."""
    return np.arctan2(draws[:, 1], draws[:, 0]) if draws.shape[1] == 2 else draws[:, 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--draws", type=int, default=20000)
    parser.add_argument("--chains", type=int, default=16)
    parser.add_argument("--hmc-draws", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, CPU, 1 thread, float64; load average {os.getloadavg()[0]:.1f}\n")
    print("| case | linearised: KS distance D | max mean error / sd | max sd ratio - 1 | draws returned by "
          "projection | Laplace log Z - exact | importance log Z - exact (stderr) |")
    print("|---|---|---|---|---|---|---|")
    hmc_rows = []
    for name, (mu, sigma, r) in CASES.items():
        mu_a, sigma_a = np.array(mu), np.array(sigma)
        ref = exact_summary(mu_a, sigma_a, r)
        con = NonlinearConstraint(lambda z: (z * z).sum(-1, keepdim=True), torch.tensor([r * r], dtype=torch.float64))
        d = ConstrainedNormal(torch.tensor(mu_a), torch.tensor(sigma_a), constraint=con)
        z = d.sample((args.draws,)).numpy()
        from hardeq.manifold.linearised import return_to_manifold, tangent_distribution
        plane, J = tangent_distribution(d.target, d.mode.detach())
        _, ok = return_to_manifold(d.target, plane.sample((args.draws,)), d.target.sigma_rows(J))
        cdf = lambda t, g=ref["grid"], c=ref["cdf"]: np.interp(t, g, c)  # noqa: E731
        D = scipy.stats.kstest(statistic(z), cdf).statistic
        mean_err = np.max(np.abs(z.mean(0) - ref["mean"]) / ref["sd"])
        sd_err = np.max(np.abs(z.std(0) / ref["sd"] - 1))
        lap = float(d.log_normaliser()[0]) - ref["log_z"]
        imp, se = d.log_normaliser("importance", num_samples=args.draws)
        print(f"| {name} | {D:.3f} | {mean_err:.3f} | {sd_err:.3f} | {float((~ok).double().mean()):.3f} | "
              f"{lap:+.3f} | {float(imp) - ref['log_z']:+.4f} ({float(se):.4f}) |")
        start = time.perf_counter()
        out = d.sample_with_info((args.chains * args.hmc_draws,), "manifold_hmc", chains=args.chains, burn_in=100,
                                 generator=torch.Generator().manual_seed(1))
        seconds = time.perf_counter() - start
        hz = out.samples.numpy()
        D_h = scipy.stats.kstest(statistic(hz), cdf).statistic
        mean_err_h = np.max(np.abs(hz.mean(0) - ref["mean"]) / ref["sd"])
        ess = float(out.ess.min())
        hmc_rows.append(f"| {name} | {float(out.acceptance):.2f} | {float(out.reversibility_rejections):.3f} | "
                        f"{float(out.step_size):.2f} | {ess:.0f} of {hz.shape[0]} | {float(out.rhat.max()):.3f} | "
                        f"{ess / seconds:.1f} | {D_h:.3f} | {mean_err_h:.3f} |")
    print(f"\nmanifold_hmc: {args.chains} chains x {args.hmc_draws} draws after 100 burn-in trajectories (step size "
          "adapted during burn-in), from the mode\n")
    print("| case | acceptance | reversibility / projection rejections | step size | min ESS | max split R-hat | "
          "ESS / s | KS distance D (correlated draws) | max mean error / sd |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(hmc_rows))


if __name__ == "__main__":
    main()
