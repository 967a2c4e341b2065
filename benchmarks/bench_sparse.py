#!/usr/bin/env python
r"""Conditioned sampling under a large sparse constraint against the unconstrained draw, CPU.

The problem: ``n = 1e6`` coordinates, ``a = 1000`` balance equations, each coordinate (an edge of a flow network)
entering 4 distinct random rows with random signed weights, so ``nnz = 4e6``; a shared diagonal covariance
(``loc``, ``scale`` of shape ``(n,)``). One timed round, repeated with the two sides interleaved:

* **conditioned**: ``hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.SparseConstraint(A, k)).sample((64,))``
  with the same ``A`` tensor and a new ``k`` each round (the per-step pattern; the constraint converts and
  validates ``A`` once, on the warm-up call);
* **unconstrained**: ``loc + scale * torch.randn(64, n)``.

The script prints both medians, their ratio (the goal is at most 2), the load average before and after, the
peak resident memory, the per-row exactness of the samples, and the cost of the constraint's own parts (one
``matvec`` and one ``rmatvec`` of 64 vectors, the in-place gain ``rmatvec_add_`` the sparse factor's step uses,
the residual check's ``matvec_and_scale``, the Gram matrix ``A diag(v) A^T``, remembered for equal variances),
which bound what any conditioner needs: a conditioned sample needs at least the draw, one ``matvec``, one
``rmatvec`` and the check. A third
side, **by parts**, conditions the draw with those methods alone (Matheron's rule for a diagonal covariance,
:math:`z - \Sigma A^\top S^{-1}(Az - k)` with :math:`S = A\Sigma A^\top` from ``gram`` and one float32 Cholesky),
interleaved with the other two: what a conditioner that never densifies can reach with these operators.

A conditioner that densifies the constraint needs ``a n`` = 1e9 entries (4 GB in float32) and more; run the
script under a memory limit (``ulimit -v``) on a shared machine: the failure is then reported, not an OOM kill.

Usage::

    PYTHONPATH=src python benchmarks/bench_sparse.py                  # n = 1e6, a = 1000, 5 rounds
    PYTHONPATH=src python benchmarks/bench_sparse.py --n 100000 --a 200 --repeats 3   # smaller smoke run
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
import warnings

import torch

import hardeq


def flow_balance_matrix(a: int, n: int, per_column: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Sparse COO ``(a, n)``: column ``j`` has ``per_column`` distinct random rows with weights +-U(0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, a, (n, 1), generator=g)
    gaps = torch.randint(1, max(2, a // per_column), (n, per_column - 1), generator=g)
    rows = (first + torch.cat([torch.zeros(n, 1, dtype=torch.long), gaps.cumsum(-1)], -1)) % a  # distinct per column
    cols = torch.arange(n).repeat_interleave(per_column)
    values = (torch.rand(n * per_column, generator=g, dtype=torch.float64) + 0.5)
    values = values * (torch.randint(0, 2, (n * per_column,), generator=g) * 2 - 1)
    return torch.sparse_coo_tensor(torch.stack([rows.flatten(), cols]), values.to(dtype), (a, n)).coalesce()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--a", type=int, default=1000)
    parser.add_argument("--per-column", type=int, default=4)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n, a, s = args.n, args.a, args.samples
    dtype = torch.float32
    load_before = os.getloadavg()
    A = flow_balance_matrix(a, n, args.per_column, 0, dtype)
    loc = torch.randn(n, dtype=dtype)
    scale = torch.rand(n, dtype=dtype) + 0.5
    k0 = torch.randn(a, dtype=dtype) * 10
    print(f"n = {n}, a = {a}, nnz = {A._nnz()}, {s} samples, float32, {torch.get_num_threads()} threads")

    def conditioned(k):
        c = hardeq.SparseConstraint(A, k)
        return hardeq.ConstrainedNormal(loc, scale, constraint=c).sample((s,)), c

    def unconstrained():
        return loc + scale * torch.randn(s, n, dtype=dtype)

    def by_parts(k):
        c = hardeq.SparseConstraint(A, k)
        cov = hardeq.DiagonalCovariance(scale)
        L = torch.linalg.cholesky(c.gram(cov))  # (a, a)
        z = unconstrained()
        u = torch.cholesky_solve(c.residual(z).mT, L).mT  # (s, a) = S^{-1} (A z - k)
        return z - cov.variance * c.rmatvec(u), c

    z, c = by_parts(k0)
    t_parts, t_ref = [], []
    for r in range(args.repeats):
        t_parts.append(timed(lambda r=r: by_parts(k0 + r)))
        t_ref.append(timed(unconstrained))
    mp, mr = statistics.median(t_parts), statistics.median(t_ref)
    print(f"by parts {mp:.3f} s, unconstrained {mr:.3f} s, ratio {mp / mr:.2f}; samples exact per row: "
          f"{bool(c.check(z, rtol=1e-5).all())}")
    try:
        first = timed(lambda: conditioned(k0))
        print(f"first call (converts and validates A, builds the caches): {first:.2f} s")
        t_con, t_unc = [], []
        for r in range(args.repeats):
            k = k0 + r
            t_con.append(timed(lambda k=k: conditioned(k)))
            t_unc.append(timed(unconstrained))
        z, c = conditioned(k0)
        exact = bool(c.check(z, rtol=1e-5).all())  # per row, float32 tolerance (the library's promise)
        mc, mu = statistics.median(t_con), statistics.median(t_unc)
        print(f"conditioned {mc:.3f} s, unconstrained {mu:.3f} s, ratio {mc / mu:.2f} (goal <= 2); "
              f"samples exact per row: {exact}")
    except (RuntimeError, MemoryError) as error:  # e.g. a conditioner that densifies A under a memory limit
        print(f"conditioned sampling failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    c = hardeq.SparseConstraint(A, k0)
    z = torch.randn(s, n, dtype=dtype)
    u = torch.randn(s, a, dtype=dtype)
    cov = hardeq.DiagonalCovariance(scale)
    c.gram(cov)  # builds the pair matrix once
    parts = {"matvec": lambda: c.matvec(z), "rmatvec": lambda: c.rmatvec(u),
             "rmatvec_add_": lambda: c.rmatvec_add_(z, u, scale), "check": lambda: c.matvec_and_scale(z),
             "gram": lambda: c.gram(cov), "draw": unconstrained}
    print("parts (median of 3): " + ", ".join(
        f"{name} {statistics.median(timed(fn) for _ in range(3)):.3f} s" for name, fn in parts.items()))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {peak:.2f} GB; load average before {load_before}, after {os.getloadavg()}")


if __name__ == "__main__":
    main()
