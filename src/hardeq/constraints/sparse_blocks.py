r"""Products of a sparse ``A`` with many vectors stored sample-major, block by block (:class:`_Blocks`): the CPU
path of :class:`~hardeq.constraints.SparseConstraint`'s products without gradient."""

from __future__ import annotations

import torch
from torch import Tensor

from .sparse_csr import _csr

#: columns of ``A`` per block of the blocked products of many vectors (:class:`_Blocks`)
BLOCK_COLUMNS = 16384
#: vectors per tile of the blocked products: a tile of 16 x 16384 float32 values is 1 MB (it stays in cache)
BLOCK_VECTORS = 16


class _Blocks:
    r"""``A`` cut into blocks of :data:`BLOCK_COLUMNS` columns (CSR each, int32 indices, with ``|A|``), and
    :math:`A^\top` into the matching blocks of rows, for products with many vectors stored sample-major.

    For ``Z`` ``(N, n)`` (each vector contiguous), :math:`AZ^\top` is the sum over column blocks ``q`` of
    :math:`A_q Z_{:,q}^\top`, taken tile by tile: :data:`BLOCK_VECTORS` vectors x :data:`BLOCK_COLUMNS` columns
    (1 MB in float32) are copied transposed into one reused buffer that stays in cache, and the block's product
    reads ``s`` contiguous values per stored entry. ``Z`` is read once and no ``(n, N)`` copy is made (the
    transposing copy of all of ``Z`` took as long as the product; a product on column-major views of ``Z``
    instead, one sparse matrix-vector product per vector, was 1.6x slower than the tiles, and 2.4x for
    :math:`Az` and :math:`|A||z|` together, which share one tile). :math:`A^\top u` is computed tile by tile
    into the buffer and written (or added) transposed. Built once per ``A`` in O(nnz log nnz); memory about
    ``nnz`` indices and two ``nnz`` value arrays more.
    """

    def __init__(self, A: Tensor, At: Tensor) -> None:
        a, n = A.shape
        crow, col, values = A.crow_indices().long(), A.col_indices().long(), A.values().detach()
        index = torch.int32 if A._nnz() < 2**31 and max(a, n) < 2**31 else torch.int64
        row = torch.repeat_interleave(torch.arange(a, device=col.device), crow[1:] - crow[:-1])
        block = torch.div(col, BLOCK_COLUMNS, rounding_mode="floor")
        count = -(-n // BLOCK_COLUMNS)
        key = block * a + row
        # stable: within a (block, row) pair the entries keep the column order of the CSR rows
        order = torch.sort(key, stable=True).indices
        local = (col - block * BLOCK_COLUMNS)[order].to(index)
        vals = values[order]
        starts = torch.zeros(count * a + 1, dtype=torch.long, device=col.device)
        starts[1:] = torch.bincount(key, minlength=count * a).cumsum(0)
        self.columns: list[tuple[int, int, Tensor, Tensor]] = []  # (j0, j1, A_q, |A_q|)
        bounds = starts[::a].tolist()
        for q in range(count):
            j0, j1 = q * BLOCK_COLUMNS, min(n, (q + 1) * BLOCK_COLUMNS)
            s0, s1 = bounds[q], bounds[q + 1]
            if s1 == s0:  # no entries: the block adds nothing to A z, and A^T u is 0 there
                continue
            crow_q = (starts[q * a:(q + 1) * a + 1] - s0).to(index)
            v = vals[s0:s1]
            self.columns.append((j0, j1, _csr(crow_q, local[s0:s1], v, (a, j1 - j0)),
                                 _csr(crow_q, local[s0:s1], v.abs(), (a, j1 - j0))))
        tcrow, tcol, tvals = At.crow_indices().long(), At.col_indices().to(index), At.values().detach()
        self.rows: list[tuple[int, int, Tensor]] = []  # (j0, j1, rows j0:j1 of A^T)
        self.empty_rows: list[tuple[int, int]] = []  # blocks of columns of A without entries: A^T u is 0 there
        tbounds = tcrow[::BLOCK_COLUMNS].tolist() + [int(tcrow[-1])]
        for q in range(count):
            j0, j1 = q * BLOCK_COLUMNS, min(n, (q + 1) * BLOCK_COLUMNS)
            s0, s1 = tbounds[q], tbounds[q + 1]
            if s1 == s0:
                self.empty_rows.append((j0, j1))
                continue
            self.rows.append((j0, j1, _csr((tcrow[j0:j1 + 1] - s0).to(index), tcol[s0:s1], tvals[s0:s1],
                                           (j1 - j0, a))))
        self.shape, self.width = (a, n), BLOCK_COLUMNS

    def matvec(self, z: Tensor, absolute: bool = False) -> tuple[Tensor, Tensor | None]:
        r""":math:`AZ^\top` as ``(N, a)`` for ``z`` ``(N, n)``, and with ``absolute``, :math:`|A||Z|^\top` too
        (the transposed tile made absolute in place between the two products)."""
        N, a = z.shape[0], self.shape[0]
        out = torch.zeros((a, N), dtype=z.dtype, device=z.device)  # (a, N): row-major rows of the products
        scale = torch.zeros((a, N), dtype=z.dtype, device=z.device) if absolute else None
        tile = self._tile(N, z)
        for j0, j1, A_q, abs_q in self.columns:
            for s0 in range(0, N, BLOCK_VECTORS):
                s1 = min(N, s0 + BLOCK_VECTORS)
                t = tile[:j1 - j0, :s1 - s0]
                t.copy_(z[s0:s1, j0:j1].mT)  # the tile transposed, in cache: each stored entry reads s values
                out[:, s0:s1].addmm_(A_q, t)
                if scale is not None:
                    scale[:, s0:s1].addmm_(abs_q, t.abs_())
        return out.mT, None if scale is None else scale.mT

    def rmatvec(self, u: Tensor, z: Tensor | None = None, weight: Tensor | None = None) -> Tensor:
        r""":math:`UA` as ``(N, n)`` for ``u`` ``(N, a)``, tile by tile (each tile of :math:`A^\top U^\top`
        computed row-major into one reused buffer and written transposed); with ``z`` ``(N, n)`` (contiguous
        rows), :math:`z \mathrel{+}= w \circ (UA)` in place (``weight`` ``w``: ``(n,)``, or ``None`` for ones)
        and ``z`` returned."""
        N, n = u.shape[0], self.shape[1]
        out = torch.empty((N, n), dtype=u.dtype, device=u.device) if z is None else z
        if z is None:
            for j0, j1 in self.empty_rows:
                out[:, j0:j1] = 0
        tile = self._tile(N, u)
        ut = u.mT.contiguous()  # (a, N), row-major
        for j0, j1, At_q in self.rows:
            for s0 in range(0, N, BLOCK_VECTORS):
                s1 = min(N, s0 + BLOCK_VECTORS)
                t = tile[:j1 - j0, :s1 - s0]
                torch.mm(At_q, ut[:, s0:s1], out=t)
                view = out[s0:s1, j0:j1]
                if z is None:
                    view.copy_(t.mT)
                elif weight is None:
                    view.add_(t.mT)
                else:
                    view.addcmul_(t.mT, weight[j0:j1])
        return out

    def _tile(self, N: int, like: Tensor) -> Tensor:
        """The reused ``(columns, vectors)`` buffer of one tile, row-major."""
        return torch.empty((self.width, min(N, BLOCK_VECTORS)), dtype=like.dtype, device=like.device)
