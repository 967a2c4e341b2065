r""":class:`SparseConstraint`: a shared sparse ``A`` (CSR or COO, ``(a, n)``) with ``nnz`` stored entries.

Mass balances over a flow network, conservation laws on a mesh, sums over overlapping regions: rows with few
nonzeros over a large ``n``. Products with :math:`A`, :math:`A^\top` and :math:`|A|` cost O(nnz) per vector
(the vectors of a sample or batch become the columns of one sparse-dense product), and the Gram matrix under a
diagonal covariance, :math:`A\,\mathrm{diag}(v)A^\top`, is one sparse-sparse product (O(sum over columns of
the squared column counts)), returned dense ``(a, a)``. Nothing ``n x n`` or dense ``a x n`` is formed on
those paths.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Callable, TypeVar, TypeVarTuple

import torch
from torch import Tensor

from .._utils import check_finite, check_same_dtype_device, check_tensor, is_tracing, validate_default
from .._validation import check_device, check_not_transposed
from ..linalg.device import profile
from . import pairs
from ._cache import PerTensorCache, host_reads_allowed, lookup_on_host, no_host_reads
from .sparse_traced import TracedSparse
from .base import EqualityConstraint, config_dtype, dtype_name, register_constraint_kind, require_keys

if TYPE_CHECKING:
    from ..linalg.covariance import Covariance

__all__ = ["SparseConstraint"]

#: largest number of column pairs sum_j c_j^2 for which the diagonal-covariance Gram uses the cached pair matrix
MAX_GRAM_PAIRS = 64_000_000

#: most column pairs sum_j c_j^2 whose pair matrix (and its traced COO form, 20 bytes a pair more) a construction
#: builds at once, for ``torch.compile``; above, a traced Gram matrix under a diagonal covariance is refused
TRACED_MAX_PAIRS = 4_000_000

#: columns of ``A`` per block of the blocked products of many vectors (:class:`_Blocks`)
BLOCK_COLUMNS = 16384
#: vectors per tile of the blocked products: a tile of 16 x 16384 float32 values is 1 MB (it stays in cache)
BLOCK_VECTORS = 16
#: fewest elements (vectors x n) for which products on the CPU go by blocks; below, the whole product at once
BLOCKED_MIN_ELEMENTS = 1 << 20

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


@register_constraint_kind("sparse")
class SparseConstraint(EqualityConstraint):
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

    def _make_traced(self) -> TracedSparse:
        """The COO form of ``A`` (:mod:`.sparse_traced`), with the Gram's pairs when the Gram matrix is not diagonal
        and they number at most :data:`TRACED_MAX_PAIRS` (the pair matrix of the eager Gram, built now)."""
        diagonal = self.has_diagonal_gram
        small = not diagonal and int(self._column_counts().square().sum()) <= TRACED_MAX_PAIRS
        return TracedSparse(self._A, self._pair_matrix() if small else None, diagonal)

    def _validate_A(self) -> None:
        A = self._A
        check_finite("A", A.values())
        factors = self._gram_factors()
        if factors.min_pivot <= factors.tol:
            raise ValueError(
                f"A must have full row rank {A.shape[0]} (a = A.shape[0]), but after normalising each row of A "
                f"(shape {tuple(A.shape)}, nnz {A._nnz()}) to unit length some row lies within "
                f"{factors.min_pivot:.2e} of the span of the rows before it (expected more than {factors.tol:.2e}); "
                "remove linearly dependent rows (e.g. one node balance of a closed flow network)."
            )

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

    def _gram_factors(self) -> _GramFactors:
        return self._cached("gram", lambda: _GramFactors(*self._float64(), self._A.dtype))

    def _blocks(self) -> _Blocks:
        return self._cached("blocks", lambda: _Blocks(self._A, self._At))

    def _blocked(self, x: Tensor, size: int) -> bool:
        """Does a product with the vectors of ``x`` (``(*lead, m)``, each stored contiguously) go by blocks
        (:class:`_Blocks`)? On the CPU, without gradient, when the vectors times ``size`` (the longer side, ``n``)
        are at least :data:`BLOCKED_MIN_ELEMENTS` elements."""
        if not profile(x.device).blocked_drivers or x.dtype != self._A.dtype or x.dim() == 0 or x.stride(-1) != 1:
            return False
        if torch.is_grad_enabled() and (x.requires_grad or self._A.requires_grad):
            return False
        return x.numel() // max(1, x.shape[-1]) * size >= BLOCKED_MIN_ELEMENTS

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

    # ------------------------------------------------------------------ what the conditioner asks for
    def _pair_matrix(self) -> Tensor | None:
        r"""The ``(a^2, n)`` CSR matrix :math:`M` with :math:`M_{(i,j),c} = A_{ic}A_{jc}`, so that
        :math:`\mathrm{vec}(A\,\mathrm{diag}(v)A^\top) = Mv`. Built once, in O(P log P) for the
        ``P = sum_c c_c^2`` pairs of nonzeros sharing a column (memory about 16 P bytes); ``None`` when ``P``
        exceeds :data:`MAX_GRAM_PAIRS` (then :meth:`gram` runs a sparse-sparse product per batch element)."""
        def make() -> Tensor | None:
            m = self._column_counts()
            P = int(m.square().sum())
            if P > MAX_GRAM_PAIRS:
                return None
            At = self._At  # (n, a) CSR: row c of A^T lists the rows of A that column c touches
            crow, rows, vals = At.crow_indices(), At.col_indices(), At.values()
            device = rows.device
            column = torch.repeat_interleave(torch.arange(self.event_size, device=device), m)  # shape: (nnz,)
            m_e = m[column]  # the count of the column each stored entry lies in
            first = torch.repeat_interleave(torch.arange(rows.shape[0], device=device), m_e)  # shape: (P,)
            start = torch.repeat_interleave(torch.cumsum(m_e, 0) - m_e, m_e)
            second = crow[column[first]] + (torch.arange(P, device=device) - start)
            a = self.num_constraints
            index = torch.stack([rows[first] * a + rows[second], column[first]])
            shape = (a * a, self.event_size)
            return _quiet(lambda: torch.sparse_coo_tensor(index, vals[first] * vals[second], shape,
                                                          check_invariants=False).coalesce().to_sparse_csr())
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


def _components(A: Tensor) -> tuple[Tensor, Tensor, Tensor, tuple[int, ...]]:
    return (A.crow_indices(), A.col_indices(), A.values(), tuple(A.shape))


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
