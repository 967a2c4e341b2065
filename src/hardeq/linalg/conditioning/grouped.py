r"""Grouped closed form: the constraint's Gram matrix is diagonal, with an O(n) cross covariance.

The pair registry (:func:`hardeq.constraints.pairs.grouped_structure`) says when this applies: :math:`\Sigma A^\top
= \mathrm{diag}(w)A^\top` for a vector ``w`` and :math:`S = A\,\mathrm{diag}(w)A^\top = \mathrm{diag}(s)`. Both hold
when every column of ``A`` has at most one nonzero (:math:`A_{g(i), i} = a_i`, any value or sign; a coordinate in no
row has :math:`a_i = 0`) and (generic registration) :math:`\Sigma = \mathrm{diag}(\sigma^2)`, with
:math:`w = \sigma^2` and :math:`s_g = \sum_{i \in g} a_i^2\sigma_i^2`; or (registered for
:class:`~hardeq.BlockDiagonalCovariance` and a :class:`~hardeq.SumConstraint`) when every block of :math:`\Sigma`
lies inside one group, with :math:`w_i = (\Sigma\mathbf 1_{g(i)})_i`. (In general: :math:`\Sigma` couples no two
coordinates of different rows of ``A``, the contract of a ``"grouped"`` registration.) Then

.. math::
    Kr = w \odot A^\top(r / s), \qquad
    \bar\Sigma_{ii} = \Sigma_{ii} - w_i^2 a_i^2 / s_{g(i)} = \Sigma_{ii} - \big(w_i (A^\top s^{-1/2})_i\big)^2,
    \qquad \log\det S = \textstyle\sum_g \log s_g,

since :math:`(A^\top s^{-1/2})_i = a_i / \sqrt{s_{g(i)}}` when column ``i`` has one nonzero (0 for a coordinate in
no row, which keeps :math:`\Sigma_{ii}`). Every operation is a product with :math:`A` or :math:`A^\top` and an
elementwise one: O(n) per vector for a :class:`~hardeq.SumConstraint`, O(nnz) for a sparse one. Coordinates the
constraint alone determines (:meth:`~hardeq.EqualityConstraint.pinned_values`, e.g. a group of one) are set to
their value exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...constraints import pairs
from .factor import Factor, check_pivots

if TYPE_CHECKING:
    from ...constraints import EqualityConstraint
    from ..covariance import Covariance

__all__ = ["GroupedFactor"]


class GroupedFactor(Factor):
    r"""The O(n) factor of a diagonal Gram matrix (see the module docstring).

    Attributes:
        v: the normalised weights :math:`w / c^2` (:math:`\Sigma'A^\top = \mathrm{diag}(v)A^\top`; the
            normalised variances :math:`\sigma^2 / c^2` for a diagonal covariance), ``(*batch, n)``.
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
        """The factor, or ``None`` when the pair has no grouped structure (see the module docstring)."""
        grouped = pairs.grouped_structure(constraint, cov.scaled(c))
        if grouped is None:
            return None
        return cls(cov, constraint, c, grouped.weight, grouped.gram_diagonal, checked=checked)

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

    def _diagonal(self) -> Tensor:
        r""":math:`\mathrm{diag}\,\Sigma' = \mathrm{diag}\,\Sigma / c^2` (``v`` itself for a diagonal covariance)."""
        return self.v if self.cov.is_diagonal else self.cov.scaled(self.c).diagonal()

    def variance(self) -> Tensor:
        v = self.v  # Sigma'_ii - w'_i^2 a_i^2 / s'_g(i), in normalised quantities (no overflow)
        return ((self._diagonal() - v.square() * self._weight()) * self.c.square()).clamp_min(0)

    def gain_factor(self) -> Tensor:
        # G = Sigma A^T S^-1/2 = c Sigma' A^T / sqrt(s')
        cross = self.constraint.cross_covariance(self.cov.scaled(self.c))  # (*batch, n, a)
        return cross / self.s.sqrt().unsqueeze(-2) * self.c.unsqueeze(-1)

    def trace_correction(self, other: "Covariance") -> Tensor:
        if other.is_diagonal:
            # sum_i w_i^2 a_i^2 / (Sigma_p,ii s_g(i)) = sum_i (w_i / Sigma_p,ii) (w'_i a_i^2 / s'_g(i)): scale-free
            ratio = self.v * self._weight()
            return (self.v * self.c.square() / other.variance * ratio).sum(-1)
        if pairs.grouped_structure(self.constraint, other) is not None:
            # Sigma_p^{-1} does not couple rows either: G's columns (w_i a_i / sqrt(s_g) on the coordinates of row g)
            # add up to one n-vector without mixing, and tr(G^T Sigma_p^{-1} G) is one inverse quadratic form
            compact = self.v * self.constraint.rmatvec(self.s.rsqrt()) * self.c
            return other.inv_quad(compact)
        return super().trace_correction(other)
