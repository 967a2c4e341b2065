r"""The constraint interface :class:`EqualityConstraint`, its generic pair operations and the kind registry.

A constraint object is an operator :math:`A` (``a x n``, full row rank, ``a < n``) together with a right-hand
side ``k`` (``(*batch, a)``). Callers ask it for what they need (products with :math:`A`, :math:`A^\top`,
:math:`|A|`, the Gram matrix under a covariance, a projection onto the plane, its group ids, its config) and never
for its type; a structured subclass overrides the defaults below with cheaper algorithms.

* **Adding a constraint:** subclass :class:`EqualityConstraint` and implement its six abstract members
  (:attr:`~EqualityConstraint.event_size`, :meth:`~EqualityConstraint.matvec`, :meth:`~EqualityConstraint.rmatvec`,
  :meth:`~EqualityConstraint.dense_matrix`, :meth:`~EqualityConstraint.with_k`, :meth:`~EqualityConstraint.to`);
  set ``k``. Everything else is a dense, exact default (:mod:`hardeq.constraints._dense`).
* **A cheaper (constraint, covariance) pair:** :func:`~hardeq.constraints.pairs.register_pair`.
* **Saving it:** :meth:`~EqualityConstraint.to_config` defaults to the dense equivalent (kind ``"linear"``); a class
  with a compact form decorates itself with :func:`register_constraint_kind` and implements ``to_config`` and the
  classmethod ``_from_config``; :meth:`EqualityConstraint.from_config` finds it by its kind.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, Protocol, cast

import torch
from torch import Tensor

from .._utils import batch_mv
from . import pairs
from ._dense import RowSpaceFactors, particular_dense, project_dense, same_row_space_dense

if TYPE_CHECKING:
    from ..linalg.covariance import Covariance

__all__ = ["EqualityConstraint", "RowSpaceFactors", "register_constraint_kind", "constraint_kinds"]

#: kind name -> constraint class (what EqualityConstraint.from_config looks up)
_KINDS: dict[str, type] = {}


class _ConfigReader(Protocol):
    """A registered constraint class: its classmethod ``_from_config(config)`` builds the instance."""

    def _from_config(self, config: dict[str, Any]) -> EqualityConstraint: ...

#: dtypes a config may name
CONFIG_DTYPES = ("float16", "bfloat16", "float32", "float64")


def register_constraint_kind(*kinds: str) -> Callable[[type], type]:
    """Class decorator: ``cls.to_config()`` writes one of ``kinds`` and ``cls._from_config(config)`` reads every one
    of them (the first is the main name; the others are accepted when loading, e.g. older layouts)."""
    if not kinds or not all(isinstance(k, str) and k for k in kinds):
        raise ValueError(f"register_constraint_kind needs one or more non-empty kind names, got {kinds!r}.")

    def decorator(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, EqualityConstraint)):
            raise TypeError(f"register_constraint_kind decorates a subclass of hardeq.EqualityConstraint, got {cls!r}.")
        if "_from_config" not in cls.__dict__:
            raise TypeError(f"{cls.__name__} registers the constraint kinds {list(kinds)} but defines no classmethod "
                            "_from_config(config) to read them.")
        for kind in kinds:
            other = _KINDS.get(kind)
            if other is not None and other.__qualname__ != cls.__qualname__:
                raise ValueError(f"constraint kind {kind!r} is registered to {other.__name__} already.")
            _KINDS[kind] = cls
        return cls

    return decorator


def constraint_kinds() -> list[str]:
    """The registered constraint kinds, sorted (what :meth:`EqualityConstraint.from_config` accepts)."""
    return sorted(_KINDS)


def config_dtype(config: dict[str, Any]) -> torch.dtype:
    """The ``"dtype"`` of a config (default float32), or ``ValueError`` naming the accepted ones."""
    name = config.get("dtype", "float32")
    if name not in CONFIG_DTYPES:
        raise ValueError(f"constraint config dtype must be one of {CONFIG_DTYPES}, got {name!r}.")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def require_keys(config: dict[str, Any], *keys: str) -> None:
    """``ValueError`` naming the keys a config of this kind lacks."""
    missing = [k for k in keys if k not in config]
    if missing:
        raise ValueError(f"a constraint config of kind {config.get('kind')!r} needs the keys {list(keys)}, missing "
                         f"{missing}.")


class EqualityConstraint(ABC):
    r"""Base class of the constraint operators :math:`A z = k` (``A``: ``a x n``, full row rank, ``a < n``).

    A subclass sets ``k`` and implements six abstract members: :attr:`event_size`, :meth:`matvec`,
    :meth:`rmatvec`, :meth:`dense_matrix`, :meth:`with_k` and :meth:`to`. Every other method has a default written
    against those (:meth:`dense_matrix` where it needs the entries, O(a n) memory) that is exact; a subclass
    overrides one where its structure gives a cheaper algorithm. Pair operations with a covariance (:meth:`gram`,
    :meth:`cross_covariance`, :meth:`sqrt_gram_factor`, the grouped path) are specialised by registration
    (:func:`~hardeq.constraints.register_pair`). :class:`~hardeq.testing.ConstraintTestCase` checks a subclass
    against a dense float64 oracle.

    Examples:
        >>> c = SumConstraint(torch.tensor([0, 0, 1]), torch.tensor([1.0, 2.0]))
        >>> isinstance(c, EqualityConstraint), c.dense_matrix()
        (True, tensor([[1., 1., 0.],
                [0., 0., 1.]]))
        >>> z = c.project(torch.tensor([3.0, 0.0, 0.0]))  # the nearest point of the plane
        >>> z, bool(c.check(z))
        (tensor([ 2., -1.,  2.]), True)
    """

    #: right-hand side k, shape ``(*batch, a)`` (one name across the API)
    k: Tensor

    # ------------------------------------------------------------------ the six abstract members
    @property
    @abstractmethod
    def event_size(self) -> int:
        """Dimension ``n`` of the constrained vector."""

    @abstractmethod
    def matvec(self, z: Tensor) -> Tensor:
        """``A z``: ``(*sample, *batch, n) -> (*sample, *batch, a)``."""

    @abstractmethod
    def rmatvec(self, u: Tensor) -> Tensor:
        """``A^T u``: ``(*sample, *batch, a) -> (*sample, *batch, n)``."""

    @abstractmethod
    def dense_matrix(self) -> Tensor:
        """``A`` as a dense tensor ``(*batch, a, n)``. Only the constraint classes and :mod:`hardeq.testing`
        call it; everyone else asks for what they need (see :meth:`dense_rows` for the dense baselines)."""

    @abstractmethod
    def with_k(self, k: Tensor) -> EqualityConstraint:
        """The same ``A`` with a new right-hand side ``k`` (shape ``(*batch, a)``), sharing caches."""

    @abstractmethod
    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> EqualityConstraint:
        """A copy on ``device`` with floating-point tensors cast to ``dtype`` (group ids stay ``long``),
        like ``Tensor.to``. Returns ``self`` when nothing changes."""

    # ------------------------------------------------------------------ shape
    @property
    def num_constraints(self) -> int:
        """Number of constraint rows ``a`` (default: ``k.shape[-1]``)."""
        return self.k.shape[-1]

    @property
    def batch_shape(self) -> torch.Size:
        """Batch shape: the broadcast of the batch dimensions of ``A`` and ``k`` (default: ``k.shape[:-1]``)."""
        return self.k.shape[:-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def operator_requires_grad(self) -> bool:
        """Does a tensor of the operator ``A`` (anything but ``k``) require grad? Default: any tensor attribute of
        the constraint other than ``k``; the built-in constraints name their operator tensors directly, which
        ``torch.compile`` traces without a graph break."""
        return any(isinstance(t, Tensor) and t.requires_grad and t is not self.k for t in vars(self).values())

    # ------------------------------------------------------------------ products
    def matmul(self, X: Tensor) -> Tensor:
        """``A X``: ``(*batch, n, m) -> (*batch, a, m)``. Default: the columns of ``X`` as a sample of vectors
        through :meth:`matvec`."""
        return self.matvec(X.movedim(-1, 0)).movedim(0, -1)

    def operator_cache(self) -> dict[str, Any] | None:
        """A dict for values derived from the operator ``A`` alone, shared by every constraint built on the same
        unchanged operator tensor (a training loop builds a new constraint each step on the same ``A``), or
        ``None`` where there is none (the default; an operator that requires grad). Callers key their entries by
        name and fall back to computing per call on ``None``."""
        return None

    def dense_rows(self) -> Tensor:
        r"""Materialises ``A``: a dense ``(*batch, a, n)`` tensor, for algorithms defined on the entries of the
        matrix (the dense baselines: elimination pivots, KKT layers built from a constraint). Costs ``a n``
        memory, which a structured constraint (sparse, grouped) never needs otherwise."""
        return self.dense_matrix()

    def logdet_gram_identity(self) -> Tensor:
        r""":math:`\log\det(A A^\top)`, shape: the batch shape of ``A``; computed once per object. Default: a float64
        QR of the row-normalised dense :math:`A^\top` (:class:`~hardeq.constraints._dense.RowSpaceFactors`, O(a^2 n),
        no gradient w.r.t. ``A``)."""
        factors = self.__dict__.get("_default_row_space")
        if factors is None:
            factors = self.__dict__["_default_row_space"] = RowSpaceFactors(self.dense_matrix())
        logdet: Tensor = factors.logdet.to(self.dtype)
        return logdet

    @property
    def has_diagonal_gram(self) -> bool:
        r"""Is :math:`A\,\mathrm{diag}(v)\,A^\top` diagonal for every ``v`` (then :meth:`diagonal_gram` returns its
        diagonal)? Lets a conditioner skip preparing the O(n) path for a dense ``A``. Default: ``False``."""
        return False

    def diagonal_gram(self, variance: Tensor) -> Tensor | None:
        r"""The diagonal of :math:`A\,\mathrm{diag}(v)\,A^\top` (shape ``(*batch, a)``) when that matrix is
        diagonal for every ``v`` (every column of ``A`` has at most one nonzero), else ``None``.

        The generic ``"grouped"`` pair registration uses it to pick the O(n) path for a diagonal covariance
        (``variance``: ``(*batch, n)``) without knowing the constraint's type. The default (dense ``A``) says
        ``None``.
        """
        return None

    def _check_points(self, z: Tensor, name: str = "z") -> None:
        """``TypeError`` / ``ValueError`` naming ``name`` unless ``z`` is a floating tensor ``(..., n)`` (a shape check
        only: no host synchronisation). Used by the user-facing :meth:`residual`, :meth:`check` and :meth:`project`;
        the products (:meth:`matvec`, ...) are left unchecked on the hot path."""
        if not isinstance(z, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(z).__name__}.")
        if not z.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {z.dtype}.")
        if z.dim() < 1 or z.shape[-1] != self.event_size:
            raise ValueError(f"{name} must have shape (..., n) with n = {self.event_size} (the constraint's event "
                             f"size), got {tuple(z.shape)}.")

    def residual(self, z: Tensor) -> Tensor:
        """``A z - k``, shape ``(*sample, *batch, a)``."""
        self._check_points(z)
        return self.matvec(z) - self.k

    def _shortfall(self, z: Tensor) -> Tensor:
        """``k - A z`` (``(*sample, *batch, a)``) without checking ``z``: the right-hand side of a Matheron step. A
        constraint whose product can add ``k`` in the same call (one ``addmm``) overrides it."""
        return self.k - self.matvec(z)

    def check(self, z: Tensor, rtol: float | None = None) -> Tensor:
        r"""Boolean tensor ``(*sample, *batch)``: does ``z`` satisfy every row of ``A z = k`` to round-off?

        Per row ``i``: :math:`|(Az - k)_i| \le \mathrm{rtol}\,(|A||z| + |k|)_i`, with ``rtol = 1e3 eps(dtype)``
        by default, i.e. relative to the size of the terms summed in that row (never to the largest row:
        a small group cannot hide behind a large one)."""
        self._check_points(z)
        if rtol is None:
            rtol = 1e3 * torch.finfo(z.dtype).eps
        residual = self.residual(z).abs()
        scale = self.abs_matvec(z.abs()) + self.k.abs()
        return (residual <= rtol * scale).all(-1)

    def abs_matvec(self, z_abs: Tensor) -> Tensor:
        r""":math:`|A|\,x` for ``x >= 0`` (``|A|`` elementwise): the size of the terms summed in each row,
        ``(*sample, *batch, n) -> (*sample, *batch, a)``. Default: dense ``|A|`` (O(a n) per vector)."""
        return batch_mv(self.dense_matrix().abs(), z_abs)

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
        r""":math:`S = A\Sigma A^\top` under a :class:`~hardeq.Covariance`, ``(*batch, a, a)``: dispatched on the pair
        of types (:func:`hardeq.constraints.pairs.gram`; specialise with :func:`~hardeq.constraints.register_pair`,
        not by overriding)."""
        return pairs.gram(self, covariance)

    def sqrt_gram_factor(self, covariance: Covariance) -> Tensor:
        r""":math:`B^\top = F^\top A^\top` with :math:`\Sigma = FF^\top`, ``(*batch, m, a)`` (:math:`S = BB^\top`;
        the QR fallback factorises it); dispatched like :meth:`gram`."""
        return pairs.sqrt_gram_factor(self, covariance)

    def cross_covariance(self, covariance: Covariance) -> Tensor:
        r""":math:`\Sigma A^\top = \mathrm{Cov}(z, Az)`, ``(*batch, n, a)``; dispatched like :meth:`gram`."""
        return pairs.cross_covariance(self, covariance)

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

    def pinned_values_static(self) -> tuple[Tensor, Tensor] | None:
        """:meth:`pinned_values` without a host read (for the conditioner's static mode): a verdict remembered
        from an earlier call may still say ``None``; otherwise the mask and values are formed always (an all-false
        mask when nothing is determined). Default: from :meth:`dense_matrix`, O(a n)."""
        from ._pinned import pinned_dense_static

        return pinned_dense_static(self.dense_matrix(), self.k)

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
        self._check_points(z)
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

    @property
    def group_sizes(self) -> Tensor | None:
        """For grouped-sum constraints (:attr:`group_index` not ``None``): members per row, ``(a,)`` long; else
        ``None``. Default: a count of :attr:`group_index`."""
        index = self.group_index
        return None if index is None else torch.bincount(index, minlength=self.num_constraints)

    # ------------------------------------------------------------------ copies and configs
    def expand(self, batch_shape: torch.Size) -> EqualityConstraint:
        """The constraint with ``k`` (and a batched ``A``) expanded to ``batch_shape``, sharing caches. Default:
        :meth:`with_k` of the expanded ``k`` (right for an ``A`` shared by the batch)."""
        return self.with_k(self.k.expand(torch.Size(batch_shape) + self.k.shape[-1:]))

    def to_config(self) -> dict[str, Any]:
        """A JSON-serialisable description (nested lists, Python floats written exactly), read back by
        :meth:`from_config`. Default: the dense equivalent, kind ``"linear"`` (``{"kind", "A", "k", "dtype"}``,
        about ``20 a n`` bytes of JSON); a class with a compact form registers a kind and overrides this."""
        return {"kind": "linear", "A": self.dense_matrix().detach().cpu().tolist(),
                "k": self.k.detach().cpu().tolist(), "dtype": dtype_name(self.dtype)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EqualityConstraint:
        """The constraint a :meth:`to_config` dict describes, built by the class registered for its ``"kind"``
        (:func:`register_constraint_kind`; :func:`constraint_kinds` lists them).

        Raises:
            TypeError: ``config`` is not a dict, or describes a constraint that is not a ``cls``.
            ValueError: unknown kind, missing keys, bad dtype or values.
        """
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict from EqualityConstraint.to_config(), got {type(config).__name__}.")
        kind: Any = config.get("kind")  # (any JSON value; only a registered name finds a class)
        target = _KINDS.get(kind)
        if target is None:
            raise ValueError(f"unknown constraint spec kind {kind!r} in the config; registered kinds: "
                             f"{constraint_kinds()}.")
        out = cast(_ConfigReader, target)._from_config(config)  # (register_constraint_kind: it defines one)
        if not isinstance(out, cls):
            raise TypeError(f"{cls.__name__}.from_config: the config describes a {type(out).__name__} (kind {kind!r}), "
                            f"not a {cls.__name__}; call EqualityConstraint.from_config.")
        return out


# ---------------------------------------------------------------------------------------- generic pair operations
@pairs.register_pair("gram", EqualityConstraint, pairs.ANY_COVARIANCE)
def _gram(constraint: EqualityConstraint, covariance: Covariance) -> Tensor:
    grouped = pairs.grouped_structure(constraint, covariance)
    if grouped is not None:  # diagonal: no a x n product
        return torch.diag_embed(grouped.gram_diagonal)
    return covariance.sandwich(constraint.dense_matrix())


@pairs.register_pair("sqrt_gram_factor", EqualityConstraint, pairs.ANY_COVARIANCE)
def _sqrt_gram_factor(constraint: EqualityConstraint, covariance: Covariance) -> Tensor:
    return covariance.sqrt_t_matmul(constraint.dense_matrix().mT)


@pairs.register_pair("cross_covariance", EqualityConstraint, pairs.ANY_COVARIANCE)
def _cross_covariance(constraint: EqualityConstraint, covariance: Covariance) -> Tensor:
    return covariance.matmul(constraint.dense_matrix().mT)


@pairs.register_pair("grouped", EqualityConstraint, pairs.ANY_COVARIANCE)
def _grouped(constraint: EqualityConstraint, covariance: Covariance) -> pairs.Grouped | None:
    r"""A diagonal covariance (:math:`w = \sigma^2`) with a constraint whose columns have at most one nonzero."""
    if not covariance.is_diagonal or not constraint.has_diagonal_gram:
        return None
    v = covariance.variance
    s = constraint.diagonal_gram(v)
    return None if s is None else pairs.Grouped(v, s)
