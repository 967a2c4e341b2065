r"""The small SPD matrix :math:`S = A \Sigma A^\top` in factored form.

Two storage forms: :class:`DenseGram` (Cholesky of an ``a x a`` matrix) and :class:`DiagonalGram`
(disjoint sum constraints with a diagonal covariance, where :math:`S` is diagonal). Both expose the same
operations, so the conditioning code never branches on the form.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cholesky import psd_cholesky

__all__ = ["DenseGram", "DiagonalGram", "Gram"]


class DenseGram:
    r"""``S`` stored through its lower Cholesky factor ``C`` (``S = C C^T``).

    Shapes:
        matrix: ``(*batch, a, a)``.
    """

    def __init__(self, matrix: Tensor) -> None:
        self.matrix = matrix
        self.cholesky = psd_cholesky(matrix)

    @property
    def size(self) -> int:
        return self.matrix.shape[-1]

    def solve(self, rhs: Tensor) -> Tensor:
        r"""``S^{-1} r`` for ``r`` of shape ``(*sample, *batch, a)``."""
        return self.whiten_transpose(self.whiten(rhs))

    def whiten(self, rhs: Tensor) -> Tensor:
        r"""``C^{-1} r`` for ``r`` of shape ``(*sample, *batch, a)`` (vectors)."""
        return _tri_solve_vec(self.cholesky, rhs, upper=False)

    def whiten_transpose(self, rhs: Tensor) -> Tensor:
        return _tri_solve_vec(self.cholesky.mT, rhs, upper=True)

    def whiten_matrix(self, rhs: Tensor) -> Tensor:
        r"""``C^{-1} X`` for ``X`` of shape ``(*batch, a, m)``."""
        return torch.linalg.solve_triangular(self.cholesky, rhs, upper=False)

    def inv_quad(self, rhs: Tensor) -> Tensor:
        r"""``r^T S^{-1} r``."""
        return self.whiten(rhs).square().sum(-1)

    def logdet(self) -> Tensor:
        return 2 * self.cholesky.diagonal(dim1=-2, dim2=-1).log().sum(-1)

    def trace_inv(self, other: "Gram") -> Tensor:
        r"""``tr(S^{-1} M)`` for another Gram-form matrix ``M``."""
        M = other.dense()
        return torch.cholesky_solve(M, self.cholesky).diagonal(dim1=-2, dim2=-1).sum(-1)

    def add_lowrank(self, factor: Tensor) -> "DenseGram":
        r"""``S + U U^T`` for ``U`` of shape ``(*batch, a, r)``."""
        return DenseGram(self.matrix + factor @ factor.mT)

    def dense(self) -> Tensor:
        return self.matrix


class DiagonalGram:
    r"""Diagonal ``S = diag(s)`` (disjoint sum constraints, diagonal covariance): every operation is O(a).

    Shapes:
        diag: ``(*batch, a)``.
    """

    def __init__(self, diag: Tensor) -> None:
        if not bool((diag > 0).all()):
            from ..errors import NotPSDError

            raise NotPSDError(
                f"A Sigma A^T is diagonal with non-positive entries (min {diag.min().item():.3e}): a group "
                "has zero total variance."
            )
        self.diag = diag

    @property
    def size(self) -> int:
        return self.diag.shape[-1]

    def solve(self, rhs: Tensor) -> Tensor:
        return rhs / self.diag

    def whiten(self, rhs: Tensor) -> Tensor:
        return rhs / self.diag.sqrt()

    def whiten_transpose(self, rhs: Tensor) -> Tensor:
        return rhs / self.diag.sqrt()

    def whiten_matrix(self, rhs: Tensor) -> Tensor:
        return rhs / self.diag.sqrt().unsqueeze(-1)

    def inv_quad(self, rhs: Tensor) -> Tensor:
        return (rhs.square() / self.diag).sum(-1)

    def logdet(self) -> Tensor:
        return self.diag.log().sum(-1)

    def trace_inv(self, other: "Gram") -> Tensor:
        if isinstance(other, DiagonalGram):
            return (other.diag / self.diag).sum(-1)
        return (other.dense().diagonal(dim1=-2, dim2=-1) / self.diag).sum(-1)

    def add_lowrank(self, factor: Tensor) -> DenseGram:
        return DenseGram(torch.diag_embed(self.diag) + factor @ factor.mT)

    def dense(self) -> Tensor:
        return torch.diag_embed(self.diag)


Gram = DenseGram | DiagonalGram


def _tri_solve_vec(tri: Tensor, rhs: Tensor, *, upper: bool) -> Tensor:
    """Triangular solve for vectors ``rhs`` (``(*sample, *batch, a)``), folding sample dims into columns."""
    num_batch = tri.dim() - 2
    extra = rhs.dim() - 1 - num_batch
    if extra <= 0:
        return torch.linalg.solve_triangular(tri, rhs.unsqueeze(-1), upper=upper).squeeze(-1)
    sample_shape = rhs.shape[:extra]
    cols = rhs.reshape((-1,) + rhs.shape[extra:]).movedim(0, -1)  # (*batch, a, s)
    out = torch.linalg.solve_triangular(tri, cols, upper=upper).movedim(-1, 0)
    return out.reshape(sample_shape + out.shape[1:])
