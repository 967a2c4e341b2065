"""A mass-and-energy balance surrogate trained by the likelihood of a Gaussian conditioned on a NONLINEAR balance.

Two streams (flows f1, f2, temperatures T1, T2) mix into an outlet at temperature Tm. Per unit outlet flow the
balances are

    mass:    f1 + f2 = 1
    energy:  f1 T1 + f2 T2 - Tm = 0        (bilinear: a flow times a temperature)

A small network maps operating conditions x (a valve opening and two heater powers) to the mean of
z = (f1, f2, T1, T2, Tm); the model is ConstrainedNormal(loc(x), scale, constraint=NonlinearConstraint(h, 0)), a law
on the manifold {h(z) = 0}, trained by maximising its log_prob (Laplace normaliser, gradients through the mode by
implicit differentiation). The example then predicts with the mode and draws samples on the manifold.

Claims, checked at the end (the script exits non-zero if one fails):
  1. every predicted mode and every sample meets both balances per row (|h_i(z)| <= tol * s_i(z), tol 1e-12);
  2. training lowers the held-out negative log-likelihood by more than 2 nats per point;
  3. the mode's held-out RMSE is below half that of predicting the training mean;
  4. a plain MSE-trained network (no constraint) violates the energy balance by orders of magnitude more.

Run: ``python examples/nonlinear_energy_balance.py [--out DIR] [--seed S] [--steps N]``; core install and
matplotlib (for the figure). Exactness is the per-row criterion of the nonlinear constraint
(``NonlinearConstraint.row_ratio``: ``|h_i(z)| / s_i(z)``, docs/nonlinear.md).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from hardeq import ConstrainedNormal, NonlinearConstraint
from hardeq.manifold import feasibility_tol

DEFAULT_OUT = Path(__file__).resolve().parent / "figures"


def balance(z: torch.Tensor) -> torch.Tensor:
    """h(z) = (f1 + f2 - 1, f1 T1 + f2 T2 - Tm): (..., 5) -> (..., 2)."""
    f1, f2, t1, t2, tm = z.unbind(-1)
    return torch.stack([f1 + f2 - 1, f1 * t1 + f2 * t2 - tm], -1)


def plant(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The 'true' process: latent disturbances, then the physics; every z is exactly on the manifold."""
    v, p1, p2 = (x + 0.1 * torch.randn(x.shape, dtype=x.dtype, generator=gen)).unbind(-1)
    f1 = torch.sigmoid(3 * v)
    f2 = 1 - f1
    t1 = 1 + p1 + 0.3 * torch.sin(3 * p2)
    t2 = 2 + 0.5 * p2 ** 2
    return torch.stack([f1, f2, t1, t2, f1 * t1 + f2 * t2], -1)


def claims(r: dict[str, float]) -> list[tuple[str, bool]]:
    """Each claim the script prints, with whether the numbers ``r`` (what :func:`main` returns) meet it (a NaN
    meets none)."""
    tol = r["tol"]
    return [
        (f"every mode meets both balances per row: worst residual / scale {r['worst_mode']:.2e} <= {tol:g}",
         r["worst_mode"] <= tol),
        (f"every sample meets both balances per row: worst residual / scale {r['worst_samples']:.2e} <= {tol:g}",
         r["worst_samples"] <= tol),
        (f"held-out NLL per point lower by more than 2 nats ({r['nll_before']:.3f} -> {r['nll_after']:.3f})",
         r["nll_after"] < r["nll_before"] - 2),
        (f"mode RMSE {r['rmse_mode']:.4f} below half the training mean's {r['rmse_const']:.4f}",
         r["rmse_mode"] < 0.5 * r["rmse_const"]),
        (f"the plain network misses the energy balance 1e6x more (median {r['energy_plain']:.2e} against the "
         f"modes' max {r['energy_mode']:.2e})", r["energy_plain"] > 1e6 * max(r["energy_mode"], 1e-300)),
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the figure")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the model is tiny: one is fastest)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    dtype = torch.float64
    start = time.perf_counter()
    x_train = torch.rand(512, 3, dtype=dtype, generator=gen) * 2 - 1
    x_test = torch.rand(256, 3, dtype=dtype, generator=gen) * 2 - 1
    z_train, z_test = plant(x_train, gen), plant(x_test, gen)
    constraint = NonlinearConstraint(balance, torch.zeros(2, dtype=dtype))

    net = torch.nn.Sequential(torch.nn.Linear(3, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5)).to(dtype)
    with torch.no_grad():
        net[2].bias.copy_(z_train.mean(0))
    log_scale = torch.nn.Parameter(torch.full((5,), -1.0, dtype=dtype))
    opt = torch.optim.Adam([*net.parameters(), log_scale], lr=1e-2)

    def model(x: torch.Tensor) -> ConstrainedNormal:
        return ConstrainedNormal(net(x), log_scale.exp(), constraint=constraint)

    def test_nll() -> float:
        with torch.no_grad():
            return float(-model(x_test).log_prob(z_test).mean())

    nll_before = test_nll()
    for step in range(args.steps):
        idx = torch.randint(0, len(x_train), (128,), generator=gen)
        loss = -model(x_train[idx]).log_prob(z_train[idx]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"step {step:4d}  train NLL {float(loss.detach()):8.3f}")
    nll_after = test_nll()

    # a plain MSE network, for contrast (no constraint)
    plain = torch.nn.Sequential(torch.nn.Linear(3, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5)).to(dtype)
    opt_p = torch.optim.Adam(plain.parameters(), lr=1e-2)
    for _ in range(args.steps):
        idx = torch.randint(0, len(x_train), (128,), generator=gen)
        loss_p = (plain(x_train[idx]) - z_train[idx]).square().mean()
        opt_p.zero_grad()
        loss_p.backward()
        opt_p.step()

    with torch.no_grad():
        d = model(x_test)
        mode = d.mode
        samples = d.sample((20,))                       # linearised: exactly feasible draws
        z_plain = plain(x_test)
    tol = feasibility_tol(dtype)
    worst_mode = float(constraint.row_ratio(mode).max())
    worst_samples = float(constraint.row_ratio(samples).max())
    rmse_mode = float((mode - z_test).square().mean().sqrt())
    rmse_const = float((z_train.mean(0) - z_test).square().mean().sqrt())
    rmse_plain = float((z_plain - z_test).square().mean().sqrt())
    energy_plain = float(balance(z_plain)[..., 1].abs().median())
    energy_mode = float(balance(mode)[..., 1].abs().max())
    seconds = time.perf_counter() - start

    print(f"held-out NLL per point: {nll_before:.3f} before training, {nll_after:.3f} after")
    print(f"held-out RMSE: mode {rmse_mode:.4f}, plain MSE network {rmse_plain:.4f}, training mean {rmse_const:.4f}")
    print(f"worst per-row residual / scale: modes {worst_mode:.2e}, {samples.shape[0] * samples.shape[1]} samples "
          f"{worst_samples:.2e} (tol {tol:.0e})")
    print(f"energy balance |f1 T1 + f2 T2 - Tm|: mode max {energy_mode:.2e}, plain network median {energy_plain:.2e}")
    print(f"time {seconds:.1f} s")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    names = ["f1", "f2", "T1", "T2", "Tm"]
    for i, name in enumerate(names):
        axes[0].plot(z_test[:, i], mode[:, i], ".", ms=2, label=name)
    top = float(z_test.max())
    axes[0].plot([0, top], [0, top], "k-", lw=0.5)
    axes[0].set(xlabel="plant", ylabel="predicted (mode)", title="held-out points: the mode")
    axes[0].legend(fontsize=8, markerscale=4)
    plain_res = balance(z_plain)[..., 1].abs().clamp_min(1e-18)
    sample_res = balance(samples)[..., 1].abs().flatten().clamp_min(1e-18)
    edges = [e / 2 for e in range(-36, 3)]  # log10 residual; an exact 0 is drawn at -18
    axes[1].hist(plain_res.log10().tolist(), bins=edges, alpha=0.7, label="plain MSE network")
    axes[1].hist(sample_res.log10().tolist(), bins=edges, alpha=0.7, label="ManifoldNormal samples")
    axes[1].set(xlabel="log10 |f1 T1 + f2 T2 - Tm|", ylabel="count", title="energy balance residual")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    path = args.out / "nonlinear_energy_balance.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"figure: {path}")
    numbers = {"worst_mode": worst_mode, "worst_samples": worst_samples, "tol": tol, "nll_before": nll_before,
               "nll_after": nll_after, "rmse_mode": rmse_mode, "rmse_const": rmse_const,
               "energy_mode": energy_mode, "energy_plain": energy_plain}
    enforce(claims(numbers))
    return numbers


if __name__ == "__main__":
    main()
