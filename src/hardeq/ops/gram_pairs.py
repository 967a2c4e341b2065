r"""Row-pair products of a dense ``A``: the Gram matrix :math:`A\,\mathrm{diag}(v)A^\top` for a batch of ``v`` as
one GEMM (:func:`row_pairs`, :func:`gram_from_pairs`)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["row_pairs", "gram_from_pairs", "gram_from_pairs_flat", "PAIR_ELEMS"]


#: largest n * a(a+1)/2 for the row-product matrix of a Gram under a per-sample diagonal covariance
PAIR_ELEMS = 1 << 25


def row_pairs(A: Tensor) -> Tensor | None:
    r"""The row-product matrix ``P`` of a 2-D ``A`` (``a x n``): ``P[(i, l), j] = A_ij A_lj`` for ``i <= l``, shape
    ``(a(a+1)/2, n)``, so that :math:`A\,\mathrm{diag}(v)A^\top` for a batch of ``v`` is one GEMM ``v @ P^T``
    (:func:`gram_from_pairs`); ``None`` when it would exceed :data:`PAIR_ELEMS` elements."""
    a, n = A.shape
    if n * a * (a + 1) // 2 > PAIR_ELEMS:
        return None
    iu = torch.triu_indices(a, a, device=A.device)
    return A[iu[0]] * A[iu[1]]


def gram_from_pairs(pairs: Tensor, variance: Tensor, a: int) -> Tensor:
    r""":math:`A\,\mathrm{diag}(v)A^\top` for ``variance`` ``v`` of shape ``(*batch, n)`` from :func:`row_pairs`:
    ``(*batch, a, a)``, one GEMM; symmetric to the last bit."""
    n = variance.shape[-1]
    flat = variance.reshape(-1, n) @ pairs.mT  # (B, a(a+1)/2)
    return gram_from_pairs_flat(flat, a).reshape(variance.shape[:-1] + (a, a))


def gram_from_pairs_flat(flat: Tensor, a: int) -> Tensor:
    """The symmetric ``(B, a, a)`` Gram matrices from their packed upper triangles ``flat`` (``(B, a(a+1)/2)``, the
    product ``v @ P^T`` of :func:`gram_from_pairs`): one gather (``index_select`` with :func:`_unpacking_index`),
    both triangles from the same packed entry."""
    return flat.index_select(-1, _unpacking_index(a, flat.device)).view(flat.shape[0], a, a)


@functools.lru_cache(maxsize=64)
def _unpacking_index(a: int, device: torch.device) -> Tensor:
    """``(a * a,)`` long: entry ``i * a + l`` is the position of the pair ``(min(i, l), max(i, l))`` in the packed
    upper triangle (row-major, as ``torch.triu_indices``), made once per ``a`` and device."""
    i = torch.arange(a, device=device)
    lo, hi = torch.minimum(i[:, None], i[None, :]), torch.maximum(i[:, None], i[None, :])
    # row r of the packed upper triangle starts at r a - r (r - 1) / 2
    return (lo * a - lo * (lo - 1) // 2 + (hi - lo)).flatten()
