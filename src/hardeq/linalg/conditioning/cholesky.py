r"""Gram matrix and Cholesky factor, in the working precision or in float64.

:math:`S' = A\Sigma'A^\top` is formed by one (batched) GEMM (:meth:`~hardeq.EqualityConstraint.gram`), equilibrated
(Jacobi scaling :math:`D = \mathrm{diag}(S')^{1/2}`, :math:`\tilde S = D^{-1}S'D^{-1}` with unit diagonal: rows of
very different sizes cost nothing) and factorised, :math:`\tilde S = LL^\top`. Then

.. math::
    S'^{-1}r = D^{-1}L^{-\top}L^{-1}D^{-1}r, \qquad Kr = \Sigma'A^\top S'^{-1}r, \qquad
    \log\det S = 2a\log c + 2\textstyle\sum_j\log d_j + 2\textstyle\sum_j\log L_{jj},

and :math:`G = c\,\Sigma'A^\top D^{-1}L^{-\top}` (:math:`GG^\top = \Sigma A^\top S^{-1}A\Sigma`).

**Large shared dense A under a diagonal covariance** (``a >=`` :data:`BLOCKED_MIN_ROWS`, CPU, no gradient wanted):
:math:`S'` is never formed. :func:`~hardeq.linalg.cholesky.gram_cholesky_lower` computes the lower Cholesky factor of
:math:`S'` itself block column by block column, fused with the lower half of the Gram product (about
:math:`a^2 n + a^3/3` flops per batch element instead of :math:`2a^2 n`, no triangle copy, no ``a x a`` elementwise
pass); :math:`D = I` in the formulas above. Cholesky is invariant to diagonal scaling, so this factor is the
equilibrated one up to :math:`D`: the pivot ratio uses :math:`L_{jj}/S'^{1/2}_{jj}`, the pivots of
:math:`D^{-1}L`. Only the lower triangle of :attr:`CholeskyFactor.L` is then defined; every use reads that
triangle only.

In float64 for a float32 input (``precision=torch.float64``), the ``a x a`` factor, the solves and the gain product
:math:`\Sigma'A^\top x` are float64 (the entries of :math:`x = S'^{-1}r` cancel in that product when
:math:`\kappa(\tilde S)` is large); the samples stay float32, rounded once.

The product :math:`W' = A\Sigma'` (``a x n``) is kept when it is no larger than the inputs (a shared covariance), so
that a gain costs one GEMM; otherwise the gain is applied as :math:`\Sigma'(A^\top x)`.

Cost: factorisation O(batch n a^2 + batch a^3) at GEMM speed; a gain O(n a) (O(nnz) for a sparse constraint).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import Tensor

from ..._utils import batch_mv
from ...ops.gram_pairs import gram_from_pairs_flat
from ..cholesky import gram_cholesky_lower
from ..covariance import Covariance, DiagonalCovariance
from ..device import profile
from ..triangular import chol_solve_vec, tri_solve_vec
from .factor import Factor
from .fused import _dense_2d, _rows_per_chunk, folded_gain_, sample_fused

if TYPE_CHECKING:
    from ...constraints.base import EqualityConstraint
    from ...constraints.linear import LinearConstraint


class _Scaled(Protocol):
    """A diagonal covariance's per-coordinate standard deviations (``scale``, ``(*batch, n)``)."""

    scale: Tensor

__all__ = ["CholeskyFactor"]

#: largest bound (nats) on a float32 factor's log-determinant error accepted without its float64 twin
LOGDET_FLOAT32_NATS = 1e-4
#: a float32 factor whose :math:`32\,\varepsilon_{32}\kappa` (``kappa``: the pivot-ratio estimate) exceeds this gives
#: its conditional variances and covariance matrix from its float64 twin: their error relative to :math:`\Sigma_{ii}`
#: was measured up to :math:`23\,\varepsilon_{32}\kappa` (200 random problems, scales over ten decades)
MOMENTS_FLOAT32_RTOL = 1e-5
#: elements of a transient (chunk x batch x n) tensor in :meth:`CholeskyFactor.variance`
_CHUNK_ELEMS = 1 << 24
#: fewest constraint rows for which the factor of a shared dense ``A`` under a diagonal covariance is built by the
#: blocked Gram-Cholesky (:func:`~hardeq.linalg.cholesky.gram_cholesky_lower`, CPU): below it, forming
#: :math:`S` and ``torch.linalg.cholesky_ex`` cost little
BLOCKED_MIN_ROWS = 256


def _blocked_operand(con: "EqualityConstraint", cov: "Covariance") -> Tensor | None:
    """The 2-D ``A`` when the factor is built by :func:`~hardeq.linalg.cholesky.gram_cholesky_lower` (a shared dense
    ``A`` with at least :data:`BLOCKED_MIN_ROWS` rows, a diagonal covariance, CPU, no gradient wanted), else
    ``None``."""
    A = _dense_2d(con)
    if A is None or not cov.is_diagonal:
        return None
    if A.dim() != 2 or A.shape[0] < BLOCKED_MIN_ROWS or not profile(A.device).blocked_drivers:
        return None
    if torch.is_grad_enabled() and (A.requires_grad or any(t.requires_grad for t in cov.tensors())):
        return None
    return A


def _pairs_operand(con: "EqualityConstraint", cov: "Covariance") -> Tensor | None:
    """The row-pair matrix of a shared 2-D ``A`` (:func:`~hardeq.ops.gram_pairs.row_pairs`, kept per ``A`` tensor)
    when the Gram matrix under a per-sample diagonal covariance ``(B, n)`` is built from it without a gradient,
    else ``None``."""
    from ...constraints.linear import shared_row_pairs

    A = _dense_2d(con)
    if A is None or not isinstance(cov, DiagonalCovariance) or cov.scale.dim() != 2:
        return None
    if torch.is_grad_enabled() and (A.requires_grad or cov.scale.requires_grad):
        return None
    return shared_row_pairs(cast("LinearConstraint", con))  # (_dense_2d: it keeps its per-A constants)


def _pivot_ratio(pivots: Tensor) -> float:
    r""":math:`(\max_j L_{jj} / \min_j L_{jj})^2` over the batch (``inf`` when not finite): the estimate of
    :math:`\kappa(\tilde S)` from the pivots of the equilibrated factor."""
    kappa = float(((pivots.amax(-1) / pivots.amin(-1)).amax().detach()) ** 2)
    return kappa if math.isfinite(kappa) else math.inf



class CholeskyFactor(Factor):
    r"""Cholesky factor of the equilibrated Gram matrix (see the module docstring).

    Use :meth:`build`; ``kappa`` is the pivot-ratio estimate :math:`(\max L_{jj}/\min L_{jj})^2` of
    :math:`\kappa(\tilde S)` (``inf`` when the factorisation failed), computed only when ``checked``.
    """

    name = "cholesky"

    def __init__(self, cov: "Covariance", constraint: "EqualityConstraint", c: Tensor, precision: torch.dtype,
                 *, checked: bool = True) -> None:
        super().__init__(cov, constraint, c)
        self.precision = precision
        if precision != self.dtype:
            self.name = "cholesky64"
        self._con = constraint if precision == constraint.dtype else constraint.to(dtype=precision)
        self._scaled_cov: Covariance | None = None  # Sigma' in the factor's precision, made on first use (_cov)
        self.kappa = math.inf
        self.L: Tensor  # the (lower) Cholesky factor, (*batch, a, a)
        self.d: Tensor | None  # the equilibration D, (*batch, a); None when S' was factorised as it is
        A = _blocked_operand(self._con, cov)
        pairs = _pairs_operand(self._con, cov)
        if A is not None:  # no S, no equilibration pass: the pivot ratio is taken against diag(S') below
            self.L, info, diag_S = gram_cholesky_lower(A, self._cov.variance)
            self.d = None
            if checked:
                diag = self.L.diagonal(dim1=-2, dim2=-1) / diag_S.sqrt()  # the equilibrated factor's pivots
                ok = torch.isfinite(diag).all() & (info == 0).all() & (diag_S > 0).all()
                if bool(ok):
                    self.kappa = _pivot_ratio(diag)
        else:
            S = self._con.gram(self._cov) if pairs is None else self._pairs_gram(pairs, squares=checked)
            d = S.diagonal(dim1=-2, dim2=-1).sqrt()
            self.d = d  # (*batch, a)
            L, info = torch.linalg.cholesky_ex(S / (d.unsqueeze(-1) * d.unsqueeze(-2)))
            self.L = L
            if checked:
                if bool(torch.isfinite(S).all()) and not bool((info > 0).any()) and bool((d > 0).all()):
                    self.kappa = _pivot_ratio(L.diagonal(dim1=-2, dim2=-1))
        self._W = self._shared_product()
        self._scaled_L: Tensor | None = None  # D L, made on first solve (_row_scaled)
        self._wide_factor: CholeskyFactor | None = None  # float64 twin for logdet, made on first use
        # float64 copies of Sigma' and A for gain_wide, made on first use
        self._wide_cross: tuple[Covariance, EqualityConstraint] | None = None

    @classmethod
    def build(cls, cov: "Covariance", constraint: "EqualityConstraint", c: Tensor, precision: torch.dtype,
              kappa_max: float) -> "CholeskyFactor | None":
        """The factor, or ``None`` when the factorisation fails (``kappa`` infinite, whatever ``kappa_max``) or its
        :math:`\\kappa` estimate exceeds ``kappa_max`` (then :math:`\\varepsilon\\kappa` would cost more than one
        refinement step)."""
        factor = cls(cov, constraint, c, precision)
        return factor if math.isfinite(factor.kappa) and factor.kappa <= kappa_max else None

    @property
    def _cov(self) -> "Covariance":
        r""":math:`\Sigma' = \Sigma / c^2` in the factor's precision, made on first use (the per-sample diagonal
        path never forms it: :meth:`_scaled_variance` gives it chunk by chunk)."""
        if self._scaled_cov is None:
            self._scaled_cov = self.cov.to(dtype=self.precision).scaled(self.c.to(self.precision))
        return self._scaled_cov

    def _scaled_variance(self, r0: int, r1: int, out: Tensor) -> Tensor:
        r"""Rows ``r0:r1`` of the diagonal of :math:`\Sigma'`, :math:`(\sigma/c)^2`, computed into ``out`` (a
        reused chunk buffer) as :attr:`_cov` would compute them (a per-sample diagonal covariance)."""
        if self._scaled_cov is not None:
            return self._scaled_cov.variance[r0:r1]
        scale = cast(_Scaled, self.cov).scale[r0:r1].to(self.precision)
        return torch.div(scale, self.c[r0:r1].to(self.precision), out=out).square_()

    def _pairs_gram(self, pairs: Tensor, squares: bool = True) -> Tensor:
        r""":math:`S' = A\,\mathrm{diag}((\sigma/c)^2)A^\top` for a shared 2-D ``A`` and per-sample scales
        ``(B, n)``: the row-pair GEMM of :func:`~hardeq.ops.gram_pairs.gram_from_pairs`, over chunks of rows whose
        variances are computed into one reused buffer (no ``B x n`` temporary).

        On the CPU (``squares``: a checked factor, which reads values on the host anyway; a static one makes no host
        synchronisation), when every :math:`c_i` lies within :math:`2^{\pm e/16}` (:math:`2^e`: the dtype's overflow
        threshold; :math:`2^{\pm 8}` in float32), the buffer holds :math:`\sigma^2` (one pass, where
        :math:`(\sigma/c)^2` takes two) and the ``a(a+1)/2`` products per row are divided by :math:`c_i^2`
        afterwards: :math:`\sigma^2 \le c^2` cannot overflow, and a square underflows only where
        :math:`(\sigma/c)^2` would within a factor :math:`c^2 \le 2^{e/8}` (terms below :math:`2^{-7e/8}` of the
        row's largest variance)."""
        scale = cast(_Scaled, self.cov).scale
        count, n = scale.shape
        step = _rows_per_chunk(count, n, pairs.shape[0], pairs.device)  # P streamed once per chunk
        buffer = torch.empty((step, n), dtype=self.precision, device=pairs.device)
        flat = torch.empty((count, pairs.shape[0]), dtype=self.precision, device=pairs.device)
        c = self.c.to(self.precision)
        span = 2.0 ** (math.frexp(torch.finfo(self.precision).max)[1] // 16)
        squares = (squares and profile(pairs.device).host_guards and self._scaled_cov is None
                   and bool((c >= 1.0 / span).all() & (c <= span).all()))
        for r0 in range(0, count, step):
            r1 = min(r0 + step, count)
            if squares:
                s = scale[r0:r1].to(self.precision)
                v = torch.mul(s, s, out=buffer[:r1 - r0])
            else:
                v = self._scaled_variance(r0, r1, buffer[:r1 - r0])
            torch.mm(v, pairs.mT, out=flat[r0:r1])
        if squares:
            flat /= c.square()
        return gram_from_pairs_flat(flat, self._con.num_constraints)

    def _shared_product(self) -> Tensor | None:
        r""":math:`W' = A\Sigma'` (``(*batch, a, n)``) when it is no larger than the inputs, else ``None``."""
        con, cov = self._con, self.cov
        batch = torch.broadcast_shapes(con.batch_shape, cov.batch_shape)
        if math.prod(batch) * con.num_constraints * con.event_size > max(con.storage_numel, cov.param_numel):
            return None
        return con.cross_covariance(self._cov).mT

    # ------------------------------------------------------------------ solves
    def _unscale(self, r: Tensor) -> Tensor:
        """``r / d`` (Jacobi scaling of the equilibrated factor), or ``r`` for a factor of :math:`S'` itself."""
        return r if self.d is None else r / self.d

    def _row_scaled(self) -> Tensor:
        r""":math:`DL`, the lower Cholesky factor of :math:`S' = DLL^\top D` (:attr:`L` itself without
        equilibration); its rows scaled once, on first use, and kept."""
        if self._scaled_L is not None:
            return self._scaled_L
        scaled = self.L if self.d is None else self.d.unsqueeze(-1) * self.L
        if torch.is_grad_enabled() or not (self.L.requires_grad or self.d is not None and self.d.requires_grad):
            self._scaled_L = scaled  # (not one made without gradient from a factor that has one: a later rsample)
        return scaled

    def solve(self, residual: Tensor) -> Tensor:
        r""":math:`S'^{-1}r`, in the factor's precision: one Cholesky solve with :math:`DL` (both triangular solves in
        one call, no division by ``d`` before or after; row scaling leaves the triangular solves' componentwise
        backward error as it is). Reads the lower triangle of :attr:`L` only."""
        return chol_solve_vec(self._row_scaled(), residual.to(self.precision))

    def _apply_cross(self, x: Tensor) -> Tensor:
        r""":math:`\Sigma'A^\top x` in the factor's precision."""
        if self._W is not None:
            return batch_mv(self._W.mT, x)
        return self._cov.matvec(self._con.rmatvec(x))

    def gain(self, residual: Tensor) -> Tensor:
        return self._apply_cross(self.solve(residual)).to(self.dtype)

    def _twin(self) -> "CholeskyFactor":
        """This factor in float64 (itself when it is float64; else built on first use and kept)."""
        if self.precision == torch.float64:
            return self
        if self._wide_factor is None:
            self._wide_factor = CholeskyFactor(self.cov, self.constraint, self.c, torch.float64, checked=False)
        return self._wide_factor

    def gain_wide(self, residual: Tensor) -> Tensor:
        r""":math:`\Sigma'A^\top S'^{-1}r` with the solve in the factor's precision and the last product in float64
        (float64 copies of the covariance and constraint, made on first use and kept: O(n + storage of A), not the
        :math:`a^2 n` Gram matrix). The solve's error (:math:`\varepsilon\kappa` relative) lies in
        :math:`\mathrm{range}(\Sigma A^\top)`, where :meth:`~hardeq.linalg.conditioning.Conditioner.deviation`'s
        refinement removes it."""
        if self.precision == torch.float64:
            return self._apply_cross(self.solve(residual))
        if self._wide_cross is None:
            self._wide_cross = (self._cov.to(dtype=torch.float64), self._con.to(dtype=torch.float64))
        cov, con = self._wide_cross
        return cov.matvec(con.rmatvec(self.solve(residual).to(torch.float64)))

    def step_(self, z: Tensor) -> Tensor:
        r"""The Matheron step on ``z`` in place. A factor wider than ``z`` (``cholesky64`` on float32 vectors) under
        a diagonal covariance, without :math:`W'`: :math:`x = S'^{-1}(k - Az)` and
        ``z.addcmul_(v, A^T x)`` with :math:`v` and :math:`A^\top x` in float64, a mixed-precision update that
        rounds the float64 sum once to ``z``'s dtype (:meth:`step` rounds the gain to it first, then the sum)."""
        con = self.constraint
        if self.precision != z.dtype:
            if self._W is not None or not self._cov.is_diagonal:
                return self.step(z)
            x = self.solve(con._shortfall(z))
            variance = self._cov.variance
            if torch.broadcast_shapes(z.shape, variance.shape, x.shape[:-1] + z.shape[-1:]) != z.shape:
                return self.step(z)
            return z.addcmul_(variance, self._con.rmatvec(x))
        x = self.solve(con._shortfall(z))
        W = self._W
        if W is not None and W.dim() == 2 and z.dim() >= 2 and x.shape[:-1] == z.shape[:-1]:
            n, a = W.shape[-1], W.shape[-2]
            z.view(-1, n).addmm_(x.reshape(-1, a), W)  # the gain as one GEMM with beta = 1
            return z
        if self._cov.is_diagonal:
            return z.addcmul_(self._cov.variance, con.rmatvec(x))
        return z.add_(self._apply_cross(x))

    def sample_fused(self, loc: Tensor, sample_shape: torch.Size, generator: torch.Generator | None,
                     rtol: float) -> tuple[Tensor, bool] | None:
        """Draw, reparameterise, take the Matheron step and check every row, chunk by chunk of the output
        (:func:`~.fused.sample_fused`); ``None`` where it does not apply."""
        return sample_fused(self, loc, sample_shape, generator, rtol)

    def _folded_gain_(self, z: Tensor, x: Tensor, s: Tensor, r0: int, r1: int, y: Tensor, A: Tensor,
                      a_max: float | None) -> bool:
        """The gain of a chunk with :math:`1/c^2` folded into ``x`` (:func:`~.fused.folded_gain_`)."""
        return folded_gain_(self, z, x, s, r0, r1, y, A, a_max)

    def whiten(self, residual: Tensor) -> Tensor:
        y = tri_solve_vec(self.L, self._unscale(residual.to(self.precision)), upper=False)
        return (y / self.c.to(self.precision)).to(self.dtype)

    def logdet(self) -> Tensor:
        r""":math:`\log\det S`. The rounding of a float32 Gram matrix moves its log-determinant by about
        :math:`a\,\varepsilon_{32}\kappa(\tilde S)` nats (4e-3 nats with scales over five decades), which
        :meth:`~hardeq.ConstrainedNormal.log_prob` would add to every density. A working-precision (float32) factor
        whose bound exceeds :data:`LOGDET_FLOAT32_NATS` takes it from a float64 factor of the same :math:`S` (built
        on first use and kept; cost :math:`a^2 n` in float64), else from its own factorisation."""
        if self.precision != torch.float64:
            bound = self.L.shape[-1] * torch.finfo(self.precision).eps * self.kappa
            if not bound <= LOGDET_FLOAT32_NATS:
                return self._twin().logdet()
        a = self.L.shape[-1]
        out = 2 * self.L.diagonal(dim1=-2, dim2=-1).log().sum(-1) + 2 * a * self.c.squeeze(-1).to(self.precision).log()
        if self.d is not None:
            out = out + 2 * self.d.log().sum(-1)
        return out.to(self.dtype)

    # ------------------------------------------------------------------ second moments
    def _whitening(self) -> Tensor:
        r""":math:`Y = D^{-1}L^{-\top}` (``(*batch, a, a)``), so that :math:`G = c\,\Sigma'A^\top Y`."""
        eye = torch.eye(self.L.shape[-1], dtype=self.precision, device=self.L.device)
        Y: Tensor = torch.linalg.solve_triangular(self.L.mT, eye.expand_as(self.L), upper=True)
        return Y if self.d is None else Y / self.d.unsqueeze(-1)

    def gain_factor(self) -> Tensor:
        cross = self._W.mT if self._W is not None else self._con.cross_covariance(self._cov)
        return (cross @ self._whitening() * self.c.to(self.precision).unsqueeze(-1)).to(self.dtype)

    def _moments_factor(self) -> "CholeskyFactor":
        r"""The factor for the second moments: :math:`\mathrm{diag}\,\Sigma - \lVert G_{i,:}\rVert^2` cancels for a
        coordinate the constraint nearly determines, and ``G`` from a float32 factor carries
        :math:`\varepsilon_{32}\kappa(\tilde S)` relative error, so past :data:`MOMENTS_FLOAT32_RTOL` the float64
        twin is used (without it, float32 variances were 1.3e-3 :math:`\Sigma_{ii}` off at scales over ten decades,
        4.7e-5 at ratios of 300)."""
        bound = 32 * torch.finfo(self.precision).eps * self.kappa
        if self.precision != torch.float64 and not bound <= MOMENTS_FLOAT32_RTOL:
            return self._twin()
        return self

    def trace_correction(self, other: "Covariance") -> Tensor:
        factor = self._moments_factor()  # tr(G^T Sigma_p^-1 G) nearly cancels tr(Sigma_p^-1 Sigma_q) in the KL
        return super().trace_correction(other) if factor is self else factor.trace_correction(other)

    def covariance_matrix(self) -> Tensor:
        factor = self._moments_factor()
        return super().covariance_matrix() if factor is self else factor.covariance_matrix()

    def variance(self) -> Tensor:
        r""":math:`\mathrm{diag}\,\Sigma - \lVert G_{i,:}\rVert^2`, accumulated over chunks of the columns of ``Y``:
        each chunk is a batch of vectors :math:`\Sigma'A^\top y_j` (transient ``chunk x batch x n``), so nothing of
        size ``a x n`` is formed unless :math:`W'` is kept anyway. From the float64 twin when
        :math:`\varepsilon_{32}\kappa` exceeds :data:`MOMENTS_FLOAT32_RTOL`; the difference is taken in the factor's
        precision."""
        if self._moments_factor() is not self:
            return self._twin().variance()
        Y = self._whitening()
        if self._W is not None:
            reduction = (self._W.mT @ Y).square().sum(-1)
        else:
            a, n = Y.shape[-1], self.cov.event_size
            batch = torch.broadcast_shapes(Y.shape[:-2], self._con.batch_shape, self._cov.batch_shape)
            step = max(1, _CHUNK_ELEMS // max(1, math.prod(batch) * n))
            cols = Y.movedim(-1, 0)  # (a, *batch, a): column j of Y as a "sample"
            reduction = sum((self._apply_cross(cols[j:j + step]).square().sum(0) for j in range(0, a, step)),
                            torch.zeros((), dtype=self.precision, device=Y.device))
        reduction = reduction * self.c.to(self.precision).square()
        # the difference in the factor's precision: it cancels for a coordinate the constraint nearly determines
        return (self.cov.diagonal().to(self.precision) - reduction).clamp_min(0).to(self.dtype)
