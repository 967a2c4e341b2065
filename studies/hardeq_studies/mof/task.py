r"""Training losses and validation metrics of the mof study's members (:class:`hardeq_studies.harness.Task`).

Each member is one network with a *method*; all members of a training unit share every graph batch.
Per-atom training losses (the harness sums them over the batch's atoms and divides by the atom count):

* ``KKT`` / ``variance`` / ``CL``: :math:`|\hat q_i - q_i|` of the corrected prediction (Raza et al.'s L1);
* ``closed-form``: :math:`\mathbb E|z_i - q_i|` under the conditional marginal of atom ``i``
  (:meth:`hardeq.ConstrainedNormal.expected_l1`; the ICML code's ``erf_loss``);
* ``likelihood``: :math:`-\log p(q \mid \sum_{i\in g} z_i = 0)` on the planes
  (:meth:`hardeq.ConstrainedNormal.log_prob`, one SumConstraint over the batch), spread evenly over the
  batch's atoms, i.e. the per-atom NLL (the ICML code sums it over graphs; Adam is invariant to the scale).

Validation metrics (one batch holding the whole validation split): ``mad`` (per atom), ``nll`` (per graph,
:mod:`.metrics`'s convention) and ``log_var`` (mean log-variance of the head, to watch a variance collapse).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hardeq.nn import graph_normal
from ..harness import Task
from .metrics import METHODS, predict, single_nll

__all__ = ["MofTask"]


class MofTask(Task):
    """Losses and metrics of members ``methods[m]`` (one method name per member, see :data:`.metrics.METHODS`)."""

    def __init__(self, methods: Sequence[str]) -> None:
        bad = [m for m in methods if m not in METHODS]
        if bad:
            raise ValueError(f"unknown methods {bad}; expected names from {METHODS}.")
        self.methods = list(methods)

    def forward(self, model: nn.Module, batch: Any) -> Tensor:
        """``(M, N, 2)`` float64: per member, per atom, ``mu`` and ``variance``."""
        return model(batch)

    def _member_loss(self, method: str, mu: Tensor, var: Tensor, batch: Any, G: int) -> tuple[Tensor, Tensor]:
        y = batch.y.to(mu.dtype)
        if method == "closed-form":
            dist = graph_normal(mu, var, batch.batch, num_graphs=G, validate_args=False)
            return dist.expected_l1(y), (dist.mean - y).abs()
        if method == "likelihood":
            dist = graph_normal(mu, var, batch.batch, num_graphs=G, validate_args=False)
            nll = -dist.log_prob(y).sum()  # log_prob is per graph, (G,)
            return nll.expand(y.shape) / y.shape[0], (dist.mean - y).abs()
        err = (predict(method, mu, var, batch.batch, G) - y).abs()
        return err, err

    def loss(self, output: Tensor, batch: Any) -> tuple[Tensor, dict[str, Tensor]]:
        G = int(batch.num_graphs)
        losses, mads = zip(*(self._member_loss(m, output[i, :, 0], output[i, :, 1], batch, G)
                             for i, m in enumerate(self.methods)))
        return torch.stack(losses), {"mad": torch.stack(mads).detach()}

    @torch.no_grad()
    def metrics(self, output: Tensor, batch: Any, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        G = int(batch.num_graphs)
        y = batch.y.to(output.dtype)
        mad, nll, log_var = [], [], []
        for i, m in enumerate(self.methods):
            mu, var = output[i, :, 0], output[i, :, 1]
            pred = predict(m, mu, var, batch.batch, G)
            mad.append((pred - y).abs().mean())
            nll.append(single_nll(pred, var, y, batch.batch, G).mean())
            log_var.append(var.log().mean())
        return {"mad": torch.stack(mad), "nll": torch.stack(nll), "log_var": torch.stack(log_var)}


def unit_methods(group: Mapping[str, Any]) -> list[str]:
    """Members of a training unit: each method of the group repeated ``ensemble`` times (m0, m0, m1, m1, ...)."""
    return [m for m in group["methods"] for _ in range(int(group["ensemble"]))]
