r"""The interface every conditioning algorithm implements: one small object per factorisation of
:math:`S = A\Sigma A^\top`.

Notation (shared by the factor modules): :math:`\Sigma = FF^\top`; the factors work with the normalised
:math:`\Sigma' = \Sigma / c^2` (``c`` = :meth:`~hardeq.Covariance.max_abs_sqrt`, per batch element), so that scales
of 1e-20 or 1e20 neither under- nor overflow; :math:`S' = A\Sigma'A^\top = S / c^2`. The gain
:math:`K = \Sigma A^\top S^{-1} = \Sigma'A^\top S'^{-1}` does not depend on ``c``.

A factor answers, for one covariance/constraint pair:

* :meth:`Factor.gain` -- :math:`Kr`; :meth:`Factor.step` -- the Matheron map :math:`z + K(k - Az)`;
* :meth:`Factor.whiten` -- :math:`L^{-1}r` with :math:`LL^\top = S`
  (so :math:`\lVert L^{-1}r\rVert^2 = r^\top S^{-1}r`);
* :meth:`Factor.logdet` -- :math:`\log\det S`;
* :meth:`Factor.variance` -- the conditional marginal variances :math:`\mathrm{diag}(\Sigma - K A\Sigma)`;
* :meth:`Factor.gain_factor` -- :math:`G` with :math:`GG^\top = \Sigma A^\top S^{-1}A\Sigma`, and from it
  :meth:`Factor.covariance_matrix` and :meth:`Factor.trace_correction`.

Factors never check residuals and never choose each other: :class:`~hardeq.linalg.conditioning.Conditioner` does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...errors import NotPSDError

if TYPE_CHECKING:
    from ...constraints.base import EqualityConstraint
    from ..covariance import Covariance

__all__ = ["DeferredFactor", "Factor", "check_pivots"]


class Factor(ABC):
    r"""A factorisation of :math:`S = A\Sigma A^\top` and everything derived from it.

    Args:
        cov: the covariance (batch shape ``B_s``).
        constraint: the constraint (batch shape ``B_c``); results broadcast over ``B_s`` and ``B_c``.
        c: the normalising scale, ``(*B_s, 1)``, detached.
    """

    #: short name of the algorithm (for messages and introspection)
    name: str = "factor"
    #: whether the null-space form pays on top of this factor when ``n - a < a`` (not for O(n) factors)
    nullspace_pays: bool = True

    def __init__(self, cov: "Covariance", constraint: "EqualityConstraint", c: Tensor) -> None:
        self.cov = cov
        self.constraint = constraint
        self.c = c
        self.dtype = constraint.dtype

    # ------------------------------------------------------------------ the Matheron map
    @abstractmethod
    def gain(self, residual: Tensor) -> Tensor:
        r""":math:`Kr = \Sigma A^\top S^{-1}r`: ``(*sample, *batch, a) -> (*sample, *batch, n)``."""

    def gain_wide(self, residual: Tensor) -> Tensor:
        r""":math:`Kr` in float64 (``(*sample, *batch, n)``), with the last product :math:`\Sigma A^\top y` in float64:
        its rounding is then not a fraction of the largest terms of the product, which the conditioner's
        :meth:`~hardeq.linalg.conditioning.Conditioner.deviation` cannot refine away (it lies off
        :math:`\mathrm{range}(\Sigma A^\top)`). Default: :meth:`gain` cast to float64 (exact for factors that compute
        in float64 or whose gain is elementwise)."""
        return self.gain(residual).to(torch.float64)

    def step(self, z: Tensor) -> Tensor:
        r"""One Matheron step :math:`z + K(k - Az)`: maps :math:`\mathcal N(\mu, \Sigma)` samples to exact conditional
        samples and :math:`\mu` to :math:`\bar\mu`; a projection, so repeating it refines. Differentiable."""
        return z + self.gain(self.constraint.k - self.constraint.matvec(z))

    def step_(self, z: Tensor) -> Tensor:
        """:meth:`step` on a buffer the caller owns and needs no gradient for; may update ``z`` in place."""
        return self.step(z)

    def refine(self, z: Tensor) -> Tensor:
        """One refinement step applied to an (almost) exact ``z``; :meth:`step` unless the factor knows better."""
        return self.step(z)

    def refine_(self, z: Tensor) -> Tensor:
        """:meth:`refine` on a buffer the caller owns and needs no gradient for: :meth:`step_` where :meth:`refine`
        is :meth:`step`, else :meth:`refine`."""
        return self.step_(z) if type(self).refine is Factor.refine else self.refine(z)

    # ------------------------------------------------------------------ S
    @abstractmethod
    def whiten(self, residual: Tensor) -> Tensor:
        r""":math:`L^{-1}r` with :math:`LL^\top = S`: ``(*sample, *batch, a) -> (*sample, *batch, a)``."""

    def inv_quad(self, residual: Tensor) -> Tensor:
        r""":math:`r^\top S^{-1}r`, shape ``(*sample, *batch)``."""
        return self.whiten(residual).square().sum(-1)

    @abstractmethod
    def logdet(self) -> Tensor:
        r""":math:`\log\det S`, shape ``(*batch)``."""

    def plane_logdet(self) -> Tensor:
        r""":math:`\log\det\Sigma - \log\det S + \log\det(AA^\top) = -\log\det(N^\top\Sigma^{-1}N)` (``N`` an
        orthonormal basis of :math:`\mathrm{null}(A)`): the log-volume term of the density on the plane, shape
        ``(*batch)``. Default: the three log-determinants, summed in float64 (they nearly cancel when ``a`` is close
        to ``n``)."""
        wide = torch.float64
        out = (self.cov.to(dtype=wide).logdet() - self.logdet().to(wide)
               + self.constraint.logdet_gram_identity().to(wide))
        return out.to(self.dtype)

    # ------------------------------------------------------------------ conditional second moments
    @abstractmethod
    def gain_factor(self) -> Tensor:
        r""":math:`G` (``(*batch, n, a)``, transient) with :math:`GG^\top = \Sigma A^\top S^{-1}A\Sigma`."""

    def variance(self) -> Tensor:
        r"""Conditional marginal variances :math:`\mathrm{diag}\,\Sigma - \lVert G_{i,:}\rVert^2`, ``(*batch, n)``,
        clamped at 0."""
        return (self.cov.diagonal() - self.gain_factor().square().sum(-1)).clamp_min(0)

    def covariance_matrix(self) -> Tensor:
        r"""Dense conditional covariance :math:`\Sigma - GG^\top`, ``(*batch, n, n)``."""
        G = self.gain_factor()
        return self.cov.dense() - G @ G.mT

    def trace_correction(self, other: "Covariance") -> Tensor:
        r""":math:`\mathrm{tr}(G^\top\Sigma_p^{-1}G)` for another covariance :math:`\Sigma_p` (the part of the KL's
        trace that the constraint removes), shape ``(*batch)``."""
        G = self.gain_factor()
        batch = torch.broadcast_shapes(G.shape[:-2], other.batch_shape)
        return other.inv_quad_matrix(G.expand(batch + G.shape[-2:]))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={self.cov.event_size}, a={self.constraint.num_constraints})"


class DeferredFactor:
    """A factor made on first use (:meth:`get`), for a wrapper that may never need it: the null-space form samples
    without its base factor, which only the density and the KL ask for. It carries what the wrapper reads before
    then (``cov``, ``constraint``, ``c``, ``dtype``, ``nullspace_pays``), and makes the factor under the gradient
    and inference modes of its own creation, so that the factor is the one an eager construction would have made
    (with a graph where the construction had one) whenever it is first asked for.

    Args:
        make: builds the factor (called once).
        cov, constraint, c: as :class:`Factor`'s.
        nullspace_pays: the made factor's :attr:`Factor.nullspace_pays`.
    """

    def __init__(self, make: Callable[[], Factor], cov: "Covariance", constraint: "EqualityConstraint", c: Tensor,
                 *, nullspace_pays: bool = True) -> None:
        self.cov, self.constraint, self.c, self.dtype = cov, constraint, c, constraint.dtype
        self.nullspace_pays = nullspace_pays
        self._make: Callable[[], Factor] | None = make
        self._made: Factor | None = None
        self._modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())

    @property
    def made(self) -> bool:
        """Whether :meth:`get` has made the factor."""
        return self._made is not None

    def get(self) -> Factor:
        """The factor, made on the first call (under the modes of this object's creation) and kept."""
        if self._made is None:
            assert self._make is not None  # (set until the factor is made)
            grad, inference = self._modes
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                self._made = self._make()
            self._make = None
        return self._made


def check_pivots(pivots: Tensor, tol: Tensor | float) -> None:
    """Raise :class:`~hardeq.NotPSDError` when ``S`` is numerically singular: a pivot at or below ``tol`` (or NaN)."""
    bad = ~(pivots > tol)
    if bool(bad.any()):
        first = tuple(torch.nonzero(bad)[0].tolist())
        tol_at = torch.broadcast_to(torch.as_tensor(tol, dtype=pivots.dtype), pivots.shape)[first]
        raise NotPSDError(
            "A Sigma A^T is not numerically positive definite: the constraint rows are (nearly) linearly "
            f"dependent under this covariance (batch/row index {first}, pivot {pivots[first].item():.3e} "
            f"<= tolerance {tol_at.item():.3e}, dtype {pivots.dtype}). Remove redundant rows, rescale them, or use "
            "float64."
        )
