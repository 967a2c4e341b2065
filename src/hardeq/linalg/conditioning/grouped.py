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

**The differentiable step under a diagonal covariance** (:class:`_GroupedStep`) is one autograd node with the
closed-form backward, instead of the dozen nodes of the step written out (each a kernel of a few microseconds on
vectors of 1e4 entries, the size of a batch of graphs). With :math:`v = \sigma^2/c^2`, :math:`s = (A\circ A)v`,
:math:`u = (k - A\hat z)/s` and :math:`z = \hat z + v\odot A^\top u`, an upstream gradient :math:`g` gives, with
:math:`q = A(v\odot g)/s`,

.. math::
    \bar{\hat z} = g - A^\top q, \qquad \bar k = q, \qquad
    \bar v = g\odot A^\top u - (A\circ A)^\top(q\odot u), \qquad \bar\sigma = 2\sigma/c^2\,\bar v,

where :math:`(A\circ A)^\top y = (A^\top\mathbf 1)\odot A^\top y` (one nonzero per column; :math:`A^\top\mathbf 1
= \mathbf 1` for a sum). ``c`` is a constant (the step does not depend on it). At a determined coordinate the
formula gives 0 to round-off for :math:`\hat z` and :math:`\sigma` and :math:`1/a_i` for its row of ``k``; the
first two are set to 0 exactly. Cost: forward 2 products and 3 elementwise passes, backward 3 products and 4 passes
(O(n) for a sum). Differentiable once (a second derivative raises: use ``Conditioner(..., static=True)``, which
writes the step out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..._utils import is_tracing
from ...constraints import pairs  # (the module hardeq.constraints.pairs)
from ..covariance import DiagonalCovariance
from .factor import Factor, check_pivots
from .grouped_sample import GroupedOps, _generic_diagonal, grouped_rsample

if TYPE_CHECKING:
    from ...constraints.base import EqualityConstraint
    from ..covariance import Covariance

__all__ = ["GroupedFactor", "GroupedOps", "grouped_rsample"]


class _GroupedStep(torch.autograd.Function):
    r"""The Matheron step :math:`z = \hat z + v\odot A^\top((k - A\hat z)/s)` of a diagonal covariance, with the
    closed-form backward of the module docstring; inputs ``(z_hat, scale, k)`` are differentiable, the factor's
    normalised ``v`` and ``s`` (detached), ``c``, the constraint, :math:`A^\top\mathbf 1` (None for a sum) and the
    determined coordinates (``(mask, values)`` or None) are constants. ``(*sample, *batch, n)``."""

    @staticmethod
    def forward(ctx: Any, z_hat: Tensor, scale: Tensor, k: Tensor, v: Tensor, s: Tensor, c: Tensor,
                con: EqualityConstraint, col: Tensor | None, pinned: tuple[Tensor, Tensor] | None) -> Tensor:
        u = (k - con.matvec(z_hat)) / s
        Atu = con.rmatvec(u)
        z = torch.addcmul(z_hat, v, Atu)
        if pinned is not None:
            z = torch.where(pinned[0], pinned[1], z)
        ctx.con, ctx.col, ctx.mask = con, col, None if pinned is None else pinned[0]
        ctx.shapes = (z_hat.shape, scale.shape, k.shape)
        ctx.save_for_backward(scale, v, s, c, u, Atu)
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        scale, v, s, c, u, Atu = ctx.saved_tensors
        con, col, mask = ctx.con, ctx.col, ctx.mask
        z_shape, scale_shape, k_shape = ctx.shapes
        need_z, need_scale, need_k = ctx.needs_input_grad[:3]
        q = con.matvec(v * g) / s
        g_z = g_scale = g_k = None
        if need_z:
            g_z = g - con.rmatvec(q)
            if mask is not None:
                g_z = g_z.masked_fill(mask, 0.0)
            g_z = g_z.sum_to_size(z_shape)
        if need_scale:
            back = con.rmatvec(q * u)
            g_v = g * Atu - (back if col is None else col * back)
            if mask is not None:
                g_v = g_v.masked_fill(mask, 0.0)
            g_scale = (g_v.sum_to_size(scale_shape) * scale).mul_(2 / c.square())
        if need_k:
            g_k = q.sum_to_size(k_shape)
        return g_z, g_scale, g_k, None, None, None, None, None, None


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
        # the one-node step (_GroupedStep) needs v = (scale / c)^2 of a plain diagonal covariance; not when tracing
        self._fused = checked and _generic_diagonal(constraint, cov)
        self._col: Tensor | None = None

    @classmethod
    def build(cls, cov: "Covariance", constraint: "EqualityConstraint", c: Tensor, *,
              checked: bool = True) -> "GroupedFactor | None":
        """The factor, or ``None`` when the pair has no grouped structure (see the module docstring)."""
        if _generic_diagonal(constraint, cov) and constraint.has_diagonal_gram:
            # the generic registration's (v, s), without building the scaled covariance: v = (scale / c)^2
            v = (cast(DiagonalCovariance, cov).scale / c).square()  # (_generic_diagonal: exactly that type)
            s = constraint.diagonal_gram(v)
            return None if s is None else cls(cov, constraint, c, v, s, checked=checked)
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
        if self._fused and torch.is_grad_enabled() and not is_tracing():
            scale = cast(DiagonalCovariance, self.cov).scale  # (_fused: a plain diagonal covariance)
            if z.requires_grad or scale.requires_grad or con.k.requires_grad:
                out: Tensor = _GroupedStep.apply(  # type: ignore[no-untyped-call]  # torch: Function.apply unannotated
                    z, scale, con.k, self.v.detach(), self.s.detach(), self.c, con, self._column_weights(),
                    self._pinned)
                return out
        return self._pin(torch.addcmul(z, self.v, con.rmatvec((con.k - con.matvec(z)) / self.s)))

    def _column_weights(self) -> Tensor | None:
        r""":math:`A^\top\mathbf 1` (the one coefficient of each column), ``(n,)``; None for a sum (all ones)."""
        con = self.constraint
        if con.group_index is not None:
            return None
        if self._col is None:
            with torch.no_grad():
                self._col = con.rmatvec(con.k.new_ones(con.num_constraints))
        return self._col

    def step_(self, z: Tensor) -> Tensor:
        con = self.constraint
        u = (con.k - con.matvec(z)) / self.s
        add = getattr(con, "rmatvec_add_", None)  # z += v A^T u in place, without forming A^T u where it can
        if add is not None and u.shape[:-1] == z.shape[:-1]:
            add(z, u, self.v)
        else:
            z.addcmul_(self.v, con.rmatvec(u))
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
