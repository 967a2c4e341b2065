r"""The checks of :class:`~hardeq.constraints.SparseConstraint`'s arguments: types, layouts, shapes, dtypes and
devices (always), and the rank of ``A`` from its Gram factors (with validation)."""

from __future__ import annotations

import torch
from torch import Tensor

from .._utils import check_same_dtype_device, check_tensor
from .._validation import check_not_transposed
from .sparse_gram import _GramFactors


def check_arguments(A: Tensor, k: Tensor) -> None:
    """Refuse an ``A`` that is not a floating-point sparse ``(a, n)`` tensor with ``a < n``, or a ``k`` that is not
    ``(*batch, a)`` with ``A``'s dtype and device (a clear TypeError or ValueError naming the argument)."""
    if not isinstance(A, Tensor):
        raise TypeError(f"A must be a sparse torch.Tensor (CSR or COO), got {type(A).__name__}.")
    if A.layout not in (torch.sparse_csr, torch.sparse_coo):
        raise TypeError(f"A must be a torch.sparse_csr or sparse COO tensor, got layout {A.layout}; "
                        "use hardeq.LinearConstraint for a dense A.")
    if not A.is_floating_point():
        raise TypeError(f"A must be a floating-point tensor (float32 or float64), got dtype {A.dtype}.")
    if A.dim() != 2:
        raise ValueError(f"A must have shape (a, n) (one A shared by the batch), got A.shape = {tuple(A.shape)}.")
    check_tensor("k", k, min_dim=1)
    check_same_dtype_device(A=A, k=k)
    a, n = A.shape
    check_not_transposed(A.shape, k.shape)
    if k.shape[-1] != a:
        raise ValueError(f"k must have shape (*batch, a) with a = A.shape[0] = {a}, "
                         f"got k.shape = {tuple(k.shape)}.")
    if a >= n:
        raise ValueError(f"A must have fewer rows than columns (a < n) so that A z = k leaves freedom, got "
                         f"A.shape = {tuple(A.shape)}.")


def check_rank(A: Tensor, factors: _GramFactors) -> None:
    """Refuse an ``A`` without full row rank: a pivot of the row-equilibrated Gram factors at or below their
    tolerance (see :class:`~.sparse_gram._GramFactors`)."""
    if factors.min_pivot <= factors.tol:
        raise ValueError(
            f"A must have full row rank {A.shape[0]} (a = A.shape[0]), but after normalising each row of A "
            f"(shape {tuple(A.shape)}, nnz {A._nnz()}) to unit length some row lies within "
            f"{factors.min_pivot:.2e} of the span of the rows before it (expected more than {factors.tol:.2e}); "
            "remove linearly dependent rows (e.g. one node balance of a closed flow network)."
        )
