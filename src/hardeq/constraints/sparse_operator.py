r"""The stored operator of :class:`~hardeq.constraints.SparseConstraint` (:class:`_SparseOperator`, its base): the
CSR parts of ``A`` and their caches per ``A``, and the products with :math:`A`, :math:`A^\top` and :math:`|A|`
(O(nnz) per vector; on the CPU for many vectors, block by block through :class:`~.sparse_blocks._Blocks`; under
``torch.compile``, through the COO form :class:`~.sparse_traced.TracedSparse`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor

from ..linalg.device import profile
from .base import EqualityConstraint
from .sparse_blocks import _Blocks
from .sparse_csr import _T, _compiling, _csr, _Parts, _quiet, _spmm
from .sparse_traced import TracedSparse


class _SparseOperator(EqualityConstraint):
    """``A``'s CSR parts, its caches and its products: the base of :class:`~hardeq.constraints.SparseConstraint`,
    which holds ``_parts``, ``_grad_A``, ``_traced`` and decides :meth:`_blocked`."""

    _parts: _Parts
    _grad_A: bool
    _traced: TracedSparse

    if TYPE_CHECKING:
        def _blocked(self, x: Tensor, size: int) -> bool: ...

    @property
    def _A(self) -> Tensor:
        return self._parts.A

    @property
    def _At(self) -> Tensor:
        return self._parts.At

    @property
    def _shared(self) -> dict[str, Any]:
        return self._parts.shared

    def _traced_form(self) -> TracedSparse:
        """The COO form for a traced product; refused for an ``A`` that requires grad (its values are copied)."""
        if self._grad_A:
            raise NotImplementedError("a SparseConstraint whose A requires grad is not traced by torch.compile (the "
                                      "traced products use a copy of A's values); run this step eagerly.")
        return self._traced

    # ------------------------------------------------------------------ caches on A
    def _cached(self, name: str, make: Callable[[], _T]) -> _T:
        if name not in self._shared:
            self._shared[name] = make()
        value: _T = self._shared[name]
        return value

    def _abs(self) -> Tensor:
        A = self._A
        return self._cached("abs", lambda: _csr(A.crow_indices(), A.col_indices(), A.values().abs(), A.shape))

    def _float64(self) -> tuple[Tensor, Tensor]:
        def make() -> tuple[Tensor, Tensor]:
            if self._A.dtype == torch.float64:
                return self._A.detach(), self._At.detach()
            return _quiet(lambda: (self._A.detach().to(torch.float64), self._At.detach().to(torch.float64)))
        return self._cached("float64", make)

    def _blocks(self) -> _Blocks:
        return self._cached("blocks", lambda: _Blocks(self._A, self._At))

    def _column_counts(self) -> Tensor:
        return self._cached("column_counts", lambda: torch.bincount(self._A.col_indices(), minlength=self.event_size))

    # ------------------------------------------------------------------ products
    def matvec(self, z: Tensor) -> Tensor:
        if _compiling():
            return self._traced_form().matvec(z)
        if self._blocked(z, self.event_size):
            z2 = z.reshape(-1, z.shape[-1])
            if z2.stride(-1) == 1:
                return self._blocks().matvec(z2)[0].contiguous().reshape(z.shape[:-1] + (self.num_constraints,))
        return _spmm(self._A, z)

    def _shortfall(self, z: Tensor) -> Tensor:
        """``k - A z``; on a GPU profile (the product of :func:`_spmm` on ``z`` as it is), for one shared ``k`` and
        without gradient, as one sparse ``addmm`` with ``k`` broadcast over the columns (no separate subtraction)."""
        k = self.k
        if (_compiling() or profile(z.device).blocked_drivers or k.dim() != 1 or z.dtype != self._A.dtype
                or (torch.is_grad_enabled() and (z.requires_grad or k.requires_grad or self._A.requires_grad))):
            return k - self.matvec(z)
        lead = z.shape[:-1]
        out = _quiet(lambda: torch.addmm(k.unsqueeze(-1), self._A, z.reshape(-1, z.shape[-1]).mT, alpha=-1.0))
        return out.mT.reshape(lead + (self.num_constraints,))

    def rmatvec(self, u: Tensor) -> Tensor:
        if _compiling():
            return self._traced_form().rmatvec(u)
        if self._blocked(u, self.event_size):
            return self._blocks().rmatvec(u.reshape(-1, u.shape[-1])).reshape(u.shape[:-1] + (self.event_size,))
        return _spmm(self._At, u)

    def rmatvec_add_(self, z: Tensor, u: Tensor, weight: Tensor | None = None) -> Tensor:
        r""":math:`z \mathrel{+}= w \circ A^\top u` in place (``weight`` ``w``: ``(n,)``, or ``None`` for ones),
        for ``z`` ``(*lead, n)`` and ``u`` ``(*lead, a)`` of the same leading shape, without gradient; returns
        ``z``. On the CPU for many vectors, block by block onto column-major views of ``z`` (:class:`_Blocks`: no
        ``(*lead, n)`` temporary, one pass over ``z``); otherwise ``z.add_(A^T u)`` (or ``addcmul_``)."""
        n = self.event_size
        if z.shape[:-1] != u.shape[:-1] or z.shape[-1] != n or u.shape[-1] != self.num_constraints:
            raise ValueError(f"z must have shape (*lead, n) and u (*lead, a) with the same leading shape (n = {n}, "
                             f"a = {self.num_constraints}), got z.shape = {tuple(z.shape)}, u.shape = "
                             f"{tuple(u.shape)}.")
        if weight is not None and weight.shape[-1] != n:
            raise ValueError(f"weight must have shape (n,) with n = {n}, got weight.shape = {tuple(weight.shape)}.")
        blocked = not _compiling() and z.is_contiguous() and self._blocked(z, n) and u.dtype == z.dtype and (
            weight is None or (weight.dim() == 1 and weight.dtype == z.dtype and weight.device == z.device))
        if blocked and not (torch.is_grad_enabled() and (u.requires_grad or (weight is not None
                                                                             and weight.requires_grad))):
            self._blocks().rmatvec(u.reshape(-1, u.shape[-1]), z.view(-1, n), weight)
            return z
        return z.add_(self.rmatvec(u)) if weight is None else z.addcmul_(weight, self.rmatvec(u))

    def matmul(self, X: Tensor) -> Tensor:
        # (*batch, n, m) -> (n, *batch, m) -> one product -> (*batch, a, m)
        Xt = X.movedim(-2, 0)
        out = _quiet(torch.matmul, self._A, Xt.reshape(Xt.shape[0], -1))
        return out.reshape((self.num_constraints,) + Xt.shape[1:]).movedim(0, -2)

    def abs_matvec(self, z_abs: Tensor) -> Tensor:
        if _compiling():
            return self._traced_form().matvec(z_abs, absolute=True)
        return _spmm(self._abs(), z_abs)

    def matvec_and_scale(self, z: Tensor) -> tuple[Tensor, Tensor]:
        r""":math:`Az` and :math:`|A||z|` from one transposed copy of ``z`` (the columns of both products), made
        absolute in place between them: without gradient, one ``(n, N)`` buffer instead of three (``|z|``, and a
        transposed copy of each); for many vectors on the CPU, tile by tile (:class:`_Blocks`: one cache-sized
        transposed tile, no ``(n, N)`` buffer). Results ``(*lead, a)`` (transposed views of the ``(a, N)``
        products)."""
        if _compiling() or torch.is_grad_enabled() and (z.requires_grad or self._A.requires_grad) or z.dim() < 2:
            return super().matvec_and_scale(z)
        lead, a = z.shape[:-1], self.num_constraints
        if self._blocked(z, self.event_size):
            z2 = z.reshape(-1, z.shape[-1])
            if z2.stride(-1) == 1:  # blocked: A z and |A||z| tile by tile (|z| of each tile into one buffer)
                Az, scale = self._blocks().matvec(z2, absolute=True)
                assert scale is not None  # (asked for)
                return Az.reshape(lead + (a,)), scale.reshape(lead + (a,))
        cols = z.reshape(-1, z.shape[-1]).mT.contiguous()  # shape: (n, N)
        Az = _quiet(torch.matmul, self._A, cols)  # shape: (a, N)
        # |z| in place on the copy; not when the transpose was z's own storage (one vector, or transposed samples)
        shared = cols.untyped_storage().data_ptr() == z.untyped_storage().data_ptr()
        scale = _quiet(torch.matmul, self._abs(), cols.abs() if shared else cols.abs_())
        return Az.mT.reshape(lead + (a,)), scale.mT.reshape(lead + (a,))

    def dense_matrix(self) -> Tensor:
        if _compiling():
            return self._traced_form().dense()
        return self._A.to_dense()
