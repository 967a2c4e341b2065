r"""Soft constraint penalty (PINN-style): :math:`w \, \|A y - k\|^2`, added to a data loss."""

from __future__ import annotations

from torch import Tensor

from ..constraints import EqualityConstraint
from ._common import check_constraint, check_y_against_constraint

__all__ = ["penalty_loss"]

_REDUCTIONS = ("mean", "sum", "none")


def penalty_loss(y: Tensor, constraint: EqualityConstraint, weight: float | Tensor = 1.0,
                 reduction: str = "mean") -> Tensor:
    r"""Squared constraint residual :math:`w\,\|A y - k\|_2^2` per sample, reduced like ``torch.nn`` losses.

    Unlike the layers, this does not make ``y`` feasible; it only pushes a network towards feasibility.

    Args:
        y (Tensor): ``(*sample, *batch, n)``.
        constraint (EqualityConstraint): ``A z = k`` (dense or grouped sums; per-sample ``k`` allowed).
        weight (float or Tensor): penalty weight ``w`` (a tensor broadcasts against the per-sample losses).
        reduction (str): ``"mean"`` (over all samples), ``"sum"`` or ``"none"`` (shape ``(*sample, *batch)``).

    Returns:
        Tensor: a scalar, or ``(*sample, *batch)`` for ``reduction="none"``.

    Example:
        >>> import torch
        >>> from hardeq import SumConstraint
        >>> c = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([1.0]))
        >>> penalty_loss(torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]]), c, weight=0.5, reduction="none")
        tensor([2., 0.])
    """
    constraint = check_constraint(constraint, "penalty_loss")
    y = check_y_against_constraint(y, constraint, "penalty_loss")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"penalty_loss: reduction must be one of {_REDUCTIONS}, got {reduction!r}.")
    if not isinstance(weight, (int, float, Tensor)):
        raise TypeError(f"penalty_loss: weight must be a float or a Tensor, got {type(weight).__name__}.")
    loss = weight * constraint.residual(y).square().sum(-1)  # (*sample, *batch)
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss
