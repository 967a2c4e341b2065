"""KKTProjection against a differentiable QP layer solving the same projection problem.

    min_x ||x - y||^2   s.t.   A x = k        (batch of problems, shared A, per-sample y and k)

The reference is cvxpylayers (``pip install hardeq[bench]``); if it is missing, qpth; if both are
missing, a per-sample dense KKT solve with scipy (forward only, labelled as such). For every size the
script checks that the solutions (and, where the reference is differentiable, the gradients of a random
linear loss w.r.t. y and k) agree to ``--tol`` in float64, and reports times and speed ratios measured in
this one run. Prints a Markdown table.

    python benchmarks/bench_kkt_vs_qp.py [--batch 256] [--sizes 10:3,30:5,100:10] [--repeats 5]
                                         [--solver-defaults]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from hardeq.baselines import KKTProjection, kkt_projection
from hardeq.constraints import LinearConstraint


# ---------------------------------------------------------------------------------------------------------
# reference QP layers: each factory returns (label, version, solve(y, k) -> x, differentiable)
# ---------------------------------------------------------------------------------------------------------


def cvxpylayers_reference(A: torch.Tensor, solver_defaults: bool = False):
    import cvxpy as cp
    import cvxpylayers
    from cvxpylayers.torch import CvxpyLayer

    a, n = A.shape
    x, y_p, k_p = cp.Variable(n), cp.Parameter(n), cp.Parameter(a)
    problem = cp.Problem(cp.Minimize(cp.sum_squares(x - y_p)), [A.numpy() @ x == k_p])
    layer = CvxpyLayer(problem, parameters=[y_p, k_p], variables=[x])
    # diffcp/SCS defaults stop at ~1e-7 and differentiate with LSQR (~1e-6 error); tighten both so that the
    # 1e-6 agreement check tests the layers, not the solver tolerances
    # ("mode" is diffcp's derivative option; the forward-only path passes every argument to SCS)
    solve_args, derivative_args = {"eps": 1e-12}, {"eps": 1e-12, "mode": "dense"}
    settings = "eps=1e-12, dense derivative"
    if solver_defaults:
        solve_args, derivative_args, settings = {}, {}, "default tolerances, LSQR derivative"

    def solve(y, k):
        needs_grad = torch.is_grad_enabled() and (y.requires_grad or k.requires_grad)
        (out,) = layer(y, k, solver_args=derivative_args if needs_grad else solve_args)
        return out

    version = (f"cvxpylayers {cvxpylayers.__version__} (diffcp + SCS, {settings}), "
               f"cvxpy {cp.__version__}")
    return "cvxpylayers", version, solve, True


def qpth_reference(A: torch.Tensor, solver_defaults: bool = False):
    import qpth
    from qpth.qp import QPFunction

    a, n = A.shape
    Q = 2 * torch.eye(n, dtype=A.dtype)
    # qpth needs an inequality block; use one that is never active: 0 x <= 1
    G, h = torch.zeros(1, n, dtype=A.dtype), torch.ones(1, dtype=A.dtype)

    def solve(y, k):
        return QPFunction(verbose=-1, eps=1e-12, maxIter=50)(Q, -2 * y, G, h, A, k)

    return "qpth", f"qpth {getattr(qpth, '__version__', '?')}", solve, True


def scipy_reference(A: torch.Tensor, solver_defaults: bool = False):
    import numpy as np
    import scipy
    import scipy.linalg

    a, n = A.shape
    An = A.numpy()
    kkt = np.block([[2 * np.eye(n), An.T], [An, np.zeros((a, a))]])

    def solve(y, k):
        out = [scipy.linalg.solve(kkt, np.concatenate([2 * yi, ki]))[:n] for yi, ki in zip(y.numpy(), k.numpy())]
        return torch.from_numpy(np.stack(out))

    label = "scipy per-sample KKT solve (NOT a differentiable QP layer: neither installed)"
    return "scipy", f"{label}, scipy {scipy.__version__}", solve, False


def make_reference(A: torch.Tensor, choice: str, solver_defaults: bool):
    factories = {"cvxpylayers": cvxpylayers_reference, "qpth": qpth_reference, "scipy": scipy_reference}
    order = [choice] if choice != "auto" else ["cvxpylayers", "qpth", "scipy"]
    for name in order:
        try:
            return factories[name](A, solver_defaults)
        except ImportError:
            continue
    raise SystemExit(f"no reference available among {order}; pip install 'hardeq[bench]'")


# ---------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def forward_backward(solve, y, k, w):
    y = y.detach().requires_grad_()
    k = k.detach().requires_grad_()
    out = solve(y, k)
    (out * w).sum().backward()
    return out.detach(), y.grad, k.grad


def run_size(n: int, a: int, batch: int, repeats: int, kkt_repeats: int, reference: str, seed: int,
             solver_defaults: bool):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(a, n, generator=g, dtype=torch.float64)
    y = torch.randn(batch, n, generator=g, dtype=torch.float64)
    k = torch.randn(batch, a, generator=g, dtype=torch.float64)
    w = torch.randn(batch, n, generator=g, dtype=torch.float64)  # random linear loss for the backward pass

    label, version, qp_solve, differentiable = make_reference(A, reference, solver_defaults)
    layer = KKTProjection(A)
    constraint = LinearConstraint(A, k)

    # agreement (float64)
    out_kkt, gy_kkt, gk_kkt = forward_backward(layer, y, k, w)
    if differentiable:
        out_qp, gy_qp, gk_qp = forward_backward(qp_solve, y, k, w)
        grad_err = max((gy_qp - gy_kkt).abs().max().item(), (gk_qp - gk_kkt).abs().max().item())
    else:
        with torch.no_grad():
            out_qp = qp_solve(y, k)
        grad_err = float("nan")
    sol_err = (out_qp - out_kkt).abs().max().item()

    # timings, all in this run
    with torch.no_grad():
        t_qp_fwd = median_time(lambda: qp_solve(y, k), repeats)
        t_kkt_fwd = median_time(lambda: layer(y, k), kkt_repeats)
        t_fn_fwd = median_time(lambda: kkt_projection(y, constraint), kkt_repeats)
    t_qp_fb = median_time(lambda: forward_backward(qp_solve, y, k, w), repeats) if differentiable else float("nan")
    t_kkt_fb = median_time(lambda: forward_backward(layer, y, k, w), kkt_repeats)
    return {
        "n": n, "a": a, "batch": batch, "label": label, "version": version,
        "sol_err": sol_err, "grad_err": grad_err,
        "qp_fwd": t_qp_fwd, "kkt_fwd": t_kkt_fwd, "fn_fwd": t_fn_fwd, "qp_fb": t_qp_fb, "kkt_fb": t_kkt_fb,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--sizes", default="10:3,30:5,100:10", help="comma-separated n:a pairs")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of the QP layer (median)")
    parser.add_argument("--kkt-repeats", type=int, default=200, help="timed repeats of KKTProjection (median)")
    parser.add_argument("--reference", default="auto", choices=["auto", "cvxpylayers", "qpth", "scipy"])
    parser.add_argument("--tol", type=float, default=1e-6, help="required agreement (max abs, float64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--solver-defaults", action="store_true",
                        help="run cvxpylayers with its default (looser) tolerances: faster, but it then misses --tol")
    args = parser.parse_args(argv)
    sizes = [tuple(int(v) for v in s.split(":")) for s in args.sizes.split(",")]

    rows = [run_size(n, a, args.batch, args.repeats, args.kkt_repeats, args.reference, args.seed + i,
                     args.solver_defaults)
            for i, (n, a) in enumerate(sizes)]
    ref = rows[0]["label"]

    print(f"reference: {rows[0]['version']}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs, "
          f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, float64, CPU")
    print(f"times: median of {args.repeats} ({ref}) / {args.kkt_repeats} (KKT) runs after one warm-up; "
          "f+b = forward + backward of a random linear loss; speed-up = reference time / KKTProjection time")
    print()
    print(f"| n | a | batch | max abs diff x | max abs diff grad | {ref} fwd (ms) | KKTProjection fwd (ms) | "
          f"speed-up fwd | kkt_projection fwd (ms) | {ref} f+b (ms) | KKTProjection f+b (ms) | speed-up f+b |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    for r in rows:
        ok &= r["sol_err"] <= args.tol and not (r["grad_err"] > args.tol)
        print(f"| {r['n']} | {r['a']} | {r['batch']} | {r['sol_err']:.1e} | {r['grad_err']:.1e} | "
              f"{1e3 * r['qp_fwd']:.1f} | {1e3 * r['kkt_fwd']:.3f} | {r['qp_fwd'] / r['kkt_fwd']:,.0f}x | "
              f"{1e3 * r['fn_fwd']:.3f} | {1e3 * r['qp_fb']:.1f} | {1e3 * r['kkt_fb']:.3f} | "
              f"{r['qp_fb'] / r['kkt_fb']:,.0f}x |")
    print()
    print(f"agreement within {args.tol:g}: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
