"""Grouped conditioning over a PyG batch against the ICML code's per-graph Python loop, on real MOF batches.

For batches of ``--batch`` real MOF graphs (study ``mof``'s data), per-atom ``mu`` and variances ``v``:

* **grouped** (hardeq): one :class:`~hardeq.SumConstraint` over the ``batch`` vector
  (:func:`hardeq.nn.graph_normal`): O(atoms), no loop over graphs;
* **loop** (as the ICML 2025 code, ``model.py`` / ``main.py``): a Python loop over graphs with boolean masks
  ``batch == i``; the NLL and the samples use a dense ``MultivariateNormal`` on the first ``n - 1`` atoms
  with covariance ``A - A B A / (1 + tr(B A))``.

Operations (float64 like the ICML code, forward and backward where training needs it): conditional mean and
variance, expected-L1 loss, NLL loss, one sample. The script checks that both give the same numbers and
reports the median times and their ratio, measured in this one run; then the share of one training step of
the closed-form configuration (E=20, H=50, T=6, float32 network, float64 head) spent in the constraint.

    python benchmarks/bench_mof_conditioning.py [--batch 128] [--batches 3] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import torch
from torch.distributions import MultivariateNormal

from hardeq import ConstrainedNormal, SumConstraint
from hardeq.nn import graph_normal, per_graph_log_prob


def graph_normal_batched(mu, v, batch, G):
    """The same distribution with a leading batch dimension of 1 (``loc`` (1, N), ``total`` (1, G)): the
    conditioner then takes its scatter/gather path instead of the dense one-hot GEMM it uses for a 1-D
    covariance with ``a * n <= 2**24`` (see the benchmark README section)."""
    con = SumConstraint(batch, mu.new_zeros(1, G), validate_args=False)
    return ConstrainedNormal(mu[None], v.sqrt()[None], constraint=con, validate_args=False)


def loop_conditional(mu, v, batch, G):
    """The ICML code's ``Net_gaussian_correction_with_erf_loss.forward``: masks per graph."""
    mean_bar, var_bar = torch.empty_like(mu), torch.empty_like(v)
    for i in range(G):
        m = batch == i
        mean_bar[m] = mu[m] + v[m] * (0 - torch.sum(mu[m])) / torch.sum(v[m])
        var_bar[m] = v[m] - torch.square(v[m]) / torch.sum(v[m])
    return mean_bar, var_bar


def loop_expected_l1(mu, v, y, batch, G):
    mean, var = loop_conditional(mu, v, batch, G)
    d = mean - y
    return ((2 * var / math.pi) ** 0.5 * torch.exp(-d**2 / (2 * var)) + d * torch.erf(d * (2 * var) ** -0.5)).mean()


def _reduced(mu, v):
    """The ICML code's ``multivariate_mean_variance`` (first n - 1 coordinates, k = 0)."""
    n = len(v)
    A = torch.diag(v[:-1])
    B = torch.ones(n - 1, n - 1, dtype=v.dtype) / v[-1]
    cov = A - 1 / (1 + torch.trace(B @ A)) * (A @ (B @ A))
    c = (0 - mu[-1]) / v[-1]
    return cov @ (torch.ones(n - 1, dtype=v.dtype) * c + mu[:-1] / v[:-1]), cov


def loop_nll(mu, v, y, batch, G):
    total = mu.new_zeros(())
    for i in range(G):
        m = batch == i
        mean, cov = _reduced(mu[m], v[m])
        total = total - MultivariateNormal(mean, covariance_matrix=cov).log_prob(y[m][:-1])
    return total


def loop_sample(mu, v, batch, G, eps):
    out = torch.empty_like(mu)
    for i in range(G):
        m = batch == i
        mean, cov = _reduced(mu[m], v[m])
        x = mean + torch.linalg.cholesky(cov) @ eps[m][:-1]
        out[m] = torch.cat([x, -x.sum()[None]])
    return out


def timeit(fn, repeats):
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bench_batch(b, g: torch.Generator, repeats: int, rows: dict, diffs: dict) -> None:
    """Time every operation on batch ``b``, grouped (both paths) and looped; record the largest differences."""
    G, batch, y = int(b.num_graphs), b.batch, b.y.double()
    N = len(y)
    mu0 = 0.3 * torch.randn(N, generator=g, dtype=torch.float64)
    v0 = torch.nn.functional.softplus(torch.randn(N, generator=g, dtype=torch.float64))
    eps = torch.randn(N, generator=g, dtype=torch.float64)

    def leaf():
        return mu0.clone().requires_grad_(), v0.clone().requires_grad_()

    def grouped_cond():
        d = graph_normal(mu0, v0, batch, num_graphs=G)
        return d.mean, d.variance

    def grouped_l1():
        mu, v = leaf()
        graph_normal(mu, v, batch, num_graphs=G).expected_l1(y).mean().backward()
        return mu.grad

    def looped_l1():
        mu, v = leaf()
        loop_expected_l1(mu, v, y, batch, G).backward()
        return mu.grad

    def grouped_nll():
        mu, v = leaf()
        (-graph_normal(mu, v, batch, num_graphs=G).log_prob(y).sum()).backward()  # per graph, (G,)
        return mu.grad

    def looped_nll():
        mu, v = leaf()
        loop_nll(mu, v, y, batch, G).backward()
        return mu.grad

    def grouped_sample():
        return graph_normal(mu0, v0, batch, num_graphs=G).rsample((1,), noise=eps[None])[0]

    def scatter_cond():
        d = graph_normal_batched(mu0, v0, batch, G)
        return d.mean[0], d.variance[0]

    def scatter_l1():
        mu, v = leaf()
        graph_normal_batched(mu, v, batch, G).expected_l1(y[None]).mean().backward()
        return mu.grad

    def scatter_nll():
        mu, v = leaf()
        (-graph_normal_batched(mu, v, batch, G).log_prob(y[None])).sum().backward()
        return mu.grad

    def scatter_sample():
        return graph_normal_batched(mu0, v0, batch, G).rsample((1,), noise=eps[None, None])[0, 0]

    ops = {"conditional mean + variance (fwd)": (grouped_cond, lambda: loop_conditional(mu0, v0, batch, G)),
           "expected L1 (fwd + bwd)": (grouped_l1, looped_l1),
           "NLL (fwd + bwd)": (grouped_nll, looped_nll),
           "one sample (fwd)": (grouped_sample, lambda: loop_sample(mu0, v0, batch, G, eps))}
    for name, (fg, fl) in ops.items():
        a, c = fg(), fl()
        if name.startswith("one sample"):  # same law, different factorisation: compare the constraint only
            sums = torch.zeros(G, dtype=a.dtype).index_add_(0, batch, a)
            diffs[name] = max(diffs.get(name, 0.0), float(sums.abs().max()))
        else:
            a, c = (a[0], c[0]) if isinstance(a, tuple) else (a, c)
            diffs[name] = max(diffs.get(name, 0.0), float((a - c).abs().max()))
        fs = {"conditional": scatter_cond, "expected": scatter_l1, "NLL": scatter_nll,
              "one": scatter_sample}[name.split()[0]]
        a2 = fs()
        a2 = a2[0] if isinstance(a2, tuple) else a2
        a1 = fg()
        a1 = a1[0] if isinstance(a1, tuple) else a1
        if not name.startswith("one sample"):
            diffs[name] = max(diffs[name], float((a1 - a2).abs().max()))
        rows.setdefault(name, []).append((timeit(fg, repeats), timeit(fl, repeats),
                                          timeit(fs, repeats)))
    nll_here = -per_graph_log_prob(mu0, v0, batch, y, num_graphs=G).sum()
    nll_loop = loop_nll(mu0, v0, y, batch, G)
    counts = torch.bincount(batch, minlength=G).double()
    diffs["NLL value (plane - 0.5 log n convention)"] = max(
        diffs.get("NLL value (plane - 0.5 log n convention)", 0.0),
        float((nll_here - 0.5 * counts.log().sum() - nll_loop).abs() / nll_loop.abs()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.distributions.Distribution.set_default_validate_args(False)
    from hardeq_studies.mof.data import collate, load_graphs
    from hardeq_studies.mof.models import build_member

    data = load_graphs()
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(data), generator=g).tolist()
    batches = [collate([data.graphs[i] for i in perm[k * args.batch:(k + 1) * args.batch]])
               for k in range(args.batches)]
    rows, diffs = {}, {}
    for b in batches:
        bench_batch(b, g, args.repeats, rows, diffs)
    atoms = statistics.mean(len(b.y) for b in batches)
    print(f"torch {torch.__version__}, {platform.machine()}, {args.threads} thread(s); {args.batches} real batches "
          f"of {args.batch} MOFs (mean {atoms:.0f} atoms), float64, median of {args.repeats} repeats\n")
    print("| operation | grouped, 1-D (ms) | grouped, scatter path (ms) | per-graph loop (ms) | loop / grouped 1-D "
          "| loop / scatter path | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, ts in rows.items():
        tg, tl, ts_ = (statistics.mean(t[j] for t in ts) * 1e3 for j in range(3))
        print(f"| {name} | {tg:.2f} | {ts_:.2f} | {tl:.1f} | {tl / tg:,.0f}x | {tl / ts_:,.0f}x | {diffs[name]:.1e} |")
    print(f"\nNLL values agree (relative): {diffs['NLL value (plane - 0.5 log n convention)']:.1e}; "
          "the sample row's diff is the largest |sum| of a grouped sample per graph.")

    # share of a training step (closed-form configuration) spent in the constraint
    torch.manual_seed(0)
    model = build_member({"embedding": 20, "hidden": 50, "steps": 6}, 0)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    b = batches[0]
    G, y = int(b.num_graphs), b.y.double()

    def step():
        out = model(b)
        loss = graph_normal(out[:, 0], out[:, 1], b.batch, num_graphs=G).expected_l1(y).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    with torch.no_grad():
        out0 = model(b)

    def constraint_only():
        mu, v = out0[:, 0].clone().requires_grad_(), out0[:, 1].clone().requires_grad_()
        graph_normal(mu, v, b.batch, num_graphs=G).expected_l1(y).mean().backward()

    def constraint_scatter():
        mu, v = out0[:, 0].clone().requires_grad_(), out0[:, 1].clone().requires_grad_()
        graph_normal_batched(mu, v, b.batch, G).expected_l1(y[None]).mean().backward()

    t_step, t_c = timeit(step, args.repeats), timeit(constraint_only, args.repeats)
    t_s = timeit(constraint_scatter, args.repeats)
    print(f"\nTraining step, closed-form configuration, one batch of {G} MOFs ({len(y)} atoms): "
          f"{t_step * 1e3:.0f} ms; the constraint (conditioning + expected L1, forward and backward): "
          f"{t_c * 1e3:.2f} ms = {100 * t_c / t_step:.1f}% of the step with the 1-D distribution the head returns, "
          f"{t_s * 1e3:.2f} ms = {100 * t_s / t_step:.1f}% on the scatter path.")


if __name__ == "__main__":
    main()
