r"""Linear equality constraints :math:`A z = k` as operators.

A constraint object knows how to apply :math:`A` and :math:`A^\top` without materialising :math:`A` when
it has structure:

* :class:`LinearConstraint` holds a dense, possibly batched ``A`` of shape ``(*batch, a, n)``.
* :class:`SumConstraint` holds a group id per coordinate (like PyG's ``batch`` vector); every operation is a
  scatter / gather, O(n).

Both carry the right-hand side ``k`` (``k``), which may have batch dimensions, e.g. one ``k = b - B x``
per input ``x``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from ._utils import (
    batch_mv,
    check_finite,
    check_group_index,
    check_same_dtype_device,
    check_tensor,
    validate_default,
)
from .ops import GroupSum

__all__ = ["EqualityConstraint", "LinearConstraint", "SumConstraint"]


class EqualityConstraint(ABC):
    """Base class of the constraint operators. Subclasses implement the operator methods below."""

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
        """``A`` as a dense tensor ``(*batch, a, n)`` (materialised; used by dense oracles and baselines)."""
        ...

    @abstractmethod
    def logdet_gram_identity(self) -> Tensor:
        r""":math:`\log\det(A A^\top)`, shape: the batch shape of ``A``."""
        ...

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

    # ------------------------------------------------------------------ what the conditioner asks for
    @property
    def storage_numel(self) -> int:
        """Entries stored to represent ``A`` (a cached ``a x n`` product is worth it when not much larger)."""
        return self.num_constraints * self.event_size

    def gram(self, covariance) -> Tensor:
        r""":math:`S = A\Sigma A^\top` under a :class:`~hardeq.Covariance`, ``(*batch, a, a)``."""
        return covariance.sandwich(self.dense_matrix())

    def sqrt_gram_factor(self, covariance) -> Tensor:
        r""":math:`B^\top = F^\top A^\top` with :math:`\Sigma = FF^\top`, ``(*batch, m, a)``
        (:math:`S = BB^\top`; the QR fallback factorises it)."""
        return covariance.sqrt_t_matmul(self.dense_matrix().mT)

    def cross_covariance(self, covariance) -> Tensor:
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
        """Coordinates the constraint alone determines (e.g. a group of one): ``(mask, values)`` with ``mask``
        ``(n,)`` bool and ``values`` ``(*batch, n)``, valid where ``mask``; ``None`` if there are none."""
        return None

    @abstractmethod
    def expand(self, batch_shape: torch.Size) -> "EqualityConstraint":
        ...

    @abstractmethod
    def with_k(self, k: Tensor) -> "EqualityConstraint":
        """The same ``A`` with a new right-hand side ``k`` (shape ``(*batch, a)``)."""
        ...

    @abstractmethod
    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "EqualityConstraint":
        """A copy on ``device`` with floating-point tensors cast to ``dtype`` (group ids stay ``long``),
        like ``Tensor.to``. Returns ``self`` when nothing changes."""
        ...


class LinearConstraint(EqualityConstraint):
    r"""Dense linear equality constraint :math:`A z = k`.

    Args:
        A (Tensor): constraint matrix, shape ``(*batch, a, n)`` with full row rank ``a < n``.
        k (Tensor): right-hand side, shape ``(*batch, a)``; batch dims of ``A`` and ``k`` broadcast (a shared
            ``A`` with one ``k = b - B x`` per input is the common case).
        validate_args (bool, optional): check the rank of ``A`` (an SVD) and finiteness; defaults to
            torch.distributions' global setting. Shapes, dtypes and devices are always checked.

    Example:
        >>> c = LinearConstraint(torch.ones(1, 3), torch.tensor([1.0]))
        >>> c.num_constraints, c.event_size, c.batch_shape
        (1, 3, torch.Size([]))
    """

    def __init__(self, A: Tensor, k: Tensor, *, validate_args: bool | None = None) -> None:
        check_tensor("A", A, min_dim=2)
        if isinstance(k, (int, float)):
            k = torch.full(A.shape[-2:-1], float(k), dtype=A.dtype, device=A.device)
        check_tensor("k", k, min_dim=1)
        check_same_dtype_device(A=A, k=k)
        a, n = A.shape[-2:]
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
            self._batch_shape = torch.broadcast_shapes(A.shape[:-2], k.shape[:-1])
        except RuntimeError:
            raise ValueError(
                f"batch dimensions of A {tuple(A.shape[:-2])} and k {tuple(k.shape[:-1])} do not broadcast."
            ) from None
        self.A = A
        self.k = k
        self._validate_args = validate_default(validate_args)
        if self._validate_args:
            check_finite("A", A)
            check_finite("k", k)
            rank = torch.linalg.matrix_rank(A)
            if bool((rank < a).any()):
                raise ValueError(
                    f"A must have full row rank {a}, but some batch element has rank {int(rank.min())} "
                    f"(A.shape = {tuple(A.shape)}); remove linearly dependent rows."
                )

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
        return batch_mv(self.A, z)

    def rmatvec(self, u: Tensor) -> Tensor:
        return batch_mv(self.A.mT, u)

    def matmul(self, X: Tensor) -> Tensor:
        return self.A @ X

    def dense_matrix(self) -> Tensor:
        return self.A

    def logdet_gram_identity(self) -> Tensor:
        # QR of A^T: log det(A A^T) = 2 sum log |R_jj|, without squaring cond(A)
        R = torch.linalg.qr(self.A.mT, mode="r")[1]
        return 2 * R.diagonal(dim1=-2, dim2=-1).abs().log().sum(-1)

    @property
    def storage_numel(self) -> int:
        return self.A.numel()

    def abs_matvec(self, z_abs: Tensor) -> Tensor:
        return batch_mv(self.A.abs(), z_abs)

    def expand(self, batch_shape: torch.Size) -> "LinearConstraint":
        batch_shape = torch.Size(batch_shape)
        new = object.__new__(LinearConstraint)
        new.A = self.A if self.A.dim() == 2 else self.A.expand(batch_shape + self.A.shape[-2:])
        new.k = self.k.expand(batch_shape + self.k.shape[-1:])
        new._batch_shape = batch_shape
        new._validate_args = False
        return new

    def with_k(self, k: Tensor) -> "LinearConstraint":
        return LinearConstraint(self.A, k, validate_args=False)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "LinearConstraint":
        A, k = self.A.to(device=device, dtype=dtype), self.k.to(device=device, dtype=dtype)
        if A is self.A and k is self.k:
            return self
        return LinearConstraint(A, k, validate_args=False)

    def __repr__(self) -> str:
        return (f"LinearConstraint(a={self.num_constraints}, n={self.event_size}, "
                f"batch_shape={tuple(self.batch_shape)})")


class SumConstraint(EqualityConstraint):
    r"""Grouped sum constraints: :math:`\sum_{i : g(i) = j} z_i = t_j` for every group ``j``.

    Equivalent to a :class:`LinearConstraint` whose ``A`` is the ``a x n`` group-indicator matrix, but every
    operation is a scatter-add or a gather (O(n) time and memory): applying ``A`` sums coordinates per group,
    ``A^T`` broadcasts a group value to its members, and :math:`A\,\mathrm{diag}(v)A^\top` is diagonal
    (per-group sums of ``v``).

    Args:
        index (LongTensor): group id of each coordinate, shape ``(n,)``, values in ``[0, a)``, every group
            non-empty (PyG's ``batch`` vector, an image's channel id, ...). ``index = torch.zeros(n)`` is the
            single sum-to-total constraint.
        total (Tensor): required sum of each group, shape ``(*batch, a)``.
        validate_args (bool, optional): check finiteness of ``total``; defaults to torch.distributions'
            global setting. Shapes, index range and non-empty groups are always checked.

    Example:
        >>> c = SumConstraint(torch.tensor([0, 0, 1, 1, 1]), torch.tensor([1.0, 2.0]))
        >>> c.matvec(torch.ones(5))
        tensor([2., 3.])
    """

    def __init__(self, index: Tensor, total: Tensor, *, validate_args: bool | None = None) -> None:
        if not isinstance(index, Tensor):
            raise TypeError(f"index must be a torch.Tensor of dtype torch.long, got {type(index).__name__}.")
        if index.dtype != torch.long:
            raise TypeError(f"index must have dtype torch.long, got {index.dtype}.")
        if index.dim() != 1:
            raise ValueError(f"index must be 1-D (one group id per coordinate), got shape {tuple(index.shape)}.")
        if isinstance(total, (int, float)):
            total = torch.tensor([float(total)], device=index.device)
        check_tensor("total", total, min_dim=1)
        if total.device != index.device:
            raise ValueError(f"total is on device {total.device} but index is on {index.device}.")
        a, n = total.shape[-1], index.shape[0]
        counts = check_group_index(index, a)
        if a >= n:
            raise ValueError(
                f"there must be fewer groups than coordinates (a < n), got a = {a} groups for n = {n}."
            )
        self.index = index
        self.k = total
        self.counts = counts
        # precise two-level summation (hardeq.ops.GroupSum): a plain index_add drifts ~ n eps
        self._group_sum = GroupSum(index, a)
        self._pinned = None
        self._validate_args = validate_default(validate_args)
        if self._validate_args:
            check_finite("total", total)

    @property
    def num_constraints(self) -> int:
        return self.k.shape[-1]

    @property
    def event_size(self) -> int:
        return self.index.shape[0]

    @property
    def batch_shape(self) -> torch.Size:
        return self.k.shape[:-1]

    def matvec(self, z: Tensor) -> Tensor:
        return self._group_sum(z)

    def rmatvec(self, u: Tensor) -> Tensor:
        return self._group_sum.broadcast(u)

    def matmul(self, X: Tensor) -> Tensor:
        return self._group_sum.matmul(X)

    def diagonal_gram(self, variance: Tensor) -> Tensor:
        r"""Per-group sums of ``variance`` (each coordinate is in one group, so the Gram matrix is diagonal),
        with the two-level summation of :meth:`matvec`; shape ``(*batch, a)``."""
        return self.matvec(variance)

    def dense_matrix(self) -> Tensor:
        onehot = torch.nn.functional.one_hot(self.index, self.num_constraints).mT.to(self.k.dtype)
        return onehot

    def logdet_gram_identity(self) -> Tensor:
        return self.counts.to(self.k.dtype).log().sum()

    @property
    def storage_numel(self) -> int:
        return self.event_size

    def abs_matvec(self, z_abs: Tensor) -> Tensor:
        return self.matvec(z_abs)

    def gram(self, covariance) -> Tensor:
        if covariance.is_diagonal:
            return torch.diag_embed(self.diagonal_gram(covariance.variance))
        return super().gram(covariance)

    def pinned_values(self) -> tuple[Tensor, Tensor] | None:
        """Members of groups of one: their value is the group's total."""
        if self._pinned is None:
            mask = self.counts[self.index] == 1
            self._pinned = (mask, bool(mask.any()))
        mask, any_pinned = self._pinned
        if not any_pinned:
            return None
        return mask, self.k[..., self.index]

    def expand(self, batch_shape: torch.Size) -> "SumConstraint":
        new = object.__new__(SumConstraint)
        new.index, new.counts, new._validate_args = self.index, self.counts, False
        new._group_sum = self._group_sum
        new._pinned = self._pinned
        new.k = self.k.expand(torch.Size(batch_shape) + self.k.shape[-1:])
        return new

    def with_k(self, k: Tensor) -> "SumConstraint":
        return SumConstraint(self.index, k, validate_args=False)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "SumConstraint":
        index, k = self.index.to(device=device), self.k.to(device=device, dtype=dtype)
        if index is self.index and k is self.k:
            return self
        return SumConstraint(index, k, validate_args=False)

    def __repr__(self) -> str:
        return (f"SumConstraint(groups={self.num_constraints}, n={self.event_size}, "
                f"batch_shape={tuple(self.batch_shape)})")
