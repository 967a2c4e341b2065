r""":class:`SparseConstraint`: a shared sparse ``A`` (CSR or COO, ``(a, n)``) with ``nnz`` stored entries.

Mass balances over a flow network, conservation laws on a mesh, sums over overlapping regions: rows with few
nonzeros over a large ``n``. Products with :math:`A`, :math:`A^\top` and :math:`|A|` cost O(nnz) per vector
(the vectors of a sample or batch become the columns of one sparse-dense product), and the Gram matrix under a
diagonal covariance, :math:`A\,\mathrm{diag}(v)A^\top`, is one sparse-sparse product (O(sum over columns of
the squared column counts)), returned dense ``(a, a)``. Nothing ``n x n`` or dense ``a x n`` is formed on
those paths.

The class is split by job: :mod:`.sparse_csr` (the CSR parts, the per-``A`` cache, the sparse-dense product),
:mod:`.sparse_blocks` (blocked products of many vectors), :mod:`.sparse_operator` (the caches per ``A`` and the
products, the class's base), :mod:`.sparse_gram` (the Gram factors and the pair matrix), :mod:`.sparse_checks`
(argument and rank checks) and :mod:`.sparse_traced` (the COO form under ``torch.compile``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._utils import check_finite, check_same_dtype_device, check_tensor, is_tracing, validate_default
from .._validation import check_device
from ..linalg.device import profile
from . import pairs
from ._cache import host_reads_allowed, lookup_on_host, no_host_reads
from .base import EqualityConstraint, config_dtype, dtype_name, register_constraint_kind, require_keys
from .sparse_blocks import BLOCK_COLUMNS as BLOCK_COLUMNS
from .sparse_blocks import BLOCK_VECTORS as BLOCK_VECTORS
from .sparse_blocks import _Blocks as _Blocks
from .sparse_checks import check_arguments, check_rank
from .sparse_csr import _PREPARED as _PREPARED
from .sparse_csr import _components, _compiling, _csr, _Parts, _prepared, _quiet, _remember, _spmm, _transpose_csr
from .sparse_gram import _GramFactors, pair_matrix
from .sparse_operator import _SparseOperator
from .sparse_traced import TracedSparse

if TYPE_CHECKING:
    from ..linalg.covariance import Covariance

__all__ = ["SparseConstraint"]

#: largest number of column pairs sum_j c_j^2 for which the diagonal-covariance Gram uses the cached pair matrix
MAX_GRAM_PAIRS = 64_000_000

#: most column pairs sum_j c_j^2 whose pair matrix (and its traced COO form, 20 bytes a pair more) a construction
#: builds at once, for ``torch.compile``; above, a traced Gram matrix under a diagonal covariance is refused
TRACED_MAX_PAIRS = 4_000_000
#: fewest elements (vectors x n) for which products on the CPU go by blocks; below, the whole product at once
BLOCKED_MIN_ELEMENTS = 1 << 20


@register_constraint_kind("sparse")
class SparseConstraint(_SparseOperator, EqualityConstraint):
    r"""Sparse linear equality constraint :math:`A z = k` with one ``A`` shared by every batch element.

    Args:
        A (Tensor): ``torch.sparse_csr`` or sparse COO tensor of shape ``(a, n)``, ``a < n``, full row rank,
            float32 or float64. Stored as CSR (with a CSR copy of :math:`A^\top` for :meth:`rmatvec`).
        k (Tensor): right-hand side, ``(*batch, a)``, same dtype and device as ``A``.
        validate_args (bool, optional): check finiteness of ``A`` and ``k`` and the rank of ``A`` (a float64
            Cholesky of the row-equilibrated sparse Gram matrix :math:`AA^\top`, ``a x a``, cached and shared with
            :meth:`logdet_gram_identity`); defaults to torch.distributions' global setting. Types, shapes, dtypes
            and devices are always checked.

    Cost:
        :meth:`matvec`, :meth:`rmatvec`, :meth:`abs_matvec`: O(nnz) per vector. On the CPU without gradient, for
        at least :data:`BLOCKED_MIN_ELEMENTS` elements of vectors, :meth:`matvec`, :meth:`rmatvec`,
        :meth:`matvec_and_scale` and :meth:`rmatvec_add_` go tile by tile over blocks of columns (cache-sized
        transposed tiles of the vectors, CSR blocks of ``A`` built once per ``A``: about ``nnz`` indices and two
        value arrays more). :meth:`gram` under a diagonal
        covariance: one sparse-dense product with a cached ``(a^2, n)`` matrix of the ``P = sum_j c_j^2`` pairs of
        nonzeros sharing a column (``c_j``: column counts), O(P) per batch element, memory about 16 P bytes
        (above :data:`MAX_GRAM_PAIRS` pairs: a sparse-sparse product per batch element instead). The first
        construction on an ``A`` tensor converts it to CSR and transposes it (O(nnz log nnz)); later ones with
        the same, unchanged tensor reuse that work and the validation.
        :meth:`gram` under a full or low-rank covariance, :meth:`sqrt_gram_factor`, :meth:`cross_covariance`,
        :meth:`orthonormal_decomposition` and :meth:`same_row_space` with a non-sparse constraint densify
        ``A`` (``a x n``; the conditioner asks for them only in fallbacks or when small).

    Example:
        >>> A = torch.tensor([[1.0, -1.0, 0.0, 0.0], [0.0, 1.0, -1.0, 1.0]]).to_sparse_csr()
        >>> c = SparseConstraint(A, torch.tensor([0.0, 2.0]))
        >>> c.matvec(torch.ones(4))
        tensor([0., 1.])
        >>> bool(c.check(c.particular_solution()))
        True
    """

    def __init__(self, A: Tensor, k: Tensor, *, validate_args: bool | None = None) -> None:
        check_arguments(A, k)
        a, n = A.shape
        validate = validate_default(validate_args)
        with no_host_reads(not lookup_on_host(validate, A.device)):  # (else the cache checks A on the device)
            prepared = _prepared(A, trust_version=not validate)  # (unvalidated: A's version only, _cache)
        if prepared is None:
            A_csr = _quiet(lambda: A.coalesce().to_sparse_csr()) if A.layout == torch.sparse_coo else A
            # caches that depend on A only, shared by with_k / expand and by later constructions on the same A
            # tensor (never A itself: the cache holds A weakly)
            prepared = [None if A_csr is A else A_csr, _transpose_csr(A_csr), {}, False]
            _remember(A, prepared)
        self._parts = _Parts(A if prepared[0] is None else prepared[0], prepared[1], prepared[2])
        self._shape, self._grad_A = (a, n), A.requires_grad
        self.k = k
        self._validate_args = validate
        #: the COO form of A for torch.compile (built once per A: O(nnz), and the Gram's pairs when they are needed)
        self._traced: TracedSparse = self._cached("traced", self._make_traced)
        if self._validate_args:
            check_finite("k", k)
            if not prepared[3]:
                self._validate_A()
                prepared[3] = True


    def _make_traced(self) -> TracedSparse:
        """The COO form of ``A`` (:mod:`.sparse_traced`), with the Gram's pairs when the Gram matrix is not diagonal
        and they number at most :data:`TRACED_MAX_PAIRS` (the pair matrix of the eager Gram, built now)."""
        diagonal = self.has_diagonal_gram
        small = not diagonal and int(self._column_counts().square().sum()) <= TRACED_MAX_PAIRS
        return TracedSparse(self._A, self._pair_matrix() if small else None, diagonal)
    def _validate_A(self) -> None:
        A = self._A
        check_finite("A", A.values())
        check_rank(A, self._gram_factors())

    # ------------------------------------------------------------------ shape
    @property
    def num_constraints(self) -> int:
        return self._shape[0]

    @property
    def event_size(self) -> int:
        return self._shape[1]

    @property
    def batch_shape(self) -> torch.Size:
        return self.k.shape[:-1]

    @property
    def storage_numel(self) -> int:
        """``nnz``: the stored entries of ``A`` (asked of ``A`` once: ``_nnz`` is an ATen call)."""
        if _compiling():
            return self._traced.nnz
        nnz: int = self._cached("nnz", self._A._nnz)
        return nnz

    @property
    def operator_requires_grad(self) -> bool:
        return self._grad_A

    def operator_cache(self) -> dict[str, Any] | None:
        """The caches of this ``A`` tensor (shared by every constraint built on it), unless ``A`` requires grad."""
        return None if self._grad_A else self._shared

    @property
    def sparse_matrix(self) -> Tensor:
        """``A`` as the CSR tensor ``(a, n)`` stored by this constraint (no copy)."""
        return self._A

    def pinned_values(self) -> tuple[Tensor, Tensor] | None:
        """Rows of ``A`` with one stored nonzero fix their column (see the base class); O(a) from the CSR rows."""
        from ._pinned import pinned_from_rows

        if _compiling():
            return self._traced_form().pinned(self.k)
        A = self._A
        nnz = self.storage_numel
        if nnz == 0:
            return None

        def rows() -> tuple[Tensor, Tensor] | None:  # (the singleton rows, found once per A: one host read)
            crow = A.crow_indices()
            first = crow[:-1].clamp_max(nnz - 1)  # the first stored entry of each row
            single = (crow[1:] - crow[:-1] == 1) & (A.values()[first] != 0)
            return (single, first) if bool(single.any()) else None

        found = rows() if A.requires_grad else self._cached("singleton_rows", rows)  # (A is not differentiated)
        if found is None:
            return None
        single, first = found
        return pinned_from_rows(single, A.col_indices()[first], A.values()[first], self.k, self.event_size)

    def pinned_values_static(self) -> tuple[Tensor, Tensor] | None:
        """As :meth:`pinned_values` (its verdict is found once per ``A``, at the first use, and remembered: no host
        read after that); under tracing, formed without a branch."""
        from ._pinned import pinned_from_rows

        if _compiling():
            return self._traced_form().pinned(self.k)
        A = self._A
        nnz = self.storage_numel
        if nnz == 0:
            return None
        if not is_tracing() and not A.requires_grad:  # the verdict once per A (a host read, at its first use)
            return self.pinned_values()
        crow = A.crow_indices()
        first = crow[:-1].clamp_max(nnz - 1)
        single = (crow[1:] - crow[:-1] == 1) & (A.values()[first] != 0)
        return pinned_from_rows(single, A.col_indices()[first], A.values()[first], self.k, self.event_size)

    def _gram_factors(self) -> _GramFactors:
        return self._cached("gram", lambda: _GramFactors(*self._float64(), self._A.dtype))
    def _blocked(self, x: Tensor, size: int) -> bool:
        """Does a product with the vectors of ``x`` (``(*lead, m)``, each stored contiguously) go by blocks
        (:class:`_Blocks`)? On the CPU, without gradient, when the vectors times ``size`` (the longer side, ``n``)
        are at least :data:`BLOCKED_MIN_ELEMENTS` elements."""
        if not profile(x.device).blocked_drivers or x.dtype != self._A.dtype or x.dim() == 0 or x.stride(-1) != 1:
            return False
        if torch.is_grad_enabled() and (x.requires_grad or self._A.requires_grad):
            return False
        return x.numel() // max(1, x.shape[-1]) * size >= BLOCKED_MIN_ELEMENTS
    # ------------------------------------------------------------------ what the conditioner asks for
    def _pair_matrix(self) -> Tensor | None:
        r"""The ``(a^2, n)`` CSR pair matrix of :math:`\mathrm{vec}(A\,\mathrm{diag}(v)A^\top) = Mv`
        (:func:`~.sparse_gram.pair_matrix`), built once; ``None`` when its ``P = sum_c c_c^2`` pairs exceed
        :data:`MAX_GRAM_PAIRS` (then :meth:`gram` runs a sparse-sparse product per batch element)."""
        def make() -> Tensor | None:
            m = self._column_counts()
            P = int(m.square().sum())
            if P > MAX_GRAM_PAIRS:
                return None
            return pair_matrix(self._At, m, P, self.num_constraints, self.event_size)
        return self._cached("pairs", make)

    @property
    def has_diagonal_gram(self) -> bool:
        """Every column of ``A`` has at most one nonzero (checked once per ``A``: one host read)."""
        if _compiling():
            return self._traced.diagonal_gram
        return self._cached("diagonal_gram", lambda: not bool(self._column_counts().max() > 1))

    def diagonal_gram(self, variance: Tensor) -> Tensor | None:
        r"""When every column of ``A`` has at most one nonzero, :math:`A\,\mathrm{diag}(v)A^\top` is diagonal
        for every ``v``, with diagonal :math:`(A\circ A)\,v` (O(nnz)); otherwise ``None``."""
        if not self.has_diagonal_gram:
            return None
        if _compiling():
            return self._traced_form().diagonal_gram_of(variance)
        A = self._A
        square = self._cached("square", lambda: _csr(A.crow_indices(), A.col_indices(), A.values().square(), A.shape))
        return _spmm(square, variance)

    def logdet_gram_identity(self) -> Tensor:
        r""":math:`\log\det(AA^\top) = 2\sum_i\log d_i + 2\sum_j\log L_{jj}` from the cached float64 Cholesky of
        the row-equilibrated Gram matrix (see :class:`_GramFactors`), a scalar in ``dtype``."""
        if _compiling():
            return self._traced_form().logdet_gram_identity().to(self.dtype)
        return self._gram_factors().logdet.to(self.dtype)

    # ------------------------------------------------------------------ geometry of the plane
    def particular_solution(self) -> Tensor:
        r""":math:`A^\top(AA^\top)^{-1}k` in float64 (cached Cholesky): O(nnz + a^2), ``(*batch, n)``."""
        A64, At64 = self._float64()
        u = self._gram_factors().solve(self.k.to(torch.float64))
        return _spmm(At64, u).to(self.dtype)

    def project(self, z: Tensor) -> Tensor:
        r""":math:`z - A^\top(AA^\top)^{-1}(Az - k)`, evaluated in float64 with the cached Cholesky: O(nnz + a^2)
        per vector. Differentiable w.r.t. ``z`` and ``k``."""
        self._check_points(z)
        A64, At64 = self._float64()
        z64 = z.to(torch.float64)
        r = _spmm(A64, z64) - self.k.to(torch.float64)
        return (z64 - _spmm(At64, self._gram_factors().solve(r))).to(z.dtype)

    def same_row_space(self, other: EqualityConstraint) -> bool:
        """``True`` at once for a sparse constraint with the identical ``A``; otherwise the dense default."""
        if isinstance(other, SparseConstraint) and other._A.shape == self._A.shape \
                and other._A._nnz() == self._A._nnz():
            B = other._A
            if B is self._A or (torch.equal(B.crow_indices(), self._A.crow_indices())
                                and torch.equal(B.col_indices(), self._A.col_indices())
                                and torch.equal(B.values(), self._A.values())):
                return True
        return super().same_row_space(other)

    # ------------------------------------------------------------------ copies
    def _with(self, parts: _Parts, k: Tensor, traced: TracedSparse | None = None) -> SparseConstraint:
        new = object.__new__(SparseConstraint)
        new._parts, new._shape, new._grad_A = parts, self._shape, self._grad_A
        new.k, new._validate_args, new._traced = k, False, self._traced if traced is None else traced
        return new

    def expand(self, batch_shape: torch.Size) -> SparseConstraint:
        return self._with(self._parts, self.k.expand(torch.Size(batch_shape) + self.k.shape[-1:]))

    def with_k(self, k: Tensor) -> SparseConstraint:
        """This ``A`` with the right-hand side ``k`` (``(*batch, a)``), sharing every cache; under
        ``torch.compile`` the way to a new ``k`` (construct the constraint outside the compiled code: a sparse
        ``A`` cannot enter a graph). Like every copy, without validation of its own."""
        check_tensor("k", k, min_dim=1)
        if _compiling():
            if k.dtype != self._traced.val.dtype:
                raise TypeError(f"k must have the dtype of A, {self._traced.val.dtype}, got {k.dtype}.")
        else:
            check_same_dtype_device(A=self._A, k=k)
        if k.shape[-1] != self.num_constraints:
            raise ValueError(f"k must have shape (*batch, a) with a = {self.num_constraints}, got {tuple(k.shape)}.")
        return self._with(self._parts, k)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> SparseConstraint:
        """This constraint on ``device`` / in ``dtype``. Float64 on the same device, for an ``A`` without gradient,
        reuses the cached float64 copies of ``A`` and ``A^T`` and keeps one cache dictionary for them per ``A``
        (the conditioner's float64 residual check and factor then prepare their blocks once per ``A``)."""
        check_device(device)
        if _compiling():  # (the traced form in dtype; a device change is not traced)
            if device is not None and torch.device(device) != self.k.device:
                raise ValueError("SparseConstraint.to(device) is not traced under torch.compile: move the "
                                 "constraint before compiling.")
            if dtype is None or dtype == self.dtype:
                return self
            return self._with(self._parts, self.k.to(dtype=dtype), self._traced.to(dtype))
        same_device = device is None or torch.device(device) == self._A.device
        if dtype == torch.float64 and self.dtype != torch.float64 and same_device and not self._A.requires_grad:
            try:  # (asked twice per construction, by the factor and by the check: remembered while k is unchanged)
                version: int | None = self.k._version
            except RuntimeError:  # (an inference tensor has no version counter)
                version = None
            wide = self.__dict__.get("_wide")
            if wide is not None and version is not None and wide[0] == version:
                widened: SparseConstraint = wide[1]
                return widened
            A64, At64 = self._float64()
            widened = self._with(_Parts(A64, At64, self._cached("float64_shared", dict)), self.k.to(dtype=dtype),
                                 self._cached("traced_float64", lambda: self._traced.to(torch.float64)))
            self._wide = (version, widened)
            return widened
        A, k = _quiet(lambda: self._A.to(device=device, dtype=dtype)), self.k.to(device=device, dtype=dtype)
        if A is self._A and k is self.k:
            return self
        At = _quiet(lambda: self._At.to(device=device, dtype=dtype))
        new = self._with(_Parts(A, At, {}), k)
        new._traced = new._make_traced()
        return new

    # ------------------------------------------------------------------ configs, copies and pickling
    def to_config(self) -> dict[str, Any]:
        """``{"kind": "sparse", "shape": [a, n], "crow_indices": [...], "col_indices": [...], "values": [...],
        "k": [...], "dtype": ...}``: the CSR arrays of ``A`` (O(nnz) JSON), floats written exactly."""
        A = self._A
        return {"kind": "sparse", "shape": list(A.shape), "crow_indices": A.crow_indices().cpu().tolist(),
                "col_indices": A.col_indices().cpu().tolist(), "values": A.values().detach().cpu().tolist(),
                "k": self.k.detach().cpu().tolist(), "dtype": dtype_name(self.dtype)}

    @classmethod
    def _from_config(cls, config: dict[str, Any]) -> SparseConstraint:
        require_keys(config, "shape", "crow_indices", "col_indices", "values", "k")
        dtype = config_dtype(config)
        shape = tuple(int(x) for x in config["shape"])
        if len(shape) != 2:
            raise ValueError(f"a sparse config's shape must be [a, n], got {config['shape']!r}.")
        crow = torch.tensor(config["crow_indices"], dtype=torch.long)
        col = torch.tensor(config["col_indices"], dtype=torch.long)
        values = torch.tensor(config["values"], dtype=dtype)
        if crow.shape != (shape[0] + 1,) or col.shape != values.shape or col.dim() != 1:
            raise ValueError(f"a sparse config needs crow_indices of length a + 1 = {shape[0] + 1} and col_indices / "
                             f"values of equal length, got {tuple(crow.shape)}, {tuple(col.shape)}, "
                             f"{tuple(values.shape)}.")
        A = _quiet(lambda: torch.sparse_csr_tensor(crow, col, values, shape, check_invariants=True))
        return cls(A, torch.tensor(config["k"], dtype=dtype))

    def __getstate__(self) -> dict[str, Any]:
        """Sparse CSR tensors have no storage to copy: the state holds ``A`` and ``A^T`` as their index and value
        arrays (``copy.deepcopy`` and ``pickle`` work on any constraint), and drops the caches (rebuilt on use)."""
        state = dict(self.__dict__)
        del state["_parts"]
        state.pop("_wide", None)
        state["_A"], state["_At"] = _components(self._A), _components(self._At)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["_parts"] = _Parts(_csr(*state.pop("_A")), _csr(*state.pop("_At")), {})
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (f"SparseConstraint(a={self.num_constraints}, n={self.event_size}, nnz={self.storage_numel}, "
                f"batch_shape={tuple(self.batch_shape)})")



@pairs.register_pair("gram", SparseConstraint, pairs.ANY_COVARIANCE)
def _gram_sparse(constraint: SparseConstraint, covariance: Covariance) -> Tensor:
    r""":math:`A\Sigma A^\top`, ``(*batch, a, a)``. Diagonal :math:`\Sigma = \mathrm{diag}(v)`: the sparse
    product :math:`(A\,\mathrm{diag}(v))A^\top` per batch element of ``v`` (O(sum_j c_j^2 + a^2) each,
    differentiable w.r.t. ``v``). Other structures: the dense default (``A`` densified, O(a n) memory).

    Without gradient, the last diagonal result is remembered per ``A`` with a copy of its ``v``: a call with equal
    variances (the per-step pattern ``SparseConstraint(A, k_step)`` under one covariance, whose conditioner
    factorises anew each step) costs one comparison, O(batch n), and a copy of the ``(*batch, a, a)`` result."""
    if not covariance.is_diagonal:
        return covariance.sandwich(constraint.dense_matrix())
    v = covariance.variance  # shape: (*batch, n)
    if _compiling():  # the traced form: the pairs scatter-added (sparse_traced)
        return constraint._traced_form().gram(v)
    # (the memo compares on the host: not without host reads, where S is computed afresh)
    memo = host_reads_allowed() and not (torch.is_grad_enabled() and (v.requires_grad or constraint._A.requires_grad))
    if memo:  # the per-step pattern: the same A and variances, a new k each step
        last: tuple[Tensor, Tensor] | None = constraint._shared.get("gram_last")
        if last is not None and last[0].shape == v.shape and last[0].dtype == v.dtype \
                and last[0].device == v.device and bool(torch.equal(last[0], v)):
            return last[1].clone()
    S = _gram_diagonal(constraint, v)
    if memo:
        constraint._shared["gram_last"] = (v.detach().clone(), S.detach().clone())
    return S


def _gram_diagonal(constraint: SparseConstraint, v: Tensor) -> Tensor:
    a = constraint.num_constraints
    pm = constraint._pair_matrix()
    if pm is not None:  # vec(G) = M v: one sparse-dense product for every batch element
        return _spmm(pm, v).reshape(v.shape[:-1] + (a, a))
    A = constraint._A
    crow, col, values = A.crow_indices(), A.col_indices(), A.values()
    flat = v.reshape(-1, v.shape[-1])
    grams = [_quiet(torch.matmul, _csr(crow, col, values * w[col], A.shape), constraint._At).to_dense() for w in flat]
    return torch.stack(grams).reshape(v.shape[:-1] + (a, a))
