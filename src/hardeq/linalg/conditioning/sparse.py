r"""The Cholesky factor of a :class:`~hardeq.SparseConstraint` under a diagonal covariance: its in-place Matheron
step adds the gain onto the samples block by block.

:class:`~.cholesky.CholeskyFactor` applies the gain of a diagonal covariance as ``z.addcmul_(v, A^T x)``: the
product :math:`A^\top x` is a fresh ``(*sample, n)`` tensor (64 x 1e6 float32 is 256 MB, whose first touch costs
about as much as writing it) and the update one more pass over it and ``z``. Here the step is

.. math::  x = S'^{-1}(k - Az), \qquad z \mathrel{+}= v \circ (A^\top x),

with :math:`Az` and the update from :meth:`~hardeq.SparseConstraint.matvec` and
:meth:`~hardeq.SparseConstraint.rmatvec_add_`: on the CPU for many vectors, block by block of columns on
tiles of ``z`` that stay in cache (one read of ``z`` for :math:`Az`, one read-modify-write for the update; no
temporary the size of ``z``). Everything else -- the factorisation, solves, log-determinant, variances -- is the
Cholesky factor's; the result equals its step up to the order of the floating-point sums.

Cost: the factor's, and per vector O(nnz) for the step.
"""

from __future__ import annotations

from torch import Tensor

from .cholesky import CholeskyFactor

__all__ = ["SparseCholeskyFactor"]


class SparseCholeskyFactor(CholeskyFactor):
    """:class:`~.cholesky.CholeskyFactor` whose :meth:`step_` adds the gain of a diagonal covariance in place
    (:meth:`~hardeq.SparseConstraint.rmatvec_add_`); built by the conditioner for a
    :class:`~hardeq.SparseConstraint` (see the module docstring)."""

    def step_(self, z: Tensor) -> Tensor:
        con = self.constraint
        add = getattr(con, "rmatvec_add_", None)
        if add is None or self.precision != z.dtype or self._W is not None or not self._cov.is_diagonal \
                or not z.is_contiguous():
            return super().step_(z)
        x = self.solve(con._shortfall(z))
        variance = self._cov.variance
        if x.shape[:-1] != z.shape[:-1] or variance.dim() != 1:  # broadcasting batch shapes: the general update
            return z.addcmul_(variance, con.rmatvec(x))
        add(z, x, variance)
        return z
