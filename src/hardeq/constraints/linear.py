r""":class:`LinearConstraint`: a dense, possibly batched ``A`` of shape ``(*batch, a, n)``.

What depends on ``A`` alone (the rank verdict, :math:`\log\det(AA^\top)`, the orthonormal row basis) is
computed once, lazily, from one float64 QR of the row-normalised :math:`A^\top`
(:class:`~hardeq.constraints._dense.RowSpaceFactors`) and shared by :meth:`~LinearConstraint.with_k`,
:meth:`~LinearConstraint.expand` and every later ``LinearConstraint(A, k)`` built on the same ``A`` tensor
(keyed by the tensor's identity and version counter, so an in-place change of ``A`` invalidates it). The
per-step pattern ``LinearConstraint(A, k_step)`` therefore validates ``A`` once, not every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._utils import batch_mv, check_finite, check_same_dtype_device, check_tensor, is_tracing, validate_default
from .._validation import check_device, check_not_transposed
from ..ops.gram_pairs import gram_from_pairs, row_pairs
from . import pairs
from ._cache import PerTensorCache
from ._dense import RowSpaceFactors, particular_dense, project_dense, same_row_space_dense
from ._pinned import pinned_from_rows, singleton_rows
from .base import EqualityConstraint, config_dtype, dtype_name, register_constraint_kind, require_keys

if TYPE_CHECKING:
    from ..linalg.covariance import Covariance

__all__ = ["LinearConstraint"]

#: per A tensor: (factors, validated); and a dict of the constants derived from it (the row-product matrix of its
#: Gram under a per-sample diagonal covariance, the singleton rows, ``|A|``), filled on first use of each
_FACTORS = PerTensorCache()
_DERIVED = PerTensorCache()


def _lookup(A: Tensor) -> tuple[RowSpaceFactors, bool] | None:
    return _FACTORS.get(A)


def _remember(A: Tensor, factors: RowSpaceFactors, validated: bool) -> None:
    _FACTORS.put(A, (factors, validated))


@register_constraint_kind("linear")
class LinearConstraint(EqualityConstraint):
    r"""Dense linear equality constraint :math:`A z = k`.

    Args:
        A (Tensor): constraint matrix, shape ``(*batch, a, n)`` with full row rank ``a < n``.
        k (Tensor): right-hand side, shape ``(*batch, a)``; batch dims of ``A`` and ``k`` broadcast (a shared
            ``A`` with one ``k = b - B x`` per input is the common case).
        validate_args (bool, optional): check finiteness and the rank of ``A`` (float64 QR of the row-normalised
            :math:`A^\top`, O(a^2 n), done once per ``A`` tensor and remembered while it lives unchanged) and
            finiteness of ``k``; defaults to torch.distributions' global setting. Shapes, dtypes and devices are
            always checked.

    Raises:
        ValueError: ``A`` has non-finite entries or is rank-deficient (some normalised row lies within
            ``max(a, n) eps`` of the span of the others; the verdict does not depend on row scaling), or
            shapes do not match.

    Example:
        >>> c = LinearConstraint(torch.ones(1, 3), torch.tensor([1.0]))
        >>> c.num_constraints, c.event_size, c.batch_shape
        (1, 3, torch.Size([]))
        >>> bool(c.check(c.project(torch.zeros(3))))
        True
    """

    def __init__(self, A: Tensor, k: Tensor, *, validate_args: bool | None = None) -> None:
        check_tensor("A", A, min_dim=2)
        if A.layout != torch.strided:
            raise TypeError(f"A must be a dense (strided) tensor, got layout {A.layout}; use hardeq.SparseConstraint.")
        if isinstance(k, (int, float)):
            k = torch.full(A.shape[-2:-1], float(k), dtype=A.dtype, device=A.device)
        check_tensor("k", k, min_dim=1)
        check_same_dtype_device(A=A, k=k)
        a, n = A.shape[-2:]
        check_not_transposed(A.shape, k.shape)
        if k.shape[-1] != a:
            raise ValueError(
                f"k must have shape (..., a) with a = A.shape[-2] = {a}, got k.shape = {tuple(k.shape)} "
                f"for A.shape = {tuple(A.shape)}."
            )
        if a >= n:
            raise ValueError(
                f"A must have fewer rows than columns (a < n) so that A z = k leaves freedom, got "
                f"A.shape = {tuple(A.shape)}."
            )
        try:
            batch_shape = torch.broadcast_shapes(A.shape[:-2], k.shape[:-1])
        except RuntimeError:
            raise ValueError(
                f"batch dimensions of A {tuple(A.shape[:-2])} and k {tuple(k.shape[:-1])} do not broadcast."
            ) from None
        self._set(A, k, batch_shape, None)
        self._validate_args = validate_default(validate_args)
        if self._validate_args and (is_tracing() or not self._validated_in_one_read()):
            check_finite("k", k)  # (the precise checks: each names what it found)
            self._validate_A()

    def _set(self, A: Tensor, k: Tensor, batch_shape: torch.Size, factors: RowSpaceFactors | None,
             source: Tensor | None = None) -> None:
        self.A = A
        self.k = k
        self._source = A if source is None else source  # the unexpanded A: the factors are computed from it
        self._batch_shape = batch_shape
        self._factors = factors
        self._abs_A: Tensor | None = None
        self._derived: dict[str, Any] | None = None  # the _DERIVED entry of the source A, looked up once per instance
        self._converted: dict[torch.dtype, LinearConstraint] | None = None  # to(dtype=...) of this instance

    def _validated_in_one_read(self) -> bool:
        """Validation with one host read: ``k`` finite and either ``A`` unchanged since it was validated (the
        cache's comparison with its snapshot) or, for an ``A`` not validated before, ``A`` finite with full row rank
        (the float64 QR's smallest pivot), all verdicts one device boolean read once. ``True`` when everything
        passed (the rank verdict is then remembered); ``False`` sends the caller to the precise checks, which name
        what failed (after a stale cache entry, they recompute)."""
        k, A = self.k.detach(), self.A.detach()
        verdict = k.sum() * 0 == 0 if k.numel() else None  # (finite: x * 0 is 0; NaN for NaN and inf)
        hit = _FACTORS.get_pending(self._source)  # ((factors, validated), unchanged) or None
        check: Tensor | None = None
        if hit is not None:  # seen before: is it unchanged?
            (factors, validated), check = hit
        else:
            try:
                factors, validated = RowSpaceFactors(self._source), False
            except RuntimeError:  # (a non-finite A whose QR fails: the precise checks say so)
                return False
        if not validated:  # A finite, with full row rank
            pivot = factors._min_pivot
            a, n = A.shape[-2:]
            finite = A.sum() * 0 == 0 if A.numel() else None
            for part in (finite, pivot > max(a, n) * torch.finfo(A.dtype).eps if isinstance(pivot, Tensor) else None):
                if part is not None:
                    check = part if check is None else check & part
        if check is not None:
            verdict = check if verdict is None else verdict & check
        if verdict is not None and not bool(verdict):  # the one host read
            if hit is not None:  # (changed through .data since: forget what was derived from it)
                _FACTORS.forget(self._source)
                _DERIVED.forget(self._source)
                self._factors = None
            return False
        self._factors = factors
        if not validated:
            _remember(self._source, factors, validated=True)
        return True

    def _validate_A(self) -> None:
        hit = _lookup(self._source)
        if hit is not None and hit[1]:
            self._factors = hit[0]
            return
        check_finite("A", self.A)
        factors = self._row_space()
        if is_tracing():  # inside a graph: the rank verdict on the device, its error deferred
            if torch._C._functorch.maybe_current_level() is None:  # (no batching rule for a device assertion)
                a, n = self.A.shape[-2:]
                pivot = factors._min_pivot  # (a tensor until read on the host)
                if isinstance(pivot, Tensor):
                    torch._assert_async(pivot > max(a, n) * torch.finfo(self.A.dtype).eps, "A must have full row "
                                        "rank (checked on the device): remove linearly dependent rows.")
            return
        if not factors.full_rank(self.A.dtype):
            a, n = self.A.shape[-2:]
            raise ValueError(
                f"A must have full row rank {a} (a = A.shape[-2]), but some row of A (shape {tuple(self.A.shape)}) "
                "lies within "
                f"{factors.min_pivot:.2e} of the span of the rows before it after normalising each row to unit length "
                f"(expected more than max(a, n) eps = {max(a, n) * torch.finfo(self.A.dtype).eps:.2e}); "
                "remove linearly dependent rows."
            )
        _remember(self._source, factors, validated=True)

    def _row_space(self) -> RowSpaceFactors:
        """The cached float64 QR of the row-normalised ``A^T`` (computed on first use, shared per ``A`` tensor)."""
        if self._factors is None:
            hit = _lookup(self._source)
            if hit is not None:
                self._factors = hit[0]
            else:
                self._factors = RowSpaceFactors(self._source)
                _remember(self._source, self._factors, validated=False)
        return self._factors

    def _cached_factors(self) -> RowSpaceFactors | None:
        """The cached factors, or ``None`` when a gradient w.r.t. ``A`` is wanted (then recompute with graph)."""
        if self.A.requires_grad and torch.is_grad_enabled():
            return None
        return self._row_space()

    @property
    def num_constraints(self) -> int:
        return self.A.shape[-2]

    @property
    def event_size(self) -> int:
        return self.A.shape[-1]

    @property
    def batch_shape(self) -> torch.Size:
        return self._batch_shape

    def matvec(self, z: Tensor) -> Tensor:
        if self.A.dim() == 2 and not self.A.requires_grad and z.dim() == 2:
            return z @ self.columns()[0]  # one GEMM with the contiguous A^T (about 1.6x faster than with A.mT)
        return batch_mv(self.A, z)

    def rmatvec(self, u: Tensor) -> Tensor:
        return batch_mv(self.A.mT, u)

    def matmul(self, X: Tensor) -> Tensor:
        return self.A @ X

    def dense_matrix(self) -> Tensor:
        return self.A

    def logdet_gram_identity(self) -> Tensor:
        r""":math:`\log\det(AA^\top) = 2\sum_i\log d_i + 2\sum_j\log|R_{jj}|` from the cached float64 QR of the
        row-normalised :math:`A^\top` (see :class:`~hardeq.constraints._dense.RowSpaceFactors`), cast to ``dtype``;
        shape ``A.shape[:-2]``. Differentiable w.r.t. ``A`` (then recomputed per call)."""
        factors = self._cached_factors()
        if factors is None:
            A64 = self.A.to(torch.float64)
            d = torch.linalg.vector_norm(A64, dim=-1)
            R = torch.linalg.qr((A64 / d.unsqueeze(-1)).mT, mode="reduced")[1]  # "r" has no derivative
            logdet: Tensor = 2 * (d.log().sum(-1) + R.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1))
            return logdet.to(self.A.dtype)
        return factors.logdet.to(self.A.dtype).expand(self.A.shape[:-2])

    @property
    def storage_numel(self) -> int:
        return self._source.numel()

    @property
    def operator_requires_grad(self) -> bool:
        return self.A.requires_grad or self._source.requires_grad

    def derived(self) -> dict[str, Any] | None:
        """The constants derived from ``A`` alone, shared by every constraint built on the same unchanged ``A``
        tensor (one lookup per instance, whose cost is one comparison of ``A`` with its snapshot; an unvalidated
        constraint trusts ``A``'s version counter instead, as a ``SumConstraint`` trusts its index's: no comparison,
        see :mod:`hardeq.constraints._cache`); ``None`` when ``A`` requires grad or under tracing (then nothing is
        cached)."""
        if self._derived is None and not self._source.requires_grad:
            entry = _DERIVED.get(self._source, trust_version=not getattr(self, "_validate_args", True))
            if entry is None:
                entry = {}
                _DERIVED.put(self._source, entry)
            self._derived = entry
        return self._derived

    def operator_cache(self) -> dict[str, Any] | None:
        """:meth:`derived` when this constraint's ``A`` is the tensor it was built on (not an expanded view)."""
        return self.derived() if self.A is self._source and not self.A.requires_grad else None

    def abs_A(self) -> Tensor:
        """``|A|`` (elementwise), computed once per ``A`` tensor when it needs no gradient."""
        if self.A.requires_grad:
            return self.A.abs()
        if self._abs_A is None:
            derived = self.derived() if self.A is self._source else None
            if derived is None:
                self._abs_A = self.A.abs()
            else:
                if "abs" not in derived:
                    derived["abs"] = self.A.abs()
                self._abs_A = derived["abs"]
        return self._abs_A

    def abs_matvec(self, z_abs: Tensor) -> Tensor:
        if self.A.dim() == 2 and not self.A.requires_grad and z_abs.dim() == 2:
            return z_abs @ self.columns()[1]
        return batch_mv(self.abs_A(), z_abs)

    def columns(self) -> tuple[Tensor, Tensor]:
        """``A^T`` and ``|A|^T`` as contiguous ``(n, a)`` tensors, for a 2-D ``A`` that needs no gradient, made once
        per ``A`` tensor: a product ``Z @ A^T`` with ``Z`` ``(rows, n)`` and a small ``a`` runs at about 1.6x the
        speed of one with the strided ``A.mT`` (and a product with the row pairs at 4x)."""
        derived = self.derived() if self.A is self._source else None
        if derived is None:
            return self.A.mT.contiguous(), self.abs_A().mT.contiguous()
        if "columns" not in derived:
            derived["columns"] = (self.A.mT.contiguous(), self.abs_A().mT.contiguous())
        columns: tuple[Tensor, Tensor] = derived["columns"]
        return columns

    def pinned_values(self) -> tuple[Tensor, Tensor] | None:
        """As :meth:`EqualityConstraint.pinned_values`; the singleton rows of ``A`` are found once per ``A`` tensor
        (O(a n) and a host synchronisation the first time), the values are ``k_i / a_ij`` per call."""
        derived = self.derived() if not self.A.requires_grad else None
        if derived is None:
            return super().pinned_values()
        if "pinned" not in derived:
            derived["pinned"] = singleton_rows(self._source)
        rows = derived["pinned"]
        if rows is None:
            return None
        single, col, coef = rows
        return pinned_from_rows(single, col, coef, self.k, self.event_size)

    def pinned_values_static(self) -> tuple[Tensor, Tensor] | None:
        """As :meth:`EqualityConstraint.pinned_values_static`: the remembered verdict of this ``A`` tensor (found
        with one host read the first time an ``A`` is used, in eager mode), else (``A`` requires grad, or under
        tracing) the mask and values formed without a branch."""
        derived = self.derived() if not self.A.requires_grad else None
        if derived is not None and ("pinned" in derived or not is_tracing()):  # (eager: found once per A tensor)
            return self.pinned_values()
        return super().pinned_values_static()

    def particular_solution(self) -> Tensor:
        r"""Minimum-norm solution :math:`QR^{-\top}D^{-1}k`, ``(*batch, n)``, from the cached float64 QR (O(n a)
        per call after the first)."""
        out = particular_dense(self._source, self.k, self._cached_factors())
        return out.expand(self.batch_shape + out.shape[-1:])

    def project(self, z: Tensor) -> Tensor:
        r""":math:`z - Q(Q^\top z - R^{-\top}D^{-1}k)` from the cached float64 QR: O(n a) per vector."""
        self._check_points(z)
        return project_dense(self._source, self.k, z, self._cached_factors())

    def same_row_space(self, other: EqualityConstraint) -> bool:
        """``True`` at once for the same ``A`` tensor (or an equal one); otherwise the dense test of the base class."""
        if isinstance(other, EqualityConstraint) and other.num_constraints == self.num_constraints \
                and other.event_size == self.event_size:
            B = other.dense_matrix()
            if B is self.A or (B.shape == self.A.shape and bool(torch.equal(B, self.A))):
                return True
            return same_row_space_dense(self.A, B, self.dtype)
        return super().same_row_space(other)

    def expand(self, batch_shape: torch.Size) -> LinearConstraint:
        batch_shape = torch.Size(batch_shape)
        new = object.__new__(LinearConstraint)
        A = self.A if self.A.dim() == 2 else self.A.expand(batch_shape + self.A.shape[-2:])
        new._set(A, self.k.expand(batch_shape + self.k.shape[-1:]), batch_shape, self._factors, self._source)
        new._validate_args = False
        return new

    def with_k(self, k: Tensor) -> LinearConstraint:
        new = LinearConstraint(self.A, k, validate_args=False)
        new._factors, new._source = self._factors, self._source
        return new

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> LinearConstraint:
        """This constraint on ``device`` / in ``dtype``. A change of dtype alone of a cached ``A`` (no gradient) is
        converted once per ``A`` tensor and kept with its derived constants, so that the converted constraint's own
        constants (``A^T``, the row pairs) are made once too."""
        derived = self.derived() if device is None and dtype not in (None, self.A.dtype) and \
            self.A is self._source else None
        if derived is not None and dtype is not None:
            mine = self._converted.get(dtype) if self._converted is not None else None
            if mine is not None:  # (the conditioner's factor and its check both ask: one constraint)
                return mine
            key = f"to {dtype}"
            if key not in derived:
                derived[key] = self.A.to(dtype=dtype)
            new = LinearConstraint(derived[key], self.k.to(dtype=dtype), validate_args=False)
            # (its own derived constants are kept in this A's entry: the converted A is the cache's, so it needs no
            # comparison with a snapshot of its own)
            new._derived = derived.setdefault(f"derived {dtype}", {})
            self._converted = {**(self._converted or {}), dtype: new}
            return new
        check_device(device)
        A, k = self.A.to(device=device, dtype=dtype), self.k.to(device=device, dtype=dtype)
        if A is self.A and k is self.k:
            return self
        return LinearConstraint(A, k, validate_args=False)

    def to_config(self) -> dict[str, Any]:
        """``{"kind": "linear", "A": [[...]], "k": [...], "dtype": ...}``: dense nested lists (about ``20 a n``
        bytes of JSON; meant for small constraints), floats written exactly."""
        return {"kind": "linear", "A": self.A.detach().cpu().tolist(), "k": self.k.detach().cpu().tolist(),
                "dtype": dtype_name(self.dtype)}

    @classmethod
    def _from_config(cls, config: dict[str, Any]) -> LinearConstraint:
        require_keys(config, "A", "k")
        dtype = config_dtype(config)
        return cls(torch.tensor(config["A"], dtype=dtype), torch.tensor(config["k"], dtype=dtype))

    def __repr__(self) -> str:
        return (f"LinearConstraint(a={self.num_constraints}, n={self.event_size}, "
                f"batch_shape={tuple(self.batch_shape)})")


@pairs.register_pair("gram", LinearConstraint, pairs.ANY_COVARIANCE)
def _gram_linear(constraint: LinearConstraint, covariance: Covariance) -> Tensor:
    r""":math:`A\Sigma A^\top`. A shared 2-D ``A`` under a per-sample diagonal covariance: one GEMM of the
    variances with the row-product matrix of ``A`` (``n x a(a+1)/2``, computed once per ``A`` tensor) when that
    matrix is small; otherwise the covariance's own product."""
    A = constraint.A
    if covariance.is_diagonal and A.dim() == 2 and len(covariance.batch_shape) > 0 and not A.requires_grad:
        pairs_ = shared_row_pairs(constraint)
        if pairs_ is not None:
            return gram_from_pairs(pairs_, covariance.variance, constraint.num_constraints)
    return covariance.sandwich(A)


def shared_row_pairs(constraint: LinearConstraint) -> Tensor | None:
    """The row-product matrix of a 2-D ``A`` that needs no gradient (:func:`~hardeq.ops.gram_pairs.row_pairs`),
    computed once per ``A`` tensor; ``None`` for a batched ``A``, one that requires grad, or when it would exceed
    :data:`~hardeq.ops.gram_pairs.PAIR_ELEMS` elements."""
    A = constraint.A
    if A.dim() != 2 or A.requires_grad:
        return None
    derived = constraint.derived() if A is constraint._source else None
    if derived is None:
        return row_pairs(A)
    if "pairs" not in derived:  # stored column-major: the GEMM v @ P^T reads a contiguous P^T (4x faster)
        pairs_ = row_pairs(A)
        derived["pairs"] = None if pairs_ is None else pairs_.mT.contiguous().mT
    shared: Tensor | None = derived["pairs"]
    return shared
