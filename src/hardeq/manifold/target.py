r"""The small object every manifold algorithm takes: :math:`\mathcal N(\mu, \Sigma)` and :math:`h(z) = k`, plus the
dense ``a x a`` linear algebra at one point of the manifold (the Gram matrix :math:`J\Sigma J^\top` and its gain).

The algorithms (projection, the linearised sampler, constrained HMC) take a :class:`ManifoldTarget`, never the
distribution, so they can be used and tested on their own.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..linalg.covariance import Covariance
from .constraint import ManifoldError, NonlinearConstraint, _first_bad

__all__ = ["ManifoldTarget", "TangentGram"]


class ManifoldTarget:
    r""":math:`z \sim \mathcal N(\mu, \Sigma)` restricted to :math:`\mathcal M = \{h(z) = k\}`.

    Args:
        loc: :math:`\mu`, ``(*batch, n)``.
        covariance: a :class:`~hardeq.Covariance` (``Sigma = F F^T``, ``F``: ``n x m``).
        constraint: the :class:`~hardeq.NonlinearConstraint`.

    ``batch_shape`` is the broadcast of the three; every method accepts points ``(*sample, *batch, n)``.
    """

    def __init__(self, loc: Tensor, covariance: Covariance, constraint: NonlinearConstraint) -> None:
        self.loc = loc
        self.covariance = covariance
        self.constraint = constraint
        self.n = loc.shape[-1]
        self.batch_shape = torch.broadcast_shapes(loc.shape[:-1], covariance.batch_shape, constraint.batch_shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.loc.dtype

    def sigma_rows(self, J: Tensor) -> Tensor:
        r"""The rows of :math:`J\Sigma` (:math:`= (\Sigma J^\top)^\top`): ``(..., a, n) -> (..., a, n)``."""
        return self.covariance.matvec(J.movedim(-2, 0)).movedim(0, -2)

    def sqrt_t_rows(self, J: Tensor) -> Tensor:
        r"""The rows of :math:`JF`: ``(..., a, n) -> (..., a, m)``."""
        return self.covariance.sqrt_t_matmul(J.mT).mT

    def gram(self, J: Tensor) -> TangentGram:
        r"""The Gram matrix :math:`J\Sigma J^\top` at a point, factorised."""
        return TangentGram(J, self.sigma_rows(J))


class TangentGram:
    r"""At one point ``z``: :math:`S = J\Sigma J^\top` (``a x a``, equilibrated and Cholesky-factorised in float64),
    with the operations the algorithms need. ``J``: ``(..., a, n)``; ``JS``: the rows of :math:`J\Sigma`.

    * :meth:`solve` -- :math:`S^{-1} r`;
    * :meth:`gain` -- :math:`\Sigma J^\top S^{-1} r` (the Matheron / Gauss-Newton correction along the normal space);
    * :meth:`tangent` -- :math:`P v = v - \Sigma J^\top S^{-1} J v`, the projection onto :math:`\ker J` along
      :math:`\mathrm{range}(\Sigma J^\top)` (self-adjoint in the :math:`\Sigma^{-1}` inner product).

    Cost: ``a^2 n`` for ``S``, ``a^3 / 3`` for its factor, ``a n`` per product.

    Raises:
        ManifoldError: :math:`S` is not numerically positive definite (``J`` rank-deficient at some element: a
            singular point of :math:`h`); the message names the batch element.
    """

    def __init__(self, J: Tensor, JS: Tensor, what: str = "the Jacobian") -> None:
        self.J, self.JS = J, JS
        S = (J @ JS.mT).to(torch.float64)
        d = S.diagonal(dim1=-2, dim2=-1).clamp_min(torch.finfo(torch.float64).tiny).rsqrt()
        S_eq = S * d.unsqueeze(-1) * d.unsqueeze(-2)
        L, info = torch.linalg.cholesky_ex(S_eq)
        pivots = L.diagonal(dim1=-2, dim2=-1)
        limit = 1e-7 if J.dtype == torch.float32 else 1e-13
        bad = (info != 0) | ~(pivots.amin(-1) > limit ** 0.5 * pivots.amax(-1))
        if bool(bad.any()):
            where = _first_bad(bad) if bad.dim() else ()
            raise ManifoldError(f"J Sigma J^T is singular at batch index {where}: the rows of {what} are (nearly) "
                                "linearly dependent there (a singular point of h, where {h = k} is no manifold).")
        self._L, self._d = L, d

    def solve(self, r: Tensor) -> Tensor:
        """:math:`S^{-1} r`, ``(..., a) -> (..., a)`` (computed in float64, returned in ``r``'s dtype)."""
        x = (self._d * r.to(torch.float64)).unsqueeze(-1)
        return (self._d * torch.cholesky_solve(x, self._L).squeeze(-1)).to(r.dtype)

    def gain(self, r: Tensor) -> Tensor:
        r""":math:`\Sigma J^\top S^{-1} r`, ``(..., a) -> (..., n)``."""
        return (self.solve(r).unsqueeze(-2) @ self.JS).squeeze(-2)

    def jv(self, v: Tensor) -> Tensor:
        """:math:`J v`, ``(..., n) -> (..., a)``."""
        return (self.J @ v.unsqueeze(-1)).squeeze(-1)

    def tangent(self, v: Tensor) -> Tensor:
        r""":math:`v - \Sigma J^\top S^{-1} J v`."""
        return v - self.gain(self.jv(v))

    def logdet(self) -> Tensor:
        r""":math:`\log\det S` (float64)."""
        out: Tensor = 2 * self._L.diagonal(dim1=-2, dim2=-1).log().sum(-1) - 2 * self._d.log().sum(-1)
        return out
