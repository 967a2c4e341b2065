r"""The static (sync-free) sampler of a Cholesky factor, chunk by chunk of rows of the output on the CPU.

The static conditioner's sample is ``loc + sigma eps``, a Matheron step, its refinement steps and the deferred
per-row check (:mod:`hardeq.linalg.conditioning`, "Static mode"). Written out over the whole
``(*sample, *batch, n)`` output that is a dozen passes over fresh ``n``-sized tensors, several of them float64 (the
factor is float64): on a CPU every fresh tensor costs its page faults and every pass that leaves the cache costs as
much as the arithmetic. Here every pass runs on one chunk of rows (:func:`~hardeq.linalg.device.rows_per_chunk`:
cache-sized chunks on the CPU, one chunk on a GPU), on reused buffers. Same arithmetic as the unfused path:

per chunk, ``randn`` into the output, :math:`z = \mu + \sigma\varepsilon`, then ``1 + steps`` times
:math:`r = k - Az` (working precision, one ``addmm``), :math:`x = S'^{-1}r` (float64, one ``cholesky_solve`` with the
factor's rows scaled once per call: :math:`DL`, the factor of :math:`S'`; for per-sample float32 scales :math:`cDL`, the
factor of :math:`S = c^2S'`, so that :math:`x'' = x/c^2` and the gain is :math:`\sigma^2 \circ (A^\top x'')`),
:math:`z \mathrel{+}= \Sigma'(A^\top x)` (float64 product, one GEMM, added with one rounding), and the check
:math:`|(Az - k)_i| \le \mathrm{rtol}\,(|A||z|)_i + b_i` with
:math:`Az` in float64 and :math:`b = \mathrm{rtol}|k| + \varepsilon^2(|A|\sigma)` (the check's floor). The verdicts
of all chunks are one device tensor, asserted once at the end (``torch._assert_async``); no host read.

Applies to a shared dense 2-D ``A`` under a diagonal covariance, a float64 factor, no determined coordinates, and
either no batch dimensions (chunks of samples) or no sample dimensions (chunks of batch elements). A factor with a
sampler of its own (``sample_checked``: :class:`~.static_dense.StaticPairsFactor`, per-sample scales) draws with
it instead, in whole-batch calls. The noise is
drawn in the order of one ``torch.randn`` of the whole output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast, overload

import torch
from torch import Tensor

from ..device import rows_per_chunk
from .factor import Factor
from .fused import FUSED_CHUNK_ELEMS, _dense_2d, _FusedFactor, _Scaled
from .residual import DEFERRED_MESSAGE, ResidualCheck, check_rtol

if TYPE_CHECKING:
    from ...constraints.linear import LinearConstraint

__all__ = ["STATIC_REFINEMENT_STEPS", "sample_static_checked", "sample_static_fused"]

#: refinement steps every vector gets in static mode, by dtype: each multiplies the error of the float64 gain by
#: eps64 kappa (float32 vectors meet their rows after one at kappa <= 1e12; float64 ones need two at 1e10)
STATIC_REFINEMENT_STEPS = {torch.float32: 1, torch.float64: 2}


def sample_static_checked(factor: Factor, check: ResidualCheck, cause: Callable[[Tensor], str], loc: Tensor,
                          sample_shape: torch.Size, generator: torch.Generator | None) -> Tensor | None:
    """:func:`sample_static_fused` with the conditioner's check: its verdict asserted on the device (on a CPU at once,
    where a failure is re-checked by :meth:`~.residual.ResidualCheck.defer`, which names the row); ``None`` where
    the sampler does not apply (not a Cholesky factor, ...)."""
    if not hasattr(factor, "L") or not hasattr(factor, "_con"):
        return None
    rtol = check_rtol(loc.dtype, loc.shape[-1])
    steps = STATIC_REFINEMENT_STEPS.get(loc.dtype, 1)
    # a factor with a fused sampler of its own (.static_dense) uses it; where that does not apply, neither does the
    # chunked one below (its factor has no per-row normalising scale c)
    own = getattr(factor, "sample_checked", None)
    done: tuple[Tensor, Tensor] | None = own(loc, sample_shape, generator, steps, rtol) if own is not None else None
    if done is None and own is None:
        done = sample_static_fused(cast(_FusedFactor, factor), loc, sample_shape, generator, steps, rtol,
                                   lambda: check.base(rtol))
    if done is None:
        return None
    z, ok = done
    if loc.device.type != "cpu":
        torch._assert_async(ok, DEFERRED_MESSAGE)
        return z
    try:
        torch._assert_async(ok, DEFERRED_MESSAGE)
    except RuntimeError:  # (at once on a CPU: the full check names the row and raises)
        return check.defer(z, cause)
    return z


@torch.no_grad()
def sample_static_fused(factor: _FusedFactor, loc: Tensor, sample_shape: torch.Size, generator: torch.Generator | None,
                        steps: int, rtol: float, base: Tensor | Callable[[], Tensor]) -> tuple[Tensor, Tensor] | None:
    """``(z, ok)``: the samples and a 0-dim bool tensor, true when every row of every vector met the check (see the
    module docstring); ``None`` where the sampler does not apply. ``steps``: refinement steps after the Matheron
    step; ``base``: :math:`\\mathrm{rtol}|k| + \\varepsilon^2(|A|\\sigma)`, float64, ``(*batch, a)`` or ``(a,)``, or a
    function giving it (called only where the sampler applies: no work for a path that falls back)."""
    con, cov = factor.constraint, factor.cov
    if (factor.precision != torch.float64 or _dense_2d(con) is None or not cov.is_diagonal
            or not hasattr(cov, "scale") or loc.dtype != factor.dtype or not loc.is_contiguous()):
        return None
    n, a = con.event_size, con.num_constraints
    batch = torch.broadcast_shapes(loc.shape[:-1], cov.batch_shape, con.batch_shape)
    if len(batch) > 1 or (len(batch) == 1 and len(sample_shape) > 0):
        return None
    count = batch.numel() if batch else torch.Size(sample_shape).numel()
    base = base() if callable(base) else base
    dense = cast("LinearConstraint", con)
    A_t, abs_A_t = dense.columns()
    A64 = cast("LinearConstraint", factor._con).A  # (the factor's constraint in its precision, float64)
    A64_t = A64.mT
    dtype = factor.dtype
    out = torch.empty(torch.Size(sample_shape) + batch + (n,), dtype=dtype, device=loc.device)
    flat = out.view(count, n)
    step = rows_per_chunk(count, n, a, loc.device, FUSED_CHUNK_ELEMS)
    v_buffer = torch.empty((step, n), dtype=torch.float64, device=loc.device)
    ok: Tensor | None = None  # (the verdicts of the chunks, and-ed on the device)
    scale, k_all, L, d = cast(_Scaled, cov).scale, con.k, factor.L, factor.d
    k64_all = cast("LinearConstraint", factor._con).k  # (k in float64: the factor's constraint's)
    per_row_scale = bool(batch) and scale.dim() > 1 and scale.shape[0] == count
    W = factor._W if factor._W is not None and factor._W.dim() == 2 else None
    variance = None if per_row_scale or W is not None else factor._cov.variance
    # float32 scales: sigma^2 / c^2 folded into the solve (below) and the product sigma^2 (A^T x'') in float64 (whose
    # range holds the square of any float32 number): no (sigma / c)^2 pass per chunk
    fold = W is None and per_row_scale and dtype == torch.float32
    # the solve with S' = D L L^T D as one Cholesky solve with the factor L_s = D L, its rows scaled once per call;
    # folded, with L_s = c D L, the factor of S = c^2 S' itself, so that x'' = S^{-1} r = x / c^2
    row_scale = None if d is None else d
    if fold:
        c64 = factor.c.to(torch.float64)
        row_scale = c64 if row_scale is None else row_scale * c64
    L_s = L if row_scale is None else row_scale.unsqueeze(-1) * L

    @overload
    def rows(t: Tensor, r0: int, r1: int, event_dims: int) -> Tensor: ...
    @overload
    def rows(t: None, r0: int, r1: int, event_dims: int) -> None: ...

    def rows(t: Tensor | None, r0: int, r1: int, event_dims: int) -> Tensor | None:
        if t is None or not batch or t.dim() == event_dims:
            return t
        return t[0] if t.shape[0] == 1 else t[r0:r1]

    for r0 in range(0, count, step):
        r1 = min(r0 + step, count)
        z = flat[r0:r1]
        z.normal_(generator=generator)
        s = rows(scale, r0, r1, 1)
        torch.addcmul(rows(loc, r0, r1, 1), z, s, out=z)
        k, k64 = rows(k_all, r0, r1, 1), rows(k64_all, r0, r1, 1)
        Lr = rows(L_s, r0, r1, 2)
        v = None if fold or not (W is None and per_row_scale) else factor._scaled_variance(r0, r1, v_buffer[:r1 - r0])
        v = variance if v is None and not fold else v
        # sigma^2 in float64, exact (a float32 number's square has at most 48 significant bits); once per chunk
        s2 = s.to(torch.float64).square() if fold else None
        for _ in range(1 + steps):
            residual = torch.addmm(k, z, A_t, alpha=-1.0).to(torch.float64)  # k - A z
            x = _cholesky_solve(Lr, residual)
            if W is not None:
                z.add_(x @ W)
            elif s2 is not None:  # z += sigma^2 (A^T x''), the product in float64, rounded once
                z.addcmul_(torch.mm(x, A64, out=v_buffer[:r1 - r0]), s2)
            else:
                assert v is not None
                z.add_((x @ A64).mul_(v))
        b = rows(base, r0, r1, 1)
        miss = torch.addmm(k64, z.to(torch.float64), A64_t, alpha=-1.0).abs_()
        size = (z.abs() @ abs_A_t).to(torch.float64)
        met = (miss <= torch.add(b, size, alpha=rtol)).all()
        ok = met if ok is None else ok & met
    if ok is None:  # (no rows)
        ok = torch.ones((), dtype=torch.bool, device=loc.device)
    return out, ok


def _cholesky_solve(L: Tensor, r: Tensor) -> Tensor:
    r""":math:`(LL^\top)^{-1}r` for ``r`` ``(rows, a)`` and a lower ``L``, ``(a, a)`` shared or ``(rows, a, a)``: one
    ``torch.cholesky_solve`` (it reads the lower triangle only)."""
    if L.dim() == 2:
        return torch.cholesky_solve(r.mT, L).mT
    return torch.cholesky_solve(r.unsqueeze(-1), L).squeeze(-1)
