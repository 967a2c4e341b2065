r"""Operations on a (constraint, covariance) pair, dispatched on the pair of types through a registry.

In the manner of :func:`torch.distributions.register_kl`: each operation has a generic implementation (dense,
exact) for ``(EqualityConstraint, ANY_COVARIANCE)`` -- any covariance object; the constraint layer does not import
the covariance classes -- and a structured pair that can do better registers one function; the most specific
registration wins (smallest distance in the constraint's MRO, then in the covariance's), resolved once per pair of
types (memoised). The operations:

* ``"gram"`` -- :func:`gram`: :math:`S = A\Sigma A^\top`, ``(*batch, a, a)``;
* ``"cross_covariance"`` -- :func:`cross_covariance`: :math:`\Sigma A^\top = \mathrm{Cov}(z, Az)`, ``(*batch, n, a)``;
* ``"sqrt_gram_factor"`` -- :func:`sqrt_gram_factor`: :math:`B^\top = F^\top A^\top` (:math:`S = BB^\top`),
  ``(*batch, m, a)``;
* ``"grouped"`` -- :func:`grouped_structure`: does the O(n) grouped path apply, and with what? It returns a
  :class:`Grouped` ``(weight, gram_diagonal)`` when :math:`\Sigma A^\top = \mathrm{diag}(w)A^\top` for a vector
  ``w`` (``weight``, ``(*batch, n)``) and :math:`S = A\,\mathrm{diag}(w)A^\top` is diagonal with diagonal
  ``gram_diagonal`` (``(*batch, a)``) -- e.g. a diagonal covariance (:math:`w = \sigma^2`) with a constraint
  whose columns have at most one nonzero -- and ``None`` otherwise. Contract of a registration: every column of
  ``A`` has at most one nonzero and :math:`\Sigma` couples no two coordinates that lie in different rows of ``A``
  (nor a row's coordinates with those in no row); then both identities hold, and so does the O(n) trace
  correction of the KL between two such covariances. The grouped factor
  (:class:`~hardeq.linalg.conditioning.grouped.GroupedFactor`) then needs only ``w``, ``s`` and products with
  :math:`A` and :math:`A^\top`.

A structured pair is one registration, e.g. for a new covariance ``MyCov`` whose Gram with a
:class:`~hardeq.SumConstraint` is cheap::

    @register_pair("gram", SumConstraint, MyCov)
    def _gram_sum_mycov(constraint, covariance):
        ...  # -> (*batch, a, a)

The generic registrations live in :mod:`hardeq.constraints.base`; the structured ones next to the structure they
serve (:mod:`~hardeq.constraints.linear`, :mod:`~hardeq.constraints.sparse`,
:mod:`~hardeq.linalg.block_diagonal`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol, TypeVar

from torch import Tensor

if TYPE_CHECKING:
    from ..linalg.covariance import Covariance

__all__ = ["OPERATIONS", "ANY_COVARIANCE", "Grouped", "register_pair", "gram", "cross_covariance", "sqrt_gram_factor",
           "grouped_structure"]

#: the pair operations that can be registered
OPERATIONS = ("gram", "cross_covariance", "sqrt_gram_factor", "grouped")

#: the covariance type of the registrations made in the constraint modules: every covariance. (The constraint layer
#: sits below the covariance classes and does not import them; a registration for a covariance class is more
#: specific and wins.)
ANY_COVARIANCE: type = object

#: a registered pair function ``fn(constraint, covariance)``: its result type depends on the operation
PairFn = Callable[..., Any]
_F = TypeVar("_F", bound=PairFn)

_REGISTRY: dict[str, dict[tuple[type, type], PairFn]] = {op: {} for op in OPERATIONS}


class ConstraintLike(Protocol):
    """What the pair functions take as ``constraint``: a :class:`~hardeq.EqualityConstraint` in practice (any type
    with a registration; this module sits below ``constraints.base``, which imports it, so it names no class)."""

    @property
    def event_size(self) -> int: ...


class Grouped(NamedTuple):
    r"""What the O(n) grouped path needs: :math:`\Sigma A^\top = \mathrm{diag}(w)A^\top` and
    :math:`A\Sigma A^\top = \mathrm{diag}(s)`."""

    #: ``w``, ``(*batch, n)``
    weight: Tensor
    #: ``s``, ``(*batch, a)``
    gram_diagonal: Tensor


def register_pair(operation: str, constraint_type: type, covariance_type: type) -> Callable[[_F], _F]:
    """Decorator registering ``fn(constraint, covariance)`` for one of :data:`OPERATIONS` and a pair of types
    (subclasses inherit it; the most specific registration wins, as in :func:`torch.distributions.register_kl`).

    Examples:
        >>> from hardeq.constraints.pairs import gram
        >>> class UnitCovariance(DiagonalCovariance):  # a structure known to be the identity
        ...     pass
        >>> @register_pair("gram", SumConstraint, UnitCovariance)
        ... def _gram_sum_unit(constraint, covariance):  # A I A^T = diag(group sizes) = diag(A 1)
        ...     return torch.diag_embed(constraint.matvec(torch.ones(constraint.event_size)))
        >>> gram(SumConstraint(torch.tensor([0, 0, 1]), torch.zeros(2)), UnitCovariance(torch.ones(3)))
        tensor([[2., 0.],
                [0., 1.]])
    """
    if operation not in _REGISTRY:
        raise ValueError(f"operation must be one of {OPERATIONS}, got {operation!r}.")
    if not isinstance(constraint_type, type) or not isinstance(covariance_type, type):
        raise TypeError(f"register_pair needs two classes (a constraint type and a covariance type), got "
                        f"{constraint_type!r} and {covariance_type!r}.")

    def decorator(fn: _F) -> _F:
        _REGISTRY[operation][constraint_type, covariance_type] = fn
        _dispatch.cache_clear()
        return fn

    return decorator


@lru_cache(maxsize=None)
def _dispatch(operation: str, type_c: type, type_v: type) -> PairFn:
    table = _REGISTRY[operation]
    matches = [(tc, tv) for tc, tv in table if issubclass(type_c, tc) and issubclass(type_v, tv)]
    if not matches:
        raise TypeError(f"{operation}(constraint, covariance) needs a hardeq.EqualityConstraint and a "
                        f"hardeq.Covariance (or types registered with register_pair), got constraint: "
                        f"{type_c.__name__}, covariance: {type_v.__name__}.")
    best = min(matches, key=lambda m: (type_c.__mro__.index(m[0]), type_v.__mro__.index(m[1])))
    return table[best]


def gram(constraint: ConstraintLike, covariance: Covariance) -> Tensor:
    r""":math:`A\Sigma A^\top`, ``(*batch, a, a)``."""
    out: Tensor = _dispatch("gram", type(constraint), type(covariance))(constraint, covariance)
    return out


def cross_covariance(constraint: ConstraintLike, covariance: Covariance) -> Tensor:
    r""":math:`\Sigma A^\top`, ``(*batch, n, a)``."""
    out: Tensor = _dispatch("cross_covariance", type(constraint), type(covariance))(constraint, covariance)
    return out


def sqrt_gram_factor(constraint: ConstraintLike, covariance: Covariance) -> Tensor:
    r""":math:`B^\top = F^\top A^\top` with :math:`\Sigma = FF^\top`, ``(*batch, m, a)``."""
    out: Tensor = _dispatch("sqrt_gram_factor", type(constraint), type(covariance))(constraint, covariance)
    return out


def grouped_structure(constraint: ConstraintLike, covariance: Covariance) -> Grouped | None:
    r""":class:`Grouped` ``(w, s)`` when the O(n) grouped path applies to the pair, else ``None``."""
    out: Grouped | None = _dispatch("grouped", type(constraint), type(covariance))(constraint, covariance)
    return out
