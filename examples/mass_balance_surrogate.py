"""A mass-balance surrogate: an MLP predicts the flows of a small process, exact balances and non-negative flows.

Two feeds ``a`` and ``b`` (known per sample) enter a mixer together with a recycle ``r``; the mixer's outlet
``m`` goes to a splitter that sends it to two products ``p1``, ``p2``, a waste stream ``w`` and back as the
recycle. With the flows ``z = (m, p1, p2, r, w)`` the balances are

    mixer:    m - r                 = a + b
    splitter: m - p1 - p2 - r - w   = 0

a constraint ``A z = k`` with one ``A`` and a right-hand side ``k = (a + b, 0)`` per sample. The hidden "plant"
sets the splits from the feeds and an operating temperature; the waste is exactly zero over a third of the
operating range, so a surrogate without bounds predicts negative waste there.

An MLP maps ``(a, b, temperature)`` to a ``hardeq.nn.ConstrainedGaussianHead(..., lower=0.0)``: the Gaussian of
the flows conditioned on the balances and truncated to ``z >= 0``. It is trained with the closed-form expected
squared error of the untruncated conditional law (``dist.base.expected_l2``) and predicts with the truncated
law's ``mode`` (the most probable non-negative flows that meet both balances) and samples. The script prints
the worst per-row residual ``|(Az - k)_i| / (|A||z|)_i`` of the predictions and of samples for every balance row
(claim: below 1e-5 in float32), the smallest flow (claim: >= 0, exactly) and the test error. It exits with status
1, naming the claims that failed, when one does not hold.

Run: ``python examples/mass_balance_surrogate.py [--out DIR] [--seed S]``; core install and matplotlib.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

import hardeq
from hardeq.testing import exactness_tolerance, row_residual_ratio

DEFAULT_OUT = Path(__file__).resolve().parent / "figures"
FLOWS = ("m", "p1", "p2", "r", "w")
A = torch.tensor([[1.0, 0.0, 0.0, -1.0, 0.0],       # mixer:    m - r = a + b
                  [1.0, -1.0, -1.0, -1.0, -1.0]])   # splitter: m - p1 - p2 - r - w = 0


def plant(x: torch.Tensor) -> torch.Tensor:
    """The hidden process: inputs ``(a, b, T)`` ``(N, 3)`` to flows ``(N, 5)`` meeting both balances, >= 0."""
    a, b, T = x.unbind(-1)
    feed = a + b
    recycle_ratio = 0.2 + 0.3 * torch.sigmoid(3 * T)            # r / m
    m = feed / (1 - recycle_ratio)
    r = m - feed
    waste = feed * 0.3 * torch.relu(T - 0.3)                      # zero for T <= 0.3
    share = torch.sigmoid(2 * (a - b) / feed + T)                 # product split
    p1 = (feed - waste) * share
    p2 = feed - waste - p1
    return torch.stack([m, p1, p2, r, waste], -1)


def claims(r: dict[str, float]) -> list[tuple[str, bool]]:
    """Each claim the script prints, with whether the numbers ``r`` (what :func:`main` returns) meet it (a NaN
    meets none)."""
    tol = r["tol"]
    return [
        (f"the predicted flows meet both balances: worst per-row residual {r['worst_mode']:.2e} <= {tol:g}",
         r["worst_mode"] <= tol),
        (f"every sample meets both balances: worst per-row residual {r['worst_samples']:.2e} <= {tol:g}",
         r["worst_samples"] <= tol),
        (f"every predicted or sampled flow is >= 0 (smallest {r['min_flow']:.3g})", r["min_flow"] >= 0),
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
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)

    def inputs(n: int) -> torch.Tensor:
        ab = 0.5 + 1.5 * torch.rand(n, 2, generator=g)
        T = -1 + 2 * torch.rand(n, 1, generator=g)
        return torch.cat([ab, T], -1)

    def rhs(x: torch.Tensor) -> torch.Tensor:
        return torch.stack([x[:, 0] + x[:, 1], torch.zeros_like(x[:, 0])], -1)   # k per sample, (N, 2)

    x_train, x_test = inputs(2048), inputs(512)
    y_train, y_test = plant(x_train), plant(x_test)
    body = nn.Sequential(nn.Linear(3, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU())
    # min_scale: a floor on the predicted scales keeps the variances within a few decades of each other
    head = hardeq.nn.ConstrainedGaussianHead(64, 5, constraint_matrix=A, lower=0.0, min_scale=0.03)
    params = list(body.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(params, lr=3e-3)
    losses = []
    for _ in range(args.steps):
        batch = torch.randint(0, x_train.shape[0], (256,), generator=g)
        dist = head(body(x_train[batch]), rhs(x_train[batch]))        # TruncatedConstrainedNormal
        loss = dist.base.expected_l2(y_train[batch]).sum(-1).mean()   # closed form, untruncated law on the plane
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"trained {args.steps} steps: E||z - y||^2 from {losses[0]:.3f} to {sum(losses[-20:]) / 20:.4f}")

    with torch.no_grad():
        dist = head(body(x_test), rhs(x_test))
        mode, mean = dist.mode, dist.base.mean                        # (512, 5) each
        first = head(body(x_test[:32]), rhs(x_test[:32]))
        info = first.sample_with_info((16,), generator=g)             # exactly feasible draws, (16, 32, 5)
    tol = exactness_tolerance(torch.float32)
    ratio_mode = row_residual_ratio(dist.base.constraint, mode)       # (512, 2): one per sample and balance
    ratio_samples = row_residual_ratio(first.base.constraint, info.samples)
    worst_mode = [float(v) for v in ratio_mode.amax(0)]
    worst_samples = [float(v) for v in ratio_samples.flatten(0, 1).amax(0)]
    min_flow = float(torch.minimum(mode.min(), info.samples.min()))
    negative = float((mean < 0).any(-1).float().mean())
    mae_mode = float((mode - y_test).abs().mean())
    mae_mean = float((mean - y_test).abs().mean())
    print(f"worst per-row residual |(Az - k)_i| / (|A||z|)_i on {x_test.shape[0]} test samples, mode: "
          f"mixer {worst_mode[0]:.2e}, splitter {worst_mode[1]:.2e} (claim: <= {tol:g})")
    print(f"worst per-row residual of 16 samples ({info.method}) of 32 test inputs: mixer {worst_samples[0]:.2e}, "
          f"splitter {worst_samples[1]:.2e} (claim: <= {tol:g})")
    print(f"smallest predicted or sampled flow: {min_flow:.3g} (claim: >= 0)")
    print(f"test samples whose untruncated conditional mean has a negative flow: {100 * negative:.1f}%")
    print(f"test mean absolute error per flow: mode {mae_mode:.4f}, untruncated mean {mae_mean:.4f}")

    args.out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = x_test[:, 2].argsort()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].plot(x_test[order, 2], y_test[order, 4], "k.", ms=3, label="plant")
    axes[0].plot(x_test[order, 2], mean[order, 4], ".", ms=3, label="untruncated mean")
    axes[0].plot(x_test[order, 2], mode[order, 4], ".", ms=3, label="truncated mode (>= 0)")
    axes[0].axhline(0, color="grey", lw=0.5)
    axes[0].set(xlabel="temperature", ylabel="waste flow w", title="waste: zero below T = 0.3")
    axes[0].legend(fontsize=8)
    for i, name in enumerate(FLOWS):
        axes[1].plot(y_test[:, i], mode[:, i], ".", ms=2, label=name)
    top = float(y_test.max())
    axes[1].plot([0, top], [0, top], "k-", lw=0.5)
    axes[1].set(xlabel="plant flow", ylabel="predicted (mode)", title="all flows, test set")
    axes[1].legend(fontsize=8, markerscale=4)
    fig.tight_layout()
    path = args.out / "mass_balance_surrogate.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"figure: {path}")
    numbers = {"worst_mode": max(worst_mode), "worst_samples": max(worst_samples), "tol": tol, "min_flow": min_flow,
               "negative_share": negative, "mae_mode": mae_mode, "mae_mean": mae_mean}
    enforce(claims(numbers))
    return numbers


if __name__ == "__main__":
    main()
