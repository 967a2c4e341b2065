r"""Dense row-space factorisation of a constraint matrix ``A`` (``(*batch, a, n)``): the rank verdict,
:math:`\log\det(AA^\top)`, the minimum-norm solution, the projection onto :math:`\{Az = k\}` and the row-space
test, each from one float64 QR of the row-normalised :math:`A^\top`. The defaults of
:class:`~hardeq.EqualityConstraint` and :class:`~hardeq.LinearConstraint` use them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._utils import batch_mv

__all__ = ["RowSpaceFactors", "particular_dense", "project_dense", "same_row_space_dense", "min_norm_coefficients"]


class RowSpaceFactors:
    r"""One float64 QR of the row-normalised :math:`A^\top`, from which the rank, :math:`\log\det(AA^\top)`,
    the minimum-norm solution and the orthogonal projection onto :math:`\{Az = k\}` all follow.

    With the row norms :math:`D = \mathrm{diag}(\lVert A_{i\cdot}\rVert)` and :math:`(D^{-1}A)^\top = QR`
    (``Q``: ``(*batch_A, n, a)`` orthonormal columns, ``R``: ``(*batch_A, a, a)`` upper),

    .. math::
        A = D R^\top Q^\top, \qquad \log\det(AA^\top) = 2\sum_i \log d_i + 2\sum_j \log|R_{jj}|,
        \qquad A^\top(AA^\top)^{-1} = Q R^{-\top} D^{-1}.

    :math:`|R_{jj}|` is the distance of normalised row ``j`` from the span of the rows before it, so the rank
    verdict (:attr:`min_pivot` against ``max(a, n) eps``) does not depend on how the rows are scaled, and the
    log-determinant does not square :math:`\mathrm{cond}(A)` as a Cholesky of :math:`AA^\top` would.

    Computed without gradient (the verdict and cached quantities are constants); cost O(a^2 n) once, memory
    ``n a`` float64 for ``Q`` (formed only when :meth:`orthonormal` is asked). Holds no reference to ``A``
    (a cache keyed weakly by ``A`` may keep it while ``A`` lives).

    Args:
        A (Tensor): ``(*batch_A, a, n)``, any floating dtype.
    """

    def __init__(self, A: Tensor) -> None:
        with torch.no_grad():
            A64 = A.detach().to(torch.float64)
            d = torch.linalg.vector_norm(A64, dim=-1)  # shape: (*batch_A, a)
            self.row_norms = d
            self.R: Tensor = torch.linalg.qr(_normalised_t(A64, d), mode="r")[1]  # (*batch_A, a, a)
            pivots = self.R.diagonal(dim1=-2, dim2=-1).abs()
            # smallest |R_jj| over rows and batch (0 for a zero row), read on the host only when asked (min_pivot)
            self._min_pivot: Tensor | float | None = torch.where(d > 0, pivots, 0.0).amin() if d.numel() else None
            self.logdet: Tensor = 2 * (d.log().sum(-1) + pivots.log().sum(-1))  # float64, (*batch_A)
        self.shape = A.shape
        self._Q: Tensor | None = None

    @property
    def min_pivot(self) -> float:
        """Smallest ``|R_jj|`` over rows and batch (0 for a zero row; 1 for orthogonal rows). One host
        synchronisation on first use (validation only), none when the factors are built."""
        if not isinstance(self._min_pivot, float):
            self._min_pivot = 1.0 if self._min_pivot is None else float(self._min_pivot)
        return self._min_pivot

    def full_rank(self, dtype: torch.dtype) -> bool:
        """Is every normalised row more than ``max(a, n) eps(dtype)`` away from the span of the rows before it?"""
        a, n = self.shape[-2:]
        return self.min_pivot > max(a, n) * torch.finfo(dtype).eps

    def orthonormal(self, A: Tensor) -> Tensor:
        """``Q`` (``(*batch_A, n, a)``, float64) for the ``A`` these factors were computed from, formed once on
        first use (with ``R`` from the same factorisation)."""
        if self._Q is None:
            with torch.no_grad():
                self._Q, self.R = torch.linalg.qr(_normalised_t(A.detach().to(torch.float64), self.row_norms))
        return self._Q


def _normalised_t(A64: Tensor, d: Tensor) -> Tensor:
    """``(D^{-1} A)^T``, ``(*batch, n, a)``, with zero rows left as they are."""
    return (A64 / torch.where(d > 0, d, 1.0).unsqueeze(-1)).mT


def min_norm_coefficients(R: Tensor, d: Tensor, k: Tensor) -> Tensor:
    r""":math:`u = R^{-\top} D^{-1} k` (``(*batch, a)``), so that :math:`Qu` is the minimum-norm solution."""
    rhs = (k / d).unsqueeze(-1)  # solve_triangular broadcasts the batch dimensions of R and rhs
    u: Tensor = torch.linalg.solve_triangular(R.mT, rhs, upper=False)
    return u.squeeze(-1)


def project_dense(A: Tensor, k: Tensor, z: Tensor, factors: RowSpaceFactors | None = None) -> Tensor:
    r"""Orthogonal projection of ``z`` onto :math:`\{Az = k\}` in float64 from the factors of :class:`RowSpaceFactors`:
    :math:`z - Q(Q^\top z - R^{-\top}D^{-1}k)`. Differentiable w.r.t. ``z`` and ``k``; w.r.t. ``A`` only when
    ``factors`` is ``None`` (then the QR is recomputed with gradient)."""
    Q, R, d = _differentiable_factors(A, factors)
    u = min_norm_coefficients(R, d, k.to(torch.float64))  # (*batch, a)
    z64 = z.to(torch.float64)
    out = z64 - batch_mv(Q, batch_mv(Q.mT, z64) - u)
    return out.to(z.dtype)


def particular_dense(A: Tensor, k: Tensor, factors: RowSpaceFactors | None = None) -> Tensor:
    r"""Minimum-norm solution :math:`A^\top(AA^\top)^{-1}k = QR^{-\top}D^{-1}k`, ``(*batch, n)``."""
    Q, R, d = _differentiable_factors(A, factors)
    return batch_mv(Q, min_norm_coefficients(R, d, k.to(torch.float64))).to(k.dtype)


def _differentiable_factors(A: Tensor, factors: RowSpaceFactors | None) -> tuple[Tensor, Tensor, Tensor]:
    if factors is not None:
        return factors.orthonormal(A), factors.R, factors.row_norms
    A64 = A.to(torch.float64)
    d = torch.linalg.vector_norm(A64, dim=-1)
    Q, R = torch.linalg.qr((A64 / d.unsqueeze(-1)).mT, mode="reduced")
    return Q, R, d


def same_row_space_dense(A: Tensor, B: Tensor, dtype: torch.dtype) -> bool:
    r"""Do the rows of ``A`` and ``B`` (``(*batch, a, n)``, equal ``a``) span the same space in every batch element?

    Each normalised row of ``B`` is projected off the row space of ``A`` (float64 QR); the spaces agree
    when every remainder is below ``10 max(a, n) eps(dtype)`` (the rank tolerance, with room for the rounding
    of rows rescaled in ``dtype``). Dense: O(a^2 n)."""
    with torch.no_grad():
        A, B = torch.broadcast_tensors(A.detach().to(torch.float64), B.detach().to(torch.float64))
        Q = _differentiable_factors(A, None)[0]  # (*batch, n, a)
        Bt = B.mT / torch.linalg.vector_norm(B, dim=-1).clamp_min(torch.finfo(torch.float64).tiny).unsqueeze(-2)
        rest = Bt - Q @ (Q.mT @ Bt)
        a, n = A.shape[-2:]
        return bool(torch.linalg.vector_norm(rest, dim=-2).max() <= 10 * max(a, n) * torch.finfo(dtype).eps)
