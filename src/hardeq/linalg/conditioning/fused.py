r"""The fused per-sample sampler of a Cholesky factor (:meth:`~.cholesky.CholeskyFactor.sample_fused`): draw,
reparameterise, take the Matheron step and check every row, chunk by chunk of rows of the output, so that every
transient stays in cache (on the CPU) and every ``n``-sized temporary is reused.

The device decides the chunking and whether host-read guards (the screen of the residual check, the overflow guard
of the folded gain) are used: :mod:`hardeq.linalg.device`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol, cast, overload

import torch
from torch import Tensor

from ..device import profile, rows_per_chunk
from ..triangular import tri_solve_vec

if TYPE_CHECKING:
    from ...constraints.base import EqualityConstraint
    from ...constraints.linear import LinearConstraint
    from ..covariance import Covariance

__all__ = ["FUSED_CHUNK_ELEMS", "SCREEN_FRACTION", "SCREEN_MIN_SIZE", "folded_gain_", "sample_fused"]


class _Scaled(Protocol):
    """A diagonal covariance's per-coordinate standard deviations (``scale``, ``(*batch, n)``)."""

    scale: Tensor


class _FusedFactor(Protocol):
    """What the fused sampler reads of a :class:`~.cholesky.CholeskyFactor` (named structurally: that module
    imports this one)."""

    constraint: "EqualityConstraint"
    _con: "EqualityConstraint"
    cov: "Covariance"
    c: Tensor
    dtype: torch.dtype
    precision: torch.dtype
    L: Tensor
    d: Tensor | None
    _W: Tensor | None
    _scaled_cov: "Covariance | None"

    @property
    def _cov(self) -> "Covariance": ...

    def _scaled_variance(self, r0: int, r1: int, out: Tensor) -> Tensor: ...

    def _folded_gain_(self, z: Tensor, x: Tensor, s: Tensor, r0: int, r1: int, y: Tensor, A: Tensor,
                      a_max: float | None) -> bool: ...


def _dense_2d(con: "EqualityConstraint") -> Tensor | None:
    """The shared dense 2-D ``A`` of a constraint that keeps its per-``A`` constants (``columns()``, ``abs_A()``,
    the row pairs: a :class:`~hardeq.LinearConstraint`), else ``None``."""
    A = getattr(con, "A", None)
    if getattr(con, "columns", None) is None or not isinstance(A, Tensor) or A.layout != torch.strided or A.dim() != 2:
        return None
    return A


#: elements of one chunk of rows in :func:`sample_fused` (each of its transients is one chunk), on the
#: CPU; on other devices one chunk holds every row (see :func:`_rows_per_chunk`)
FUSED_CHUNK_ELEMS = 1 << 21
#: the screen of the per-row check in :func:`sample_fused` sums :math:`|A||z|` over the first
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
    return rows_per_chunk(count, n, min_rows, device, FUSED_CHUNK_ELEMS)


def _screen_columns(n: int, dtype: torch.dtype, device: torch.device) -> tuple[int | None, float]:
    r"""The columns ``[0, m)`` of the screen of the per-row check in :func:`sample_fused`, and its
    factor ``f``: ``(m, f)``, or ``(None, 1.0)`` where it is not used (off the CPU, where reading its verdict per
    chunk would cost a host synchronisation; vectors shorter than :data:`SCREEN_MIN_SIZE`).

    The terms of :math:`(|A||z|)_i` are not negative, so the sum :math:`s_i` over the first ``m`` columns is a
    lower bound of the full one; computed in floating point, each carries a relative error of at most
    :math:`\gamma_n \approx n\varepsilon` (:math:`\gamma_m` for the part), so :math:`f\,\hat s_i` with
    :math:`f = 1 - 3n\varepsilon` is at most the computed full sum (for :math:`n\varepsilon \le 1/6`). A row
    with :math:`|(Az - k)_i| \le \mathrm{rtol}\,(f\hat s_i + |k_i|)` therefore passes the full check; a chunk with
    a row that does not is checked in full."""
    eps = torch.finfo(dtype).eps
    if not profile(device).host_guards or n < SCREEN_MIN_SIZE or 6 * n * eps > 1:
        return None, 1.0
    return n // SCREEN_FRACTION, 1.0 - 3 * n * eps


def _chunk_fails(z: Tensor, k: Tensor, A_t: Tensor, abs_A_t: Tensor, rtol: float, screen: int | None,
                 shrink: float, scratch: Tensor) -> tuple[Tensor, int | None]:
    r"""The per-row check of a chunk ``z`` (``(rows, n)``) of :func:`sample_fused`: a 0-dim bool
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


@torch.no_grad()
def sample_fused(factor: "_FusedFactor", loc: Tensor, sample_shape: torch.Size, generator: torch.Generator | None,
                 rtol: float) -> tuple[Tensor, bool] | None:
    r"""Draw, reparameterise, take the Matheron step and check every row, chunk by chunk of rows of the output,
    so that every transient stays in cache and every ``n``-sized temporary is reused (a fresh ``batch x n``
    tensor costs its page faults, about as much as one pass over it).

    Per chunk of rows: ``randn`` into the output, :math:`z = \mu + \sigma\varepsilon` (one ``addcmul``),
    :math:`r = k - Az` (one GEMM), :math:`x = S'^{-1}r`, :math:`z \mathrel{+}= \Sigma'(A^\top x)` (one GEMM into
    the one reused buffer and, for per-sample scales on the CPU, ``y *= sigma`` and ``z += y sigma`` with
    :math:`1/c^2` folded into ``x``: :func:`folded_gain_`), then the conditioner's per-row check
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
    con, cov = factor.constraint, factor.cov
    if (factor.precision != factor.dtype or _dense_2d(con) is None
            or not cov.is_diagonal or not hasattr(cov, "scale") or loc.dtype != factor.dtype):
        return None
    n = con.event_size
    batch = torch.broadcast_shapes(loc.shape[:-1], cov.batch_shape, con.batch_shape)
    if len(batch) > 1 or (len(batch) == 1 and len(sample_shape) > 0) or not loc.is_contiguous():
        return None
    count = batch.numel() if batch else torch.Size(sample_shape).numel()
    dense = cast("LinearConstraint", con)  # (_dense_2d: a shared dense 2-D A with its per-A constants)
    A = dense.A
    A_t, abs_A_t = dense.columns()
    out = torch.empty(torch.Size(sample_shape) + batch + (n,), dtype=factor.dtype, device=loc.device)
    flat = out.view(count, n)
    # at least a rows per chunk: each chunk's products stream A once, which must not cost more than the chunk
    step = _rows_per_chunk(count, n, con.num_constraints, loc.device)
    buffer = torch.empty((step, n), dtype=factor.dtype, device=loc.device)
    v_buffer: Tensor | None = None
    failed = torch.zeros((), dtype=torch.bool, device=loc.device)
    scale, k_all, L, d = cast(_Scaled, cov).scale, con.k, factor.L, factor.d
    per_row_scale = bool(batch) and scale.dim() > 1 and scale.shape[0] == count
    if not per_row_scale:
        variance = factor._cov.variance
    # max |A_kj|, for the overflow guard of the folded gain (CPU only: the guard reads a value per chunk)
    a_max = float(abs_A_t.amax()) if per_row_scale and profile(loc.device).host_guards else None
    screen, shrink = _screen_columns(n, factor.dtype, loc.device)

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
        if factor._W is not None and factor._W.dim() == 2:
            z.addmm_(x, factor._W)  # shared covariance: the gain as one GEMM with beta = 1
        elif not per_row_scale:
            z.addcmul_(variance, torch.mm(x, A, out=y))
        elif not factor._folded_gain_(z, x, s, r0, r1, y, A, a_max):
            if v_buffer is None:  # the normalised variances (sigma/c)^2 of a chunk, made on first need
                v_buffer = torch.empty_like(buffer)
            z.addcmul_(factor._scaled_variance(r0, r1, v_buffer[:r1 - r0]), torch.mm(x, A, out=y))
        fails, screen = _chunk_fails(z, k, A_t, abs_A_t, rtol, screen, shrink, y)
        failed |= fails
    return out, not bool(failed)


def folded_gain_(factor: "_FusedFactor", z: Tensor, x: Tensor, s: Tensor, r0: int, r1: int, y: Tensor, A: Tensor,
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
    c = factor.c[r0:r1]
    xs = x / c.square()
    bound = (xs.abs().sum(-1, keepdim=True) * c.clamp_min(1.0)).amax() * a_max
    if not bool((c >= 1.0 / span).all() & (c <= span).all() & (bound <= finfo.max / 8)):
        return False
    torch.mm(xs, A, out=y)
    z.addcmul_(y.mul_(s), s)
    return True
