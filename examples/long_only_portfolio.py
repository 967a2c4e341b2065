"""A long-only portfolio head: weights in [0, 1] that sum to one, by conditioning and truncation.

A linear model of six assets' next-day returns on four observed factors generates 1,536 days of data. A small
network maps the factors to a ``hardeq.nn.ConstrainedGaussianHead`` with ``constraint_value=1.0, lower=0.0,
upper=1.0``: the Gaussian of the weights conditioned on ``sum w = 1`` and truncated to ``[0, 1]^6``, a
``hardeq.TruncatedConstrainedNormal``. Its targets are the day's hindsight allocation
``softmax(returns / 0.02)`` (long-only, summing to one). It is trained for a few epochs with the closed-form
expected squared error ``E||w - y||^2`` of the untruncated conditional law (``dist.base.expected_l2(y)``: exact,
no sampling, and it never leaves the plane ``sum w = 1``), and used through the truncated law: its ``mode``
(the most probable feasible portfolio, an exact QP) and its samples (exactly feasible draws). Training by the
truncated density instead, ``-dist.log_prob(y)``, also works: in ``train()`` the head builds the truncated law
with its persistent Gibbs chains, which give the gradient of ``log P(box | plane)`` in a few sweeps per step
(docs/bounds.md).

On the held-out days it prints the worst per-row residual ``|sum w - 1| / sum |w|`` of the mode and of samples
(claim: below 1e-5 in float32), the smallest and largest weight (claim: in [0, 1], exactly, no clipping), and
the mean daily return of the mode portfolio against equal weights. The script exits with status 1, naming the
claims that failed, when one does not hold.

Run: ``python examples/long_only_portfolio.py [--out DIR] [--seed S]``; core install and matplotlib.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

import hardeq
from hardeq.testing import exactness_tolerance, row_residual_ratio

DEFAULT_OUT = Path(__file__).resolve().parent / "figures"


def make_returns(days: int, assets: int, factors: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Factors ``x`` ``(days, factors)`` and next-day returns ``r = x B + noise`` ``(days, assets)``."""
    x = torch.randn(days, factors, generator=generator)
    B = 0.01 * torch.randn(factors, assets, generator=generator)
    drift = torch.linspace(-0.002, 0.002, assets)
    r = drift + x @ B + 0.01 * torch.randn(days, assets, generator=generator)
    return x, r


def claims(r: dict[str, float]) -> list[tuple[str, bool]]:
    """Each claim the script prints, with whether the numbers ``r`` (what :func:`main` returns) meet it (a NaN
    meets none)."""
    tol = r["tol"]
    return [
        (f"the mode's weights sum to one: worst per-row residual {r['worst_mode']:.2e} <= {tol:g}",
         r["worst_mode"] <= tol),
        (f"every sample's weights sum to one: worst per-row residual {r['worst_samples']:.2e} <= {tol:g}",
         r["worst_samples"] <= tol),
        (f"every weight lies in [0, 1] (got [{r['w_min']:.3g}, {r['w_max']:.3g}])",
         0 <= r["w_min"] and r["w_max"] <= 1),
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
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    assets, factors, days, test_days = 6, 4, 1536, 256
    x, r = make_returns(days + test_days, assets, factors, g)
    y = torch.softmax(r / 0.02, dim=-1)                           # hindsight long-only weights, sum to one
    x_train, y_train, x_test, r_test = x[:days], y[:days], x[days:], r[days:]

    body = nn.Sequential(nn.Linear(factors, 32), nn.Tanh())
    head = hardeq.nn.ConstrainedGaussianHead(32, assets, constraint_matrix=torch.ones(1, assets),
                                             constraint_value=1.0, lower=0.0, upper=1.0)
    model = nn.ModuleDict({"body": body, "head": head})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for epoch in range(args.epochs):
        perm = torch.randperm(days, generator=g)
        for start in range(0, days, 128):
            batch = perm[start:start + 128]
            dist = head(body(x_train[batch]))                       # a TruncatedConstrainedNormal, batch (128,)
            loss = dist.base.expected_l2(y_train[batch]).sum(-1).mean()   # closed form, on the plane
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        print(f"epoch {epoch + 1}: mean E||w - y||^2 {sum(losses[-12:]) / 12:.4f}")

    with torch.no_grad():
        dist = head(body(x_test))
        w_mode = dist.mode                                            # (256, 6)
        # exactly feasible draws for the first 32 days (exact HMC on the plane here: the box holds little of it,
        # and HMC costs far more than a draw of the plane, so not all 256 days)
        first = head(body(x_test[:32]))
        info = first.sample_with_info((16,), generator=g)
        w_samples = info.samples                                      # (16, 32, 6)
        untruncated = dist.base.mean                                  # the plane's mean, before the box
    constraint = dist.base.constraint
    tol = exactness_tolerance(torch.float32)
    worst_mode = float(row_residual_ratio(constraint, w_mode).max())
    worst_samples = float(row_residual_ratio(first.base.constraint, w_samples).max())
    w_min = float(torch.minimum(w_mode.min(), w_samples.min()))
    w_max = float(torch.maximum(w_mode.max(), w_samples.max()))
    negative = float((untruncated < 0).any(-1).float().mean())
    ret_model = float((w_mode * r_test).sum(-1).mean())
    ret_equal = float(r_test.mean())
    print(f"held-out days: {x_test.shape[0]}; worst per-row residual |sum w - 1| / sum|w|: mode {worst_mode:.2e}, "
          f"16 samples ({info.method}) on each of 32 days {worst_samples:.2e} (claim: <= {tol:g})")
    print(f"smallest weight {w_min:.3g}, largest {w_max:.3g} (claim: in [0, 1])")
    print(f"days whose untruncated conditional mean has a negative weight: {100 * negative:.1f}% (the box matters)")
    print(f"mean daily return: mode portfolio {1e4 * ret_model:.2f} bp, equal weights {1e4 * ret_equal:.2f} bp")

    args.out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].plot(losses)
    axes[0].set(xlabel="step", ylabel="E||w - y||^2 (closed form)", title="training")
    days_shown = torch.arange(60)
    axes[1].stackplot(days_shown, w_mode[:60].T, labels=[f"asset {i}" for i in range(assets)])
    axes[1].set(xlabel="held-out day", ylabel="weight (mode)", ylim=(0, 1), title="long-only weights sum to one")
    axes[1].legend(fontsize=7, loc="upper right", ncol=2)
    fig.tight_layout()
    path = args.out / "long_only_portfolio.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"figure: {path}")
    numbers = {"worst_mode": worst_mode, "worst_samples": worst_samples, "tol": tol, "w_min": w_min, "w_max": w_max,
               "negative_share": negative, "return_model_bp": 1e4 * ret_model, "return_equal_bp": 1e4 * ret_equal}
    enforce(claims(numbers))
    return numbers


if __name__ == "__main__":
    main()
