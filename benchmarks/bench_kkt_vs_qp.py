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


def make_problem(n: int, a: int, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(a, n, generator=g, dtype=torch.float64)
    y = torch.randn(batch, n, generator=g, dtype=torch.float64)
    k = torch.randn(batch, a, generator=g, dtype=torch.float64)
    w = torch.randn(batch, n, generator=g, dtype=torch.float64)  # random linear loss for the backward pass
    return A, y, k, w


def run_kkt(A, y, k, w, kkt_repeats: int) -> dict:
    """Phase 1: KKTProjection results and timings (no reference solver has run in the process yet)."""
    layer = KKTProjection(A)
    constraint = LinearConstraint(A, k)
    out, gy, gk = forward_backward(layer, y, k, w)
    with torch.no_grad():
        t_fwd = median_time(lambda: layer(y, k), kkt_repeats)
        t_fn_fwd = median_time(lambda: kkt_projection(y, constraint), kkt_repeats)
    t_fb = median_time(lambda: forward_backward(layer, y, k, w), kkt_repeats)
    return {"out": out, "gy": gy, "gk": gk, "kkt_fwd": t_fwd, "fn_fwd": t_fn_fwd, "kkt_fb": t_fb}


def run_reference(A, y, k, w, kkt: dict, repeats: int, reference: str, solver_defaults: bool) -> dict:
    """Phase 2: the reference QP layer, its agreement with phase 1, and its timings."""
    label, version, qp_solve, differentiable = make_reference(A, reference, solver_defaults)
    if differentiable:
        out, gy, gk = forward_backward(qp_solve, y, k, w)
        grad_err = max((gy - kkt["gy"]).abs().max().item(), (gk - kkt["gk"]).abs().max().item())
    else:
        with torch.no_grad():
            out = qp_solve(y, k)
        grad_err = float("nan")
    with torch.no_grad():
        t_fwd = median_time(lambda: qp_solve(y, k), repeats)
    t_fb = median_time(lambda: forward_backward(qp_solve, y, k, w), repeats) if differentiable else float("nan")
    return {"label": label, "version": version, "sol_err": (out - kkt["out"]).abs().max().item(),
            "grad_err": grad_err, "qp_fwd": t_fwd, "qp_fb": t_fb}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--sizes", default="10:3,30:5,100:10", help="comma-separated n:a pairs")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats of the QP layer (median)")
    parser.add_argument("--kkt-repeats", type=int, default=200, help="timed repeats of KKTProjection (median)")
    parser.add_argument("--reference", default="auto", choices=["auto", "cvxpylayers", "qpth", "scipy"])
    parser.add_argument("--tol", type=float, default=1e-6, help="required agreement (max abs, float64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for the KKT side (default: torch's default)")
    parser.add_argument("--solver-defaults", action="store_true",
                        help="run cvxpylayers with its default (looser) tolerances: faster, but it then misses --tol")
    args = parser.parse_args(argv)
    sizes = [tuple(int(v) for v in s.split(":")) for s in args.sizes.split(",")]
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    problems = [make_problem(n, a, args.batch, args.seed + i) for i, (n, a) in enumerate(sizes)]
    # All KKTProjection timings come first: after a reference solve, the solver's bundled BLAS / OpenMP
    # worker threads keep spinning and, on a 2-core machine, slow torch's own thread pool down by orders of
    # magnitude (seen: 0.08 ms -> 80 ms per call). That is an interaction of two runtimes in one process,
    # not a property of either layer, so the phases are kept apart.
    kkts = [run_kkt(*p, args.kkt_repeats) for p in problems]
    rows = []
    for (n, a), p, kkt in zip(sizes, problems, kkts):
        row = run_reference(*p, kkt, args.repeats, args.reference, args.solver_defaults)
        row.update(n=n, a=a, batch=args.batch, kkt_fwd=kkt["kkt_fwd"], fn_fwd=kkt["fn_fwd"], kkt_fb=kkt["kkt_fb"])
        rows.append(row)
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
