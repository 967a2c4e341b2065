r"""Conditioning a Gaussian on a linear equality constraint (Matheron's rule), without forming ``n x n``.

With :math:`S = A\Sigma A^\top` (factored once) and the gain :math:`K = \Sigma A^\top S^{-1}`:

.. math::
    \bar\mu = \mu + K(k - A\mu), \qquad
    \bar\sigma^2_i = \Sigma_{ii} - (\Sigma A^\top S^{-1} A \Sigma)_{ii}, \qquad
    z = \tilde z + K(k - A\tilde z),\ \tilde z \sim \mathcal N(\mu, \Sigma).

``K r`` is applied as :math:`\Sigma (A^\top (S^{-1} r))`: a solve with the ``a x a`` Cholesky factor, one
application of :math:`A^\top` and one of :math:`\Sigma`. Cost per vector: O(n a + a^2) for a dense ``A``
(plus O(n a^2 + a^3) once for :math:`S`), O(n) for a :class:`~hardeq.SumConstraint` with diagonal
:math:`\Sigma`.

Accuracy: a single Matheron step leaves a residual :math:`A z - k` of order
:math:`\epsilon\,\kappa(S)\,\lVert k - A\tilde z\rVert`. One step of iterative refinement (applying the same
map again to its own output) brings it to round-off whenever :math:`\epsilon\,\kappa(S) < 1`. The map is a
projection, so the extra step changes neither the distribution nor, to first order, the gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from .covariance import Covariance, DiagonalCovariance
from .gram import DiagonalGram, Gram

if TYPE_CHECKING:
    from ..constraints import EqualityConstraint

__all__ = ["Conditioner"]

#: number of refinement steps applied after the Matheron step (see module docstring)
REFINEMENT_STEPS = 1


class Conditioner:
    r"""Everything about :math:`\mathcal N(\mu, \Sigma)` given :math:`A z = k` that does not depend on
    :math:`\mu`: the Gram factor, the gain, conditional variances.

    Args:
        covariance: the structure of :math:`\Sigma` (batch shape ``B_s``).
        constraint: the constraint (batch shape ``B_c``); results broadcast over ``B_s`` and ``B_c``.
    """

    def __init__(self, covariance: Covariance, constraint: "EqualityConstraint") -> None:
        self.cov = covariance
        self.constraint = constraint
        self.gram: Gram = covariance.gram(constraint)

    def gain_matvec(self, residual: Tensor) -> Tensor:
        r""":math:`K r = \Sigma A^\top S^{-1} r` for ``r`` of shape ``(*sample, *batch, a)``."""
        return self.cov.matvec(self.constraint.rmatvec(self.gram.solve(residual)))

    def condition(self, z_hat: Tensor, refinement_steps: int = REFINEMENT_STEPS) -> Tensor:
        r""":math:`z = \hat z + K(k - A\hat z)`, then ``refinement_steps`` more applications of the same map."""
        k = self.constraint.value
        z = z_hat + self.gain_matvec(k - self.constraint.matvec(z_hat))
        for _ in range(refinement_steps):
            z = z + self.gain_matvec(k - self.constraint.matvec(z))
        return z

    def variance(self) -> Tensor:
        r"""Conditional marginal variances :math:`\bar\sigma^2`, shape ``(*batch, n)``, clamped at 0."""
        from ..constraints import SumConstraint

        if isinstance(self.constraint, SumConstraint) and isinstance(self.cov, DiagonalCovariance):
            assert isinstance(self.gram, DiagonalGram)
            d = self.cov.variance
            reduction = d.square() / self.constraint.rmatvec(self.gram.diag)
        else:
            A_Sigma = self.cov.right_apply(self.constraint.dense_matrix())  # (*batch, a, n)
            reduction = self.gram.whiten_matrix(A_Sigma).square().sum(-2)
        return (self.cov.diagonal() - reduction).clamp_min(0)

    def covariance_matrix(self) -> Tensor:
        r"""Dense conditional covariance :math:`\Sigma - \Sigma A^\top S^{-1} A \Sigma`, ``(*batch, n, n)``."""
        A_Sigma = self.cov.right_apply(self.constraint.dense_matrix())
        V = self.gram.whiten_matrix(A_Sigma)
        return self.cov.dense() - V.mT @ V
