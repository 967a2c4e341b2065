"""The samplers' last step on a nonlinear manifold (``final=NonlinearConstraint``) against PCFM's final projection.

A PDE-like case: ``B`` one-dimensional fields of ``n = 128`` cells whose conserved quantities are those of the
inviscid Burgers equation on a periodic domain, mass and energy, ``h(u) = (sum u, sum u^2 / 2) = k`` (a sphere cut by
a plane; ``k`` differs per field). The fields are ``u = a + b sin(2 pi x + phi)`` (random ``a, b, phi`` per field),
their ``k`` computed exactly; the last step's prediction ``x0`` (what a flow or diffusion model returns before its
last step) is ``u + 0.05 * noise``. On the same ``x0`` this times and checks:

* hardeq, projected last step (``deterministic=True``): ``con.last_step(x0, scale, None)``, the Euclidean
  nearest point of the manifold (Newton-CG SQP with line search, ``hardeq.manifold.project``);
* hardeq, sampled last step (the default): ``con.last_step(x0, scale, noise)``, a ``"linearised"`` draw of
  ``N(x0, 0.05^2 I) | h = k`` (tangent-plane conditional at the projection, returned along the normal space);
* PCFM's final projection: the batched Gauss-Newton iteration ``u <- u - J^T (J J^T)^-1 (h(u) - k)`` from ``x0``
  (Utkarsh et al., *Physics-Constrained Flow Matching*, NeurIPS 2025), reimplemented from the paper's description
  in ``bench_manifold_mici.gauss_newton_pcfm`` (stopping when every row meets the per-row tolerance).

Reported: the worst per-row residual ratio ``|h_i - k_i| / s_i`` (``NonlinearConstraint.row_ratio``; feasible at
``<= 1e-5`` float32, ``1e-12`` float64), the mean distance from ``x0``, and the best of 3 wall times (one thread).

    python benchmarks/bench_manifold_final.py
"""

from __future__ import annotations

import math
import os
import time

import torch

from bench_manifold_mici import gauss_newton_pcfm
from hardeq import NonlinearConstraint

N = 128
SCALE = 0.05


def burgers_invariants(u: torch.Tensor) -> torch.Tensor:
    return torch.stack([u.sum(-1), 0.5 * (u * u).sum(-1)], -1)


def fields(B: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x0, noise, k): the noisy predictions, the sampled step's standard normals and the per-field invariants."""
    g = torch.Generator().manual_seed(B)
    x = torch.linspace(0, 1, N + 1, dtype=torch.float64)[:-1]
    a, b = torch.rand(B, 1, generator=g, dtype=torch.float64), 0.5 + torch.rand(B, 1, generator=g, dtype=torch.float64)
    phi = 2 * math.pi * torch.rand(B, 1, generator=g, dtype=torch.float64)
    u = a + b * torch.sin(2 * math.pi * x + phi)
    k = burgers_invariants(u)
    x0 = u + SCALE * torch.randn(B, N, generator=g, dtype=torch.float64)
    noise = torch.randn(B, N, generator=g, dtype=torch.float64)
    return x0.to(dtype), noise.to(dtype), k.to(dtype)


def best_of(fn, repeats: int = 3):  # type: ignore[no-untyped-def]
    best, out = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return out, best


def main() -> None:
    torch.set_num_threads(1)
    print(f"n = {N} cells, h(u) = (sum u, sum u^2 / 2), x0 = u + {SCALE} noise, 1 thread, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| dtype | B | last step | worst row ratio | mean distance from x0 | iterations | time (ms) |")
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float64, torch.float32):
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        for B in (64, 256):
            x0, noise, k = fields(B, dtype)
            con = NonlinearConstraint(burgers_invariants, k)
            scale = torch.full((N,), SCALE, dtype=dtype)
            before = float(con.row_ratio(x0).max())
            print(f"| {str(dtype)[6:]} | {B} | (the prediction x0 itself) | {before:.1e} | 0 | - | - |")
            def projected(con=con, x0=x0, scale=scale):
                return con.last_step(x0, scale, None), "-"

            def sampled(con=con, x0=x0, scale=scale, noise=noise):
                return con.last_step(x0, scale, noise), "-"

            def pcfm(con=con, x0=x0, tol=tol):
                return gauss_newton_pcfm(con.residual, x0, tol=tol)

            runs = (("hardeq projected (`deterministic=True`)", projected),
                    ("hardeq sampled (linearised draw)", sampled),
                    ("PCFM Gauss-Newton projection", pcfm))
            for name, fn in runs:
                (z, its), seconds = best_of(fn)
                ratio = float(con.row_ratio(z).max())
                moved = float((z - x0).norm(dim=-1).mean())
                print(f"| {str(dtype)[6:]} | {B} | {name} | {ratio:.1e} | {moved:.4f} | {its} | "
                      f"{1000 * seconds:.1f} |")


if __name__ == "__main__":
    main()
