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
from typing import TYPE_CHECKING, Protocol, cast, overload

import torch
from torch import Tensor

from ..._utils import batch_mv
from ...ops.gram_pairs import gram_from_pairs_flat
from ..cholesky import gram_cholesky_lower
from ..covariance import Covariance, DiagonalCovariance
from ..triangular import tri_solve_vec
from .factor import Factor

if TYPE_CHECKING:
    from ...constraints import EqualityConstraint
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
#: elements of one chunk of rows in :meth:`CholeskyFactor.sample_fused` (each of its transients is one chunk), on the
#: CPU; on other devices one chunk holds every row (see :func:`_rows_per_chunk`)
FUSED_CHUNK_ELEMS = 1 << 21
#: the screen of the per-row check in :meth:`CholeskyFactor.sample_fused` sums :math:`|A||z|` over the first
#: ``n // SCREEN_FRACTION`` columns (:func:`_screen_columns`): at a residual of 1e-8 of a row's terms against the
#: float32 tolerance 2.5e-6, an eighth of them leaves a margin of about 30
SCREEN_FRACTION = 8
#: shortest vectors whose per-row check is screened (below it, the full product costs little)
SCREEN_MIN_SIZE = 4096


def _rows_per_chunk(count: int, n: int, min_rows: int, device: torch.device) -> int:
    """Rows of ``n`` elements per chunk for a loop over ``count`` rows: on the CPU, chunks of about
    :data:`FUSED_CHUNK_ELEMS` elements (every transient stays in cache) and at least ``min_rows`` rows (each chunk
    streams ``A`` once); elsewhere all rows at once, since on a GPU each chunk costs kernel launches (a profile of
    target B on an H200: 18 small GEMMs per call from four chunks) while the buffers stay the output's size.

    On the CPU the rows of a chunk hold a multiple of 16 elements: ``normal_`` fills a tensor in blocks of 16 draws
    and redraws the last 16 of a tensor whose size is not a multiple of 16, so only then is the noise of the chunks
    the same stream as one ``torch.randn`` of the whole output."""
    if device.type != "cpu":
        return max(1, count)
    step = max(1, min_rows, FUSED_CHUNK_ELEMS // max(1, n))
    quantum = 16 // math.gcd(n, 16)  # rows whose elements fill whole blocks of 16 draws (see the docstring)
    return max(1, min(count, -(-step // quantum) * quantum))


def _screen_columns(n: int, dtype: torch.dtype, device: torch.device) -> tuple[int | None, float]:
    r"""The columns ``[0, m)`` of the screen of the per-row check in :meth:`CholeskyFactor.sample_fused`, and its
    factor ``f``: ``(m, f)``, or ``(None, 1.0)`` where it is not used (off the CPU, where reading its verdict per
    chunk would cost a host synchronisation; vectors shorter than :data:`SCREEN_MIN_SIZE`).

    The terms of :math:`(|A||z|)_i` are not negative, so the sum :math:`s_i` over the first ``m`` columns is a
    lower bound of the full one; computed in floating point, each carries a relative error of at most
    :math:`\gamma_n \approx n\varepsilon` (:math:`\gamma_m` for the part), so :math:`f\,\hat s_i` with
    :math:`f = 1 - 3n\varepsilon` is at most the computed full sum (for :math:`n\varepsilon \le 1/6`). A row
    with :math:`|(Az - k)_i| \le \mathrm{rtol}\,(f\hat s_i + |k_i|)` therefore passes the full check; a chunk with
    a row that does not is checked in full."""
    eps = torch.finfo(dtype).eps
    if device.type != "cpu" or n < SCREEN_MIN_SIZE or 6 * n * eps > 1:
        return None, 1.0
    return n // SCREEN_FRACTION, 1.0 - 3 * n * eps


def _chunk_fails(z: Tensor, k: Tensor, A_t: Tensor, abs_A_t: Tensor, rtol: float, screen: int | None,
                 shrink: float, scratch: Tensor) -> tuple[Tensor, int | None]:
    r"""The per-row check of a chunk ``z`` (``(rows, n)``) of :meth:`CholeskyFactor.sample_fused`: a 0-dim bool
    tensor, true when a row of a vector misses :math:`|(Az - k)_i| \le \mathrm{rtol}\,((|A||z|)_i + |k_i|)`, and
    the screen for the next chunk.

    With ``screen = m`` (:func:`_screen_columns`), :math:`|A||z|` is first summed over the columns ``[0, m)`` only
    and scaled by ``shrink``: a lower bound of the full sum, so a chunk whose rows all pass with it passes the full
    check, with no more work (one host read). Otherwise the full product decides, as without a screen, and the
    screen is off for the next chunks (``A`` is shared: its rows that missed would miss there too). The verdict
    is the full check's either way. ``scratch`` (at least ``z``'s shape) receives ``|z|``. Cost: one GEMM for
    :math:`Az`, plus :math:`|z|` and its GEMM over ``m`` columns when screened, over all ``n`` otherwise."""
    miss, slack = (z @ A_t - k).abs(), k.abs()
    if screen is not None:
        size = torch.abs(z[:, :screen], out=scratch[:, :screen]) @ abs_A_t[:screen]
        if bool((miss <= rtol * (size.mul_(shrink) + slack)).all()):
            return torch.zeros((), dtype=torch.bool, device=z.device), screen
        screen = None
    full = torch.abs(z, out=scratch[:z.shape[0]]) @ abs_A_t
    return ~(miss <= rtol * (full + slack)).all(), screen


def _dense_2d(con: "EqualityConstraint") -> Tensor | None:
    """The shared dense 2-D ``A`` of a constraint that keeps its per-``A`` constants (``columns()``, ``abs_A()``,
    the row pairs: a :class:`~hardeq.LinearConstraint`), else ``None``."""
    A = getattr(con, "A", None)
    if getattr(con, "columns", None) is None or not isinstance(A, Tensor) or A.layout != torch.strided or A.dim() != 2:
        return None
    return A


def _blocked_operand(con: "EqualityConstraint", cov: "Covariance") -> Tensor | None:
    """The 2-D ``A`` when the factor is built by :func:`~hardeq.linalg.cholesky.gram_cholesky_lower` (a shared dense
    ``A`` with at least :data:`BLOCKED_MIN_ROWS` rows, a diagonal covariance, CPU, no gradient wanted), else
    ``None``."""
    A = _dense_2d(con)
    if A is None or not cov.is_diagonal:
        return None
    if A.dim() != 2 or A.shape[0] < BLOCKED_MIN_ROWS or A.device.type != "cpu":
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
        squares = (squares and pairs.device.type == "cpu" and self._scaled_cov is None
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

    def solve(self, residual: Tensor) -> Tensor:
        r""":math:`S'^{-1}r`, in the factor's precision (the solves read the lower triangle of :attr:`L` only)."""
        y = tri_solve_vec(self.L, self._unscale(residual.to(self.precision)), upper=False)
        return self._unscale(tri_solve_vec(self.L.mT, y, upper=True))

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
        if self.precision != z.dtype:
            return self.step(z)
        con = self.constraint
        x = self.solve(con.k - con.matvec(z))
        W = self._W
        if W is not None and W.dim() == 2 and z.dim() >= 2 and x.shape[:-1] == z.shape[:-1]:
            n, a = W.shape[-1], W.shape[-2]
            z.view(-1, n).addmm_(x.reshape(-1, a), W)  # the gain as one GEMM with beta = 1
            return z
        if self._cov.is_diagonal:
            return z.addcmul_(self._cov.variance, con.rmatvec(x))
        return z.add_(self._apply_cross(x))

    @torch.no_grad()
    def sample_fused(self, loc: Tensor, sample_shape: torch.Size, generator: torch.Generator | None,
                     rtol: float) -> tuple[Tensor, bool] | None:
        r"""Draw, reparameterise, take the Matheron step and check every row, chunk by chunk of rows of the output,
        so that every transient stays in cache and every ``n``-sized temporary is reused (a fresh ``batch x n``
        tensor costs its page faults, about as much as one pass over it).

        Per chunk of rows: ``randn`` into the output, :math:`z = \mu + \sigma\varepsilon` (one ``addcmul``),
        :math:`r = k - Az` (one GEMM), :math:`x = S'^{-1}r`, :math:`z \mathrel{+}= \Sigma'(A^\top x)` (one GEMM into
        the one reused buffer and, for per-sample scales on the CPU, ``y *= sigma`` and ``z += y sigma`` with
        :math:`1/c^2` folded into ``x``: :meth:`_folded_gain_`), then the conditioner's per-row check
        :math:`|(Az - k)_i| \le \mathrm{rtol}\,((|A||z|)_i + |k_i|)` (:func:`_chunk_fails`: one GEMM for
        :math:`Az`; on the CPU :math:`|A||z|` over the first ``n / 8`` columns screens the rows, the full product
        only when a row misses that lower bound); the verdicts of all chunks are read with one host synchronisation
        at the end (plus one small read per chunk on the CPU: the screen's and the gain's guards).

        Applies to a shared dense 2-D ``A`` under a diagonal covariance, a factor in the working precision, and
        either no batch dimensions (chunks of samples) or no sample dimensions (chunks of batch elements; the
        per-batch tensors are sliced, not copied). Returns ``(z, passed)`` (``passed``: every row of every vector
        met the check, so the conditioner needs no refinement), or ``None`` where it does not apply (the caller
        then takes the unfused path). The noise is drawn in the same order as ``torch.randn`` of the whole
        output."""
        con, cov = self.constraint, self.cov
        if (self.precision != self.dtype or _dense_2d(con) is None
                or not cov.is_diagonal or not hasattr(cov, "scale") or loc.dtype != self.dtype):
            return None
        n = con.event_size
        batch = torch.broadcast_shapes(loc.shape[:-1], cov.batch_shape, con.batch_shape)
        if len(batch) > 1 or (len(batch) == 1 and len(sample_shape) > 0) or not loc.is_contiguous():
            return None
        count = batch.numel() if batch else torch.Size(sample_shape).numel()
        dense = cast("LinearConstraint", con)  # (_dense_2d: a shared dense 2-D A with its per-A constants)
        A = dense.A
        A_t, abs_A_t = dense.columns()
        out = torch.empty(torch.Size(sample_shape) + batch + (n,), dtype=self.dtype, device=loc.device)
        flat = out.view(count, n)
        # at least a rows per chunk: each chunk's products stream A once, which must not cost more than the chunk
        step = _rows_per_chunk(count, n, con.num_constraints, loc.device)
        buffer = torch.empty((step, n), dtype=self.dtype, device=loc.device)
        v_buffer: Tensor | None = None
        failed = torch.zeros((), dtype=torch.bool, device=loc.device)
        scale, k_all, L, d = cast(_Scaled, cov).scale, con.k, self.L, self.d
        per_row_scale = bool(batch) and scale.dim() > 1 and scale.shape[0] == count
        if not per_row_scale:
            variance = self._cov.variance
        # max |A_kj|, for the overflow guard of the folded gain (CPU only: the guard reads a value per chunk)
        a_max = float(abs_A_t.amax()) if per_row_scale and loc.device.type == "cpu" else None
        screen, shrink = _screen_columns(n, self.dtype, loc.device)

        @overload
        def rows(t: Tensor, r0: int, r1: int, event_dims: int) -> Tensor: ...
        @overload
        def rows(t: None, r0: int, r1: int, event_dims: int) -> None: ...

        def rows(t: Tensor | None, r0: int, r1: int, event_dims: int) -> Tensor | None:
            """The rows ``r0:r1`` of a per-batch-element tensor; a shared one as it is."""
            if t is None or not batch or t.dim() == event_dims:
                return t
            return t[0] if t.shape[0] == 1 else t[r0:r1]

        for r0 in range(0, count, step):
            r1 = min(r0 + step, count)
            z, y = flat[r0:r1], buffer[:r1 - r0]
            z.normal_(generator=generator)
            s = rows(scale, r0, r1, 1)
            torch.addcmul(rows(loc, r0, r1, 1), z, s, out=z)  # as reparameterize_: loc + scale * eps, one pass
            k = rows(k_all, r0, r1, 1)
            residual = k - z @ A_t
            Lr, dr = rows(L, r0, r1, 2), rows(d, r0, r1, 1)
            residual = residual if dr is None else residual / dr
            x = tri_solve_vec(Lr.mT, tri_solve_vec(Lr, residual, upper=False), upper=True)
            x = x if dr is None else x / dr
            if self._W is not None and self._W.dim() == 2:
                z.addmm_(x, self._W)  # shared covariance: the gain as one GEMM with beta = 1
            elif not per_row_scale:
                z.addcmul_(variance, torch.mm(x, A, out=y))
            elif not self._folded_gain_(z, x, s, r0, r1, y, A, a_max):
                if v_buffer is None:  # the normalised variances (sigma/c)^2 of a chunk, made on first need
                    v_buffer = torch.empty_like(buffer)
                z.addcmul_(self._scaled_variance(r0, r1, v_buffer[:r1 - r0]), torch.mm(x, A, out=y))
            fails, screen = _chunk_fails(z, k, A_t, abs_A_t, rtol, screen, shrink, y)
            failed |= fails
        return out, not bool(failed)

    def _folded_gain_(self, z: Tensor, x: Tensor, s: Tensor, r0: int, r1: int, y: Tensor, A: Tensor,
                      a_max: float | None) -> bool:
        r""":math:`z \mathrel{+}= (\sigma/c)^2 \circ (A^\top x)` for the rows ``r0:r1`` of a per-sample diagonal
        covariance, computed as :math:`z \mathrel{+}= \sigma \circ (\sigma \circ (A^\top x'))` with
        :math:`x' = x / c^2` folded into the ``a``-sized ``x``: one GEMM into ``y`` and two elementwise passes
        (``y *= sigma``, ``z += y sigma``) instead of four (:math:`\sigma / c`, its square, the GEMM, ``z += v y``).

        Every intermediate is bounded by :math:`\lVert x'_i\rVert_1 \max|A| \max(1, c_i)` (the GEMM's partial
        sums by the first two factors, ``y sigma`` with :math:`|\sigma| \le c_i`; the result is the gain itself), so
        it applies, and returns ``True``, when that bound is below an eighth of the dtype's largest value and every
        :math:`c_i` lies within :math:`2^{\pm e/8}` (:math:`2^e`: the dtype's overflow threshold; :math:`c^2` and
        :math:`1/c^2` are then normal and far from either end, and the products underflow where
        :math:`(\sigma/c)^2` would, give or take a factor :math:`2^{e/4}`). Otherwise it does nothing and returns
        ``False``. ``a_max`` is :math:`\max|A|`; ``None`` (off the CPU, where the guard's host read would cost a
        synchronisation per chunk) returns ``False``."""
        if a_max is None:
            return False
        finfo = torch.finfo(z.dtype)
        span = 2.0 ** (math.frexp(finfo.max)[1] // 8)  # 2^16 (float32), 2^128 (float64)
        c = self.c[r0:r1]
        xs = x / c.square()
        bound = (xs.abs().sum(-1, keepdim=True) * c.clamp_min(1.0)).amax() * a_max
        if not bool((c >= 1.0 / span).all() & (c <= span).all() & (bound <= finfo.max / 8)):
            return False
        torch.mm(xs, A, out=y)
        z.addcmul_(y.mul_(s), s)
        return True

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
