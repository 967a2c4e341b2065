"""Per-atom charges from a PyG message-passing network whose charges sum to each molecule's total, exactly.

A generated batch of molecule-like graphs (random trees of H, C, N, O atoms with a few rings, some of them ions
of charge +-1, and a one-atom Na+ "molecule") carries reference charges from an electronegativity rule. Two
``torch_geometric`` ``GraphConv`` layers give node features, and ``hardeq.nn.GraphGaussianHead`` turns them
into a Gaussian over all atoms conditioned on one sum per molecule, ``sum_{i in g} q_i = t_g`` (O(atoms), no
loop over molecules). It is trained by the exact per-molecule NLL ``-dist.log_prob(q)`` for a few hundred
steps. The script prints, with the claims they check:

* the worst per-molecule residual ``|sum_g q - t_g| / sum_g |q|`` of the predicted charges and of samples
  (``hardeq.testing.row_residual_ratio``; claim: below 1e-5 in float32), and that the one-atom ion's charge is
  its total (claim: equal to ``t = +1`` to round-off, whatever the network predicts for it);
* the test error of the exact conditional mean against the mean-shift correction of the same network's means,
  ``q_i = mu_i + (t_g - sum_g mu)/n_g`` (subtract the per-molecule mean error);
* that the two corrections have different Jacobians, so training through them gives different gradients: on a
  three-atom molecule, the exact conditional mean ``mu_bar = mu + v (t - sum mu)/sum v`` has
  ``d mu_bar / d mu = I - v 1^T / V`` and a nonzero ``d mu_bar / d v``, while mean-shift has ``I - 1 1^T / n`` and
  no dependence on the variances at all. Both Jacobians are computed with ``torch.autograd.functional.jacobian``
  and the exact one is checked by central finite differences and against the closed form.

The script exits with status 1, naming the claims that failed, when one does not hold.

Run: ``python examples/charge_neutral_gnn.py [--out DIR] [--seed S]``; needs the ``graphs`` extra
(``pip install -e ".[graphs]"``: torch_geometric) and matplotlib.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

import hardeq
from hardeq.nn import GraphGaussianHead, graph_normal
from hardeq.testing import exactness_tolerance, row_residual_ratio

DEFAULT_OUT = Path(__file__).resolve().parent / "figures"
ELEMENTS = ("H", "C", "N", "O", "Na")
ELECTRONEGATIVITY = torch.tensor([2.20, 2.55, 3.04, 3.44, 0.93])
SOFTNESS = torch.tensor([1.0, 0.6, 0.8, 1.2, 0.1])               # how much of a molecule's net charge an atom takes


def molecule(generator: torch.Generator, size: int, total: float, element: int | None = None):
    """One molecule-like graph: a random tree (plus a ring bond when large enough) with reference charges."""
    from torch_geometric.data import Data

    z = (torch.randint(0, 4, (size,), generator=generator) if element is None
         else torch.full((size,), element))
    edges = [(int(torch.randint(0, i, (1,), generator=generator)), i) for i in range(1, size)]
    if size >= 5:
        edges.append((0, size - 1))
    ei = torch.tensor(edges, dtype=torch.long).reshape(-1, 2).t()
    edge_index = torch.cat([ei, ei.flip(0)], 1)
    en = ELECTRONEGATIVITY[z]
    q = torch.zeros(size).index_add_(0, edge_index[0], 0.25 * (en[edge_index[0]] - en[edge_index[1]]))
    w = SOFTNESS[z]
    q = q + w * (total - q.sum()) / w.sum()                       # reference charges sum to the total
    degree = torch.zeros(size).index_add_(0, edge_index[0], torch.ones(edge_index.shape[1]))
    x = torch.cat([nn.functional.one_hot(z, len(ELEMENTS)).float(), degree.unsqueeze(-1) / 4], -1)
    return Data(x=x, edge_index=edge_index, y=q, total=torch.tensor([total]))


def dataset(generator: torch.Generator, count: int, with_ion: bool):
    from torch_geometric.data import Batch

    graphs = []
    for _ in range(count):
        size = int(torch.randint(2, 10, (1,), generator=generator))
        total = float(torch.tensor([0.0, 0.0, 0.0, 1.0, -1.0])[torch.randint(0, 5, (1,), generator=generator)])
        graphs.append(molecule(generator, size, total))
    if with_ion:
        graphs.append(molecule(generator, 1, 1.0, element=ELEMENTS.index("Na")))    # a one-atom graph: Na+
    return Batch.from_data_list(graphs)


class ChargeNet(nn.Module):
    """Two message-passing layers, then the graph head: node features -> a GraphNormal over the atoms."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        from torch_geometric.nn import GraphConv

        self.conv1 = GraphConv(len(ELEMENTS) + 1, hidden)
        self.conv2 = GraphConv(hidden, hidden)
        self.head = GraphGaussianHead(hidden, min_variance=1e-4)

    def features(self, data) -> torch.Tensor:
        h = torch.tanh(self.conv1(data.x, data.edge_index))
        return torch.tanh(self.conv2(h, data.edge_index))

    def forward(self, data):
        return self.head(self.features(data), data.batch, data.total, num_graphs=data.num_graphs)


def mean_shift(loc: torch.Tensor, batch: torch.Tensor, total: torch.Tensor, num_graphs: int) -> torch.Tensor:
    """The common correction: subtract each molecule's mean error, ``mu_i + (t_g - sum_g mu) / n_g``."""
    sums = loc.new_zeros(num_graphs).index_add(0, batch, loc)
    sizes = loc.new_zeros(num_graphs).index_add(0, batch, torch.ones_like(loc))
    return loc + ((total - sums) / sizes)[batch]


def claims(r: dict[str, float]) -> list[tuple[str, bool]]:
    """Each claim the script prints, with whether the numbers ``r`` (what :func:`main` returns) meet it (a NaN
    meets none)."""
    tol = r["tol"]
    return [
        (f"the predicted charges meet every molecule's total: worst residual {r['worst_mean']:.2e} <= {tol:g}",
         r["worst_mean"] <= tol),
        (f"every sample meets every molecule's total: worst residual {r['worst_samples']:.2e} <= {tol:g}",
         r["worst_samples"] <= tol),
        (f"the one-atom ion's charge is its total +1 to round-off: max |q - 1| = {r['ion_error']:.1e} <= {tol:g}",
         r["ion_error"] <= tol),
        (f"the exact and mean-shift Jacobians differ w.r.t. mu ({r['jacobian_gap_mu']:.3f} > 1e-3) and w.r.t. v "
         f"({r['jacobian_gap_v']:.3f} > 1e-3)", r["jacobian_gap_mu"] > 1e-3 and r["jacobian_gap_v"] > 1e-3),
        (f"the exact Jacobian matches central finite differences ({r['fd_error']:.1e} < 1e-6) and I - v 1^T / V "
         f"({r['closed_form_error']:.1e} < 1e-6)", r["fd_error"] < 1e-6 and r["closed_form_error"] < 1e-6),
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
    train, test = dataset(g, 128, with_ion=True), dataset(g, 64, with_ion=True)

    net = ChargeNet()
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    losses = []
    for _ in range(args.steps):
        dist = net(train)
        loss = -dist.log_prob(train.y).mean()                      # exact NLL, one value per molecule
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"trained {args.steps} steps on {train.num_graphs} molecules ({train.num_nodes} atoms): "
          f"per-molecule NLL from {losses[0]:.2f} to {losses[-1]:.2f}")

    # exactness on the test batch
    with torch.no_grad():
        dist = net(test)
        q = dist.mean                                               # (atoms,)
        samples = dist.sample((16,))                                # (16, atoms)
        loc, _ = net.head.moments(net.features(test))
    constraint = hardeq.SumConstraint(test.batch, test.total)
    tol = exactness_tolerance(q.dtype)
    worst_mean = float(row_residual_ratio(constraint, q).max())
    worst_samples = float(row_residual_ratio(constraint, samples).max())
    ion = int(test.ptr[-2])                                         # the last graph is the one-atom Na+
    ion_error = float((torch.cat([q[ion:], samples[:, ion]]) - 1.0).abs().max())
    shifted = mean_shift(loc, test.batch, test.total, test.num_graphs)
    mae_exact = float((q - test.y).abs().mean())
    mae_shift = float((shifted - test.y).abs().mean())
    print(f"test: {test.num_graphs} molecules, {test.num_nodes} atoms; worst per-molecule residual "
          f"|sum q - t| / sum|q|: mean {worst_mean:.2e}, 16 samples {worst_samples:.2e} (claim: <= {tol:g})")
    print(f"one-atom Na+: predicted charge {float(q[ion]):.7f}, network mean before conditioning "
          f"{float(loc[ion]):.4f}; max |q - 1| over mean and samples {ion_error:.1e} (claim: 0 to round-off, "
          f"<= {tol:g})")
    print(f"test MAE: exact conditional mean {mae_exact:.4f} e, mean-shift of the same means {mae_shift:.4f} e")

    # the Jacobian term, on a three-atom molecule, in float64
    tiny = test.batch == test.batch[0]
    loc3 = loc[tiny].double()[:3].clone()
    var3 = (dist.variance[tiny].double()[:3] + torch.tensor([0.0, 0.02, 0.05], dtype=torch.float64))
    batch3, total3 = torch.zeros(3, dtype=torch.long), torch.tensor([0.0], dtype=torch.float64)
    exact = lambda m, v: graph_normal(m, v, batch3, total3).mean                      # noqa: E731
    shift = lambda m, v: mean_shift(m, batch3, total3, 1)                             # noqa: E731
    J_exact = torch.autograd.functional.jacobian(exact, (loc3, var3))
    J_shift = torch.autograd.functional.jacobian(shift, (loc3, var3))
    h = 1e-6
    fd = torch.stack([(exact(loc3, var3 + h * e) - exact(loc3, var3 - h * e)) / (2 * h)
                      for e in torch.eye(3, dtype=torch.float64)], -1)
    fd_error = float((fd - J_exact[1]).abs().max())
    closed = torch.eye(3, dtype=torch.float64) - var3.unsqueeze(-1) / var3.sum()        # I - v 1^T / V
    closed_error = float((closed - J_exact[0]).abs().max())
    jac_gap = float((J_exact[0] - J_shift[0]).abs().max())
    var_gap = float((J_exact[1] - J_shift[1]).abs().max())
    torch.set_printoptions(precision=4, sci_mode=False)
    print(f"three-atom molecule, variances {[round(v, 4) for v in var3.tolist()]}:")
    print(f"  d mu_bar / d mu, exact conditional mean:\n{J_exact[0]}\n  mean-shift:\n{J_shift[0]}")
    print(f"  d mu_bar / d v, exact:\n{J_exact[1]}\n  mean-shift:\n{J_shift[1]}")
    print(f"  max |J_exact - J_shift|: w.r.t. mu {jac_gap:.3f}, w.r.t. v {var_gap:.3f} (claim: > 1e-3, they differ)")
    print(f"  exact Jacobian vs central finite differences (v): {fd_error:.1e}; vs I - v 1^T / V (mu): "
          f"{closed_error:.1e} (claim: < 1e-6)")
    y3 = test.y[tiny].double()[:3]
    y3 = y3 - y3.mean()
    grads = {}
    for name, fn in (("exact", exact), ("mean-shift", shift)):
        m, v = loc3.clone().requires_grad_(), var3.clone().requires_grad_()
        ((fn(m, v) - y3) ** 2).sum().backward()
        grads[name] = (m.grad, v.grad if v.grad is not None else torch.zeros_like(var3))
        print(f"  gradient of |q - y|^2, {name}: d/d mu {m.grad.tolist()}, d/d v "
              f"{grads[name][1].tolist()}")
    grad_gap = float(max((grads["exact"][i] - grads["mean-shift"][i]).abs().max() for i in range(2)))

    args.out.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    z = test.x[:, : len(ELEMENTS)].argmax(-1)
    for e, name in enumerate(ELEMENTS):
        sel = z == e
        axes[0].plot(test.y[sel], q[sel], ".", label=name, ms=5 if name != "Na" else 12)
    lim = float(test.y.abs().max()) * 1.1
    axes[0].plot([-lim, lim], [-lim, lim], "k-", lw=0.5)
    axes[0].set(xlabel="reference charge (e)", ylabel="predicted (exact mean)", title="test atoms")
    axes[0].legend(fontsize=8)
    axes[1].plot(losses)
    axes[1].set(xlabel="step", ylabel="per-molecule NLL", title="training")
    J = torch.cat([J_exact[0], J_exact[1]], 1) - torch.cat([J_shift[0], J_shift[1]], 1)
    im = axes[2].imshow(J, cmap="RdBu_r", vmin=-float(J.abs().max()), vmax=float(J.abs().max()))
    axes[2].set_title("J_exact - J_mean-shift  [d/d mu | d/d v]", fontsize=9)
    axes[2].set_xticks(range(6), ["mu1", "mu2", "mu3", "v1", "v2", "v3"])
    axes[2].set_yticks(range(3), ["q1", "q2", "q3"])
    fig.colorbar(im, ax=axes[2], shrink=0.8)
    fig.tight_layout()
    path = args.out / "charge_neutral_gnn.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"figure: {path}")
    numbers = {"worst_mean": worst_mean, "worst_samples": worst_samples, "tol": tol, "ion_error": ion_error,
               "mae_exact": mae_exact, "mae_shift": mae_shift, "jacobian_gap_mu": jac_gap, "jacobian_gap_v": var_gap,
               "fd_error": fd_error, "closed_form_error": closed_error, "gradient_gap": grad_gap}
    enforce(claims(numbers))
    return numbers


if __name__ == "__main__":
    main()
