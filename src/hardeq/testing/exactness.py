r"""The per-row exactness criterion: what "``A z = k`` to round-off" means for every constraint row.

A vector ``z`` meets ``A z = k`` exactly (to round-off) when, for **every** row ``i``,

.. math::
    |(Az - k)_i| \le \mathrm{tol}\cdot(|A|\,|z|)_i, \qquad \mathrm{tol} = 10^{-5}\ \text{(float32)},\ 10^{-12}\
    \text{(float64)},

with the residual evaluated in float64. The scale of a row is its own :math:`(|A||z|)_i`, never the largest
row's: a row a million times smaller than the others (a one-atom molecule's charge beside a protein's) must
still hold to its own round-off.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..constraints import EqualityConstraint

__all__ = ["exactness_tolerance", "row_residual_ratio", "assert_exact_per_row"]


def exactness_tolerance(dtype: torch.dtype) -> float:
    """The criterion's ``tol`` for vectors of ``dtype``: 1e-12 for float64, 1e-5 for float32 (and narrower).

    Examples:
        >>> from hardeq.testing import exactness_tolerance
        >>> exactness_tolerance(torch.float32), exactness_tolerance(torch.float64), exactness_tolerance(torch.bfloat16)
        (1e-05, 1e-12, 1e-05)
    """
    return 1e-12 if dtype == torch.float64 else 1e-5


def _row_residual_and_scale(constraint: EqualityConstraint | Tensor, z: Tensor,
                            k: Tensor | None) -> tuple[Tensor, Tensor]:
    z64 = z.detach().to(torch.float64)
    if isinstance(constraint, Tensor):
        if k is None:
            raise TypeError("row_residual_ratio(A, z, k) needs k when A is a dense tensor.")
        A = constraint.detach().to(torch.float64)
        Az, scale = (A @ z64.unsqueeze(-1)).squeeze(-1), (A.abs() @ z64.abs().unsqueeze(-1)).squeeze(-1)
    elif isinstance(constraint, EqualityConstraint):
        con = constraint.to(dtype=torch.float64)
        Az, scale = con.matvec(z64), con.abs_matvec(z64.abs())
        k = con.k if k is None else k
    else:
        raise TypeError(f"constraint must be a hardeq EqualityConstraint or a dense A (Tensor), "
                        f"got {type(constraint).__name__}.")
    return (Az - k.detach().to(torch.float64)).abs(), scale


def row_residual_ratio(constraint: EqualityConstraint | Tensor, z: Tensor, k: Tensor | None = None) -> Tensor:
    r"""Per-row relative residual :math:`|(Az - k)_i| / (|A||z|)_i`, in float64.

    Args:
        constraint: a hardeq constraint (``k`` defaults to its right-hand side) or a dense ``A`` ``(*batch, a, n)``.
        z: vectors ``(*sample, *batch, n)``.
        k: right-hand side ``(*batch, a)``; required with a dense ``A``.

    Returns:
        ``(*sample, *batch, a)`` float64; ``0/0 := 0`` (an exact zero row), ``x/0 := inf``, NaN where ``z`` is not
        finite.

    Example:
        >>> row_residual_ratio(torch.tensor([[1.0, 1.0]]), torch.tensor([1.0, 2.0]), torch.tensor([3.0]))
        tensor([0.], dtype=torch.float64)
    """
    res, scale = _row_residual_and_scale(constraint, z, k)
    ratio = res / scale
    return torch.where(res == 0, torch.zeros_like(ratio), ratio)


def assert_exact_per_row(constraint: EqualityConstraint | Tensor, z: Tensor, tol: float | None = None, *,
                         k: Tensor | None = None, msg: str = "") -> None:
    """Raise ``AssertionError`` unless every row of every vector in ``z`` meets the per-row criterion.

    Args:
        constraint, z, k: as in :func:`row_residual_ratio`.
        tol: defaults to :func:`exactness_tolerance` of ``z.dtype``.
        msg: prefix of the error message (e.g. the case's description).

    The message names the worst vector's index in ``z``'s leading (sample and batch) dimensions, the worst row,
    its residual and its scale :math:`(|A||z|)_i`.

    Examples:
        >>> from hardeq.testing import assert_exact_per_row
        >>> c = SumConstraint(torch.tensor([0, 0, 1]), torch.tensor([1.0, 2.0]))
        >>> assert_exact_per_row(c, torch.tensor([0.25, 0.75, 2.0]))  # passes: returns None
        >>> assert_exact_per_row(c, torch.tensor([0.25, 0.75, 2.1]))
        Traceback (most recent call last):
            ...
        AssertionError: A z = k is not met to round-off: 1 of 2 rows exceed tol = 1e-05; worst at ..., row 1: ...
    """
    tol = exactness_tolerance(z.dtype) if tol is None else tol
    res, scale = _row_residual_and_scale(constraint, z, k)
    ratio = torch.where(res == 0, torch.zeros_like(res), res / scale)
    ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, float("inf")), ratio)  # non-finite z fails
    worst = int(ratio.argmax()) if ratio.numel() else 0
    if ratio.numel() == 0 or float(ratio.reshape(-1)[worst]) <= tol:
        return
    index = torch.unravel_index(torch.tensor(worst), ratio.shape)
    *lead, row = (int(i) for i in index)
    failing = int((ratio > tol).sum())
    raise AssertionError(
        f"{msg + ': ' if msg else ''}A z = k is not met to round-off: {failing} of {ratio.numel()} rows exceed "
        f"tol = {tol:g}; worst at index {tuple(lead)} (sample and batch dimensions of z), row {row}: "
        f"|(Az - k)_i| = {float(res[index]):.3e}, (|A||z|)_i = {float(scale[index]):.3e}, "
        f"ratio {float(ratio[index]):.3e}.")
