r"""The null-space form, for many constraints (``n - a < a``), on top of a factor of :math:`S`.

A complete QR :math:`A^\top = [Q_A, N][R; 0]` (:meth:`~hardeq.EqualityConstraint.orthonormal_decomposition`, float64)
gives an orthonormal basis ``N`` of :math:`\mathrm{null}(A)` (``n x p``, ``p = n - a``) and the minimum-norm solution
:math:`z_p = Q_AR^{-\top}k`. With :math:`M' = N^\top\Sigma'^{-1}N = L_ML_M^\top`, :math:`V = NL_M^{-\top}` and
:math:`U = \Sigma'^{-1}V` (``n x p`` each), the Matheron map and the moments are

.. math::
    z = z_p + VU^\top(\hat z - z_p), \qquad Kr = (I - VU^\top)Q_AR^{-\top}r, \qquad
    \bar\Sigma = c^2 VV^\top,

O(n p) per vector instead of O(n a), with variances free of cancellation. :math:`Az - k = (Az_p - k) + (AN)t` is
round-off for any :math:`\kappa(S)`: :math:`\hat z` is not added back, so there is no ``ulp(ẑ)`` term. The base
factor keeps :meth:`whiten`, :meth:`logdet` and :meth:`gain_factor` (the density and the KL need :math:`S` itself).

**Trust, with and without a host read.** The form needs ``A`` of full row rank (every pivot of ``R`` above
:math:`10\varepsilon_{64}` times the largest) and :math:`M'` numerically positive definite (``cholesky_ex``
succeeds; :math:`M' \succeq N^\top N/\lambda_{\max}(\Sigma') `, so this fails only for scales some eight decades
apart in an unlucky geometry). The checked conditioner reads both verdicts and falls back to the base factor. A
static one (:meth:`build` with ``static=True``) reads nothing: it asserts both on the device
(``torch._assert_async``, raised as :class:`~hardeq.NotPSDError` at once on a CPU, at the next synchronisation on a
GPU) and sets :math:`L_M` and :math:`z_p` of a failing batch element to NaN, so that nothing computed from it
before the error surfaces is a finite wrong value (with a wrong :math:`L_M` the map would still meet :math:`Az =
k`, with the wrong law).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..._utils import assert_deferred, batch_mv
from ...errors import NotPSDError
from ..triangular import tri_solve_vec
from .factor import DeferredFactor, Factor

if TYPE_CHECKING:
    from ...constraints.base import EqualityConstraint
    from ..covariance import Covariance

__all__ = ["NullspaceFactor"]

#: largest V, U (elements) relative to the inputs: many per-sample covariances with a shared A keep the base factor
_MAX_ELEMS = 1 << 24


class NullspaceFactor(Factor):
    """The null-space form wrapped around a base factor (see the module docstring); use :meth:`build`."""

    name = "nullspace"

    def __init__(self, base: Factor | DeferredFactor, QA: Tensor, R: Tensor, V: Tensor, U: Tensor, zp: Tensor,
                 LM: Tensor) -> None:
        super().__init__(base.cov, base.constraint, base.c)
        self._base = base
        self.QA, self.R, self.V, self.U, self.zp = QA, R, V, U, zp
        self.LM = LM  # Cholesky factor of M' = N^T Sigma'^-1 N, (*batch, p, p), float64

    @property
    def base(self) -> Factor:
        """The factor of :math:`S` under this form (made on first use when it was given deferred)."""
        return self._base.get() if isinstance(self._base, DeferredFactor) else self._base

    @classmethod
    def build(cls, base: Factor | DeferredFactor, static: bool = False) -> "NullspaceFactor | None":
        """The null-space form, or ``None`` when it does not pay or cannot be trusted: ``n - a >= a``; ``A``
        requires grad (the basis is not differentiated); ``A`` numerically rank deficient; :math:`M'` not
        numerically positive definite; ``V`` much larger than the inputs; or the base factor is O(n) already.
        With ``static`` the last two tests read nothing on the host: a failing batch element is marked instead
        (module docstring, "Trust"). A :class:`~.factor.DeferredFactor` base is made only when :meth:`whiten`,
        :meth:`logdet`, :meth:`gain_factor` or :meth:`trace_correction` asks for it: the KL does; a sample, the
        density, the entropy and the moments do not."""
        con, cov = base.constraint, base.cov
        n, a = con.event_size, con.num_constraints
        if not base.nullspace_pays or 2 * a <= n or _operator_requires_grad(con):
            return None
        gd = torch.float64
        batch = torch.broadcast_shapes(con.batch_shape, cov.batch_shape)
        if math.prod(batch) * n * (n - a) > max(4 * con.storage_numel, _MAX_ELEMS):
            return None
        QA, R, N, rank_deficient = _decomposition(con)
        if not static and bool(rank_deficient.any()):
            return None
        scov = cov.to(dtype=gd).scaled(base.c.to(gd))
        Ne = N.expand(batch + N.shape[-2:])
        Y = scov.inv_matvec(Ne.movedim(-1, 0)).movedim(0, -1)  # Sigma'^-1 N, (*batch, n, p)
        M = Ne.mT @ Y
        LM, info = torch.linalg.cholesky_ex(0.5 * (M + M.mT))
        failed = None
        if static:  # no host read: a deferred error, and NaN where the form cannot be trusted (docstring, "Trust")
            failed = (info > 0) | rank_deficient
            _assert_trusted(failed)
            LM = LM.masked_fill(failed[..., None, None], math.nan)
        elif bool((info > 0).any()):
            return None
        V = torch.linalg.solve_triangular(LM, Ne.mT, upper=False).mT
        U = torch.linalg.solve_triangular(LM, Y.mT, upper=False).mT
        zp = batch_mv(QA, tri_solve_vec(R.mT, con.k.to(gd), upper=False))
        if failed is not None:
            zp = zp.masked_fill(failed.unsqueeze(-1), math.nan)
        return cls(base, QA, R, V, U, zp, LM)

    def _project(self, x: Tensor) -> Tensor:
        r""":math:`VU^\top x`: the :math:`\Sigma^{-1}`-orthogonal projection of ``x`` onto :math:`\mathrm{null}(A)`."""
        V, U = self.V, self.U
        if x.dim() - 1 < V.dim() - 2:  # fewer dimensions than the batch: broadcast
            x = x.expand(torch.broadcast_shapes(x.shape, V.shape[:-2] + x.shape[-1:]))
        return batch_mv(V, batch_mv(U.mT, x))

    def _particular(self, residual: Tensor) -> Tensor:
        return batch_mv(self.QA, tri_solve_vec(self.R.mT, residual.to(self.R.dtype), upper=False))

    def gain(self, residual: Tensor) -> Tensor:
        xp = self._particular(residual)  # K r = (I - V U^T) x_p for any A x_p = r
        return (xp - self._project(xp)).to(self.dtype)

    def gain_wide(self, residual: Tensor) -> Tensor:
        xp = self._particular(residual)
        return xp - self._project(xp)

    def step(self, z: Tensor) -> Tensor:
        zp = self.zp
        return (zp + self._project(z.to(zp.dtype) - zp)).to(self.dtype)

    def refine(self, z: Tensor) -> Tensor:
        """In float64 with the residual of ``z`` itself (repeating :meth:`step` would reproduce the rounding of
        :math:`z_p`)."""
        con = self.constraint.to(dtype=torch.float64)
        z64 = z.to(torch.float64)
        xp = self._particular(con.k - con.matvec(z64))
        return (z64 + (xp - self._project(xp))).to(self.dtype)

    def whiten(self, residual: Tensor) -> Tensor:
        return self.base.whiten(residual)

    def logdet(self) -> Tensor:
        return self.base.logdet()

    def gain_factor(self) -> Tensor:
        return self.base.gain_factor()

    def trace_correction(self, other: "Covariance") -> Tensor:
        # the base factor's (its float64 twin where it has one): the gain is the base factor's gain
        return self.base.trace_correction(other)

    def plane_logdet(self) -> Tensor:
        r""":math:`-\log\det(N^\top\Sigma^{-1}N) = -\log\det M' + 2p\log c` from the float64 factor of
        :math:`M'`: no cancellation between :math:`\log\det\Sigma` and :math:`\log\det S` (n = 60, a = 59)."""
        p = self.LM.shape[-1]
        logdet_M = 2 * self.LM.diagonal(dim1=-2, dim2=-1).log().sum(-1)
        return (-logdet_M + 2 * p * self.c.squeeze(-1).to(torch.float64).log()).to(self.dtype)

    def variance(self) -> Tensor:
        return (self.V.square().sum(-1) * self.c.to(self.V.dtype).square()).to(self.dtype)

    def covariance_matrix(self) -> Tensor:
        return ((self.V @ self.V.mT) * self.c.to(self.V.dtype).square().unsqueeze(-1)).to(self.dtype)


#: the deferred error of a static build that cannot be trusted
UNTRUSTED_MESSAGE = (
    "hardeq: the null-space form of a constraint with more rows than half its coordinates (2a > n) cannot be trusted "
    "for at least one batch element: A is numerically rank deficient, or N^T Sigma^-1 N is not numerically positive "
    "definite (scales about eight decades apart or more). Remove dependent rows of A or rescale; the checked path "
    "(validate_args=True on a GPU, any eager call on a CPU) falls back to another factor there.")


def _assert_trusted(failed: Tensor) -> None:
    """Deferred: no batch element failed (raised at once on a CPU as :class:`~hardeq.NotPSDError`)."""
    assert_deferred(~failed.any(), UNTRUSTED_MESSAGE, lambda: NotPSDError(UNTRUSTED_MESSAGE))


def _decomposition(constraint: "EqualityConstraint") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""``(Q_A, R, N, rank_deficient)``: the float64 complete QR of :math:`A^\top` and whether a pivot of ``R`` is
    below :math:`10\varepsilon_{64}` times the largest (per batch element of ``A``), made once per operator tensor
    (:meth:`~hardeq.EqualityConstraint.operator_cache`: O(n^2 a) and a few kernels that a training loop on one ``A``
    would otherwise repeat every step), else per call."""
    cache = constraint.operator_cache()
    made = None if cache is None else cache.get("nullspace_qr")
    if made is None:
        with torch.no_grad():
            QA, R, N = constraint.orthonormal_decomposition()
            pivots = R.diagonal(dim1=-2, dim2=-1).abs()
            rank_deficient = (pivots <= 10 * torch.finfo(R.dtype).eps * pivots.amax(-1, keepdim=True)).any(-1)
        made = (QA, R, N, rank_deficient)
        if cache is not None:
            cache["nullspace_qr"] = made
    return made


def _operator_requires_grad(constraint: "EqualityConstraint") -> bool:
    """Does a tensor of the constraint other than ``k`` require grad? (The basis ``N`` is computed without it.)"""
    return constraint.operator_requires_grad
