#!/usr/bin/env python
r"""The performance targets of :class:`hardeq.ConstrainedNormal`, measured in one run (float32, CPU).

Every ratio is a ratio of two medians measured in the same process, with the repeat rounds of the variants
interleaved (``time.perf_counter``, one warm-up call first). Sections:

A. **Shared parameters, n = 1e6, 64 warm samples** (batch_shape ``()``): ``d.sample((64,))`` on a distribution
   whose factorisation is cached, and ``d.conditioner.sample(loc, (64,))`` (the fused in-place sampler), against
   the unconstrained ``loc + scale * torch.randn(64, n)``. Target: SumConstraint and dense ``a <= 8`` at
   <= 1.2x.
B. **Per-sample parameters, shared A** (batch_shape ``(64,)``, ``loc``/``scale``/``k`` per sample, one
   ``A`` of shape ``(a, n)``): construct + factor + sample, i.e. ``LinearConstraint(A, k,
   validate_args=False)``, ``ConstrainedNormal(...)``, ``.sample()``, against ``loc + scale * randn(64, n)``.
   Target: n = 1e5, a = 8 at <= 1.5x. The median minor page faults per call of each variant are reported too
   (the first touches of memory the allocator had returned: they depend on what ran before, not only on the
   code). Plus 64 x 1e6 x 64 (n = 1e6, a = 64) once, in a fresh subprocess, with its
   peak-RSS increase (``VmHWM`` after minus before, /proc/self/status).
C. **Heavy case**: n = 2048, a = 1024, per-sample scale, shared A, batch 16 and 256. The reference is the plain
   float32 code a user would write: ``Bm = A * scale[:, None, :]`` (batch x a x n), ``S = Bm @ Bm.mT`` (one
   batched GEMM), ``torch.linalg.cholesky``, ``torch.cholesky_solve`` for ``k - A loc``, and the Matheron update;
   hardeq is ``ConstrainedNormal(...).sample()`` (construct + factor + sample). The machine's batched-GEMM FLOP
   rate is that of ``Bm @ Bm.mT`` alone (``2 batch a^2 n`` flops); an achieved fraction counts the work of the
   Gram product and its Cholesky factor, ``batch (2 a^2 n + a^3/3)`` flops: ``flops / t / rate``. Targets: hardeq
   >= 80% of the rate, and hardeq <= 0.6x the plain code's time (the Gram matrix is symmetric, so a symmetric
   product can beat the GEMM-normalised rate). Anchor (the source paper's authors, A800 GPU): 0.205 s
   (batch 16), 1.24 s (batch 256).

D. **Ragged graph batch**: 128 graphs of 1-155 nodes (n about 1e4, PyG's ``batch`` vector), per-node ``loc`` and
   ``scale`` from a "network" (leaf tensors with gradients), ``ConstrainedNormal(loc, scale,
   constraint=SumConstraint(batch, totals)).rsample()`` + a squared loss + ``backward()``, against the unconstrained
   ``loc + scale * randn`` + the same loss + ``backward()``. Target <= 3x. Measured twice: with the same ``batch``
   tensor every step (the target's row; the constraint's per-index layout is then reused) and with a new copy of it
   every step, as a PyG ``DataLoader`` gives (the index is checked and laid out every step).

The per-row residual ``max_i |(A z - k)_i| / (|A||z|)_i`` (float64, ``hardeq.testing.row_residual_ratio``) of the
worst sample and row is reported for every hardeq row.

Usage::

    .venv/bin/python benchmarks/bench_targets.py                 # torch's default threads
    .venv/bin/python benchmarks/bench_targets.py --threads 1
    .venv/bin/python benchmarks/bench_targets.py --heavy-batches 16 --skip-big   # shorter
    .venv/bin/python benchmarks/bench_targets.py --sections B,C --skip-big --threads 1   # only B and C
"""

# ruff: noqa: B023  (the closures are timed within their own loop iteration)
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import hardeq
from hardeq.testing import row_residual_ratio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sampling import _machine_facts, _proc_status_kb  # noqa: E402

DTYPE = torch.float32
ANCHOR = {16: 0.205, 256: 1.24}


def rel_residual(A, k: torch.Tensor, z: torch.Tensor) -> float:
    """Worst per-row ratio ``|(Az - k)_i| / (|A||z|)_i`` over samples and rows (float64, in chunks of samples)."""
    con = A if isinstance(A, hardeq.EqualityConstraint) else hardeq.LinearConstraint(A, k, validate_args=False)
    flat = z.reshape((-1,) + con.batch_shape + z.shape[-1:]) if con.batch_shape else z.reshape(-1, z.shape[-1])
    return max(float(row_residual_ratio(con, flat[i:i + 8]).max()) for i in range(0, flat.shape[0], 8))


MIN_REPEATS = 5
HEAVY_REPEATS = 7


def _minor_faults() -> int:
    """Minor page faults of the calling thread so far (first touches of fresh memory), 0 where not available."""
    try:
        import resource

        return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt
    except (ImportError, OSError):
        return 0


def timed(fns: dict, min_repeats: int, budget_s: float = 2.0, max_repeats: int = 15, faults: bool = False) -> dict:
    """Median seconds per function; one warm-up call each, interleaved repeat rounds. With ``faults``, also the
    median minor page faults per call (``faults_<name>``): a call that follows one which freed (and so let the
    allocator return) large buffers pays a first touch for every page of its own, about 1 ms per 1,000 faults."""
    first = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t0
    min_repeats = min(min_repeats, MIN_REPEATS)
    reps = max(min_repeats, min(max_repeats, int(budget_s / max(max(first.values()), 1e-6))))
    if min_repeats == 1 and min(first.values()) > 2 * budget_s:  # slow calls: one timed call after the warm-up
        reps = 1
    times: dict = {name: [] for name in fns}
    touched: dict = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            f0 = _minor_faults() if faults else 0
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            touched[name].append(_minor_faults() - f0 if faults else 0)
    out = {name: statistics.median(v) for name, v in times.items()} | {"repeats": reps}
    return out | ({f"faults_{name}": statistics.median(v) for name, v in touched.items()} if faults else {})


def constraint(kind: str, n: int, a: int, k: torch.Tensor, g: torch.Generator):
    if kind == "sum":
        return hardeq.SumConstraint(torch.arange(n) * a // n, k, validate_args=False)
    return hardeq.LinearConstraint(torch.randn(a, n, generator=g, dtype=DTYPE), k, validate_args=False)


# ----------------------------------------------------------------------------------------------- A
def section_a(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    loc = torch.randn(n, generator=g, dtype=DTYPE)
    scale = torch.rand(n, generator=g, dtype=DTYPE) + 0.5
    rows = []
    for kind, a in (("sum", 1), ("sum", 8), ("sum", 64), ("dense", 1), ("dense", 8)):
        k = torch.randn(a, generator=g, dtype=DTYPE)
        c = constraint(kind, n, a, k, g)
        d = hardeq.ConstrainedNormal(loc, scale, constraint=c, validate_args=False)
        d.sample((64,))
        cond = d.conditioner
        t = timed({"base": lambda: loc + scale * torch.randn(64, n, dtype=DTYPE),
                   "warm": lambda: d.sample((64,)),
                   "fused": lambda: cond.sample(loc, (64,))}, min_repeats=5)
        resid = max(rel_residual(c, k, d.sample((64,))), rel_residual(c, k, cond.sample(loc, (64,))))
        rows.append({"kind": kind, "n": n, "a": a, "method": cond.method, **t,
                     "r_warm": t["warm"] / t["base"], "r_fused": t["fused"] / t["base"], "resid": resid})
        print("  A", json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


# ----------------------------------------------------------------------------------------------- B
def _eager_floor(loc: torch.Tensor, scale: torch.Tensor, A: torch.Tensor, k: torch.Tensor):
    r"""A lower bound for any eager (one ATen kernel per operation) implementation of B: the fewest kernels the
    Matheron step with a per-row check needs, with every buffer allocated once outside the timed call (no page
    faults), no normalisation of the variances, no chunking, no guards and no validation. Per call:
    ``randn`` into ``z``; :math:`z = \mu + \sigma\varepsilon` (one ``addcmul``); :math:`v = \sigma^2` (one
    ``mul``); the Gram of row pairs :math:`v P^\top` (one GEMM, ``P``: the ``a(a+1)/2`` products of rows of ``A``,
    made once); ``k - A z`` (one GEMM); the ``a x a`` Cholesky solve; :math:`y = A^\top x` (one GEMM);
    :math:`z \mathrel{+}= v y` (one ``addcmul_``); the check's ``A z`` (one GEMM) and its screen
    :math:`|A||z|` over ``n / 8`` columns (one ``abs`` and one GEMM). Returns the call (a closure)."""
    B, n = loc.shape
    a = A.shape[0]
    iu = torch.triu_indices(a, a)
    P_t = (A[iu[0]] * A[iu[1]]).t().contiguous()
    A_t = A.t().contiguous()
    screen = n // 8
    abs_A_t = A_t[:screen].abs()
    z, v, y = (torch.empty(B, n, dtype=loc.dtype) for _ in range(3))
    S = torch.empty(B, a, a, dtype=loc.dtype)

    def call() -> torch.Tensor:
        z.normal_()
        torch.addcmul(loc, z, scale, out=z)
        torch.mul(scale, scale, out=v)
        flat = v @ P_t
        S[:, iu[0], iu[1]] = flat
        S[:, iu[1], iu[0]] = flat
        x = torch.cholesky_solve((k - z @ A_t).unsqueeze(-1), torch.linalg.cholesky(S)).squeeze(-1)
        torch.mm(x, A, out=y)
        z.addcmul_(v, y)
        ok = ((k - z @ A_t).abs() <= 1e-4 * (z[:, :screen].abs() @ abs_A_t + k.abs())).all()
        bool(ok)  # the verdict read back to the host, as hardeq reads its own check's
        return z
    return call


def section_b(n: int, a_values: list[int]) -> list[dict]:
    rows = []
    B = 64
    for a in a_values:
        g = torch.Generator().manual_seed(1)
        A = torch.randn(a, n, generator=g, dtype=DTYPE)
        loc = torch.randn(B, n, generator=g, dtype=DTYPE)
        scale = torch.rand(B, n, generator=g, dtype=DTYPE) + 0.5
        k = torch.randn(B, a, generator=g, dtype=DTYPE)

        def build():
            return hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k, validate_args=False),
                                            validate_args=False)

        t = timed({"base": lambda: loc + scale * torch.randn(B, n, dtype=DTYPE),
                   "full": lambda: build().sample(),
                   "full_fused": lambda: (lambda d: d.conditioner.sample(d.loc))(build()),
                   "floor": _eager_floor(loc, scale, A, k)}, min_repeats=5, faults=True)
        d = build()
        resid = rel_residual(A, k, d.sample())
        rows.append({"n": n, "a": a, "batch": B, "method": d.conditioner.method, **t,
                     "r_full": t["full"] / t["base"], "r_full_fused": t["full_fused"] / t["base"],
                     "r_floor": t["floor"] / t["base"], "resid": resid})
        print("  B", json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _big_child() -> None:
    B, n, a = 64, 1_000_000, 64
    g = torch.Generator().manual_seed(2)
    A = torch.randn(a, n, generator=g, dtype=DTYPE)
    loc = torch.randn(B, n, generator=g, dtype=DTYPE)
    scale = torch.rand(B, n, generator=g, dtype=DTYPE) + 0.5
    k = torch.randn(B, a, generator=g, dtype=DTYPE)
    inputs_mb = sum(x.numel() * x.element_size() for x in (A, loc, scale, k)) / 2**20
    hwm0 = _proc_status_kb("VmHWM")
    t0 = time.perf_counter()
    d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k, validate_args=False),
                                 validate_args=False)
    z = d.sample()
    t_total = time.perf_counter() - t0
    hwm1 = _proc_status_kb("VmHWM")
    t0 = time.perf_counter()
    base = loc + scale * torch.randn(B, n, dtype=DTYPE)
    t_base = time.perf_counter() - t0
    del base
    out = {"batch": B, "n": n, "a": a, "method": d.conditioner.method, "t_total": t_total, "t_base": t_base,
           "inputs_mb": inputs_mb, "hwm_before_mb": hwm0 / 1024, "hwm_increase_mb": (hwm1 - hwm0) / 1024,
           "output_mb": z.numel() * 4 / 2**20, "resid": rel_residual(A, k, z)}
    print("BIG " + json.dumps(out), flush=True)


def section_b_big(threads: int) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--big-child", "--threads", str(threads)],
                          capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("BIG "):
            return json.loads(line[4:])
    return {"failed": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}


# ----------------------------------------------------------------------------------------------- C
def section_c(batches: list[int], n: int = 2048, a: int = 1024) -> list[dict]:
    rows = []
    for B in batches:
        g = torch.Generator().manual_seed(3)
        A = torch.randn(a, n, generator=g, dtype=DTYPE) / n ** 0.5
        loc = torch.randn(B, n, generator=g, dtype=DTYPE)
        scale = torch.rand(B, n, generator=g, dtype=DTYPE) + 0.5
        k = torch.randn(B, a, generator=g, dtype=DTYPE)
        Bm = A * scale.unsqueeze(-2)  # (B, a, n), for the GEMM-rate measurement

        def gemm():
            return Bm @ Bm.mT

        def plain():  # what a user would type: Gram by one batched GEMM + Cholesky + solve + Matheron
            Bm_ = A * scale.unsqueeze(-2)
            L = torch.linalg.cholesky(Bm_ @ Bm_.mT)
            z_hat = loc + scale * torch.randn(B, n, dtype=DTYPE)
            x = torch.cholesky_solve((k - z_hat @ A.mT).unsqueeze(-1), L).squeeze(-1)
            return z_hat + scale.square() * (x @ A)

        def build():
            return hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k, validate_args=False),
                                            validate_args=False)

        fns = {"gemm": gemm, "plain": plain, "hardeq": lambda: build().sample()}
        if B <= 16:
            fns["hardeq_fused"] = lambda: (lambda d: d.conditioner.sample(d.loc))(build())
        t = timed(fns, min_repeats=3 if B <= 16 else 1, budget_s=4.0, max_repeats=HEAVY_REPEATS)
        fused_measured = "hardeq_fused" in t
        t.setdefault("hardeq_fused", t["hardeq"])
        rate = 2 * B * a * a * n / t["gemm"]  # the batched GEMM's rate
        flops = B * (2 * a * a * n + a ** 3 / 3)  # the Gram product and its Cholesky factor
        d = build()
        resid = rel_residual(A, k, d.sample())
        resid_plain = rel_residual(A, k, plain())
        rows.append({"n": n, "a": a, "batch": B, "method": d.conditioner.method, **t, "gflops": rate / 1e9,
                     "frac_hardeq": flops / t["hardeq"] / rate, "frac_hardeq_fused": flops / t["hardeq_fused"] / rate,
                     "frac_plain": flops / t["plain"] / rate, "hardeq_over_plain": t["hardeq"] / t["plain"],
                     "resid": resid, "resid_plain": resid_plain,
                     "anchor_a800_s": ANCHOR.get(B), "fused_measured": fused_measured})
        print("  C", json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


# ----------------------------------------------------------------------------------------------- D
def section_d(graphs: int = 128, max_nodes: int = 155) -> dict:
    g = torch.Generator().manual_seed(4)
    sizes = torch.randint(1, max_nodes + 1, (graphs,), generator=g)
    batch = torch.repeat_interleave(torch.arange(graphs), sizes)
    n = batch.numel()
    loc = torch.randn(n, generator=g, dtype=DTYPE).requires_grad_()
    scale = (torch.rand(n, generator=g, dtype=DTYPE) + 0.5).requires_grad_()
    totals = torch.randn(graphs, generator=g, dtype=DTYPE)
    target = torch.randn(n, generator=g, dtype=DTYPE)

    def base():
        ((loc + scale * torch.randn(n, dtype=DTYPE) - target) ** 2).sum().backward()

    def constrained():
        d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.SumConstraint(batch, totals))
        ((d.rsample() - target) ** 2).sum().backward()

    # a new batch vector every step, as a PyG DataLoader gives (the SumConstraint's per-index layout cache misses
    # and the index is checked and laid out again); both sides pay the copy that stands in for the loader's
    def base_fresh():
        batch.clone()
        base()

    def constrained_fresh():
        d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.SumConstraint(batch.clone(), totals))
        ((d.rsample() - target) ** 2).sum().backward()

    t = timed({"base": base, "hardeq": constrained, "base_fresh": base_fresh, "hardeq_fresh": constrained_fresh},
              min_repeats=5, max_repeats=400)
    con = hardeq.SumConstraint(batch, totals)
    resid = rel_residual(con, totals, hardeq.ConstrainedNormal(loc, scale, constraint=con).rsample((8,)).detach())
    row = {"graphs": graphs, "n": n, **t, "ratio": t["hardeq"] / t["base"],
           "ratio_fresh": t["hardeq_fresh"] / t["base_fresh"], "resid": resid}
    print("  D", json.dumps(row), file=sys.stderr, flush=True)
    return row


# ----------------------------------------------------------------------------------------------- output
def ms(t: float) -> str:
    return f"{t * 1e3:.0f}" if t >= 0.1 else f"{t * 1e3:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--shared-n", type=int, default=1_000_000)
    p.add_argument("--per-sample-n", type=int, default=100_000)
    p.add_argument("--per-sample-a", default="8,64")
    p.add_argument("--heavy-batches", default="16,256")
    p.add_argument("--skip-big", action="store_true", help="skip the 64 x 1e6 x 64 subprocess")
    p.add_argument("--sections", default="A,B,C,D", help="comma-separated sections to run (default A,B,C,D)")
    p.add_argument("--heavy-repeats", type=int, default=7, help="largest number of timed repeats in section C")
    p.add_argument("--json", help="also write the raw numbers to this file")
    p.add_argument("--max-min-repeats", type=int, default=5,
                   help="cap on the minimum number of timed repeats per function (default 5)")
    p.add_argument("--big-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.big_child:
        return _big_child()
    global MIN_REPEATS, HEAVY_REPEATS
    MIN_REPEATS, HEAVY_REPEATS = args.max_min_repeats, args.heavy_repeats
    sections = {x.strip().upper() for x in args.sections.split(",") if x.strip()}
    if not sections <= {"A", "B", "C", "D"}:
        p.error(f"--sections takes A, B, C and D, got {args.sections!r}")
    t_start = time.perf_counter()
    facts = _machine_facts()
    facts["loadavg_at_start"] = " ".join(open("/proc/loadavg").read().split()[:3])
    print("# hardeq performance targets (float32, CPU; no GPU in this environment)\n")
    print("Machine: " + ", ".join(f"{k}={v}" for k, v in facts.items()) + "\n", flush=True)

    A = None
    if "A" in sections:
        A = section_a(args.shared_n)
        print("## A. Shared parameters, 64 warm samples (target: <= 1.2x unconstrained)\n")
        print("| constraint | n | a | method | unconstr. ms | d.sample((64,)) ms | ÷ unconstr. | conditioner.sample ms "
              "| ÷ unconstr. | met (best of the two) | rel. residual | repeats |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in A:
            name = "SumConstraint" if r["kind"] == "sum" else "LinearConstraint"
            met = "yes" if min(r["r_warm"], r["r_fused"]) <= 1.2 else "no"
            print(f"| {name} | {r['n']:,} | {r['a']} | {r['method']} | {ms(r['base'])} | {ms(r['warm'])} | "
                  f"{r['r_warm']:.2f}x | {ms(r['fused'])} | {r['r_fused']:.2f}x | {met} | {r['resid']:.1e} | "
                  f"{r['repeats']} |")
    big = None
    Bs = None
    if "B" in sections:
        Bs = section_b(args.per_sample_n, [int(x) for x in args.per_sample_a.split(",")])
        print("\n## B. Per-sample scale and k, shared A, batch 64: construct + factor + sample "
              "(target: n = 1e5, a = 8 at <= 1.5x)\n")
        print("| n | a | batch | method | unconstr. ms | ConstrainedNormal(...).sample() ms | ÷ unconstr. "
              "| with conditioner.sample ms | ÷ unconstr. | rel. residual | repeats | page faults per call "
              "(unconstr. / sample() / conditioner.sample) | eager floor ms | ÷ unconstr. |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in Bs:
            print(f"| {r['n']:,} | {r['a']} | {r['batch']} | {r['method']} | {ms(r['base'])} | {ms(r['full'])} | "
                  f"{r['r_full']:.2f}x | {ms(r['full_fused'])} | {r['r_full_fused']:.2f}x | {r['resid']:.1e} | "
                  f"{r['repeats']} | {r['faults_base']:.0f} / {r['faults_full']:.0f} / "
                  f"{r['faults_full_fused']:.0f} | {ms(r['floor'])} | {r['r_floor']:.2f}x |")
        print("\nThe eager floor: the fewest kernels any one-kernel-per-operation implementation of the Matheron "
              "step with a per-row check runs (draw, reparameterise, the variances, the Gram GEMM, `k - Az`, the "
              "solve, the gain GEMM, `z += v y`, the check's `Az` and its screen), every buffer allocated once "
              "outside the timed call, no guards and no validation (`_eager_floor`).")
        if not args.skip_big:
            big = section_b_big(torch.get_num_threads())
            print("\n64 x 1e6 x 64 (batch 64, n = 1,000,000, a = 64), fresh subprocess, one call:\n")
            if "failed" in big:
                print(f"- failed: {big['failed']}")
            else:
                print(f"- construct + factor + sample: {big['t_total']:.2f} s (method {big['method']}); unconstrained "
                      f"draw {big['t_base']:.2f} s; inputs {big['inputs_mb']:.0f} MB, output {big['output_mb']:.0f} MB")
                print(f"- peak RSS: {big['hwm_before_mb']:.0f} MB before (torch + inputs), increase "
                      f"{big['hwm_increase_mb']:.0f} MB during construct + factor + sample "
                      f"(one batch x n x a float32 tensor would be {64 * 1e6 * 64 * 4 / 2**30:.1f} GiB)")
                print(f"- rel. residual {big['resid']:.1e}")
    C = None
    if "C" in sections:
        C = section_c([int(x) for x in args.heavy_batches.split(",")])
        print("\n## C. Heavy case n = 2048, a = 1024, per-sample scale, shared A (target: >= 80% of the batched-GEMM "
              "rate, counting 2 a^2 n + a^3/3 flops; hardeq <= 0.6x the plain code)\n")
        print("| batch | method | GEMM `Bm @ Bm.mT` s | GEMM rate GFLOP/s | plain Gram+Cholesky+solve s "
              "| plain % of rate | hardeq s | hardeq % of rate | hardeq ÷ plain | hardeq (conditioner.sample) s "
              "| % of rate | A800 anchor s (paper) | rel. residual hardeq (plain) | repeats |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in C:
            print(f"| {r['batch']} | {r['method']} | {r['gemm']:.3f} | {r['gflops']:.0f} | {r['plain']:.3f} | "
                  f"{100 * r['frac_plain']:.0f}% | {r['hardeq']:.3f} | {100 * r['frac_hardeq']:.0f}% | "
                  f"{r['hardeq_over_plain']:.2f}x | "
                  + (f"{r['hardeq_fused']:.3f} | {100 * r['frac_hardeq_fused']:.0f}% | "
                     if r.get("fused_measured", True) else "not timed | — | ")
                  + f"{r['anchor_a800_s']} | "
                  f"{r['resid']:.1e} ({r['resid_plain']:.1e}) | {r['repeats']} |")
    D = None
    if "D" in sections:
        D = section_d()
        print("\n## D. Ragged batch of 128 graphs, rsample + backward (target: <= 3x unconstrained draw + backward)\n")
        print("| graphs | n | batch vector | unconstr. ms | hardeq ms | ÷ unconstr. | rel. residual | repeats |")
        print("|---|---|---|---|---|---|---|---|")
        print(f"| {D['graphs']} | {D['n']:,} | the same every step | {ms(D['base'])} | {ms(D['hardeq'])} | "
              f"{D['ratio']:.2f}x | {D['resid']:.1e} | {D['repeats']} |")
        print(f"| {D['graphs']} | {D['n']:,} | a new one every step | {ms(D['base_fresh'])} | "
              f"{ms(D['hardeq_fresh'])} | {D['ratio_fresh']:.2f}x | {D['resid']:.1e} | {D['repeats']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": facts, "A": A, "B": Bs, "big": big, "C": C, "D": D}, f, indent=1)
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    print(f"\nTotal wall time: {time.perf_counter() - t_start:.0f} s; load average at the end: {load}")


if __name__ == "__main__":
    main()
