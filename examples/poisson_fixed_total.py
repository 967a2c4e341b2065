"""Counts with fixed totals: ``hardeq.ConstrainedPoisson`` is a multinomial per group.

Independent Poisson counts ``z_i ~ Poi(r_i)`` conditioned on their group sums ``sum_{i in g} z_i = k_g`` are a
multinomial per group with probabilities ``p_i = r_i / sum_{j in g} r_j``. This script builds two groups (one
of three coordinates with total 12, one of four with total 7, and a second batch element with other rates and
totals) and checks, with numbers it prints:

1. every sample meets its totals exactly (integer sums, no tolerance);
2. ``log_prob`` equals the multinomial log-pmf computed independently (``scipy.stats.multinomial`` when SciPy
   is installed, else ``math.comb`` products), on every sample drawn;
3. the closed-form expected L1 loss ``E|z_i - y_i|`` equals the sum over the binomial marginal computed by
   hand and agrees with its Monte Carlo estimate from the samples (within 4 standard errors);
4. the sample frequencies of one coordinate match its ``Binomial(k, p)`` marginal.

Each claim is checked: the script exits with status 1, naming the claims that failed, when one does not hold.

Run: ``python examples/poisson_fixed_total.py [--out DIR] [--seed S]``; needs only the core install (SciPy and
matplotlib for the figure: ``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

import hardeq

DEFAULT_OUT = Path(__file__).resolve().parent / "figures"


def multinomial_log_pmf(counts: list[int], probs: list[float]) -> float:
    """Independent reference: ``log( k! / prod z_i! * prod p_i^z_i )`` (SciPy when available, else math)."""
    try:
        from scipy.stats import multinomial
    except ImportError:  # pragma: no cover - SciPy is optional
        total = sum(counts)
        log_coef, rest = 0.0, total
        for z in counts:
            log_coef += math.log(math.comb(rest, z))
            rest -= z
        return log_coef + sum(z * math.log(p) for z, p in zip(counts, probs) if z)
    return float(multinomial.logpmf(counts, n=sum(counts), p=probs))


def binomial_expected_l1(k: int, p: float, y: float) -> float:
    """Independent reference: ``E|Z - y|`` for ``Z ~ Bin(k, p)``, summed over the support with ``math.comb``."""
    return sum(math.comb(k, j) * p ** j * (1 - p) ** (k - j) * abs(j - y) for j in range(k + 1))


def claims(r: dict[str, float]) -> list[tuple[str, bool]]:
    """Each claim the script prints, with whether the numbers ``r`` (what :func:`main` returns) meet it (a NaN
    meets none)."""
    return [
        (f"every sample is a non-negative integer vector (got {r['integer']:g}, 1 = yes)", r["integer"] == 1),
        (f"every group sum equals its total exactly (largest error {r['max_total_error']:g})",
         r["max_total_error"] == 0),
        (f"log_prob equals the multinomial log-pmf to < 1e-10 (got {r['max_logpmf_error']:.2e})",
         r["max_logpmf_error"] < 1e-10),
        (f"expected_l1 equals the binomial sum to < 1e-12 (got {r['max_l1_error']:.2e})", r["max_l1_error"] < 1e-12),
        (f"expected_l1 is within 4 standard errors of the Monte Carlo mean (got {r['max_l1_z']:.2f})",
         r["max_l1_z"] < 4),
        (f"one coordinate's frequencies are within 4 standard errors at worst of its binomial pmf "
         f"(got {r['max_freq_error']:.4f}, bound {r['freq_bound']:.4f})", r["max_freq_error"] < r["freq_bound"]),
    ]


def enforce(checked: list[tuple[str, bool]]) -> None:
    """Print that every claim holds, or exit with status 1 and the claims that fail (running the script is a
    check: a claim that does not hold is an error, never just a printed number)."""
    failed = [claim for claim, ok in checked if not ok]
    if failed:
        raise SystemExit(f"{Path(__file__).name}: {len(failed)} of {len(checked)} claims failed:\n"
                         + "\n".join(f"  - {claim}" for claim in failed))
    print(f"all {len(checked)} claims hold")


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the figure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (these models are tiny: one is fastest, and a busy machine's "
                             "cores are not oversubscribed)")
    parser.add_argument("--samples", type=int, default=20000)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    index = torch.tensor([0, 0, 0, 1, 1, 1, 1])                       # two groups: 3 and 4 coordinates
    rate = torch.tensor([[1.0, 2.0, 5.0, 0.5, 0.5, 1.0, 3.0],         # batch element 0
                         [4.0, 1.0, 1.0, 2.0, 0.1, 0.2, 0.7]], dtype=torch.float64)
    total = torch.tensor([[12.0, 7.0], [3.0, 20.0]], dtype=torch.float64)
    dist = hardeq.ConstrainedPoisson(rate, constraint=hardeq.SumConstraint(index, total))

    # 1. exact totals
    z = dist.sample((args.samples,))                                   # (S, 2, 7) integer-valued floats
    sums = torch.zeros(args.samples, 2, 2, dtype=torch.float64).index_add_(-1, index, z)
    max_total_error = float((sums - total).abs().max())
    integer = bool((z == z.round()).all() and (z >= 0).all())
    print(f"samples: {tuple(z.shape)}, non-negative integers: {integer}")
    print(f"max |group sum - total| over {args.samples} samples x 2 batch x 2 groups: {max_total_error:g} "
          "(claim: 0, exactly)")

    # 2. log_prob against the multinomial computed independently
    probs = dist.probs
    check = z[:200]
    lp = dist.log_prob(check)                                          # (200, 2): one value per batch element
    ref = torch.zeros_like(lp)
    for s in range(check.shape[0]):
        for b in range(2):
            for g in range(2):
                members = (index == g).nonzero().flatten().tolist()
                ref[s, b] += multinomial_log_pmf([int(check[s, b, i]) for i in members],
                                                 [float(probs[b, i]) / float(probs[b, members].sum())
                                                  for i in members])
    max_logpmf_error = float((lp - ref).abs().max())
    print(f"max |log_prob - multinomial log-pmf| on 200 samples: {max_logpmf_error:.2e} (claim: < 1e-10)")

    # 3. the closed-form expected L1 loss
    y = torch.tensor([[4.0, 3.0, 5.0, 1.0, 2.0, 1.0, 3.0],
                      [1.0, 1.0, 1.0, 10.0, 0.0, 2.0, 8.0]], dtype=torch.float64)
    l1 = dist.expected_l1(y)                                           # (2, 7)
    k_node = total.gather(-1, index.expand(2, -1))
    p_node = probs / torch.zeros_like(total).index_add_(-1, index, probs).gather(-1, index.expand(2, -1))
    exact = torch.tensor([[binomial_expected_l1(int(k_node[b, i]), float(p_node[b, i]), float(y[b, i]))
                           for i in range(7)] for b in range(2)], dtype=torch.float64)
    max_l1_error = float((l1 - exact).abs().max())
    mc = (z - y).abs()
    mc_mean, mc_se = mc.mean(0), mc.std(0) / math.sqrt(args.samples)
    max_l1_z = float(((l1 - mc_mean).abs() / mc_se).max())
    print(f"expected_l1, batch element 0: {[round(v, 4) for v in l1[0].tolist()]}")
    print(f"max |expected_l1 - binomial sum (math.comb)|: {max_l1_error:.2e} (claim: < 1e-12)")
    print(f"max |expected_l1 - Monte Carlo mean| / standard error: {max_l1_z:.2f} (claim: < 4)")

    # 4. one coordinate's frequencies against its Binomial(k, p) marginal
    marginal = dist.marginal()
    support = torch.arange(13, dtype=torch.float64)
    freq = torch.stack([(z[:, 0, 2] == j).double().mean() for j in support])
    values = support[:, None, None].expand(-1, 2, 7).minimum(k_node)    # inside every coordinate's support
    pmf = marginal.log_prob(values)[:, 0, 2].exp()
    max_freq_error = float((freq - pmf).abs().max())
    freq_bound = 4 * 0.5 / math.sqrt(args.samples)                    # the standard error is <= 0.5 / sqrt(S)
    print(f"max |frequency - Binomial(12, {float(p_node[0, 2]):.3f}) pmf| of coordinate 2: {max_freq_error:.4f} "
          f"(claim: < {freq_bound:.4f}, four standard errors at worst)")

    args.out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    axes[0].bar(support - 0.2, freq, width=0.4, label=f"{args.samples} samples")
    axes[0].bar(support + 0.2, pmf, width=0.4, label="Binomial(12, p) pmf")
    axes[0].set(xlabel="z_2 (group 0, total 12)", ylabel="probability", title="a coordinate's marginal")
    x = torch.arange(7)
    axes[1].bar(x - 0.2, mc_mean[0], width=0.4, yerr=2 * mc_se[0], label="Monte Carlo mean (2 se)")
    axes[1].bar(x + 0.2, l1[0].detach(), width=0.4, label="expected_l1 (closed form)")
    axes[1].set(xlabel="coordinate", ylabel="E|z_i - y_i|", title="expected L1 loss, batch element 0")
    for ax in axes:  # the legends above the axes, clear of the bars
        ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.12), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    path = args.out / "poisson_fixed_total.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"figure: {path}")
    numbers = {"integer": float(integer), "max_total_error": max_total_error, "max_logpmf_error": max_logpmf_error,
               "max_l1_error": max_l1_error, "max_l1_z": max_l1_z, "max_freq_error": max_freq_error,
               "freq_bound": freq_bound, "samples": float(args.samples)}
    enforce(claims(numbers))
    return numbers


if __name__ == "__main__":
    main()
