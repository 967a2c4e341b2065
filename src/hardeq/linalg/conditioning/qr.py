r"""Backward-stable fallback: Householder QR of :math:`B^\top = F'^\top A^\top`, in float64.

With :math:`B = AF'` (``a x m``, :math:`F' = F / c`) and :math:`B^\top = QR` (``Q``: ``m x a`` orthonormal columns),
:math:`S' = BB^\top = R^\top R`, so with :math:`L = R^\top`

.. math::
    Kr = F'QR^{-\top}r, \qquad G = c\,FQ\ (GG^\top = \Sigma A^\top S^{-1}A\Sigma), \qquad
    \log\det S = 2a\log c + 2\textstyle\sum_j\log|R_{jj}|.

Never squares :math:`\kappa(B)`; chosen when the Cholesky paths are not accurate enough (rows of ``A`` nearly
dependent under :math:`\Sigma`, scales spanning more than about eight decades). Keeps ``Q`` (``batch x m x a``), the
only factor that does. Raises :class:`~hardeq.NotPSDError` when :math:`B` is numerically rank deficient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..._utils import batch_mv
from ..triangular import tri_solve_vec
from .factor import Factor, check_pivots

if TYPE_CHECKING:
    from ...constraints.base import EqualityConstraint
    from ..covariance import Covariance

__all__ = ["QRFactor"]


class QRFactor(Factor):
    """QR of the square root of the Gram matrix, in float64 (see the module docstring)."""

    name = "qr"

    def __init__(self, cov: "Covariance", constraint: "EqualityConstraint", c: Tensor) -> None:
        super().__init__(cov, constraint, c)
        gd = torch.float64
        self._cov = cov.to(dtype=gd).scaled(c.to(gd))
        Bt = constraint.to(dtype=gd).sqrt_gram_factor(self._cov)  # (*batch, m, a)
        Q, R = torch.linalg.qr(Bt)
        eps = torch.finfo(gd).eps  # the inputs are exact in float64: decide the rank at float64 precision
        check_pivots(R.diagonal(dim1=-2, dim2=-1).abs(), 10 * eps * Bt.abs().amax((-2, -1)).unsqueeze(-1))
        self.Q = Q
        self.L = R.mT  # S' = R^T R = L L^T (diagonal signs do not matter)

    @classmethod
    def build(cls, cov: "Covariance", constraint: "EqualityConstraint", c: Tensor) -> "QRFactor":
        return cls(cov, constraint, c)

    def gain(self, residual: Tensor) -> Tensor:
        y = tri_solve_vec(self.L, residual.to(self.L.dtype), upper=False)
        return self._cov.sqrt_matvec(batch_mv(self.Q, y)).to(self.dtype)

    def gain_wide(self, residual: Tensor) -> Tensor:
        y = tri_solve_vec(self.L, residual.to(self.L.dtype), upper=False)
        return self._cov.sqrt_matvec(batch_mv(self.Q, y))

    def whiten(self, residual: Tensor) -> Tensor:
        y = tri_solve_vec(self.L, residual.to(self.L.dtype), upper=False)
        return (y / self.c.to(y.dtype)).to(self.dtype)

    def logdet(self) -> Tensor:
        d = self.L.diagonal(dim1=-2, dim2=-1).abs()
        out: Tensor = 2 * d.log().sum(-1) + 2 * d.shape[-1] * self.c.squeeze(-1).to(d.dtype).log()
        return out.to(self.dtype)

    def gain_factor(self) -> Tensor:
        return (self._cov.sqrt_matmul(self.Q) * self.c.to(self.Q.dtype).unsqueeze(-1)).to(self.dtype)
