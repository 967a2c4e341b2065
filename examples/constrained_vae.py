"""A VAE whose latent lies on a plane and whose reconstructions keep the data's total, exactly.

Generated data: 24-dimensional non-negative "spectra" (mixtures of three Gaussian bumps at nearly fixed
positions whose weights vary: about two degrees of freedom, as many as the latent plane has), each normalised
to total intensity 10, so every data vector lies on the plane ``sum x = 10``.
The VAE uses the ``hardeq.nn`` pieces:

* ``ConstrainedGaussianLatent``: the posterior ``q(z|x) = N(mu, diag sigma^2 | sum z = 0)`` on a plane in a
  3-dimensional latent space (two free dimensions), with the prior ``N(0, I | sum z = 0)`` on the same plane and
  the closed-form ``KL(q || p)``;
* ``ConstrainedGaussianObservation``: the decoder's ``N(m, diag e^v | sum x = 10)``, whose ``log_prob`` is the
  exact density on the data plane and whose ``mean`` (the reconstruction) sums to 10.

It trains for a few epochs on the negative ELBO and prints, with the claims: the worst per-row residual of the
posterior samples on the latent plane and of the reconstructions on the data plane (``hardeq.testing``; claim:
below 1e-5 in float32), the test ELBO per example (a density on the 23-dimensional data plane, in nats), and the
KL term (finite: prior and posterior share the plane), and that training improved the test ELBO (claim: by more
than 5 nats per example from the first epoch to the last). The script exits with status 1, naming the claims
that failed, when one does not hold.

Run: ``python examples/constrained_vae.py [--out DIR] [--seed S]``; core install and matplotlib.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import nn

import hardeq
from hardeq.nn import ConstrainedGaussianLatent, ConstrainedGaussianObservation
from hardeq.testing import exactness_tolerance, row_residual_ratio

DEFAULT_OUT = Path(__file__).resolve().parent / "figures"
DIM, LATENT, TOTAL = 24, 3, 10.0


def spectra(n: int, generator: torch.Generator) -> torch.Tensor:
    """``(n, DIM)`` non-negative vectors, each a sum of three bumps, scaled to total ``TOTAL``."""
    grid = torch.linspace(0, 1, DIM)
    centres = torch.tensor([0.2, 0.5, 0.8]) + 0.02 * torch.randn(n, 3, generator=generator)
    weights = torch.softmax(torch.randn(n, 3, generator=generator), -1)
    x = (weights.unsqueeze(-1) * torch.exp(-((grid - centres.unsqueeze(-1)) / 0.07) ** 2 / 2)).sum(1)
    x = x + 0.01 * torch.rand(n, DIM, generator=generator)
    return TOTAL * x / x.sum(-1, keepdim=True)


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        latent_plane = hardeq.SumConstraint(torch.zeros(LATENT, dtype=torch.long), torch.zeros(1))
        data_plane = hardeq.SumConstraint(torch.zeros(DIM, dtype=torch.long), torch.tensor([TOTAL]))
        self.encoder = nn.Sequential(nn.Linear(DIM, 64), nn.SiLU())
        self.latent = ConstrainedGaussianLatent(64, LATENT, latent_plane)
        self.decoder = nn.Sequential(nn.Linear(LATENT, 64), nn.SiLU(), nn.Linear(64, 2 * DIM))
        self.observation = ConstrainedGaussianObservation(data_plane)

    def forward(self, x: torch.Tensor):
        q = self.latent(self.encoder(x))                            # N(mu, diag sigma^2 | sum z = 0)
        z = q.rsample()                                             # exact, pathwise
        mean, log_var = self.decoder(z).chunk(2, -1)
        p = self.observation(mean, log_var)                         # N(m, diag e^v | sum x = TOTAL)
        elbo = p.log_prob(x) - self.latent.kl(q)                    # (batch,)
        return elbo, q, z, p


def claims(r: dict[str, float]) -> list[tuple[str, bool]]:
    """Each claim the script prints, with whether the numbers ``r`` (what :func:`main` returns) meet it (a NaN
    meets none)."""
    tol = r["tol"]
    return [
        (f"the latent samples lie on sum z = 0: worst per-row residual {r['worst_latent']:.2e} <= {tol:g}",
         r["worst_latent"] <= tol),
        (f"the reconstructions keep the total: worst per-row residual {r['worst_recon']:.2e} <= {tol:g}",
         r["worst_recon"] <= tol),
        (f"the decoder samples keep the total: worst per-row residual {r['worst_decoded']:.2e} <= {tol:g}",
         r["worst_decoded"] <= tol),
        (f"KL(q || p) is finite (got {r['kl']:.2f} nats)", math.isfinite(r["kl"])),
        (f"training improves the test ELBO by more than 5 nats ({r['first_elbo']:.2f} -> {r['test_elbo']:.2f})",
         r["test_elbo"] > r["first_elbo"] + 5),
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
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    x_train, x_test = spectra(4096, g), spectra(512, g)

    vae = VAE()
    opt = torch.optim.Adam(vae.parameters(), lr=5e-3)
    history = []
    for epoch in range(args.epochs):
        perm = torch.randperm(x_train.shape[0], generator=g)
        for start in range(0, x_train.shape[0], 128):
            elbo, *_ = vae(x_train[perm[start:start + 128]])
            loss = -elbo.mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            test_elbo = float(vae(x_test)[0].mean())
        history.append(test_elbo)
        print(f"epoch {epoch + 1}: test ELBO {test_elbo:.2f} nats per example (on the 23-dimensional data plane)")

    with torch.no_grad():
        elbo, q, z, p = vae(x_test)
        kl = vae.latent.kl(q)
        recon = p.mean                                              # (512, 24), sums to TOTAL
        samples = p.sample((4,))                                    # (4, 512, 24)
    tol = exactness_tolerance(torch.float32)
    worst_latent = float(row_residual_ratio(q.constraint, z).max())
    worst_recon = float(row_residual_ratio(p.constraint, recon).max())
    worst_decoded = float(row_residual_ratio(p.constraint, samples).max())
    rel_error = float(((recon - x_test).norm(dim=-1) / x_test.norm(dim=-1)).mean())
    print(f"worst per-row residual: latent samples on sum z = 0 {worst_latent:.2e}, reconstructions on "
          f"sum x = {TOTAL:g} {worst_recon:.2e}, decoder samples {worst_decoded:.2e} (claim: <= {tol:g})")
    print(f"test: ELBO {float(elbo.mean()):.2f} nats (claim: above the first epoch's {history[0]:.2f} + 5), "
          f"KL(q || p) mean {float(kl.mean()):.2f} nats (claim: finite, same plane), relative reconstruction error "
          f"{rel_error:.3f}")

    args.out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # orthonormal coordinates of the latent plane sum z = 0
    basis = torch.linalg.qr(torch.eye(LATENT) - 1.0 / LATENT)[0][:, : LATENT - 1]
    coords = q.mean @ basis
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(range(1, args.epochs + 1), history, "o-")
    axes[0].set(xlabel="epoch", ylabel="test ELBO (nats)", title="training")
    heavy = torch.softmax(x_test[:, [5, 12, 19]], -1)
    axes[1].scatter(coords[:, 0], coords[:, 1], c=heavy.numpy(), s=6)
    axes[1].set(xlabel="plane coordinate 1", ylabel="plane coordinate 2",
                title="posterior means on sum z = 0\n(colour: bump weights)")
    axes[1].set_aspect("equal")
    for i, colour in zip(range(3), ("tab:blue", "tab:orange", "tab:green")):
        axes[2].plot(x_test[i], color=colour, lw=1)
        axes[2].plot(recon[i], "--", color=colour, lw=1)
    axes[2].set(xlabel="channel", ylabel="intensity", title="data (solid), reconstruction (dashed): sums = 10")
    fig.tight_layout()
    path = args.out / "constrained_vae.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"figure: {path}")
    numbers = {"worst_latent": worst_latent, "worst_recon": worst_recon, "worst_decoded": worst_decoded, "tol": tol,
               "test_elbo": float(elbo.mean()), "first_elbo": history[0], "kl": float(kl.mean()),
               "relative_error": rel_error}
    enforce(claims(numbers))
    return numbers


if __name__ == "__main__":
    main()
