"""Triangular solves for vectors carrying leading sample dimensions."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chol_solve_vec", "tri_solve_vec"]


def tri_solve_vec(tri: Tensor, rhs: Tensor, *, upper: bool) -> Tensor:
    """Solve ``tri @ x = rhs`` for vectors ``rhs`` of shape ``(*sample, *batch, a)``.

    ``tri`` has shape ``(*batch_t, a, a)`` with ``batch_t`` broadcastable to ``batch``. Leading sample
    dimensions are folded into the columns of one batched solve, so ``tri`` is read once for all samples.
    """
    num_batch = tri.dim() - 2
    extra = rhs.dim() - 1 - num_batch
    if extra <= 0:
        solved: Tensor = torch.linalg.solve_triangular(tri, rhs.unsqueeze(-1), upper=upper)
        return solved.squeeze(-1)
    sample_shape = rhs.shape[:extra]
    cols = rhs.reshape((sample_shape.numel(),) + rhs.shape[extra:]).movedim(0, -1)  # (*batch, a, s); a may be 0
    out: Tensor = torch.linalg.solve_triangular(tri, cols, upper=upper).movedim(-1, 0)
    return out.reshape(sample_shape + out.shape[1:])


def chol_solve_vec(lower: Tensor, rhs: Tensor) -> Tensor:
    r"""Solve :math:`LL^\top x = r` for vectors ``rhs`` of shape ``(*sample, *batch, a)`` and a lower factor ``L``
    ``(*batch_t, a, a)`` (``batch_t`` broadcastable to ``batch``; its upper triangle is not read): one
    ``torch.cholesky_solve`` (both triangular solves in one call), sample dimensions folded into its columns as in
    :func:`tri_solve_vec`."""
    num_batch = lower.dim() - 2
    extra = rhs.dim() - 1 - num_batch
    if extra <= 0:
        solved: Tensor = torch.cholesky_solve(rhs.unsqueeze(-1), lower)
        return solved.squeeze(-1)
    sample_shape = rhs.shape[:extra]
    cols = rhs.reshape((sample_shape.numel(),) + rhs.shape[extra:]).movedim(0, -1)  # (*batch, a, s)
    out: Tensor = torch.cholesky_solve(cols, lower).movedim(-1, 0)
    return out.reshape(sample_shape + out.shape[1:])
