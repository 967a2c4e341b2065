r"""The constraint interface :class:`EqualityConstraint` and the dense row-space factorisation it defaults to.

A constraint object is an operator :math:`A` (``a x n``, full row rank, ``a < n``) together with a right-hand
side ``k`` (``(*batch, a)``). Callers ask it for what they need (products with :math:`A`, :math:`A^\top`,
:math:`|A|`, the Gram matrix under a covariance, a projection onto the plane, its group ids) and never for
its type; a structured subclass overrides the defaults below with cheaper algorithms.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._utils import batch_mv

if TYPE_CHECKING:
    from ..linalg.covariance import Covariance

__all__ = ["EqualityConstraint", "RowSpaceFactors"]


class RowSpaceFactors:
    r"""One float64 QR of the row-normalised :math:`A^\top`, from which the rank, :math:`\log\det(AA^\top)`,
    the minimum-norm solution and the orthogonal projection onto :math:`\{Az = k\}` all follow.

    With the row norms :math:`D = \mathrm{diag}(\lVert A_{i\cdot}\rVert)` and :math:`(D^{-1}A)^\top = QR`
    (``Q``: ``(*batch_A, n, a)`` orthonormal columns, ``R``: ``(*batch_A, a, a)`` upper),

    .. math::
        A = D R^\top Q^\top, \qquad \log\det(AA^\top) = 2\sum_i \log d_i + 2\sum_j \log|R_{jj}|,
        \qquad A^\top(AA^\top)^{-1} = Q R^{-\top} D^{-1}.

    :math:`|R_{jj}|` is the distance of normalised row ``j`` from the span of the rows before it, so the rank
    verdict (:attr:`min_pivot` against ``max(a, n) eps``) does not depend on how the rows are scaled, and the
    log-determinant does not square :math:`\mathrm{cond}(A)` as a Cholesky of :math:`AA^\top` would.

    Computed without gradient (the verdict and cached quantities are constants); cost O(a^2 n) once, memory
    ``n a`` float64 for ``Q`` (formed only when :meth:`orthonormal` is asked). Holds no reference to ``A``
    (a cache keyed weakly by ``A`` may keep it while ``A`` lives).

    Args:
        A (Tensor): ``(*batch_A, a, n)``, any floating dtype.
    """

    def __init__(self, A: Tensor) -> None:
        with torch.no_grad():
            A64 = A.detach().to(torch.float64)
            d = torch.linalg.vector_norm(A64, dim=-1)  # shape: (*batch_A, a)
            self.row_norms = d
            self.R = torch.linalg.qr(_normalised_t(A64, d), mode="r")[1]  # (*batch_A, a, a)
            pivots = self.R.diagonal(dim1=-2, dim2=-1).abs()
            #: smallest |R_jj| over rows and batch (0 for a zero row): 1 for orthogonal rows
            self.min_pivot = float(torch.where(d > 0, pivots, 0.0).min()) if d.numel() else 1.0
            self.logdet = 2 * (d.log().sum(-1) + pivots.log().sum(-1))  # float64, (*batch_A)
        self.shape = A.shape
        self._Q: Tensor | None = None

    def full_rank(self, dtype: torch.dtype) -> bool:
        """Is every normalised row more than ``max(a, n) eps(dtype)`` away from the span of the rows before it?"""
        a, n = self.shape[-2:]
        return self.min_pivot > max(a, n) * torch.finfo(dtype).eps

    def orthonormal(self, A: Tensor) -> Tensor:
        """``Q`` (``(*batch_A, n, a)``, float64) for the ``A`` these factors were computed from, formed once on
        first use (with ``R`` from the same factorisation)."""
        if self._Q is None:
            with torch.no_grad():
                self._Q, self.R = torch.linalg.qr(_normalised_t(A.detach().to(torch.float64), self.row_norms))
        return self._Q


def _normalised_t(A64: Tensor, d: Tensor) -> Tensor:
    """``(D^{-1} A)^T``, ``(*batch, n, a)``, with zero rows left as they are."""
    return (A64 / torch.where(d > 0, d, 1.0).unsqueeze(-1)).mT


def min_norm_coefficients(R: Tensor, d: Tensor, k: Tensor) -> Tensor:
    r""":math:`u = R^{-\top} D^{-1} k` (``(*batch, a)``), so that :math:`Qu` is the minimum-norm solution."""
    rhs = (k / d).unsqueeze(-1)  # solve_triangular broadcasts the batch dimensions of R and rhs
    return torch.linalg.solve_triangular(R.mT, rhs, upper=False).squeeze(-1)


def project_dense(A: Tensor, k: Tensor, z: Tensor, factors: RowSpaceFactors | None = None) -> Tensor:
    r"""Orthogonal projection of ``z`` onto :math:`\{Az = k\}` in float64 from the factors of :class:`RowSpaceFactors`:
    :math:`z - Q(Q^\top z - R^{-\top}D^{-1}k)`. Differentiable w.r.t. ``z`` and ``k``; w.r.t. ``A`` only when
    ``factors`` is ``None`` (then the QR is recomputed with gradient)."""
    Q, R, d = _differentiable_factors(A, factors)
    u = min_norm_coefficients(R, d, k.to(torch.float64))  # (*batch, a)
    z64 = z.to(torch.float64)
    out = z64 - batch_mv(Q, batch_mv(Q.mT, z64) - u)
    return out.to(z.dtype)


def particular_dense(A: Tensor, k: Tensor, factors: RowSpaceFactors | None = None) -> Tensor:
    r"""Minimum-norm solution :math:`A^\top(AA^\top)^{-1}k = QR^{-\top}D^{-1}k`, ``(*batch, n)``."""
    Q, R, d = _differentiable_factors(A, factors)
    return batch_mv(Q, min_norm_coefficients(R, d, k.to(torch.float64))).to(k.dtype)


def _differentiable_factors(A: Tensor, factors: RowSpaceFactors | None) -> tuple[Tensor, Tensor, Tensor]:
    if factors is not None:
        return factors.orthonormal(A), factors.R, factors.row_norms
    A64 = A.to(torch.float64)
    d = torch.linalg.vector_norm(A64, dim=-1)
    Q, R = torch.linalg.qr((A64 / d.unsqueeze(-1)).mT, mode="reduced")
    return Q, R, d


def same_row_space_dense(A: Tensor, B: Tensor, dtype: torch.dtype) -> bool:
    r"""Do the rows of ``A`` and ``B`` (``(*batch, a, n)``, equal ``a``) span the same space in every batch element?

    Each normalised row of ``B`` is projected off the row space of ``A`` (float64 QR); the spaces agree
    when every remainder is below ``10 max(a, n) eps(dtype)`` (the rank tolerance, with room for the rounding
    of rows rescaled in ``dtype``). Dense: O(a^2 n)."""
    with torch.no_grad():
        A, B = torch.broadcast_tensors(A.detach().to(torch.float64), B.detach().to(torch.float64))
        Q = _differentiable_factors(A, None)[0]  # (*batch, n, a)
        Bt = B.mT / torch.linalg.vector_norm(B, dim=-1).clamp_min(torch.finfo(torch.float64).tiny).unsqueeze(-2)
        rest = Bt - Q @ (Q.mT @ Bt)
        a, n = A.shape[-2:]
        return bool(torch.linalg.vector_norm(rest, dim=-2).max() <= 10 * max(a, n) * torch.finfo(dtype).eps)


class EqualityConstraint(ABC):
    r"""Base class of the constraint operators :math:`A z = k` (``A``: ``a x n``, full row rank, ``a < n``).

    A subclass implements the abstract methods (products with :math:`A`, :math:`A^\top`, :math:`|A|`,
    :meth:`dense_matrix` for the dense defaults, :meth:`expand`, :meth:`with_k`, :meth:`to`) and overrides the
    defaults below where its structure gives a cheaper algorithm. Every default is written against
    :meth:`dense_matrix` (O(a n) memory) and is exact; :class:`~hardeq.testing.ConstraintTestCase` checks a
    subclass against a dense float64 oracle.
    """

    #: right-hand side k, shape ``(*batch, a)`` (one name across the API)
    k: Tensor

    @property
    @abstractmethod
    def num_constraints(self) -> int:
        """Number of constraint rows ``a``."""
        ...

    @property
    @abstractmethod
    def event_size(self) -> int:
        """Dimension ``n`` of the constrained vector."""
        ...

    @property
    @abstractmethod
    def batch_shape(self) -> torch.Size:
        """Batch shape: the broadcast of the batch dimensions of ``A`` and ``k``."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @abstractmethod
    def matvec(self, z: Tensor) -> Tensor:
        """``A z``: ``(*sample, *batch, n) -> (*sample, *batch, a)``."""
        ...

    @abstractmethod
    def rmatvec(self, u: Tensor) -> Tensor:
        """``A^T u``: ``(*sample, *batch, a) -> (*sample, *batch, n)``."""
        ...

    @abstractmethod
    def matmul(self, X: Tensor) -> Tensor:
        """``A X``: ``(*batch, n, m) -> (*batch, a, m)``."""
        ...

    @abstractmethod
    def dense_matrix(self) -> Tensor:
        """``A`` as a dense tensor ``(*batch, a, n)``. Only the constraint classes and :mod:`hardeq.testing`
        call it; everyone else asks for what they need (see :meth:`dense_rows` for the dense baselines)."""
        ...

    def dense_rows(self) -> Tensor:
        r"""Materialises ``A``: a dense ``(*batch, a, n)`` tensor, for algorithms defined on the entries of the
        matrix (the dense baselines: elimination pivots, KKT layers built from a constraint). Costs ``a n``
        memory, which a structured constraint (sparse, grouped) never needs otherwise."""
        return self.dense_matrix()

    @abstractmethod
    def logdet_gram_identity(self) -> Tensor:
        r""":math:`\log\det(A A^\top)`, shape: the batch shape of ``A``; computed once per object."""
        ...

    @property
    def has_diagonal_gram(self) -> bool:
        r"""Is :math:`A\,\mathrm{diag}(v)\,A^\top` diagonal for every ``v`` (then :meth:`diagonal_gram` returns its
        diagonal)? Lets a conditioner skip preparing the O(n) path for a dense ``A``. Default: ``False``."""
        return False

    def diagonal_gram(self, variance: Tensor) -> Tensor | None:
        r"""The diagonal of :math:`A\,\mathrm{diag}(v)\,A^\top` (shape ``(*batch, a)``) when that matrix is
        diagonal for every ``v``, else ``None``.

        Conditioners use it to pick the O(n) path for a diagonal covariance (``variance``: ``(*batch, n)``)
        without knowing the constraint's type. The default (dense ``A``) says ``None``.
        """
        return None

    def residual(self, z: Tensor) -> Tensor:
        """``A z - k``, shape ``(*sample, *batch, a)``."""
        return self.matvec(z) - self.k

    def check(self, z: Tensor, rtol: float | None = None) -> Tensor:
        r"""Boolean tensor ``(*sample, *batch)``: does ``z`` satisfy every row of ``A z = k`` to round-off?

        Per row ``i``: :math:`|(Az - k)_i| \le \mathrm{rtol}\,(|A||z| + |k|)_i`, with ``rtol = 1e3 eps(dtype)``
        by default, i.e. relative to the size of the terms summed in that row (never to the largest row:
        a small group cannot hide behind a large one)."""
        if rtol is None:
            rtol = 1e3 * torch.finfo(z.dtype).eps
        residual = self.residual(z).abs()
        scale = self.abs_matvec(z.abs()) + self.k.abs()
        return (residual <= rtol * scale).all(-1)

    @abstractmethod
    def abs_matvec(self, z_abs: Tensor) -> Tensor:
        r""":math:`|A|\,x` for ``x >= 0`` (``|A|`` elementwise): the size of the terms summed in each row,
        ``(*sample, *batch, n) -> (*sample, *batch, a)``."""
        ...

    def matvec_and_scale(self, z: Tensor) -> tuple[Tensor, Tensor]:
        r""":math:`Az` and :math:`|A||z|` (the residual check needs both), each ``(*sample, *batch, a)``; a structure
        may compute them in one pass."""
        return self.matvec(z), self.abs_matvec(z.abs())

    # ------------------------------------------------------------------ what the conditioner asks for
    @property
    def storage_numel(self) -> int:
        """Entries stored to represent ``A`` (a cached ``a x n`` product is worth it when not much larger)."""
        return self.num_constraints * self.event_size

    def gram(self, covariance: Covariance) -> Tensor:
        r""":math:`S = A\Sigma A^\top` under a :class:`~hardeq.Covariance`, ``(*batch, a, a)``."""
        return covariance.sandwich(self.dense_matrix())

    def sqrt_gram_factor(self, covariance: Covariance) -> Tensor:
        r""":math:`B^\top = F^\top A^\top` with :math:`\Sigma = FF^\top`, ``(*batch, m, a)``
        (:math:`S = BB^\top`; the QR fallback factorises it)."""
        return covariance.sqrt_t_matmul(self.dense_matrix().mT)

    def cross_covariance(self, covariance: Covariance) -> Tensor:
        r""":math:`\Sigma A^\top = \mathrm{Cov}(z, Az)`, ``(*batch, n, a)``."""
        return covariance.matmul(self.dense_matrix().mT)

    def orthonormal_decomposition(self) -> tuple[Tensor, Tensor, Tensor]:
        r"""Complete QR of :math:`A^\top` in float64: :math:`A^\top = [Q_A, N]\,[R; 0]`. Returns ``Q_A``
        (``(*batch_A, n, a)``, orthonormal basis of the row space), ``R`` (``(*batch_A, a, a)``, upper) and ``N``
        (``(*batch_A, n, n - a)``, orthonormal basis of :math:`\mathrm{null}(A)`). Dense: O(n^2) memory."""
        A = self.dense_matrix().to(torch.float64)
        a = A.shape[-2]
        Q, R = torch.linalg.qr(A.mT, mode="complete")
        return Q[..., :a], R[..., :a, :], Q[..., a:]

    def pinned_values(self) -> tuple[Tensor, Tensor] | None:
        """Coordinates the constraint alone determines (a row of ``A`` with one nonzero ``a_ij`` fixes
        ``z_j = k_i / a_ij``; e.g. a group of one): ``(mask, values)`` with ``mask`` ``(*batch_A, n)`` bool
        (``(n,)`` for a shared ``A``) and ``values`` ``(*batch, n)``, valid where ``mask``; ``None`` if there are
        none. Default: from :meth:`dense_matrix`, O(a n)."""
        from ._pinned import pinned_dense

        return pinned_dense(self.dense_matrix(), self.k)

    # ------------------------------------------------------------------ geometry of the plane
    def particular_solution(self) -> Tensor:
        r"""The minimum-norm solution :math:`z_0 = A^\top(AA^\top)^{-1}k` of :math:`Az = k`, ``(*batch, n)``.

        Default: from a float64 QR of the row-normalised :math:`A^\top` (O(a^2 n)), cast to ``dtype``."""
        return particular_dense(self.dense_matrix(), self.k)

    def project(self, z: Tensor) -> Tensor:
        r"""The orthogonal (Euclidean) projection of ``z`` onto :math:`\{Az = k\}`:
        :math:`z - A^\top(AA^\top)^{-1}(Az - k)`, ``(*sample, *batch, n) -> (*sample, *batch, n)``.

        Idempotent; the correction is orthogonal to the plane. Differentiable w.r.t. ``z`` and ``k``.
        Default: float64 QR of the row-normalised :math:`A^\top` (O(a^2 n)), result cast to ``z.dtype``."""
        return project_dense(self.dense_matrix(), self.k, z)

    def same_row_space(self, other: EqualityConstraint) -> bool:
        r"""Do ``self`` and ``other`` constrain the same directions (equal row spaces of :math:`A`, i.e. parallel
        planes), in every batch element? Independent of row order and row scaling; ``k`` is ignored.

        Default: dense, O(a^2 n) (a float64 QR; see :func:`same_row_space_dense` for the tolerance)."""
        if other is self:
            return True
        if not isinstance(other, EqualityConstraint):
            raise TypeError(f"other must be an EqualityConstraint, got {type(other).__name__}.")
        if other.num_constraints != self.num_constraints or other.event_size != self.event_size:
            return False
        return same_row_space_dense(self.dense_matrix(), other.dense_matrix(), self.dtype)

    @property
    def group_index(self) -> Tensor | None:
        """For grouped-sum constraints (each coordinate in exactly one row, with coefficient 1), the group id
        of each coordinate, a ``(n,)`` LongTensor; ``None`` for every other constraint."""
        return None

    # ------------------------------------------------------------------ copies
    @abstractmethod
    def expand(self, batch_shape: torch.Size) -> EqualityConstraint:
        """The constraint with ``k`` (and a batched ``A``) expanded to ``batch_shape``, sharing caches."""
        ...

    @abstractmethod
    def with_k(self, k: Tensor) -> EqualityConstraint:
        """The same ``A`` with a new right-hand side ``k`` (shape ``(*batch, a)``), sharing caches."""
        ...

    @abstractmethod
    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> EqualityConstraint:
        """A copy on ``device`` with floating-point tensors cast to ``dtype`` (group ids stay ``long``),
        like ``Tensor.to``. Returns ``self`` when nothing changes."""
        ...
