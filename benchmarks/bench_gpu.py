#!/usr/bin/env python
r"""The GPU path, measured: library tests on the device, the four speed targets and the heavy case, a study step.

Run by ``benchmarks/gpu.sh`` (``--device cuda``, under 10 minutes on one GPU); ``--smoke --device cpu`` runs the same
code at tiny sizes in a few seconds (the default test suite does, ``tests/test_bench_gpu.py``). Three phases:

1. **targets**, float32, every variant timed with its baselines in one process, repeat rounds interleaved, one
   warm-up call first; on CUDA each call is timed by CUDA events around it after a ``torch.cuda.synchronize()``
   (on CPU by ``time.perf_counter``); medians. The per-row residual ``max_i |(Az - k)_i| / (|A||z|)_i``
   (float64, :func:`hardeq.testing.row_residual_ratio`) of the worst sample and row is reported with each.

   - **B** per-sample ``loc``, ``scale``, ``k`` (batch 64), shared ``A`` ``(8, 1e5)``: construct + factor +
     ``sample()`` with ``validate_args=False`` against ``loc + scale * randn(64, n)``. Goal <= 1.5x.
   - **C** heavy case, n = 2048, a = 1024, per-sample scale, batch 16 and 256: hardeq ``ConstrainedNormal(...)
     .sample()`` against the batched GEMM ``Bm @ Bm.mT`` (``2 batch a^2 n`` flops; its rate is the reference) and
     the plain code a user would write (Gram by one batched GEMM, ``cholesky``, ``cholesky_solve``, Matheron).
     Goals: >= 80% of the GEMM rate, <= 0.6x the plain code; at batch 16 <= 10 ms on an H100/H200 (the paper's
     anchor: 0.205 s on an A800).
   - **D** ragged batch of 128 graphs (1-155 nodes, PyG's ``batch`` vector): ``rsample`` + squared loss +
     ``backward`` with default validation against ``loc + scale * randn`` + the same loss + ``backward``. Goal
     <= 3x.
   - **sparse** n = 1e6, a = 1,000, nnz = 4e6 (``benchmarks/bench_sparse.py``'s matrix), shared diagonal
     covariance, 64 samples through ``ConstrainedNormal(loc, scale, constraint=SparseConstraint(A, k))`` with a new
     ``k`` each round against the unconstrained draw. Goal <= 2x.

   A case that fails (out of memory, an operation the device lacks) is recorded with its error; the run goes on.
2. **tests** (not with ``--smoke``): ``python -m pytest --device cuda -q`` on the library suite (``tests/``), over
   up to 8 pytest-xdist processes when xdist is installed; its whole output to ``OUT/<device>-tests.log``; the
   pass/fail/skip counts, the wall time and the last lines of its output.
3. **study** (not with ``--smoke``): ``hardeq reproduce mof --preset paper`` on the device, one split, the
   likelihood group (a two-member ensemble trained together), ``--study-steps`` optimiser steps (300); the study's
   own training time (``timing.train_s`` of its JSON, validations included) per optimiser step taken, and the
   wall time of the whole command. The phases import this checkout (``src``, ``studies`` first on ``PYTHONPATH``).

Writes ``OUT/<device>.json`` (every number, the machine, the commands) and ``OUT/<device>.md`` (the tables), where
``<device>`` is the device's name in lower case with dashes (``nvidia-h100-80gb-hbm3``, or ``cpu-smoke``). ``OUT``
defaults to ``benchmarks/results/gpu``.

Usage::

    benchmarks/gpu.sh                                          # on a CUDA machine: all three phases
    python benchmarks/bench_gpu.py --device cuda --skip-tests --skip-study
    python benchmarks/bench_gpu.py --smoke --device cpu --out /tmp/gpu-smoke
"""

# ruff: noqa: B023  (the closures are timed within their own loop iteration)
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor

import hardeq
from hardeq.testing import row_residual_ratio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_sparse import flow_balance_matrix  # noqa: E402

DTYPE = torch.float32
#: the source paper's heavy-case anchor (A800), seconds, by batch
ANCHOR_A800 = {16: 0.205, 256: 1.24}

#: sizes of the full run and of ``--smoke``
SIZES = {
    "full": {"B": {"n": 100_000, "a": 8, "batch": 64}, "C": {"n": 2048, "a": 1024, "batches": (16, 256)},
             "D": {"graphs": 128, "max_nodes": 155}, "sparse": {"n": 1_000_000, "a": 1000, "per_column": 4,
                                                               "samples": 64},
             "repeats": 15, "budget_s": 3.0},
    "smoke": {"B": {"n": 1000, "a": 4, "batch": 8}, "C": {"n": 64, "a": 32, "batches": (2, 4)},
              "D": {"graphs": 8, "max_nodes": 12}, "sparse": {"n": 2000, "a": 20, "per_column": 2, "samples": 8},
              "repeats": 3, "budget_s": 0.2},
}


# ------------------------------------------------------------------------------------------------ timing
class Timer:
    """Seconds of one call of ``fn`` on ``device``: CUDA events around it (after a synchronize) on a GPU,
    ``time.perf_counter`` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3


def timed(timer: Timer, fns: dict, repeats: int, budget_s: float) -> dict:
    """Median seconds per function: one warm-up call each, then interleaved rounds (at least 3, at most
    ``repeats``, as many as fit in ``budget_s``)."""
    first = {name: timer(fn) for name, fn in fns.items()}
    reps = max(3, min(repeats, int(budget_s / max(sum(first.values()), 1e-6))))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(timer(fn))
    return {name: statistics.median(v) for name, v in times.items()} | {"repeats": reps}


def worst_residual(con, z: torch.Tensor) -> float:
    """Worst per-row ratio ``|(Az - k)_i| / (|A||z|)_i`` over samples and rows (float64, 8 samples at a time)."""
    flat = z.reshape((-1,) + con.batch_shape + z.shape[-1:])
    return max(float(row_residual_ratio(con, flat[i:i + 8]).max()) for i in range(0, flat.shape[0], 8))


def _guarded(name: str, fn) -> dict:
    """``fn()``, or a record of its failure (the run goes on)."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001  (out of memory, an operation the device lacks: reported, not fatal)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"case": name, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}


# ------------------------------------------------------------------------------------------------ cases
# Each ``make_*`` builds a case's inputs on ``dev`` (seeded on the host) and returns its calls: ``hardeq`` (the
# timed constrained call), its baselines, and what the residual check needs; ``case_*`` times them.
# ``benchmarks/profile_gpu.py`` profiles the same ``hardeq`` calls.
def make_b(dev: torch.device, n: int, a: int, batch: int) -> SimpleNamespace:
    """B: per-sample ``loc``, ``scale``, ``k``, shared ``A``; construct + factor + ``sample()``."""
    g = torch.Generator().manual_seed(1)
    A = torch.randn(a, n, generator=g, dtype=DTYPE).to(dev)
    loc = torch.randn(batch, n, generator=g, dtype=DTYPE).to(dev)
    scale = (torch.rand(batch, n, generator=g, dtype=DTYPE) + 0.5).to(dev)
    k = torch.randn(batch, a, generator=g, dtype=DTYPE).to(dev)

    def build():
        return hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k, validate_args=False),
                                        validate_args=False)

    return SimpleNamespace(build=build, hardeq=lambda: build().sample(),
                           unconstrained=lambda: loc + scale * torch.randn(batch, n, device=dev))


def case_b(dev: torch.device, timer: Timer, n: int, a: int, batch: int, repeats: int, budget_s: float) -> dict:
    case = make_b(dev, n, a, batch)
    t = timed(timer, {"unconstrained": case.unconstrained, "hardeq": case.hardeq}, repeats, budget_s)
    d = case.build()
    return {"case": "B", "n": n, "a": a, "batch": batch, "method": d.conditioner.method, **t,
            "ratio": t["hardeq"] / t["unconstrained"], "goal": "<= 1.5x unconstrained",
            "met": t["hardeq"] / t["unconstrained"] <= 1.5, "residual": worst_residual(d.constraint, d.sample())}


def make_c(dev: torch.device, n: int, a: int, batch: int) -> SimpleNamespace:
    """C, the heavy case: hardeq, the plain code a user would write, and the GEMM-rate reference."""
    g = torch.Generator().manual_seed(3)
    A = (torch.randn(a, n, generator=g, dtype=DTYPE) / n ** 0.5).to(dev)
    loc = torch.randn(batch, n, generator=g, dtype=DTYPE).to(dev)
    scale = (torch.rand(batch, n, generator=g, dtype=DTYPE) + 0.5).to(dev)
    k = torch.randn(batch, a, generator=g, dtype=DTYPE).to(dev)

    def plain():  # what a user would type: Gram by one batched GEMM + Cholesky + solve + Matheron
        Bm_ = A * scale.unsqueeze(-2)
        L = torch.linalg.cholesky(Bm_ @ Bm_.mT)
        z_hat = loc + scale * torch.randn(batch, n, device=dev)
        x = torch.cholesky_solve((k - z_hat @ A.mT).unsqueeze(-1), L).squeeze(-1)
        return z_hat + scale.square() * (x @ A)

    def build():
        return hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.LinearConstraint(A, k, validate_args=False),
                                        validate_args=False)

    def gemm_operand() -> Tensor:  # (batch, a, n): the GEMM-rate reference multiplies it by its transpose
        return A * scale.unsqueeze(-2)

    return SimpleNamespace(build=build, hardeq=lambda: build().sample(), plain=plain, gemm_operand=gemm_operand,
                           plain_constraint=lambda: hardeq.LinearConstraint(A, k, validate_args=False))


def case_c(dev: torch.device, timer: Timer, n: int, a: int, batch: int, repeats: int, budget_s: float) -> dict:
    case = make_c(dev, n, a, batch)
    Bm = case.gemm_operand()
    t = timed(timer, {"gemm": lambda: Bm @ Bm.mT, "plain": case.plain, "hardeq": case.hardeq}, repeats, budget_s)
    Bm = None  # free the (batch, a, n) copy before the residual checks
    flops = 2 * batch * a * a * n
    rate = flops / t["gemm"]
    d = case.build()
    frac = flops / t["hardeq"] / rate
    out = {"case": "C", "n": n, "a": a, "batch": batch, "method": d.conditioner.method, **t,
           "gemm_gflops": rate / 1e9, "frac_of_gemm_rate": frac, "frac_plain": flops / t["plain"] / rate,
           "ratio_to_plain": t["hardeq"] / t["plain"], "goal": ">= 80% of the GEMM rate, <= 0.6x plain",
           "met": frac >= 0.8 and t["hardeq"] / t["plain"] <= 0.6, "anchor_a800_s": ANCHOR_A800.get(batch),
           "residual": worst_residual(d.constraint, d.sample()),
           "residual_plain": worst_residual(case.plain_constraint(), case.plain())}
    if batch == 16 and (n, a) == (2048, 1024):
        out["goal_10ms"] = t["hardeq"] <= 0.010
    return out


def make_d(dev: torch.device, graphs: int, max_nodes: int) -> SimpleNamespace:
    """D: a ragged PyG-style batch; ``rsample`` + squared loss + ``backward`` with default validation."""
    g = torch.Generator().manual_seed(4)
    sizes = torch.randint(1, max_nodes + 1, (graphs,), generator=g)
    batch = torch.repeat_interleave(torch.arange(graphs), sizes).to(dev)
    n = batch.numel()
    loc = torch.randn(n, generator=g, dtype=DTYPE).to(dev).requires_grad_()
    scale = (torch.rand(n, generator=g, dtype=DTYPE) + 0.5).to(dev).requires_grad_()
    totals = torch.randn(graphs, generator=g, dtype=DTYPE).to(dev)
    target = torch.randn(n, generator=g, dtype=DTYPE).to(dev)

    def unconstrained():
        ((loc + scale * torch.randn(n, device=dev) - target) ** 2).sum().backward()

    def constrained():
        d = hardeq.ConstrainedNormal(loc, scale, constraint=hardeq.SumConstraint(batch, totals))
        ((d.rsample() - target) ** 2).sum().backward()

    return SimpleNamespace(n=n, hardeq=constrained, unconstrained=unconstrained,
                           build=lambda: hardeq.ConstrainedNormal(loc, scale,
                                                                  constraint=hardeq.SumConstraint(batch, totals)))


def case_d(dev: torch.device, timer: Timer, graphs: int, max_nodes: int, repeats: int, budget_s: float) -> dict:
    case = make_d(dev, graphs, max_nodes)
    t = timed(timer, {"unconstrained": case.unconstrained, "hardeq": case.hardeq}, max(repeats, 50), budget_s)
    d = case.build()
    z = d.rsample((8,)).detach()
    from hardeq.linalg.device import fused_kernels

    method = "fused Triton kernels" if fused_kernels(dev) else "ATen form"  # (grouped_triton.py, where Triton runs)
    return {"case": "D", "graphs": graphs, "n": case.n, "method": method, **t,
            "ratio": t["hardeq"] / t["unconstrained"],
            "goal": "<= 3x unconstrained", "met": t["hardeq"] / t["unconstrained"] <= 3.0,
            "residual": worst_residual(d.constraint, z)}


def make_sparse(dev: torch.device, n: int, a: int, per_column: int, samples: int) -> SimpleNamespace:
    """Sparse: ``SparseConstraint`` with a new ``k`` each call, shared diagonal covariance, ``samples`` draws."""
    with warnings.catch_warnings():  # torch's note that sparse invariant checks are off by default
        warnings.simplefilter("ignore", UserWarning)
        A = flow_balance_matrix(a, n, per_column, 0, DTYPE).to(dev)
    g = torch.Generator().manual_seed(5)
    loc = torch.randn(n, generator=g, dtype=DTYPE).to(dev)
    scale = (torch.rand(n, generator=g, dtype=DTYPE) + 0.5).to(dev)
    k0 = (torch.randn(a, generator=g, dtype=DTYPE) * 10).to(dev)
    shift = [0]

    def conditioned():
        shift[0] += 1  # a new right-hand side each round, as in a loop over observations
        c = hardeq.SparseConstraint(A, k0 + shift[0])
        return hardeq.ConstrainedNormal(loc, scale, constraint=c).sample((samples,))

    return SimpleNamespace(nnz=int(A._nnz()), hardeq=conditioned,
                           unconstrained=lambda: loc + scale * torch.randn(samples, n, device=dev),
                           build=lambda: hardeq.ConstrainedNormal(loc, scale,
                                                                  constraint=hardeq.SparseConstraint(A, k0)))


def case_sparse(dev: torch.device, timer: Timer, n: int, a: int, per_column: int, samples: int, repeats: int,
                budget_s: float) -> dict:
    case = make_sparse(dev, n, a, per_column, samples)
    t = timed(timer, {"unconstrained": case.unconstrained, "hardeq": case.hardeq}, repeats, budget_s)
    d = case.build()
    z = d.sample((samples,))
    return {"case": "sparse", "n": n, "a": a, "nnz": case.nnz, "samples": samples, **t,
            "ratio": t["hardeq"] / t["unconstrained"], "goal": "<= 2x unconstrained",
            "met": t["hardeq"] / t["unconstrained"] <= 2.0, "residual": worst_residual(d.constraint, z)}


def run_targets(dev: torch.device, sizes: dict) -> list[dict]:
    timer, reps, budget = Timer(dev), sizes["repeats"], sizes["budget_s"]
    rows = [_guarded("B", lambda: case_b(dev, timer, **sizes["B"], repeats=reps, budget_s=budget))]
    c = sizes["C"]
    for batch in c["batches"]:
        rows.append(_guarded("C", lambda: case_c(dev, timer, c["n"], c["a"], batch, reps, budget)))
        rows[-1].setdefault("batch", batch)
    rows.append(_guarded("D", lambda: case_d(dev, timer, **sizes["D"], repeats=reps, budget_s=budget)))
    rows.append(_guarded("sparse", lambda: case_sparse(dev, timer, **sizes["sparse"], repeats=reps,
                                                       budget_s=budget)))
    for row in rows:
        print("  target", json.dumps(row), file=sys.stderr, flush=True)
    return rows


# ------------------------------------------------------------------------------------------------ tests, study
def pytest_command(device: str, workers: int = 0) -> list[str]:
    """The library suite on ``device``; with ``workers > 0`` spread over that many pytest-xdist processes (all
    share the one GPU), one line per failure."""
    cmd = [sys.executable, "-m", "pytest", "--device", device, "-q", "-p", "no:cacheprovider", "--tb=line"]
    return cmd + (["-n", str(workers)] if workers > 0 else []) + [str(ROOT / "tests")]


def xdist_workers() -> int:
    """Worker processes for the test phase: up to 8 when pytest-xdist is installed (the CPU side of many small
    tests is the bottleneck on a GPU machine), else 0 (one process)."""
    try:
        import xdist  # noqa: F401
    except ImportError:
        return 0
    return max(0, min(8, (os.cpu_count() or 1) - 2))


def source_env() -> dict:
    """The environment of the phases' subprocesses: this checkout's ``src`` and ``studies`` first on the path,
    so that the tree being measured is the one imported, installed or not."""
    paths = [str(ROOT / "src"), str(ROOT / "studies")] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    return os.environ | {"PYTHONPATH": ":".join(paths)}


def parse_pytest_summary(text: str) -> dict:
    """Counts from pytest's last summary line (``12 passed, 2 skipped, 1 failed in 3.4s``)."""
    counts = {}
    lines = [ln for ln in text.splitlines() if re.search(r"\b(passed|failed|error|errors|skipped|no tests ran)\b", ln)]
    for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)",
                                   lines[-1] if lines else ""):
        counts["errors" if word.startswith("error") else word] = int(number)
    return counts


def run_tests(device: str, timeout_s: int, log: Path | None = None) -> dict:
    """The library suite on ``device``; its whole output goes to ``log`` (when given), its counts and last lines to
    the record."""
    cmd = pytest_command(device, xdist_workers())
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=source_env())
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as error:
        text, rc = (error.stdout or b"").decode() if isinstance(error.stdout, bytes) else (error.stdout or ""), None
    if log is not None:
        log.write_text(text)
    return {"command": " ".join(cmd[1:]), "returncode": rc, "timed_out": rc is None,
            "seconds": time.perf_counter() - t0, **parse_pytest_summary(text),
            "tail": "\n".join(text.strip().splitlines()[-25:])}


def study_command(device: str, steps: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "hardeq_studies", "reproduce", "mof", "--preset", "paper", "--device", device,
            "--splits", "1", "--groups",
            "likelihood", "--steps", str(steps), "--eval-every", str(max(1, steps // 3)), "--out", str(out),
            "--fresh", "--allow-dirty", "--quiet"]


def run_study(device: str, steps: int, timeout_s: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="hardeq-gpu-study-") as tmp:
        cmd = study_command(device, steps, Path(tmp))
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                                  env=source_env())
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except (subprocess.TimeoutExpired, FileNotFoundError) as error:
            rc, text = None, f"{type(error).__name__}: {error}"
        wall = time.perf_counter() - t0
        study_doc = {}
        doc_path = Path(tmp) / "mof.json"
        if doc_path.exists():
            try:
                study_doc = json.loads(doc_path.read_text())
            except (ValueError, OSError):
                pass
    out = {"command": " ".join(["hardeq"] + cmd[3:]), "returncode": rc, "wall_s": wall, "steps_asked": steps,
           "wall_s_per_step": wall / steps, "tail": "\n".join(text.strip().splitlines()[-10:])}
    train_s = (study_doc.get("timing") or {}).get("train_s")
    taken = [int(v) for per_unit in (study_doc.get("optimizer_steps") or {}).values() for v in per_unit]
    if train_s and taken:  # the two members of the unit step together: one step = max over members
        out |= {"train_s": float(train_s), "steps_taken": max(taken), "train_s_per_step": float(train_s) / max(taken)}
    return out


# ------------------------------------------------------------------------------------------------ output
def device_name(dev: torch.device, smoke: bool) -> str:
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return name + (" (smoke)" if smoke else "")


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def machine(dev: torch.device) -> dict:
    facts = {"torch": torch.__version__, "hardeq": hardeq.__version__, "python": platform.python_version(),
             "platform": platform.platform(), "cpu_threads": torch.get_num_threads(),
             "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        facts |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                  "cuda": torch.version.cuda, "capability": f"{props.major}.{props.minor}"}
    try:
        facts["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                      text=True).stdout.strip() or None
    except OSError:
        facts["git"] = None
    return facts


def _ms(t: float | None) -> str:
    return "—" if t is None else f"{t * 1e3:.3g}"


def _yes(v: object) -> str:
    return "—" if v is None else ("yes" if v else "**no**")


def markdown(doc: dict) -> str:
    lines = [f"# GPU path: {doc['device']}", "", f"Machine: {json.dumps(doc['machine'])}", "",
             f"Command: `{doc['command']}`; total {doc['seconds']:.0f} s.", ""]
    tests = doc.get("tests")
    if tests:
        counts = ", ".join(f"{tests[k]} {k}" for k in ("passed", "failed", "errors", "skipped") if k in tests)
        lines += ["## Library tests on the device", "", f"`{tests['command']}`: {counts or 'no summary'} in "
                  f"{tests['seconds']:.0f} s (exit code {tests['returncode']}).", ""]
    lines += ["## Targets (float32; medians of interleaved rounds; ratios of medians)", "",
              "| case | size | method | unconstr. / GEMM ms | plain ms | hardeq ms | ratio | goal | met | "
              "residual | repeats |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["targets"]:
        if "error" in r:
            lines.append(f"| {r['case']} | {r.get('batch', '')} | failed: {r['error']} | | | | | | | | |")
            continue
        if r["case"] == "C":
            size = f"n {r['n']}, a {r['a']}, batch {r['batch']}"
            ratio = f"{r['frac_of_gemm_rate']:.0%} of {r['gemm_gflops']:.0f} GFLOP/s; {r['ratio_to_plain']:.2f}x plain"
            base, plain = r["gemm"], r["plain"]
            if r.get("anchor_a800_s"):
                ratio += f"; A800 anchor {r['anchor_a800_s'] * 1e3:.0f} ms"
            goal = r["goal"] + ("; <= 10 ms" if "goal_10ms" in r else "")
            met = _yes(r["met"]) + (f" (10 ms: {_yes(r['goal_10ms'])})" if "goal_10ms" in r else "")
        else:
            size = {"B": lambda: f"n {r['n']}, a {r['a']}, batch {r['batch']}",
                    "D": lambda: f"{r['graphs']} graphs, n {r['n']}",
                    "sparse": lambda: f"n {r['n']}, a {r['a']}, nnz {r['nnz']}, {r['samples']} samples"}[r["case"]]()
            ratio, base, plain, goal, met = f"{r['ratio']:.2f}x", r["unconstrained"], None, r["goal"], _yes(r["met"])
        lines.append(f"| {r['case']} | {size} | {r.get('method', '')} | {_ms(base)} | {_ms(plain)} | "
                     f"{_ms(r['hardeq'])} | {ratio} | {goal} | {met} | {r['residual']:.1e} | {r['repeats']} |")
    study = doc.get("study")
    if study:
        per_step = (f"{study['train_s_per_step'] * 1e3:.1f} ms per optimiser step of the two-member ensemble "
                    f"({study['steps_taken']} steps in {study['train_s']:.1f} s of training, validations included)"
                    if "train_s_per_step" in study else
                    f"{study['wall_s_per_step'] * 1e3:.1f} ms per step (wall, start-up included; no study JSON)")
        lines += ["", "## Study step", "", f"`{study['command']}`: exit code {study['returncode']}, "
                  f"{study['wall_s']:.0f} s wall; {per_step}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, no tests and no study phase (a few seconds)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu", help="output folder")
    p.add_argument("--skip-tests", action="store_true", help="skip the library tests on the device")
    p.add_argument("--skip-study", action="store_true", help="skip the study step timing")
    p.add_argument("--study-steps", type=int, default=300, help="optimiser steps of the study phase (default 300)")
    p.add_argument("--tests-timeout", type=int, default=300, help="seconds allowed for the test phase")
    p.add_argument("--study-timeout", type=int, default=150, help="seconds allowed for the study phase")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch.cuda.is_available() is False (torch {torch.__version__}); "
                "use --device cpu with --smoke to check the driver without a GPU.")
    if dev.type not in ("cuda", "cpu"):
        p.error(f"--device must be cuda or cpu, got {args.device!r}.")
    t0 = time.perf_counter()
    name = device_name(dev, args.smoke)
    doc: dict = {"device": name, "smoke": args.smoke, "machine": machine(dev),
                 "command": "python benchmarks/bench_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / slug(name)

    def write() -> str:  # after every phase: a run cut short (gpu.sh's time limit) still leaves its results
        doc["seconds"] = time.perf_counter() - t0
        doc["machine"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
        text = markdown(doc)
        stem.with_suffix(".md").write_text(text)
        return text

    print(f"[bench_gpu] targets on {name} ...", file=sys.stderr, flush=True)
    doc["targets"] = run_targets(dev, SIZES["smoke" if args.smoke else "full"])
    write()
    if not (args.smoke or args.skip_tests):
        print(f"[bench_gpu] library tests on {args.device} ...", file=sys.stderr, flush=True)
        doc["tests"] = run_tests(dev.type, args.tests_timeout, log=stem.with_name(stem.name + "-tests.log"))
        write()
    if not (args.smoke or args.skip_study):
        print(f"[bench_gpu] study step on {args.device} ...", file=sys.stderr, flush=True)
        doc["study"] = run_study(dev.type, args.study_steps, args.study_timeout)
    print(write())
    print(f"[bench_gpu] wrote {stem}.json and {stem}.md", file=sys.stderr)
    return doc


if __name__ == "__main__":
    main()
