r"""Grouped closed form: the constraint's Gram matrix is diagonal under a diagonal covariance.

For a constraint whose every column has at most one nonzero (:math:`A_{g(i), i} = a_i`, a coordinate in no
row has :math:`a_i = 0`; a :class:`~hardeq.SumConstraint` has :math:`a_i = 1`), i.e. whose
:meth:`~hardeq.EqualityConstraint.diagonal_gram` is not ``None``, and :math:`\Sigma = \mathrm{diag}(\sigma^2)`:
:math:`S = \mathrm{diag}(s)` with :math:`s_g = \sum_{i \in g} a_i^2\sigma_i^2`, the cross covariance
:math:`(\Sigma A^\top)_{i, g(i)} = \sigma_i^2 a_i`, so

.. math::
    Kr = \sigma^2 \odot A^\top(r / s), \qquad
    \bar\sigma_i^2 = \sigma_i^2 - \sigma_i^4 a_i^2 / s_{g(i)} = \sigma_i^2 - \big(\sigma_i^2 (A^\top s^{-1/2})_i\big)^2,
    \qquad \log\det S = \textstyle\sum_g \log s_g.

(:math:`(A^\top s^{-1/2})_i = a_i / \sqrt{s_{g(i)}}` because column ``i`` has one nonzero; a coordinate in no row
gets 0 and keeps :math:`\sigma_i^2`.)

Every operation is a group sum or a gather: O(n) per vector. Coordinates the constraint alone determines
(:meth:`~hardeq.EqualityConstraint.pinned_values`, e.g. a group of one) are set to their value exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .factor import Factor, check_pivots

if TYPE_CHECKING:
    from ...constraints import EqualityConstraint
    from ..covariance import Covariance

__all__ = ["GroupedFactor"]


class GroupedFactor(Factor):
    r"""The O(n) factor of a diagonal Gram matrix (see the module docstring).

    Attributes:
        v: normalised variances :math:`\sigma^2 / c^2`, ``(*batch, n)``.
        s: normalised diagonal of :math:`S' = S / c^2`, ``(*batch, a)``.
    """

    name = "grouped"
    nullspace_pays = False

    def __init__(self, cov: "Covariance", constraint: "EqualityConstraint", c: Tensor, v: Tensor, s: Tensor,
                 *, checked: bool = True) -> None:
        super().__init__(cov, constraint, c)
        self.v, self.s = v, s
        if checked:
            check_pivots(s, 0.0)
        self._pinned = constraint.pinned_values() if checked else None

    @classmethod
    def build(cls, cov: "Covariance", constraint: "EqualityConstraint", c: Tensor, *,
              checked: bool = True) -> "GroupedFactor | None":
        """The factor, or ``None`` when the covariance is not diagonal or the Gram matrix is not diagonal."""
        if not cov.is_diagonal or not constraint.has_diagonal_gram:
            return None
        v = cov.scaled(c).variance
        s = constraint.diagonal_gram(v)
        if s is None:
            return None
        return cls(cov, constraint, c, v, s, checked=checked)

    def gain(self, residual: Tensor) -> Tensor:
        return self.v * self.constraint.rmatvec(residual / self.s)

    def _pin(self, z: Tensor) -> Tensor:
        if self._pinned is None:
            return z
        mask, values = self._pinned
        return torch.where(mask, values, z)

    def step(self, z: Tensor) -> Tensor:
        con = self.constraint
        return self._pin(torch.addcmul(z, self.v, con.rmatvec((con.k - con.matvec(z)) / self.s)))

    def step_(self, z: Tensor) -> Tensor:
        con = self.constraint
        z.addcmul_(self.v, con.rmatvec((con.k - con.matvec(z)) / self.s))
        if self._pinned is not None:
            mask, values = self._pinned
            z = torch.where(mask, values, z)
        return z

    def whiten(self, residual: Tensor) -> Tensor:
        return residual / self.s.sqrt() / self.c

    def logdet(self) -> Tensor:
        return self.s.log().sum(-1) + 2 * self.s.shape[-1] * self.c.squeeze(-1).log()

    def _weight(self) -> Tensor:
        r""":math:`a_i^2 / s_{g(i)} = (A^\top s^{-1/2})_i^2` (one nonzero per column), 0 for a coordinate in no row."""
        return self.constraint.rmatvec(self.s.rsqrt()).square()

    def variance(self) -> Tensor:
        v = self.v  # sigma_i^2 - sigma_i^4 a_i^2 / s_g(i), in normalised variances (no overflow)
        return ((v - v.square() * self._weight()) * self.c.square()).clamp_min(0)

    def gain_factor(self) -> Tensor:
        # G = Sigma A^T S^-1/2 = c Sigma' A^T / sqrt(s')
        cross = self.constraint.cross_covariance(self.cov.scaled(self.c))  # (*batch, n, a)
        return cross / self.s.sqrt().unsqueeze(-2) * self.c.unsqueeze(-1)

    def trace_correction(self, other: "Covariance") -> Tensor:
        if not other.is_diagonal:
            return super().trace_correction(other)
        # sum_i Sigma_ii^2 a_i^2 / (Sigma_p,ii s_g(i)) = sum_i (Sigma_ii / Sigma_p,ii) (v_i a_i^2 / s'_g(i))
        ratio = self.v * self._weight()
        return (self.cov.diagonal() / other.diagonal() * ratio).sum(-1)
