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
With ``smoothing = a`` also ``mad_smooth``, the exponential moving average of the validation MAD over the
validations so far, :math:`s_1 = m_1`, :math:`s_r = (1 - a)\,s_{r-1} + a\,m_r`: the curve that early stopping
and model selection read when the preset asks for it (a single validation's dip does not reset patience). Its
state lives in the task and is checkpointed through :meth:`MofTask.state_hook`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from hardeq.nn import graph_normal
from ..harness import Hooks, Task
from .metrics import METHODS, predict, single_nll

__all__ = ["MofTask", "SmoothingState"]


class MofTask(Task):
    """Losses and metrics of members ``methods[m]`` (one method name per member, see :data:`.metrics.METHODS`).

    Args:
        smoothing: ``a`` in (0, 1] of the ``mad_smooth`` metric (module docstring); ``None``: no such metric.
            Every call of :meth:`metrics` is one validation and advances the average, so a task with smoothing
            must validate only once per round (the harness's ``eval_train=False``, one validation batch).
    """

    def __init__(self, methods: Sequence[str], smoothing: float | None = None) -> None:
        bad = [m for m in methods if m not in METHODS]
        if bad:
            raise ValueError(f"unknown methods {bad}; expected names from {METHODS}.")
        if smoothing is not None and not (isinstance(smoothing, (int, float)) and 0 < float(smoothing) <= 1):
            raise ValueError(f"smoothing must be a number in (0, 1] or None, got {smoothing!r}.")
        self.methods = list(methods)
        self.smoothing = None if smoothing is None else float(smoothing)
        self.mad_average: Tensor | None = None  # (M,) float64, the running average of the validation MAD

    def state_hook(self) -> "SmoothingState":
        """A harness hook that saves and restores :attr:`mad_average` with the run's checkpoints."""
        return SmoothingState(self)

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
        out = {"mad": torch.stack(mad), "nll": torch.stack(nll), "log_var": torch.stack(log_var)}
        if self.smoothing is not None:
            current = out["mad"].detach().to("cpu", torch.float64)
            prev = self.mad_average
            self.mad_average = current if prev is None else (1 - self.smoothing) * prev + self.smoothing * current
            out["mad_smooth"] = self.mad_average.to(out["mad"].device, out["mad"].dtype)
        return out


class SmoothingState(Hooks):
    """Carries :attr:`MofTask.mad_average` through the harness's checkpoints, so that ``--resume`` continues the
    smoothed curve (and hence early stopping and selection) exactly where an uninterrupted run would be."""

    def __init__(self, task: MofTask) -> None:
        self.task = task

    def state_dict(self) -> dict[str, Any]:
        avg = self.task.mad_average
        return {"mad_average": None if avg is None else avg.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        avg = state.get("mad_average")
        self.task.mad_average = None if avg is None else avg.to(torch.float64).clone()


def unit_methods(group: Mapping[str, Any]) -> list[str]:
    """Members of a training unit: each method of the group repeated ``ensemble`` times (m0, m0, m1, m1, ...)."""
    return [m for m in group["methods"] for _ in range(int(group["ensemble"]))]
