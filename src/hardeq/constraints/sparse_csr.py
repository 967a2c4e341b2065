r"""The CSR side of :class:`~hardeq.constraints.SparseConstraint`: the parts one constraint holds (``A``, ``A^T``
and the caches shared per ``A``), the per-``A`` cache of prepared tensors, quiet CSR construction and transposes,
and the sparse-dense product :func:`_spmm` (O(nnz) per vector) that every eager product with ``A`` goes through."""

from __future__ import annotations

import warnings
from typing import Any, Callable, TypeVar, TypeVarTuple

import torch
from torch import Tensor

from ..linalg.device import profile
from ._cache import PerTensorCache

#: per A given by the user: [A_csr, At_csr, shared caches, validated], so the per-step pattern
#: SparseConstraint(A, k_step) converts and validates A once
_PREPARED = PerTensorCache()

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")


class _Parts:
    """The CSR tensors of one constraint (``A``, ``A^T``) and the caches shared per ``A``, in an object that traced
    code only passes along: ``torch.compile`` refuses to wrap a sparse tensor, so none may be read while tracing
    (the traced paths use :class:`~hardeq.constraints.sparse_traced.TracedSparse`)."""

    __slots__ = ("A", "At", "shared")

    def __init__(self, A: Tensor, At: Tensor, shared: dict[str, Any]) -> None:
        self.A, self.At, self.shared = A, At, shared


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _prepared(A: Tensor, trust_version: bool = False) -> list[Any] | None:
    prepared: list[Any] | None = _PREPARED.get(A, trust_version)
    return prepared


def _remember(A: Tensor, value: list[Any]) -> None:
    _PREPARED.put(A, value)


def _quiet(fn: Callable[[*_Ts], _T], *args: *_Ts) -> _T:
    """Call ``fn`` without torch's one-time "sparse CSR support is in beta" notice."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
        return fn(*args)


def _csr(crow: Tensor, col: Tensor, values: Tensor, shape: tuple[int, ...]) -> Tensor:
    return _quiet(lambda: torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=False))


def _transpose_csr(A: Tensor) -> Tensor:
    """``A^T`` as CSR (via a coalesced COO transpose), O(nnz log nnz) once."""
    At: Tensor = _quiet(lambda: A.to_sparse_coo().t().coalesce().to_sparse_csr())
    return At


def _spmm(A: Tensor, z: Tensor) -> Tensor:
    r"""``A z`` for a CSR ``A`` ``(p, q)`` and ``z`` ``(*lead, q)``: the leading dims become the columns of one
    sparse-dense product; returns ``(*lead, p)``. On a GPU profile (:mod:`hardeq.linalg.device`) the product reads
    ``z`` column-major as it is and its result is returned transposed, without a copy either way.

    The product runs row-parallel over ``A`` with the columns of the dense operand contiguous (each stored entry
    reads ``N`` consecutive values). A wide result (``p > q``: :math:`A^\top u`) is written without gradient by
    that product directly in the layout of ``(*lead, p)`` (its transpose is column-major: one buffer and no
    transposing copy, which costs about as much as the product; for a narrow result the column-major product is
    2x slower than the copy); with gradient, through the copy (``out=`` is not differentiable)."""
    lead = z.shape[:-1]
    if not profile(z.device).blocked_drivers:  # a GPU's: its vendor's product reads either layout, no copies
        return _quiet(torch.mm, A, z.reshape(-1, z.shape[-1]).mT).mT.reshape(lead + (A.shape[0],))
    cols = z.reshape(-1, z.shape[-1]).mT.contiguous()  # shape: (q, N), rows of N contiguous values
    if A.shape[0] > A.shape[1] and cols.shape[1] > 1 and not (
            torch.is_grad_enabled() and (cols.requires_grad or A.requires_grad)):
        out = torch.empty(lead + (A.shape[0],), dtype=cols.dtype, device=cols.device)
        _quiet(lambda: torch.mm(A, cols, out=out.view(-1, A.shape[0]).mT))
        return out
    out = _quiet(torch.matmul, A, cols)  # shape: (p, N)
    # one transposing copy here rather than strided access in every consumer of the result
    return out.mT.contiguous().reshape(lead + (A.shape[0],))


def _components(A: Tensor) -> tuple[Tensor, Tensor, Tensor, tuple[int, ...]]:
    return (A.crow_indices(), A.col_indices(), A.values(), tuple(A.shape))
