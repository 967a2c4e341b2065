r"""Row-pair products of a dense ``A``: the Gram matrix :math:`A\,\mathrm{diag}(v)A^\top` for a batch of ``v`` as
one GEMM (:func:`row_pairs`, :func:`gram_from_pairs`)."""

from __future__ import annotations

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
    product ``v @ P^T`` of :func:`gram_from_pairs`)."""
    iu = torch.triu_indices(a, a, device=flat.device)
    S = flat.new_zeros(flat.shape[0], a, a)
    S[:, iu[0], iu[1]] = flat
    S[:, iu[1], iu[0]] = flat
    return S
