r"""The mode for a general covariance (:mod:`hardeq.bounds.mode`, whose docstring has the mathematics): the
equality-constrained subproblem, the primal-dual and the primal active-set methods."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .mode_base import MAX_ACTIVE_SET_FACTOR, ModeNotFound

if TYPE_CHECKING:
    from ..linalg.covariance import Covariance

__all__ = ["active_set", "primal_dual_active_set"]


# ====================================================================== general covariance
def _eq_qp(mu: Tensor, cov: Covariance, A: Tensor, k: Tensor, W: Tensor, values: Tensor,
           batch_shape: torch.Size, determined: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    r"""The equality-constrained QP with the bounds of ``W`` as rows: :math:`z = \mu + \Sigma R^\top y`,
    :math:`(R\Sigma R^\top)y = r - R\mu`, :math:`R = [A; E_W]`, :math:`r = [k; \text{values}_W]`, batched with the
    working sets padded by zero rows; equilibrated Cholesky and two refinement steps. Returns ``(z, nu, ok)``: ``z``
    ``(*batch, n)`` (the ``W`` coordinates set to their values exactly), ``nu`` ``(*batch, n)`` the multipliers of the
    bound rows (0 off ``W``; :math:`\Sigma^{-1}(z - \mu) = A^\top\lambda + \nu`), ``ok`` ``(*batch)`` (factorised:
    the rows are independent), and with ``determined`` the mask ``(*batch, n)`` of the coordinates the rows fix
    (:func:`_determined`; ``None`` without).
    A determined coordinate's bound is a combination of the rows: adding it would make them dependent."""
    n = mu.shape[-1]
    a = A.shape[-2]
    m = int(W.sum(-1).max()) if W.numel() else 0
    order = torch.sort(W.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :m]
    valid = W.gather(-1, order)
    eye = torch.eye(n, dtype=mu.dtype, device=mu.device)
    E = eye[order] * valid.unsqueeze(-1).to(mu.dtype)
    R = torch.cat([A, E], -2)  # (*batch, a + m, n)
    picked = values.gather(-1, order)
    rhs = torch.cat([k, torch.where(valid, picked, torch.zeros_like(picked))], -1)
    SR = cov.matmul(R.mT)  # (*batch, n, a + m)
    S = R @ SR
    pad = torch.cat([torch.zeros(batch_shape + (a,), dtype=torch.bool, device=mu.device), ~valid], -1)
    S = S + torch.diag_embed(pad.to(S.dtype))
    s = S.diagonal(0, -2, -1).clamp_min(torch.finfo(S.dtype).tiny).sqrt()
    L, info = torch.linalg.cholesky_ex(S / (s.unsqueeze(-1) * s.unsqueeze(-2)))
    ok = info == 0
    if not bool(ok.all()):  # keep going for the others with a harmless factor; the caller handles ~ok
        eye_m = torch.eye(a + m, dtype=S.dtype, device=S.device)
        L = torch.where(ok.reshape(batch_shape + (1, 1)), L, eye_m)

    def sol(r: Tensor) -> Tensor:
        return torch.cholesky_solve((r / s).unsqueeze(-1), L).squeeze(-1) / s

    y = sol(rhs - (R @ mu.unsqueeze(-1)).squeeze(-1))
    z = mu + (SR @ y.unsqueeze(-1)).squeeze(-1)
    for _ in range(2):  # refinement: R z = rhs to round-off whatever the conditioning of S
        dy = sol(rhs - (R @ z.unsqueeze(-1)).squeeze(-1))
        y = y + dy
        z = z + (SR @ dy.unsqueeze(-1)).squeeze(-1)
    z = torch.where(W, values, z)
    nu = torch.zeros_like(z).scatter(-1, order, y[..., a:] * valid)
    if not determined:
        return z, nu, ok, None
    return z, nu, ok, _determined(R, pad) | W


def _determined(R: Tensor, pad: Tensor) -> Tensor:
    r"""The coordinates that the rows ``R`` ``(*batch, m, n)`` fix (``pad`` ``(*batch, m)``: the zero rows of
    padding): :math:`e_j` in the row space of ``R``, tested as
    :math:`1 - e_j^\top \hat R^\top(\hat R\hat R^\top)^{-1}\hat R e_j \le` :data:`DETERMINED_RTOL` with the rows
    scaled to unit length (:math:`\hat R`). Whether the rows fix a coordinate is a property of ``R`` alone. Measured
    in the covariance's metric instead (its conditional variance as a fraction of its variance), a coordinate whose
    variance is many decades above its neighbours' looked fixed while its step was real: it was left out of the
    ratio test, left the box, and the clamp then broke the rows. One ``m x m`` Cholesky and one ``m x n`` solve."""
    norms = R.norm(dim=-1).clamp_min(torch.finfo(R.dtype).tiny)
    Rn = R / norms.unsqueeze(-1)
    T = Rn @ Rn.mT + torch.diag_embed(pad.to(R.dtype))
    L, info = torch.linalg.cholesky_ex(T)
    eye = torch.eye(T.shape[-1], dtype=T.dtype, device=T.device)
    L = torch.where((info == 0).unsqueeze(-1).unsqueeze(-1), L, eye)  # (dependent rows: the caller refuses them)
    free = 1.0 - (Rn * torch.cholesky_solve(Rn, L)).sum(-2)
    determined: Tensor = free <= DETERMINED_RTOL
    return determined


#: iterations of the primal-dual active-set phase before the primal method takes over
MAX_PDAS = 10
#: a coordinate whose unit vector lies within this squared sine of the working rows' span (rows scaled to unit
#: length) is taken as fixed by them (its computed step is round-off; float64 leaves about 1e-16 times the
#: conditioning of the scaled rows)
DETERMINED_RTOL = 1e-10


def primal_dual_active_set(mu: Tensor, cov: Covariance, A: Tensor, k: Tensor, lo: Tensor, hi: Tensor, z0: Tensor,
                           batch_shape: torch.Size) -> tuple[Tensor, Tensor]:
    r"""Primal-dual active-set iteration (Hintermüller, Ito & Kunisch 2003) warm-started from the active set of
    ``z0``: solve the equality QP on the predicted active sets :math:`\mathcal L, \mathcal U`, then predict
    :math:`\mathcal L = \{i : \nu_i + c_i(l_i - z_i) > 0\}`, :math:`\mathcal U = \{i : -\nu_i + c_i(z_i - u_i) > 0\}`
    (:math:`c_i = 1/\Sigma_{ii}`). A repeated prediction is a KKT point (primal feasible, multipliers of the right
    sign), hence the exact mode; several bounds change per iteration. Not guaranteed to terminate for every
    :math:`\Sigma`: elements not settled after :data:`MAX_PDAS` iterations are left to :func:`active_set`.
    Returns ``(z, converged)``."""
    c = 1.0 / cov.variance.expand(mu.shape)
    W_lo, W_hi = z0 <= lo, z0 >= hi
    done = torch.zeros(batch_shape, dtype=torch.bool, device=mu.device)
    z = z0.clone()
    for _ in range(MAX_PDAS):
        W = W_lo | W_hi
        zs, nu, ok, _ = _eq_qp(mu, cov, A, k, W, torch.where(W_lo, lo, hi), batch_shape)
        new_lo = (nu + c * (lo - zs) > 0) & torch.isfinite(lo)
        new_hi = (-nu + c * (zs - hi) > 0) & torch.isfinite(hi) & ~new_lo
        settled = ok & (new_lo == W_lo).all(-1) & (new_hi == W_hi).all(-1) & ~done
        z = torch.where(settled.unsqueeze(-1), zs, z)
        done = done | settled
        if bool(done.all()):
            break
        live = (~done & ok).unsqueeze(-1)
        W_lo = torch.where(live, new_lo, W_lo)
        W_hi = torch.where(live, new_hi, W_hi)
    return z, done


def active_set(mu: Tensor, cov: Covariance, A: Tensor, k: Tensor, lo: Tensor, hi: Tensor, z0: Tensor,
               batch_shape: torch.Size, done: Tensor | None = None) -> tuple[Tensor, Tensor]:
    r"""Primal active-set method for a general covariance (module docstring), float64.

    Args:
        mu, lo, hi, z0: ``(*batch, n)``; ``z0`` feasible (in the box, on the plane).
        cov: the covariance in float64 (batch shape broadcasting with ``batch``).
        A: ``(*batch, a, n)`` dense rows; k: ``(*batch, a)``.
        done: ``(*batch)`` elements already solved (``z0`` is their mode; left as they are).

    Returns:
        ``(z, converged)``: ``z`` ``(*batch, n)``, the bounds of the final working set exactly at their values;
        ``converged`` ``(*batch)``.
    """
    n = mu.shape[-1]
    z = z0.clone()
    # working set: warm-started with the bounds active at z0, or empty where those are dependent with A
    W = (z0 <= lo) | (z0 >= hi)
    done = torch.zeros(batch_shape, dtype=torch.bool, device=mu.device) if done is None else done.clone()
    for it in range(MAX_ACTIVE_SET_FACTOR * n + 10):
        if bool(done.all()):
            break
        zs, nu, ok, fixed = _eq_qp(mu, cov, A, k, W, z, batch_shape, determined=True)
        if it == 0 and not bool(ok.all()):
            W = torch.where(ok.unsqueeze(-1), W, torch.zeros_like(W))
            zs, nu, ok, fixed = _eq_qp(mu, cov, A, k, W, z, batch_shape, determined=True)
        assert fixed is not None
        if bool((~ok & ~done).any()):
            raise ModeNotFound("the working set of the mode's active-set method became linearly dependent with A "
                               "(a degenerate polytope); no exact mode could be found.")
        p = zs - z
        # ratio test over the bounds not in the working set and not fixed by its rows (at a degenerate vertex such
        # a coordinate's step is round-off, or the start's accepted residual in float32, and its bound would make
        # the rows dependent; it is clamped below). A nearly fixed coordinate with a real step that crosses its
        # bound ends outside the acceptance level after the clamp, and truncated_mode raises: never a silent miss.
        toward_lo = (p < 0) & ~fixed & torch.isfinite(lo)
        toward_hi = (p > 0) & ~fixed & torch.isfinite(hi)
        ratio = torch.full_like(p, float("inf"))
        ratio = torch.where(toward_lo, (lo - z) / torch.where(toward_lo, p, -1.0), ratio)
        ratio = torch.where(toward_hi, (hi - z) / torch.where(toward_hi, p, 1.0), ratio)
        ratio = ratio.clamp_min(0)
        alpha, block = ratio.min(-1)
        full = alpha >= 1
        # at the working set's solution: the multipliers of the active bounds must push into the box
        at_upper = W & (z >= hi)
        signed = torch.where(at_upper, -nu, nu)  # must be >= 0 for every active bound
        tol = 1e-12 * nu.abs().amax(-1, keepdim=True)
        wrong = W & (signed < -tol)
        optimal = full & ~wrong.any(-1) & ~done
        z = torch.where(optimal.unsqueeze(-1), zs, z)
        done = done | optimal
        live = ~done
        # full step: move to zs; drop the most negative multiplier
        drop = torch.where(wrong, signed, torch.full_like(signed, float("inf"))).argmin(-1)
        W_full = W.scatter(-1, drop.unsqueeze(-1), torch.zeros_like(drop.unsqueeze(-1), dtype=torch.bool))
        # partial step: move alpha along p, add the blocking bound at its exact value
        z_part = z + alpha.clamp(0, 1).unsqueeze(-1) * p
        bound = torch.where(p.gather(-1, block.unsqueeze(-1)) < 0, lo.gather(-1, block.unsqueeze(-1)),
                            hi.gather(-1, block.unsqueeze(-1)))
        z_part = z_part.scatter(-1, block.unsqueeze(-1), bound)
        W_part = W.scatter(-1, block.unsqueeze(-1), torch.ones_like(block.unsqueeze(-1), dtype=torch.bool))
        step_full = (full & live).unsqueeze(-1)
        step_part = (~full & live).unsqueeze(-1)
        z = torch.where(step_full, zs, torch.where(step_part, z_part, z))
        W = torch.where(step_full, W_full, torch.where(step_part, W_part, W))
        z = torch.where(live.unsqueeze(-1), torch.minimum(torch.maximum(z, lo), hi), z)
    return z, done
