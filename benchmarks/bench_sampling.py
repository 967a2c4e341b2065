#!/usr/bin/env python
r"""Exact-sampling throughput of :class:`hardeq.ConstrainedNormal` (diagonal covariance, float32, CPU).

What is timed (``time.perf_counter``, one warm-up call first, then the median over repeats: each function
gets as many repeats as fit in ``TIME_PER_FN`` seconds, at least 5 (3 for the slowest per-sample rows) and
at most ``MAX_REPEATS``; repeat rounds of the variants are interleaved so that drift of the machine affects
them alike; every ratio is a ratio of two medians):

* ``unconstr.``: unconstrained reparameterised sampling of the same output shape,
  ``loc + scale * torch.randn(64, n)``; every ratio below is relative to it (or to the naive code).
* ``factor+sample``: build the constraint and the distribution and draw 64 samples, i.e. everything
  (``LinearConstraint(A, k, validate_args=False)`` / ``SumConstraint(...)``, ``ConstrainedNormal(...)``,
  ``.sample(...)``, which factorises ``A Sigma A^T`` on first use: a Gram GEMM and a Cholesky factor, or
  per-group variance sums for ``SumConstraint``; see ``hardeq.linalg.conditioning``).
  ``+validation``: the same with the default ``validate_args`` (torch's global default, ``True`` unless
  ``python -O``), which adds e.g. the rank check of ``A``.
* ``warm sample``: ``.sample(...)`` on a distribution whose factorisation is already cached.
* ``naive`` (n <= 4096 only): the textbook conditioning formulas typed in with explicit matrices:
  dense ``Sigma = diag(scale^2)`` (n x n), ``S = A Sigma A^T``, ``S^-1 = inv(S)``, ``K = Sigma A^T S^-1``;
  variant **C**: ``mu_bar = mu + K(k - A mu)``, ``Sigma_bar = Sigma - K A Sigma``,
  ``L = chol(Sigma_bar + jitter I)`` (jitter 1e-6 * mean(diag Sigma), times 10 until Cholesky succeeds),
  ``z = mu_bar + L eps``; variant **M**: ``z_hat = mu + scale * eps``, ``z = z_hat + K (k - A z_hat)``.
  The table reports the faster variant (letter in brackets; the other variant's time follows) and
  ``naive / hardeq`` as a speed-up (> 1 means hardeq is faster). The naive code also leaves a larger
  constraint residual (variant C: the jitter).

Two ways of batching 64 samples:

* ``shared``: batch_shape ``()``, ``d.sample((64,))``; ``loc``, ``scale`` of shape ``(n,)``, ``k`` ``(a,)``.
* ``per-sample``: batch_shape ``(64,)``, ``d.sample()``; ``loc``, ``scale`` ``(64, n)``, ``k`` ``(64, a)``,
  ``A`` ``(a, n)`` shared (the conditional network-head case).

The constraint check: ``max |A z - k| / max (|A| |z|)`` per sample (computed in float64), the worst of the 64.

Memory line: a fresh subprocess per setting, ``n = 2,000,000``, ``a = 3``, one sample; peak RSS increase is
``VmHWM`` (/proc/self/status) after construct+sample minus ``VmHWM`` before (torch imported, inputs
allocated). ``ru_maxrss`` is not used: on Linux it survives ``execve`` and so carries the parent's peak.

Usage::

    .venv/bin/python benchmarks/bench_sampling.py              # full run (all sizes; use --sizes to limit them)
    .venv/bin/python benchmarks/bench_sampling.py --threads 1  # the same with torch.set_num_threads(1)
    .venv/bin/python benchmarks/bench_sampling.py --quick      # smoke run (n = 1000 only, 2 repeats)

Results and their interpretation: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time

import torch

import hardeq

BATCH = 64
TIME_PER_FN = 0.3  # seconds of timed calls per function and row (cheap calls get more repeats)
MAX_REPEATS = 21
SLOW_CALL_S = 2.0  # a call slower than this gets 3 repeats instead of 5
DTYPE = torch.float32
DEVICE = torch.device("cpu")


# ----------------------------------------------------------------------------------------------- helpers
def _mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _proc_status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def _timeit(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _rel_residual(A: torch.Tensor, k: torch.Tensor, z: torch.Tensor) -> float:
    """max over samples of max_i |(A z - k)_i| / max_i (|A| |z|)_i, in float64. A: (a, n), z: (s, n)."""
    A64, z64, k64 = A.double(), z.double().reshape(-1, z.shape[-1]), k.double()
    res = (z64 @ A64.mT - k64.reshape(-1, k64.shape[-1])).abs().amax(-1)
    scale = (z64.abs() @ A64.abs().mT).amax(-1)
    return float((res / scale).max())


def _machine_facts() -> dict:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_total = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        git = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "src"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        git = git + (" (+ uncommitted changes in src/)" if dirty else "")
    except Exception:  # noqa: BLE001
        git = "?"
    return {
        "cpu": cpu, "logical_cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "ram_gib": round(mem_total / 2**30, 1), "python": platform.python_version(), "torch": torch.__version__,
        "hardeq": hardeq.__version__, "git": git, "platform": platform.platform(),
    }


# ----------------------------------------------------------------------------------------------- inputs
def make_inputs(kind: str, mode: str, n: int, a: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    B = (BATCH,) if mode == "per-sample" else ()
    loc = torch.randn(B + (n,), generator=g, dtype=DTYPE)
    scale = torch.rand(B + (n,), generator=g, dtype=DTYPE) + 0.5
    k = torch.randn(B + (a,), generator=g, dtype=DTYPE)
    if kind == "dense":
        A = torch.randn(a, n, generator=g, dtype=DTYPE)
        return {"loc": loc, "scale": scale, "k": k, "A": A, "index": None}
    index = torch.arange(n) * a // n  # contiguous, equal-size groups (a sorted PyG-style batch vector)
    return {"loc": loc, "scale": scale, "k": k, "A": None, "index": index}


def dense_A(inp: dict, a: int) -> torch.Tensor:
    if inp["A"] is not None:
        return inp["A"]
    return torch.nn.functional.one_hot(inp["index"], a).mT.to(DTYPE).contiguous()


def build(inp: dict, validate: bool | None) -> hardeq.ConstrainedNormal:
    if inp["A"] is not None:
        c = hardeq.LinearConstraint(inp["A"], inp["k"], validate_args=validate)
    else:
        c = hardeq.SumConstraint(inp["index"], inp["k"], validate_args=validate)
    return hardeq.ConstrainedNormal(inp["loc"], inp["scale"], constraint=c, validate_args=validate)


def sample_shape(mode: str) -> tuple:
    return (BATCH,) if mode == "shared" else ()


# ----------------------------------------------------------------------------------------------- naive
def _naive_matrices(loc, scale, A, k):
    """Explicit Sigma (n x n), S^-1 (a x a), K (n x a). loc/scale (Bp, n), k (Bp, a), Bp in {1, 64}."""
    Sigma = torch.diag_embed(scale.square())  # (Bp, n, n)
    S = A @ Sigma @ A.mT  # (Bp, a, a)
    S_inv = torch.linalg.inv(S)
    K = Sigma @ A.mT @ S_inv  # (Bp, n, a)
    return Sigma, K


def _chol_with_jitter(M: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(M.shape[-1], dtype=M.dtype)
    jitter = 1e-6 * float(ref.mean())
    for _ in range(12):
        L, info = torch.linalg.cholesky_ex(M + jitter * eye)
        if not bool((info > 0).any()):
            return L
        jitter *= 10
    raise RuntimeError("naive Cholesky failed even with large jitter")


def naive_C_factor(loc, scale, A, k):
    Sigma, K = _naive_matrices(loc, scale, A, k)
    mu_bar = loc + (K @ (k - loc @ A.mT).unsqueeze(-1)).squeeze(-1)
    Sigma_bar = Sigma - K @ A @ Sigma  # rank n - a
    L = _chol_with_jitter(Sigma_bar, Sigma.diagonal(dim1=-2, dim2=-1))
    return mu_bar, L


def naive_C_sample(fac, n):
    mu_bar, L = fac
    eps = torch.randn(BATCH, n, dtype=DTYPE)
    if L.shape[0] == 1:  # shared: one factor for all 64 samples
        return mu_bar + eps @ L[0].mT
    return mu_bar + (L @ eps.unsqueeze(-1)).squeeze(-1)  # per-sample: one factor per sample


def naive_M_factor(loc, scale, A, k):
    _, K = _naive_matrices(loc, scale, A, k)
    return loc, scale, A, k, K


def naive_M_sample(fac, n):
    loc, scale, A, k, K = fac
    z_hat = loc + scale * torch.randn(BATCH, n, dtype=DTYPE)
    r = k - z_hat @ A.mT  # (64, a)
    if K.shape[0] == 1:
        return z_hat + r @ K[0].mT
    return z_hat + (K @ r.unsqueeze(-1)).squeeze(-1)


# ----------------------------------------------------------------------------------------------- one row
def measure_row(kind: str, mode: str, n: int, a: int, min_repeats: int, with_naive: bool, quick: bool = False) -> dict:
    torch.manual_seed(0)
    inp = make_inputs(kind, mode, n, a)
    shape = sample_shape(mode)
    loc, scale = inp["loc"], inp["scale"]

    def base():
        return loc + scale * torch.randn(BATCH, n, dtype=DTYPE)

    def full():
        return build(inp, False).sample(shape)

    def full_val():
        return build(inp, None).sample(shape)

    warm_d = build(inp, False)
    warm_d.sample(shape)  # populates the cached factorisation

    def warm():
        return warm_d.sample(shape)

    fns = {"base": base, "full": full, "full_val": full_val, "warm": warm}
    resid = {}
    A = dense_A(inp, a)
    k2 = inp["k"].reshape(-1, a)
    resid["hardeq"] = _rel_residual(A, inp["k"], warm())

    if with_naive:
        l2, s2 = loc.reshape(-1, n), scale.reshape(-1, n)
        facC = naive_C_factor(l2, s2, A, k2)
        facM = naive_M_factor(l2, s2, A, k2)
        fns["naiveC_full"] = lambda: naive_C_sample(naive_C_factor(l2, s2, A, k2), n)
        fns["naiveC_warm"] = lambda: naive_C_sample(facC, n)
        fns["naiveM_full"] = lambda: naive_M_sample(naive_M_factor(l2, s2, A, k2), n)
        fns["naiveM_warm"] = lambda: naive_M_sample(facM, n)
        resid["naiveC"] = _rel_residual(A, inp["k"], naive_C_sample(facC, n))
        resid["naiveM"] = _rel_residual(A, inp["k"], naive_M_sample(facM, n))

    # warm-up, and a per-function repeat count: as many as fit in TIME_PER_FN seconds, clamped to
    # [min_repeats, MAX_REPEATS]; the rounds are interleaved so that slow drift of the machine hits all alike
    first = {name: _timeit(fn) for name, fn in fns.items()}
    want = {name: max(3 if t > SLOW_CALL_S else min_repeats, min(MAX_REPEATS, int(TIME_PER_FN / max(t, 1e-9))))
            for name, t in first.items()}
    if quick:
        want = {name: 2 for name in fns}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rnd in range(max(want.values())):
        for name, fn in fns.items():
            if rnd < want[name]:
                times[name].append(_timeit(fn))

    def med(name):
        return statistics.median(times[name])

    def ratio(num, den):
        return med(num) / med(den)

    out = {
        "kind": kind, "mode": mode, "n": n, "a": a, "batch": BATCH,
        "repeats": {name: len(v) for name, v in times.items()},
        "t_base": med("base"), "t_full": med("full"), "t_full_val": med("full_val"), "t_warm": med("warm"),
        "r_full": ratio("full", "base"), "r_full_val": ratio("full_val", "base"),
        "r_warm": ratio("warm", "base"), "resid": resid,
    }
    if with_naive:
        bestF = "C" if med("naiveC_full") < med("naiveM_full") else "M"
        bestW = "C" if med("naiveC_warm") < med("naiveM_warm") else "M"
        out.update({
            "naive_full_variant": bestF, "naive_warm_variant": bestW,
            "t_naiveC_full": med("naiveC_full"), "t_naiveM_full": med("naiveM_full"),
            "t_naiveC_warm": med("naiveC_warm"), "t_naiveM_warm": med("naiveM_warm"),
            "t_naive_full": med(f"naive{bestF}_full"), "t_naive_warm": med(f"naive{bestW}_warm"),
            "s_full": ratio(f"naive{bestF}_full", "full"), "s_warm": ratio(f"naive{bestW}_warm", "warm"),
        })
    return out


def rough_peak_bytes(kind: str, mode: str, n: int, a: int) -> int:
    """Generous estimate of the peak working set of a row (for the memory guard only)."""
    b = 4
    vecs = 12 * BATCH * n * b
    if kind == "dense":
        mats = (4 * BATCH if mode == "per-sample" else 4) * a * n * b
    else:
        mats = 0
    return vecs + mats


def run_row_guarded(kind, mode, n, a, repeats, with_naive, quick) -> dict:
    """In-process for small rows; in a subprocess with an address-space limit for big ones, so that running
    out of memory fails this row only (and does not trigger the OOM killer on a shared machine)."""
    need = rough_peak_bytes(kind, mode, n, a)
    if need < 2 * 2**30:
        return measure_row(kind, mode, n, a, repeats, with_naive, quick)
    budget = _mem_available_bytes() - 4 * 2**30  # leave room for other processes on a shared machine
    spec = json.dumps({"kind": kind, "mode": mode, "n": n, "a": a, "repeats": repeats,
                       "with_naive": with_naive, "quick": quick, "budget": budget})
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--row", spec,
                           "--threads", str(torch.get_num_threads())], capture_output=True,
                          text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("ROW "):
            return json.loads(line[4:])
    err = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return {"kind": kind, "mode": mode, "n": n, "a": a, "batch": BATCH, "failed": err[:200],
            "budget_gib": budget / 2**30}


def _row_child(spec: str) -> None:
    s = json.loads(spec)
    vm = _proc_status_kb("VmSize") * 1024
    limit = vm + max(s["budget"], 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        out = measure_row(s["kind"], s["mode"], s["n"], s["a"], s["repeats"], s["with_naive"], s["quick"])
    except (RuntimeError, MemoryError) as e:  # allocation failure under the limit
        msg = str(e)
        m = re.search(r"allocate (\d+) bytes", msg)
        what = (f"an allocation of {int(m.group(1)) / 2**30:.1f} GiB failed" if m
                else msg.splitlines()[0][:120])
        out = {"kind": s["kind"], "mode": s["mode"], "n": s["n"], "a": s["a"], "batch": BATCH,
               "failed": f"out of memory ({what}; {s['budget'] / 2**30:.1f} GiB were free for it)"}
    out["subprocess"] = True
    print("ROW " + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------------------------- memory line
def _memory_child(validate: str) -> None:
    n, a = 2_000_000, 3
    v = {"default": None, "off": False}[validate]
    g = torch.Generator().manual_seed(0)
    A = torch.randn(a, n, generator=g, dtype=DTYPE)
    k = torch.randn(a, generator=g, dtype=DTYPE)
    loc = torch.randn(n, generator=g, dtype=DTYPE)
    scale = torch.rand(n, generator=g, dtype=DTYPE) + 0.5
    torch.randn(10)  # touch the RNG / allocator once
    inputs_mb = sum(t.numel() * t.element_size() for t in (A, k, loc, scale)) / 2**20
    hwm0 = _proc_status_kb("VmHWM")
    t0 = time.perf_counter()
    d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k, validate_args=v),
                                 validate_args=v)
    z = d.sample()
    t_cold = time.perf_counter() - t0
    hwm1 = _proc_status_kb("VmHWM")
    warm = []
    for _ in range(5):
        warm.append(_timeit(lambda: d.sample()))
    base = []
    for _ in range(5):
        base.append(_timeit(lambda: loc + scale * torch.randn(n, dtype=DTYPE)))
    out = {
        "validate": validate, "n": n, "a": a, "inputs_mb": inputs_mb, "t_cold": t_cold,
        "t_warm": statistics.median(warm), "t_base": statistics.median(base),
        "hwm_before_mb": hwm0 / 1024, "hwm_increase_mb": (hwm1 - hwm0) / 1024, "hwm_total_mb": hwm1 / 1024,
        "resid": _rel_residual(A, k, z.unsqueeze(0)),
        "check": bool(d.constraint.check(z)),
    }
    print("MEM " + json.dumps(out), flush=True)


def memory_line(validate: str) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-line", validate,
                           "--threads", str(torch.get_num_threads())],
                          capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("MEM "):
            return json.loads(line[4:])
    return {"validate": validate, "failed": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}


# ----------------------------------------------------------------------------------------------- output
def _ms(t: float) -> str:
    ms = t * 1e3
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    return f"{ms:.2f}"


def _x(r: float) -> str:
    if r >= 100:
        return f"{r:.0f}x"
    if r >= 10:
        return f"{r:.1f}x"
    return f"{r:.2f}x"


HEADER = ("| constraint | k | n | a | batch | dtype | device | torch | unconstr. ms | factor+sample ms "
          "| ÷ unconstr. | +validation ÷ unconstr. | warm sample ms | warm ÷ unconstr. | naive factor+sample ms "
          "| naive ÷ hardeq | naive warm ms | naive warm ÷ hardeq warm | rel. residual hardeq (naive C / M) |")
SEP = "|" + "---|" * (HEADER.count("|") - 1)


def format_row(r: dict) -> str:
    kind = "LinearConstraint (dense A)" if r["kind"] == "dense" else "SumConstraint"
    kdesc = "shared, sample((64,))" if r["mode"] == "shared" else "per-sample, batch (64,)"
    head = f"| {kind} | {kdesc} | {r['n']:,} | {r['a']} | {r['batch']} | float32 | cpu | {torch.__version__} |"
    if "failed" in r:
        return head + f" — | not measured: {r['failed']} |" + " — |" * 9
    cells = [_ms(r["t_base"]), _ms(r["t_full"]), _x(r["r_full"]), _x(r["r_full_val"]), _ms(r["t_warm"]),
             _x(r["r_warm"])]
    if "t_naive_full" in r:
        other_f = "C" if r["naive_full_variant"] == "M" else "M"
        other_w = "C" if r["naive_warm_variant"] == "M" else "M"
        t_other_f, t_other_w = r[f"t_naive{other_f}_full"], r[f"t_naive{other_w}_warm"]
        cells += [f"{_ms(r['t_naive_full'])} ({r['naive_full_variant']}; {other_f}: {_ms(t_other_f)})",
                  _x(r["s_full"]),
                  f"{_ms(r['t_naive_warm'])} ({r['naive_warm_variant']}; {other_w}: {_ms(t_other_w)})",
                  _x(r["s_warm"])]
        res = f"{r['resid']['hardeq']:.1e} ({r['resid']['naiveC']:.1e} / {r['resid']['naiveM']:.1e})"
    else:
        why = "n² floats infeasible" if r["n"] > 4096 else "—"
        cells += [why, "—", "—", "—"]
        res = f"{r['resid']['hardeq']:.1e}"
    return head + " " + " | ".join(cells + [res]) + " |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: n = 1000 only, 2 repeats")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads(N) (default: leave torch's default, the number of cores)")
    p.add_argument("--kinds", default="dense,sum", help="comma-separated subset of dense,sum")
    p.add_argument("--modes", default="shared,per-sample", help="comma-separated subset of shared,per-sample")
    p.add_argument("--sizes", default=None, help="comma-separated n values (default 1000,100000,1000000)")
    p.add_argument("--no-memory-line", action="store_true", help="skip the n = 2,000,000 memory line")
    p.add_argument("--json", help="also write the raw measurements (median times, repeats) to this file")
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--memory-line", choices=["default", "off"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.row:
        return _row_child(args.row)
    if args.memory_line:
        return _memory_child(args.memory_line)

    t_start = time.perf_counter()
    facts = _machine_facts()
    facts["loadavg_at_start"] = " ".join(open("/proc/loadavg").read().split()[:3])
    print("# hardeq exact-sampling benchmark\n")
    print("Machine: " + ", ".join(f"{k}={v}" for k, v in facts.items()) + "\n", flush=True)

    if args.quick:
        grid_n, grid_a, naive_extra = [1000], [1, 8], []
    else:
        grid_n, grid_a, naive_extra = [1000, 100_000, 1_000_000], [1, 8, 64], [4096]  # 4096: dense only

    def repeats_for(kind, mode, n, a):  # the minimum; cheap calls get up to MAX_REPEATS
        if n >= 1_000_000 and kind == "dense" and mode == "per-sample" and a > 1:
            return 3
        return 5

    rows = []
    if args.sizes:
        grid_n, naive_extra = [int(x) for x in args.sizes.split(",")], []
    for kind in args.kinds.split(","):
        for mode in args.modes.split(","):
            ns = sorted(set(grid_n + (naive_extra if (mode, kind) == ("shared", "dense") else [])))
            for n in ns:
                for a in grid_a:
                    with_naive = n <= 4096
                    r = run_row_guarded(kind, mode, n, a, repeats_for(kind, mode, n, a), with_naive, args.quick)
                    rows.append(r)
                    print("  measured: " + format_row(r), file=sys.stderr, flush=True)

    print("## Sampling throughput (64 samples, float32, CPU)\n")
    print("Ratios are ratios of median times. `÷ unconstr.`: hardeq time / time of "
          "`loc + scale * torch.randn(64, n)`. `naive ÷ hardeq`: naive time / hardeq time (> 1: hardeq "
          "faster); C = Cholesky of the jittered conditional covariance, M = explicit-gain Matheron.\n")
    print(HEADER)
    print(SEP)
    for r in rows:
        print(format_row(r))
    print()

    mem_rows = []
    if not args.no_memory_line:
        print("## Memory line: n = 2,000,000, a = 3, one sample, fresh subprocess\n")
        print("| validate_args | n | a | dtype | device | torch | inputs MB | construct+factor+sample s "
              "| warm sample s | unconstr. s | peak RSS before MB | peak RSS increase MB | peak RSS total MB "
              "| rel. residual | constraint.check |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for v in ("default", "off"):
            m = memory_line(v)
            mem_rows.append(m)
            if "failed" in m:
                print(f"| {v} | 2,000,000 | 3 | float32 | cpu | {torch.__version__} | failed: {m['failed']} |")
                continue
            vname = "default (True)" if v == "default" else "False"
            print(f"| {vname} | {m['n']:,} | {m['a']} | float32 | cpu | {torch.__version__} | {m['inputs_mb']:.0f} "
                  f"| {m['t_cold']:.3f} | {m['t_warm']:.3f} | {m['t_base']:.3f} "
                  f"| {m['hwm_before_mb']:.0f} | {m['hwm_increase_mb']:.0f} | {m['hwm_total_mb']:.0f} "
                  f"| {m['resid']:.1e} | {m['check']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": facts, "rows": rows, "memory": mem_rows}, f, indent=1)
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    print(f"\nTotal benchmark wall time: {time.perf_counter() - t_start:.0f} s; load average at the end: {load}")


if __name__ == "__main__":
    main()
