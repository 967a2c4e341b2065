r"""The ``"linearised"`` sampler: condition on the tangent plane at the mode, then return each draw to the manifold.

With :math:`z^*` the mode (the :math:`\Sigma`-nearest point of :math:`\mathcal M` to :math:`\mu`), :math:`J_* =
J(z^*)` and :math:`N = \Sigma J_*^\top` (``n x a``):

1. :math:`y \sim \mathcal N(\mu, \Sigma) \mid J_* y = J_* z^*` -- the linear conditional on the tangent plane, by
   :class:`~hardeq.ConstrainedNormal` with :class:`~hardeq.LinearConstraint` (Matheron's rule, exact per row);
2. :math:`z = y + N\nu` with :math:`h(z) = k`: Newton in the normal-space coordinates :math:`\nu \in \mathbb R^a`
   (matrix :math:`J(z)N`), from :math:`\nu = 0`. This is the direction Matheron's update moves along, so for an
   affine ``h`` step 2 is the identity and the law is exact. A draw for which Newton does not converge (no point of
   :math:`\mathcal M` on :math:`y + \mathrm{range}(N)` nearby) is projected instead
   (:func:`~hardeq.manifold.project`, the :math:`\Sigma`-nearest point).

Every draw meets every row of :math:`h(z) = k` (per-row tolerance); the law is that of the return map applied to the
tangent-plane Gaussian, an approximation of the conditional law whose error grows with the curvature of
:math:`\mathcal M` over the spread of the draws (measured in docs/nonlinear.md).

**Density of the law on** :math:`\mathcal M` (w.r.t. its Hausdorff measure), where the return map is used: the
oblique projection :math:`\pi(z) = z - N(J_*N)^{-1}J_*(z - z^*)` maps :math:`\mathcal M` back to the plane with
area factor :math:`\frac{|\det J(z)N|/\sqrt{\det J(z)J(z)^\top}}{|\det J_*N|/\sqrt{\det J_*J_*^\top}}` (for an
orthonormal basis ``T`` of :math:`\ker J`, :math:`|\det[T, N]| = |\det JN| / \sqrt{\det JJ^\top}`), so
:math:`q(z) = q_{\text{plane}}(\pi(z))\times` that factor. :func:`importance_weights` uses it.

**Gradient.** :math:`\nu` is differentiated implicitly: :math:`z = y + N(\nu^* + M^{-1}(k - h(y + N\nu^*)))` with
:math:`\nu^*` and :math:`M = J(z)N` detached has the exact first derivatives of the solution map (its derivative
in :math:`\nu` vanishes at the solution), w.r.t. ``y``, ``N`` (through the mode) and ``k``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..constraints import LinearConstraint
from ..distributions.normal import ConstrainedNormal
from .constraint import feasibility_tol
from .projection import project
from .target import ManifoldTarget, TangentGram

__all__ = ["tangent_distribution", "return_to_manifold", "linearised_rsample", "importance_weights"]

MAX_RETURN_ITER = 30


def tangent_distribution(target: ManifoldTarget, mode: Tensor) -> tuple[ConstrainedNormal, Tensor]:
    r"""The linear conditional :math:`\mathcal N(\mu, \Sigma) \mid J_* y = J_* z^*` and :math:`J_*`
    (``(*batch, a, n)``)."""
    J = target.constraint.jacobian(mode)
    k_lin = (J @ mode.unsqueeze(-1)).squeeze(-1)
    plane = LinearConstraint(J, k_lin, validate_args=False)
    return ConstrainedNormal(target.loc, covariance=target.covariance, constraint=plane, validate_args=False), J


def return_to_manifold(target: ManifoldTarget, y: Tensor, N_rows: Tensor) -> tuple[Tensor, Tensor]:
    r"""Newton for :math:`h(y + N\nu) = k` (``N_rows`` = :math:`N^\top`, ``(*batch, a, n)``), without gradient.
    Returns ``(nu, ok)``; ``ok`` marks the draws that converged to the per-row tolerance."""
    con = target.constraint
    tol = feasibility_tol(y.dtype)
    with torch.no_grad():
        y, N_rows = y.detach(), N_rows.detach()
        nu = torch.zeros(y.shape[:-1] + (con.num_constraints,), dtype=y.dtype, device=y.device)
        done = torch.zeros(y.shape[:-1], dtype=torch.bool, device=y.device)
        ok = torch.zeros_like(done)
        previous = torch.full(done.shape, math.inf, dtype=y.dtype, device=y.device)
        for i in range(MAX_RETURN_ITER):
            z = y + (nu.unsqueeze(-2) @ N_rows).squeeze(-2)
            value = con.value(z)
            J = con.jacobian(z)
            ratio = con.row_ratio(z, value, J)
            worst = ratio.amax(-1)
            ok = torch.where(done, ok, worst <= tol)
            # stop at a sixteenth of the tolerance (a margin, one quadratic step more), or when not contracting
            done = done | (worst <= tol / 16) | ~torch.isfinite(worst) | ((i >= 3) & (worst > 0.5 * previous))
            previous = worst
            if bool(done.all()):
                break
            M = (J @ N_rows.mT).to(torch.float64)
            step, info = torch.linalg.solve_ex(M, (con.k - value).to(torch.float64))
            good = (info == 0) & torch.isfinite(step).all(-1)
            done = done | ~good
            nu = torch.where(done.unsqueeze(-1), nu, nu + step.to(y.dtype))
        ok = ok & done  # (an element still iterating at the cap was not checked at its last nu)
    return nu, ok


def _implicit(target: ManifoldTarget, y: Tensor, N_rows: Tensor, nu: Tensor) -> Tensor:
    """``y + N nu`` with the implicit first derivatives of the solution ``nu`` (module docstring)."""
    con = target.constraint
    nu = nu.detach()
    z_star = y + (nu.unsqueeze(-2) @ N_rows).squeeze(-2)
    if not (y.requires_grad or N_rows.requires_grad or con.k.requires_grad):
        return z_star.detach()
    with torch.no_grad():
        M = (con.jacobian(z_star.detach()) @ N_rows.detach().mT).to(torch.float64)
    r = con.k - con.value(z_star)
    nu_full = nu + torch.linalg.solve(M, r.to(torch.float64)).to(y.dtype)
    out: Tensor = y + (nu_full.unsqueeze(-2) @ N_rows).squeeze(-2)
    return out


def linearised_rsample(target: ManifoldTarget, mode: Tensor, sample_shape: torch.Size,
                       noise: Tensor | None = None) -> Tensor:
    """Draws ``sample_shape + batch_shape + (n,)`` of the linearised law (module docstring), differentiable."""
    plane, J = tangent_distribution(target, mode)
    y = plane.rsample(sample_shape) if noise is None else plane.rsample(sample_shape, noise=noise)
    N_rows = target.sigma_rows(J)
    y = y.expand(torch.broadcast_shapes(y.shape, sample_shape + target.batch_shape + (target.n,)))
    nu, ok = return_to_manifold(target, y, N_rows)
    z = _implicit(target, y, N_rows, nu)
    if not bool(ok.all()):  # draws with no solution along the normal space: the Sigma-nearest point instead
        x = torch.where(ok.unsqueeze(-1), z.detach(), y)  # (a feasible z is its own nearest point: no iterations)
        z = torch.where(ok.unsqueeze(-1), z, project(target, x))
    target.constraint.assert_feasible(z.detach(), "a linearised draw")
    return z


def importance_weights(target: ManifoldTarget, mode: Tensor, num_samples: int,
                       generator: torch.Generator | None = None) -> Tensor:
    r"""Log importance weights :math:`\log w = \log\mathcal N(z) - \log\mathcal N(y) + \log\det S_* -
    \log|\det J(z)\Sigma J_*^\top|` of ``num_samples`` draws, ``(num_samples, *batch)``: with the tangent-plane
    normaliser :math:`Z_* = \mathcal N(J_*z^*; J_*\mu, S_*)`, :math:`Z = Z_*\,\mathbb E[w]` is the normaliser of
    :math:`\mathcal N(z;\mu,\Sigma)/\sqrt{\det JJ^\top}` over the part of :math:`\mathcal M` that the return map
    reaches (a draw whose Newton solve fails has weight 0: it has no image)."""
    del generator  # (the linear sampler draws from torch's global generator)
    with torch.no_grad():
        plane, J = tangent_distribution(target, mode)
        y = plane.sample((num_samples,))
        y = y.expand(torch.broadcast_shapes(y.shape, (num_samples,) + target.batch_shape + (target.n,)))
        N_rows = target.sigma_rows(J)
        nu, ok = return_to_manifold(target, y, N_rows)
        z = y + (nu.unsqueeze(-2) @ N_rows).squeeze(-2)
        cov = target.covariance
        dlog_n = -0.5 * (cov.inv_quad(z - target.loc) - cov.inv_quad(y - target.loc)).to(torch.float64)
        logdet_s = TangentGram(J, N_rows).logdet()
        Jz = target.constraint.jacobian(z)
        M = (Jz @ N_rows.mT).to(torch.float64)
        log_w = dlog_n + logdet_s - torch.linalg.slogdet(M).logabsdet
        return torch.where(ok, log_w, torch.full_like(log_w, -math.inf))
