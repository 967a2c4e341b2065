r"""A :class:`~hardeq.SparseConstraint`'s ``A`` in COO index / value form, for ``torch.compile``.

Dynamo cannot trace a sparse tensor at all (it refuses to wrap one as a graph input). Under ``torch.compile`` a
:class:`~hardeq.SparseConstraint` therefore never touches its CSR tensors (they sit in a holder object the traced
code only passes along) and computes with dense index and value arrays instead, gathers and scatter-adds with static
shapes:

* :math:`(Az)_i = \sum_e [r_e = i]\,a_e z_{c_e}`: ``z[..., col] * val`` scatter-added over ``row``;
* :math:`(A^\top u)_j = \sum_e [c_e = j]\,a_e u_{r_e}`: ``u[..., row] * val`` scatter-added over ``col``;
* :math:`|A|z` likewise with :math:`|a_e|`;
* the Gram matrix under a diagonal covariance, :math:`(A\,\mathrm{diag}(v)A^\top)_{ij} = \sum_c A_{ic}A_{jc}v_c`,
  from the ``P`` pairs of stored entries sharing a column (those of the eager path's pair matrix):
  ``v[..., pair_col] * pair_val`` scatter-added over ``pair_index = i a + j``;
* the determined coordinates (a row with one stored nonzero), formed without a branch.

Cost: O(nnz) per vector for the products, O(P) per variance vector for the Gram matrix; memory about ``nnz`` and
``P`` indices and values, built once per ``A`` (eagerly, at the first construction on it). Scatter-adds accumulate
serially per row (the eager CSR product sums in the same order).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._pinned import pinned_from_rows

__all__ = ["TracedSparse"]


class TracedSparse:
    """The COO form of one ``A`` ``(a, n)`` (see the module docstring). Built from the CSR ``A`` and the eager
    path's pair matrix (``pairs``: the ``(a^2, n)`` CSR of :math:`A_{ic}A_{jc}`, or None when it is too large:
    then the traced Gram matrix is refused)."""

    def __init__(self, A: Tensor, pairs: Tensor | None, diagonal_gram: bool) -> None:
        a, n = A.shape
        crow, col, val = A.crow_indices(), A.col_indices(), A.values().detach()
        counts = crow[1:] - crow[:-1]
        self.shape, self.nnz, self.diagonal_gram = (a, n), int(col.shape[0]), diagonal_gram
        self.row = torch.repeat_interleave(torch.arange(a, device=col.device), counts)
        self.col, self.val, self.abs_val = col.long(), val.clone(), val.abs()
        if pairs is None:
            self.pair_index = self.pair_col = self.pair_val = None
        else:
            pcrow = pairs.crow_indices()
            self.pair_index = torch.repeat_interleave(torch.arange(a * a, device=col.device), pcrow[1:] - pcrow[:-1])
            self.pair_col, self.pair_val = pairs.col_indices().long(), pairs.values().detach().clone()
        # the rows with one stored nonzero: (single, its column, its entry), for the determined coordinates
        first = crow[:-1].clamp_max(max(self.nnz - 1, 0))
        self.single = (counts == 1) & (val[first] != 0) if self.nnz else torch.zeros(a, dtype=torch.bool)
        self.single_col = col[first].long() if self.nnz else torch.zeros(a, dtype=torch.long)
        self.single_coef = val[first].clone() if self.nnz else torch.zeros(a, dtype=val.dtype)

    def to(self, dtype: torch.dtype) -> TracedSparse:
        """The same ``A`` in ``dtype`` (the index arrays shared)."""
        new = object.__new__(TracedSparse)
        new.__dict__.update(self.__dict__)
        new.val, new.abs_val, new.single_coef = self.val.to(dtype), self.abs_val.to(dtype), self.single_coef.to(dtype)
        new.pair_val = None if self.pair_val is None else self.pair_val.to(dtype)
        return new

    def matvec(self, z: Tensor, absolute: bool = False) -> Tensor:
        """:math:`Az` (or :math:`|A|z`), ``(*lead, n) -> (*lead, a)``."""
        products = z.index_select(-1, self.col) * (self.abs_val if absolute else self.val)
        return z.new_zeros(z.shape[:-1] + (self.shape[0],)).index_add_(-1, self.row, products)

    def rmatvec(self, u: Tensor) -> Tensor:
        r""":math:`A^\top u`, ``(*lead, a) -> (*lead, n)``."""
        products = u.index_select(-1, self.row) * self.val
        return u.new_zeros(u.shape[:-1] + (self.shape[1],)).index_add_(-1, self.col, products)

    def gram(self, v: Tensor) -> Tensor:
        r""":math:`A\,\mathrm{diag}(v)A^\top`, ``(*batch, n) -> (*batch, a, a)``."""
        a = self.shape[0]
        if self.pair_index is None or self.pair_col is None or self.pair_val is None:
            raise NotImplementedError(
                f"the Gram matrix of this SparseConstraint under torch.compile needs the pairs of its stored entries "
                f"sharing a column, which number more than hardeq.constraints.sparse.TRACED_MAX_PAIRS (a = {a}); "
                "raise that limit before constructing the constraint, or run this step eagerly.")
        terms = v.index_select(-1, self.pair_col) * self.pair_val
        flat = v.new_zeros(v.shape[:-1] + (a * a,)).index_add_(-1, self.pair_index, terms)
        return flat.reshape(v.shape[:-1] + (a, a))

    def diagonal_gram_of(self, v: Tensor) -> Tensor:
        r""":math:`(A\circ A)v` (the diagonal Gram matrix when every column has at most one nonzero)."""
        products = v.index_select(-1, self.col) * self.val.square()
        return v.new_zeros(v.shape[:-1] + (self.shape[0],)).index_add_(-1, self.row, products)

    def dense(self) -> Tensor:
        """``A`` as a dense ``(a, n)`` tensor."""
        return self.val.new_zeros(self.shape).index_put_((self.row, self.col), self.val, accumulate=True)

    def pinned(self, k: Tensor) -> tuple[Tensor, Tensor]:
        """``(mask, values)`` of the determined coordinates, formed always (the mask all false when none)."""
        return pinned_from_rows(self.single, self.single_col, self.single_coef, k, self.shape[1])

    def logdet_gram_identity(self) -> Tensor:
        r""":math:`\log\det(AA^\top)` in float64 from the Cholesky of the row-equilibrated Gram matrix (no rank
        check: the eager path's validation made it), a float64 scalar."""
        G = self.to(torch.float64).gram(self.val.new_ones(self.shape[1], dtype=torch.float64))
        d = G.diagonal().sqrt()
        L: Tensor = torch.linalg.cholesky_ex(G / d.unsqueeze(-1) / d.unsqueeze(-2)).L
        logdet: Tensor = 2 * (d.log().sum() + L.diagonal().log().sum())
        return logdet
