"""Mass conservation on a 2-D grid: a flux field conditioned on a sparse divergence constraint.

An ``N x N`` grid of cells is joined by ``2 N (N - 1)`` edges; ``f_e`` is the flux across edge ``e`` (positive
to the right or downwards). Conservation in cell ``c`` is ``(D f)_c = outflow - inflow = s_c``, with ``D`` the
cell-edge incidence matrix (``+1`` where the edge leaves the cell, ``-1`` where it enters) and ``s`` the
sources: here one source of strength 1 and one sink of strength 1, zero elsewhere (divergence-free away from
them). ``D`` has rank ``N^2 - 1`` (its rows sum to zero), so the constraint keeps the first ``N^2 - 1`` rows;
the last cell's balance then follows (and is checked below).

A prior ``N(mu, diag(sigma^2))`` on the fluxes (a uniform drift plus noise of varying scale) is conditioned on
``D f = s`` with ``hardeq.SparseConstraint``: O(nnz) products, an ``(N^2 - 1)``-square Cholesky factor, never
an edges x edges matrix. The script prints the worst per-row residual
``max_c |(D f - s)_c| / (|D| |f|)_c`` of the conditional mean and of every sample (``hardeq.testing``; claim:
below 1e-12 in float64), the last (dropped) cell's balance (claim: its residual is at most the other rows'
bounds summed, as the rows of ``D`` sum to zero), and the same residual of the unconditioned prior draws, which
are far off the plane (claim: above 1e-3). The script exits with status 1, naming the claims that failed, when
one does not hold.

Run: ``python examples/sparse_grid_conservation.py [--out DIR] [--seed S] [--grid N]``; core install and
matplotlib.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import hardeq
from hardeq.testing import exactness_tolerance, row_residual_ratio

DEFAULT_OUT = Path(__file__).resolve().parent / "figures"


def incidence(N: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """COO indices and values of the cell-edge incidence matrix ``(N^2, E)`` and the number of edges ``E``.

    Edges ``0 .. N(N-1)-1`` are horizontal (cell ``(i, j)`` to ``(i, j+1)``), the rest vertical (``(i, j)`` to
    ``(i+1, j)``); cell ``(i, j)`` is row ``i N + j``.
    """
    cell = torch.arange(N * N).reshape(N, N)
    tail = torch.cat([cell[:, :-1].flatten(), cell[:-1, :].flatten()])
    head = torch.cat([cell[:, 1:].flatten(), cell[1:, :].flatten()])
    E = tail.numel()
    edge = torch.arange(E)
    rows = torch.cat([tail, head])
    cols = torch.cat([edge, edge])
    vals = torch.cat([torch.ones(E), -torch.ones(E)]).double()
    return torch.stack([rows, cols]), vals, E


def claims(r: dict[str, float]) -> list[tuple[str, bool]]:
    """Each claim the script prints, with whether the numbers ``r`` (what :func:`main` returns) meet it (a NaN
    meets none)."""
    return [
        (f"the conditional mean meets every conservation row: worst per-row residual {r['worst_mean']:.2e} "
         f"<= {r['tol']:g}", r["worst_mean"] <= r["tol"]),
        (f"every sample meets every conservation row: worst per-row residual {r['worst_sample']:.2e} <= {r['tol']:g}",
         r["worst_sample"] <= r["tol"]),
        (f"the dropped last cell balances: |(Df - s)_last| = {r['last_cell_error']:.2e} <= {r['last_cell_bound']:.2e}",
         r["last_cell_error"] <= r["last_cell_bound"]),
        (f"the unconditioned prior draws are far off the plane: worst per-row residual {r['worst_prior']:.2f} > 1e-3",
         r["worst_prior"] > 1e-3),
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
    parser.add_argument("--grid", type=int, default=32, help="N: the grid has N x N cells")
    parser.add_argument("--samples", type=int, default=16)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    N = args.grid

    idx, vals, E = incidence(N)
    # COO matrices whose indices torch checks once here (check_invariants: an index out of range is an error,
    # not memory corruption); SparseConstraint converts its D to CSR itself
    D_full = torch.sparse_coo_tensor(idx, vals, (N * N, E), check_invariants=True).coalesce()
    keep = idx[0] < N * N - 1                                             # drop the last cell's row
    D = torch.sparse_coo_tensor(idx[:, keep], vals[keep], (N * N - 1, E), check_invariants=True).coalesce()

    s = torch.zeros(N * N, dtype=torch.float64)
    s[(N // 4) * N + N // 4] = 1.0                                         # a source ...
    s[(3 * N // 4) * N + 3 * N // 4] = -1.0                               # ... and a sink: sum s = 0
    constraint = hardeq.SparseConstraint(D, s[:-1])

    # prior: a uniform drift to the right plus noise whose scale grows from left to right
    horizontal = torch.arange(E) < N * (N - 1)
    loc = torch.where(horizontal, 0.3, 0.0).double()
    column = torch.cat([torch.arange(N - 1).repeat(N), torch.arange(N).repeat(N - 1)]).double()
    scale = 0.2 + 0.8 * column / (N - 1)
    prior = torch.distributions.Normal(loc, scale)
    dist = hardeq.ConstrainedNormal(loc, scale, constraint=constraint)

    mean = dist.mean
    f = dist.sample((args.samples,))                                       # (S, E)
    tol = exactness_tolerance(torch.float64)
    worst_mean = float(row_residual_ratio(constraint, mean).max())
    worst_sample = float(row_residual_ratio(constraint, f).max())
    div = lambda x: torch.sparse.mm(D_full, x.T.contiguous()).T              # noqa: E731  (S, N^2)
    last = float((div(f)[:, -1] - s[-1]).abs().max())
    scales = torch.sparse.mm(D_full.abs(), f.abs().T.contiguous()).T          # (|D||f|)_c per sample, (S, N^2)
    last_scale = float(scales[:, -1].min())
    # the rows of D sum to zero and so does s: the last row's residual is minus the sum of the others', each at
    # most tol (|D||f|)_c
    last_bound = float(tol * scales[:, :-1].sum(-1).max())
    free = prior.sample((args.samples,))
    worst_prior = float(row_residual_ratio(constraint, free).max())
    print(f"grid {N} x {N}: {E} edge fluxes, {N * N - 1} conservation rows, "
          f"nnz(D) = {D.values().numel()}")
    print(f"worst per-row residual max_c |(Df - s)_c| / (|D||f|)_c, conditional mean: {worst_mean:.2e}")
    print(f"worst per-row residual over {args.samples} samples: {worst_sample:.2e} (claim: <= {tol:g})")
    print(f"dropped last cell: max |(Df - s)_last| = {last:.2e} (scale (|D||f|)_last >= {last_scale:.2f}; "
          f"claim: <= {last_bound:.1e}, the other rows' bounds summed)")
    print(f"unconditioned prior draws, for contrast: worst per-row residual {worst_prior:.2f} (claim: > 1e-3)")

    args.out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def cell_vectors(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Average the fluxes of each cell's edges into a vector per cell (for the arrows)."""
        h = x[: N * (N - 1)].reshape(N, N - 1)
        v = x[N * (N - 1):].reshape(N - 1, N)
        u = torch.zeros(N, N, dtype=x.dtype)
        w = torch.zeros(N, N, dtype=x.dtype)
        u[:, :-1] += h / 2
        u[:, 1:] += h / 2
        w[:-1, :] += v / 2
        w[1:, :] += v / 2
        return u, w

    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    lim = float(div(free[:1]).abs().max())
    for ax, x, title in ((axes[0], free[0], "prior draw"), (axes[1], f[0], "conditioned draw")):
        im = ax.imshow(div(x.unsqueeze(0))[0].reshape(N, N).numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim)
        ax.set_title(f"{title}:\nnet outflow per cell")
        ax.set_xticks([])
        ax.set_yticks([])
    bar = fig.colorbar(im, ax=axes[:2], shrink=0.8)
    bar.set_label("(D f)_c = outflow - inflow of cell c")
    u, w = cell_vectors(mean)
    yy, xx = torch.meshgrid(torch.arange(N), torch.arange(N), indexing="ij")
    axes[2].quiver(xx.numpy(), yy.numpy(), u.numpy(), -w.numpy(), angles="xy")
    axes[2].invert_yaxis()
    axes[2].set_aspect("equal")
    axes[2].set_title("conditional mean flux")
    axes[2].plot([N // 4], [N // 4], "o", color="tab:red", ms=8, label="source (s = +1)")
    axes[2].plot([3 * N // 4], [3 * N // 4], "s", color="tab:blue", ms=8, label="sink (s = -1)")
    axes[2].legend(loc="lower center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)
    axes[2].set_xticks([])
    axes[2].set_yticks([])
    path = args.out / "sparse_grid_conservation.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"figure: {path}")
    numbers = {"worst_mean": worst_mean, "worst_sample": worst_sample, "tol": tol, "last_cell_error": last,
               "last_cell_bound": last_bound, "worst_prior": worst_prior}
    enforce(claims(numbers))
    return numbers


if __name__ == "__main__":
    main()
