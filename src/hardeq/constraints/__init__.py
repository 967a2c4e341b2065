r"""Linear equality constraints :math:`A z = k` as operators.

A constraint object knows how to apply :math:`A` and :math:`A^\top` without materialising :math:`A` when
it has structure, and answers what callers need (Gram matrices, projections, group ids) itself:

* :class:`LinearConstraint` holds a dense, possibly batched ``A`` of shape ``(*batch, a, n)``.
* :class:`SumConstraint` holds a group id per coordinate (like PyG's ``batch`` vector); every operation is a
  scatter / gather, O(n).
* :class:`SparseConstraint` holds a shared sparse ``A`` (CSR or COO, ``(a, n)``); products cost O(nnz).

Each carries the right-hand side ``k``, which may have batch dimensions, e.g. one ``k = b - B x`` per input
``x``. :class:`EqualityConstraint` is the interface (six abstract members); :class:`hardeq.testing.ConstraintTestCase`
tests a new subclass against a dense oracle. Pair operations with a covariance dispatch through
:func:`register_pair` (:mod:`hardeq.constraints.pairs`); constraints save themselves with
:meth:`EqualityConstraint.to_config` and come back with :meth:`EqualityConstraint.from_config` (kinds registered by
:func:`register_constraint_kind`, listed by :func:`constraint_kinds`).
"""

from __future__ import annotations

from . import pairs
from .base import EqualityConstraint, constraint_kinds, register_constraint_kind
from .linear import LinearConstraint
from .pairs import Grouped, register_pair
from .sparse import SparseConstraint
from .sum import SumConstraint

__all__ = ["EqualityConstraint", "LinearConstraint", "SparseConstraint", "SumConstraint", "register_pair",
           "register_constraint_kind", "constraint_kinds", "Grouped", "pairs"]
