r"""The Gram matrix of a sparse ``A`` (:class:`~hardeq.constraints.SparseConstraint`): the float64 Cholesky of the
row-equilibrated :math:`AA^\top` (:class:`_GramFactors`: log-determinant, rank verdict, solves) and the pair
matrix :func:`pair_matrix` of :math:`A\,\mathrm{diag}(v)A^\top`."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .sparse_csr import _quiet


class _GramFactors:
    r"""Float64 Cholesky of the row-equilibrated Gram matrix :math:`\hat G = D^{-1}AA^\top D^{-1} = LL^\top`
    (``D``: row norms), for :math:`\log\det(AA^\top) = 2\sum\log d_i + 2\sum\log L_{jj}`, the rank verdict and
    :math:`(AA^\top)^{-1} = D^{-1}\hat G^{-1}D^{-1}`.

    :math:`L_{jj}` is the distance of normalised row ``j`` from the span of the rows before it (as the
    :math:`R_{jj}` of a QR), but forming :math:`\hat G` squares :math:`\mathrm{cond}` of the *equilibrated*
    matrix, so pivots below about :math:`\sqrt{a\,\varepsilon_{64}}` are not resolved; the rank tolerance is
    therefore :math:`\max(\max(a, r)\,\varepsilon, 10\sqrt{a\,\varepsilon_{64}})` with ``r`` the longest row.
    """

    def __init__(self, A64: Tensor, At64: Tensor, dtype: torch.dtype) -> None:
        a = A64.shape[0]
        G = _quiet(torch.matmul, A64, At64).to_dense()  # shape: (a, a), float64
        d = G.diagonal().clamp_min(0).sqrt()
        safe = torch.where(d > 0, d, 1.0)
        L, info = torch.linalg.cholesky_ex(G / safe.unsqueeze(-1) / safe.unsqueeze(-2))
        pivots = L.diagonal()
        ok = int(info) == 0 and bool((d > 0).all())
        self.row_norms, self.L = safe, L
        # no rows: an empty Cholesky, det 1 and no pivot to fail (the conditioner refuses a = 0 with its own error)
        self.min_pivot = (float(pivots.min()) if a else math.inf) if ok else 0.0
        self.logdet = 2 * (d.log().sum() + pivots.log().sum()) if ok else torch.tensor(-math.inf, dtype=torch.float64)
        row_nnz = int((A64.crow_indices()[1:] - A64.crow_indices()[:-1]).max()) if A64._nnz() else 0
        self.tol = max(max(a, row_nnz) * torch.finfo(dtype).eps, 10 * math.sqrt(a * torch.finfo(torch.float64).eps))

    def solve(self, r: Tensor) -> Tensor:
        r""":math:`(AA^\top)^{-1} r` for ``r`` ``(*, a)`` in float64."""
        y = torch.cholesky_solve((r / self.row_norms).unsqueeze(-1), self.L).squeeze(-1)
        return y / self.row_norms


def pair_matrix(At: Tensor, m: Tensor, P: int, a: int, n: int) -> Tensor:
    r"""The ``(a^2, n)`` CSR matrix :math:`M` with :math:`M_{(i,j),c} = A_{ic}A_{jc}`, so that
    :math:`\mathrm{vec}(A\,\mathrm{diag}(v)A^\top) = Mv`, from ``At`` (the ``(n, a)`` CSR :math:`A^\top`) and
    ``m`` (the ``(n,)`` column counts of ``A``). Built in O(P log P) for the ``P = sum_c c_c^2`` pairs of nonzeros
    sharing a column (memory about 16 P bytes)."""
    # At: (n, a) CSR: row c of A^T lists the rows of A that column c touches
    crow, rows, vals = At.crow_indices(), At.col_indices(), At.values()
    device = rows.device
    column = torch.repeat_interleave(torch.arange(n, device=device), m)  # shape: (nnz,)
    m_e = m[column]  # the count of the column each stored entry lies in
    first = torch.repeat_interleave(torch.arange(rows.shape[0], device=device), m_e)  # shape: (P,)
    start = torch.repeat_interleave(torch.cumsum(m_e, 0) - m_e, m_e)
    second = crow[column[first]] + (torch.arange(P, device=device) - start)
    index = torch.stack([rows[first] * a + rows[second], column[first]])
    shape = (a * a, n)
    return _quiet(lambda: torch.sparse_coo_tensor(index, vals[first] * vals[second], shape,
                                                  check_invariants=False).coalesce().to_sparse_csr())
