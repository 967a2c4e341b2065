r"""Linear equality constraints :math:`A z = k` as operators.

A constraint object knows how to apply :math:`A` and :math:`A^\top` without materialising :math:`A` when
it has structure, and answers what callers need (Gram matrices, projections, group ids) itself:

* :class:`LinearConstraint` holds a dense, possibly batched ``A`` of shape ``(*batch, a, n)``.
* :class:`SumConstraint` holds a group id per coordinate (like PyG's ``batch`` vector); every operation is a
  scatter / gather, O(n).
* :class:`SparseConstraint` holds a shared sparse ``A`` (CSR or COO, ``(a, n)``); products cost O(nnz).

Each carries the right-hand side ``k``, which may have batch dimensions, e.g. one ``k = b - B x`` per input
``x``. :class:`EqualityConstraint` is the interface; :class:`hardeq.testing.ConstraintTestCase` tests a new
subclass against a dense oracle.
"""

from __future__ import annotations

from .base import EqualityConstraint
from .linear import LinearConstraint
from .sparse import SparseConstraint
from .sum import SumConstraint

__all__ = ["EqualityConstraint", "LinearConstraint", "SparseConstraint", "SumConstraint"]
