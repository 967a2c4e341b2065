r"""The static (sync-free) factor of a shared dense ``A`` under per-sample diagonal scales, in few kernels.

The case: a 2-D ``A`` (``a x n``, ``a <`` :data:`MAX_ROWS`, no gradient wanted) shared by a batch of ``B`` vectors
with their own standard deviations :math:`\sigma_b` (a :class:`~hardeq.DiagonalCovariance` whose ``scale`` is
``(B, n)``) and right-hand sides, as :class:`~hardeq.ConstrainedNormal` builds it per training step with
``validate_args=False`` on a GPU. There every ATen call is a kernel launch, so the factor, the sampler and the
log-density here are written as few whole-batch calls (no chunks, no branch, no host read). The mathematics is
the static conditioner's (:mod:`hardeq.linalg.conditioning`, "Static mode"); only the bookkeeping differs:

* **No normalising scale for a float32 covariance.** The float64 factor holds :math:`v = \sigma^2` itself
  (:math:`c = 1` in :mod:`.factor`'s notation): the square of any float32 number lies in float64's normal range,
  and :math:`S = A\,\mathrm{diag}(v)A^\top` of float32 entries neither over- nor underflows float64. A float64
  covariance keeps :math:`v = (\sigma/c)^2`.
* **The Gram matrix** is one GEMM with the cached row-pair matrix (:func:`~hardeq.ops.gram_pairs.row_pairs`,
  :math:`P_{(i,l),j} = A_{ij}A_{lj}`, float64): ``v @ P^T`` gives the packed triangles, one gather (a cached index)
  the symmetric ``(B, a, a)`` matrices, ``torch.linalg.cholesky_ex`` their factor :math:`S = LL^\top`. It is not
  equilibrated: Cholesky and triangular solves are invariant to diagonal scaling up to the rounding of the
  scaling itself (their error bounds depend on :math:`\kappa(D^{-1}SD^{-1})` whether or not :math:`D` is
  applied), so the accuracy argument of the static mode holds as it is.
* **Sampling** (:meth:`StaticPairsFactor.sample_checked`): :math:`z = \mu + \sigma\varepsilon` (one ``randn``,
  one ``addcmul``), then ``1 + steps`` times :math:`r = k - Az` (one ``addmm``, working precision),
  :math:`x = S^{-1}r` (one ``cholesky_solve``, float64), :math:`z \mathrel{+}= v \odot (xA)` (one float64 GEMM and
  one ``addcmul_``, rounded once into ``z``); then the per-row check of the static mode,
  :math:`|(Az - k)_i| \le \mathrm{rtol}\,(|A||z| + |k|)_i + \varepsilon^2(|A||\sigma|)_i` in float64, as
  :math:`|A z - k| \le \mathrm{rtol}\,\big(|k| + |A|(|z| + \tfrac{\varepsilon^2}{\mathrm{rtol}}|\sigma|)\big)`:
  two GEMMs and a few ``(B, a)`` passes, one device verdict (asserted by the caller).
* **The log-density** (:meth:`StaticPairsFactor.log_density`) is :class:`~hardeq.ConstrainedNormal.log_prob`'s
  formula with the deviation :math:`x = z - \bar\mu` in float64: with :math:`t = Az - k` (float64) and
  :math:`x_0 = z - \mu`, two steps :math:`x \leftarrow x - v \odot ((Ax - t)S^{-1}A)`. The first is the
  Matheron step (:math:`Ax_0 - t = k - A\mu`), the second the refinement that removes the float64 gain's
  :math:`\varepsilon_{64}\kappa` error (one suffices for a float64 factor). Then
  :math:`x^\top\Sigma^{-1}x = \lVert x/\sigma\rVert^2` (no square of :math:`\sigma` formed, so no over- or
  underflow), and the normaliser
  :math:`-\tfrac12[(n-a)\log 2\pi + \log\det AA^\top] - \tfrac12\sum_j\log v_j + \sum_i\log L_{ii}` (plus
  :math:`(n - a)\log c` for a float64 covariance), the first bracket computed once per ``A`` tensor. Its
  finiteness (a zero scale has no density on the plane) is asserted on the device.

Cost per call: factor :math:`O(B(a^2 n + a^3))`; a sample :math:`O(B n a)` per step plus the check; a log-density
:math:`O(B n a)` per step. Memory: ``(B, n)`` float64 copies of :math:`\sigma` and :math:`v`, besides the inputs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from ..covariance import DiagonalCovariance
from .cholesky import BLOCKED_MIN_ROWS, CholeskyFactor
from .factor import Factor
from .fused import _dense_2d

if TYPE_CHECKING:
    from ...constraints.base import EqualityConstraint
    from ...constraints.linear import LinearConstraint
    from ..covariance import Covariance

__all__ = ["MAX_ROWS", "SINGULAR_SCALE_MESSAGE", "StaticPairsFactor"]

#: fewest constraint rows for which the general factor is used instead (the row-pair matrix has ``a(a+1)/2`` rows;
#: from here on the large-``a`` drivers of :mod:`.cholesky` apply)
MAX_ROWS = BLOCKED_MIN_ROWS
#: the message of the deferred check that the density's normaliser is finite (shared with ``ConstrainedNormal``)
SINGULAR_SCALE_MESSAGE = (
    "scale (the covariance) must be nonsingular for log_prob and entropy, but log det Sigma - log det S + "
    "log det(A A^T) is not finite (a zero scale?); such a law has no density on the (n - a)-dimensional plane. "
    "With validate_args=True a non-positive scale is rejected at construction.")
_LOG_2PI = math.log(2 * math.pi)
_F64 = torch.float64


def _constants(con64: "LinearConstraint") -> dict[str, Any] | None:
    """The per-``A`` constants (float64), kept with the constraint's other derived values: ``P^T`` of the row pairs,
    the gather index of the symmetric Gram from its packed triangle, ``A^T``, ``|A|^T`` and a ``1`` (the ``c`` of a
    float32 covariance); ``None`` when ``A`` keeps no derived values (it requires grad) or the row pairs would be
    too large. (Under tracing a constraint keeps nothing: they are computed afresh.)"""
    from ...constraints.linear import shared_row_pairs

    derived = con64.derived()
    if derived is None:
        return None
    if "static" not in derived:
        pairs = shared_row_pairs(con64)
        if pairs is None:
            derived["static"] = None
        else:
            a = con64.num_constraints
            iu = torch.triu_indices(a, a, device=pairs.device)
            slots = torch.arange(iu.shape[1], device=pairs.device)
            index = torch.empty((a, a), dtype=torch.long, device=pairs.device)
            index[iu[0], iu[1]] = slots
            index[iu[1], iu[0]] = slots
            A_t, abs_A_t = con64.columns()
            derived["static"] = {"pairs_t": pairs.mT, "index": index.flatten(), "A_t": A_t, "abs_A_t": abs_A_t,
                                 "one": torch.ones((1,), dtype=_F64, device=pairs.device)}
    constants: dict[str, Any] | None = derived["static"]
    return constants


def _affine(x: Tensor, M: Tensor, t: Tensor, beta: float, alpha: float = 1.0) -> Tensor:
    """``beta t + alpha x @ M`` (one ``addmm`` for a 2-D ``x``)."""
    if x.dim() == 2:
        return torch.addmm(t, x, M, beta=beta, alpha=alpha)
    out = torch.matmul(x, M)
    return (out if alpha == 1.0 else out.mul_(alpha)).add_(t, alpha=beta)


class StaticPairsFactor(CholeskyFactor):
    r"""The float64 Cholesky factor of the static mode for a shared 2-D ``A`` and per-sample diagonal scales (see
    the module docstring); a :class:`~.cholesky.CholeskyFactor` (every method of which applies, with ``d = None``,
    no kept :math:`W'` and, for a float32 covariance, ``c = 1``) with a fused sampler and log-density. Use
    :meth:`build_static`."""

    def __init__(self, cov: "Covariance", constraint: "EqualityConstraint", c: Tensor, con64: "LinearConstraint",
                 constants: dict[str, Any]) -> None:
        wide_cov = constraint.dtype == _F64  # (a float64 covariance keeps its normalising scale c)
        Factor.__init__(self, cov, constraint, c if wide_cov else constants["one"])  # (c = 1: broadcasts)
        self.precision = _F64
        if constraint.dtype != _F64:
            self.name = "cholesky64"
        self._con = con64
        self._A64 = con64.A  # (a, n), float64
        self._scaled_cov = None
        self.kappa = math.inf
        self._constants = constants
        scale = cast(DiagonalCovariance, cov).scale.detach()
        self._s64 = scale.to(_F64)  # sigma, (B, n)
        self._v = (self._s64 / c.to(_F64)).square_() if wide_cov else self._s64.square()  # Sigma' = diag(v)
        flat = torch.mm(self._v, constants["pairs_t"])  # packed triangles of S' = A diag(v) A^T, (B, a(a+1)/2)
        a = con64.num_constraints
        self.L = torch.linalg.cholesky_ex(flat.index_select(-1, constants["index"]).view(-1, a, a))[0]
        self.d = None
        self._scaled_L = None
        self._W = None
        self._wide_factor = None
        self._wide_cross = None

    @classmethod
    def build_static(cls, cov: "Covariance", constraint: "EqualityConstraint", c: Tensor,
                     precision: torch.dtype) -> "StaticPairsFactor | None":
        """The factor, or ``None`` where it does not apply: not a float64 factor, not a diagonal covariance with
        per-sample scales ``(B, n)``, not a shared 2-D dense ``A`` with fewer than :data:`MAX_ROWS` rows, a gradient
        wanted through ``A`` or the scales, or a row-pair matrix that would be too large
        (:data:`~hardeq.ops.gram_pairs.PAIR_ELEMS`)."""
        A = _dense_2d(constraint)
        if precision != _F64 or A is None or A.shape[0] >= MAX_ROWS or not isinstance(cov, DiagonalCovariance):
            return None
        if cov.scale.dim() != 2 or (torch.is_grad_enabled() and (A.requires_grad or cov.scale.requires_grad)):
            return None
        con64 = cast("LinearConstraint", constraint if constraint.dtype == _F64 else constraint.to(dtype=_F64))
        constants = _constants(con64)
        return None if constants is None else cls(cov, constraint, c, con64, constants)

    @torch.no_grad()
    def sample_checked(self, loc: Tensor, sample_shape: torch.Size, generator: torch.Generator | None, steps: int,
                       rtol: float) -> tuple[Tensor, Tensor] | None:
        """``(z, ok)``: samples ``(*sample, *batch, n)`` and a 0-dim bool tensor, true when every row of every vector
        met the check (see the module docstring); ``None`` where this sampler does not apply (a dtype other than
        the factor's, more than one batch dimension). The noise is one ``torch.randn`` of the output."""
        con, k64, const = cast("LinearConstraint", self.constraint), self._con.k, self._constants
        scale = cast(DiagonalCovariance, self.cov).scale
        batch = torch.broadcast_shapes(loc.shape[:-1], scale.shape[:-1], con.k.shape[:-1])
        if len(batch) != 1 or loc.dtype != self.dtype:
            return None
        z = torch.randn(sample_shape + batch + loc.shape[-1:], dtype=loc.dtype, device=loc.device,
                        generator=generator)
        torch.addcmul(loc, z, scale, out=z)
        A_t, A64, v, L = con.columns()[0], self._A64, self._v, self.L
        for _ in range(1 + steps):
            r = _affine(z, A_t, con.k, 1.0, alpha=-1.0)  # k - A z, working precision
            x = torch.cholesky_solve(r.to(_F64).unsqueeze(-1), L).squeeze(-1)  # S'^{-1} r, float64
            z.addcmul_(v, x @ A64)  # z + Sigma' A^T x, the product in float64, rounded once into z
        z64 = z.to(_F64)
        miss = _affine(z64, const["A_t"], k64, -1.0).abs_()
        floor_ratio = torch.finfo(self.dtype).eps ** 2 / rtol  # eps^2 |A||sigma| = rtol |A| (eps^2 / rtol) |sigma|
        size = torch.add(z64.abs(), self._s64.abs(), alpha=floor_ratio)  # (z64 is z in float64: not in place)
        tol = _affine(size, const["abs_A_t"], k64.abs(), rtol, alpha=rtol)
        return z, (miss <= tol).all()

    def log_density(self, value: Tensor, loc: Tensor) -> Tensor | None:
        r"""The log-density of ``value`` (``(..., *batch, n)``, on the plane) under :math:`\mathcal N(\mu, \Sigma)`
        given :math:`Az = k` (``loc`` :math:`= \mu`), shape ``(..., *batch)`` in the working dtype, with the
        finiteness of the normaliser asserted on the device (see the module docstring); ``None`` where a gradient
        is wanted (the general path then computes it)."""
        con = self._con
        if torch.is_grad_enabled() and (value.requires_grad or loc.requires_grad or con.k.requires_grad
                                        or cast(DiagonalCovariance, self.cov).scale.requires_grad):
            return None
        const = self._constants
        if "half_log_norm" not in const:  # (n - a) log(2 pi) / 2 + log det(A A^T) / 2, once per A tensor
            n, a = con.event_size, con.num_constraints
            const["half_log_norm"] = (0.5 * (n - a) * _LOG_2PI + 0.5 * con.logdet_gram_identity()).detach()
        A_t, A64, v, L = const["A_t"], self._A64, self._v, self.L
        z64 = value.to(_F64)
        target = _affine(z64, A_t, con.k, -1.0)  # A z - k
        x = torch.sub(z64, loc)  # z - mu (loc widened exactly in the subtraction)
        for _ in range(2):  # the Matheron step (A x - t = k - A mu), then one refinement
            y = torch.cholesky_solve(_affine(x, A_t, target, -1.0).unsqueeze(-1), L).squeeze(-1)
            x = torch.addcmul(x, v, y @ A64, value=-1)
        u = x / self._s64
        quad = torch.bmm(u.unsqueeze(-2), u.unsqueeze(-1)).view(u.shape[:-1]) if u.dim() == 2 else \
            u.square().sum(-1)
        # -(log det Sigma - log det S)/2 = sum log L_ii - sum log v / 2 (+ (n - a) log c for a float64 covariance)
        half = torch.add(L.diagonal(dim1=-2, dim2=-1).log().sum(-1), v.log().sum(-1), alpha=-0.5)
        if self.dtype == _F64:
            half = half - (con.event_size - con.num_constraints) * self.c.squeeze(-1).log()
        normaliser = half.sub_(const["half_log_norm"])
        finite = (normaliser * 0 == 0).all()  # (NaN and +-inf give NaN)
        if value.device.type != "cpu":
            torch._assert_async(finite, SINGULAR_SCALE_MESSAGE)
        else:
            try:
                torch._assert_async(finite, SINGULAR_SCALE_MESSAGE)
            except RuntimeError:  # raised at once on a CPU
                raise ValueError(SINGULAR_SCALE_MESSAGE) from None
        shape = torch.broadcast_shapes(normaliser.shape, quad.shape)
        out = torch.empty(shape, dtype=self.dtype, device=value.device)
        return torch.add(normaliser, quad, alpha=-0.5, out=out)
