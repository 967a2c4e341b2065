r"""Constrained Hamiltonian Monte Carlo on :math:`\mathcal M = \{h(z) = k\}` (RATTLE with a reversibility check).

**Target.** Conditioning :math:`z \sim \mathcal N(\mu, \Sigma)` on :math:`h(z) = k` (as the limit of
:math:`|h(z) - k| < \epsilon`) gives, by the co-area formula, the density with respect to the surface (Hausdorff)
measure of :math:`\mathcal M` proportional to :math:`\mathcal N(z; \mu, \Sigma) / \sqrt{\det J J^\top}`
(docs/nonlinear.md). The chain moves in whitened coordinates :math:`u \in \mathbb R^m`, :math:`z = \mu + Fu`
(:math:`\Sigma = FF^\top`, ``F``: ``n x m``, the covariance's square root), where the same conditioning of
:math:`u \sim \mathcal N(0, I_m)` on :math:`g(u) = h(\mu + Fu) = k` has, with :math:`G = JF`, the density
:math:`\propto e^{-|u|^2/2} / \sqrt{\det GG^\top}` w.r.t. the Hausdorff measure of :math:`\{g = k\}` in ``u``
(its image under :math:`u \mapsto z` is the law above). So the potential is

.. math:: U(u) = \tfrac12|u|^2 + \tfrac12\log\det(J\Sigma J^\top)(\mu + Fu),

with identity mass: RATTLE with identity mass is symplectic on the cotangent bundle of the manifold in the
coordinates it moves in, so with the Metropolis test its stationary law is :math:`e^{-U}` w.r.t. the Hausdorff
measure in ``u`` -- exactly the conditional law.

**One step** (Leimkuhler and Reich 2004, *Simulating Hamiltonian Dynamics*, ch. 7; the reversibility check of Zappa,
Holmes-Cerfon and Goodman 2018, *Monte Carlo on manifolds: sampling densities and integrating functions*, and
Lelièvre, Rousset and Stoltz 2019): with :math:`P_q` the orthogonal projection onto :math:`\ker G(q)`,

1. :math:`v = P_{q_0}(p_0 - \tfrac\epsilon2\nabla U(q_0))`;
2. :math:`q_1 = q_0 + \epsilon v + G(q_0)^\top\nu` with :math:`g(q_1) = k` (Newton in :math:`\nu \in \mathbb R^a`,
   matrix :math:`G(q_1)G(q_0)^\top`, until every row is within a sixteenth of the per-row tolerance; it fails when the
   worst row's ratio stops halving after three iterations, or after 30);
3. reversibility: the same position step from :math:`(q_1, -P_{q_1}(q_1 - q_0)/\epsilon)` must return to
   :math:`q_0` (within ``100 tol (1 + |q_0|_\infty)``); otherwise, or when a Newton solve fails, the whole
   trajectory is rejected (this keeps the map reversible where the projection has several solutions);
4. :math:`p_1 = P_{q_1}((q_1 - q_0)/\epsilon - \tfrac\epsilon2\nabla U(q_1))`.

A trajectory of ``L`` steps (``L`` uniform in ``1..num_steps`` per iteration, shared by the chains: a random
number independent of the state keeps detailed balance) ends in a Metropolis test on
:math:`H = U(q) + \tfrac12|p|^2`; the momentum is refreshed each iteration, :math:`p = P_q\xi`,
:math:`\xi \sim \mathcal N(0, I_m)`. During burn-in the step size of each batch element is adapted towards an
acceptance of 0.8 (Robbins-Monro on :math:`\log\epsilon`), then frozen.

Cost per leapfrog step and chain: two Newton solves (a few ``h`` and ``J`` evaluations, ``a x a`` solves), one
gradient of :math:`\log\det J\Sigma J^\top` (second derivatives of ``h`` by autograd); no ``n x n`` matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..bounds.diagnostics import effective_sample_size, split_rhat
from .constraint import feasibility_tol
from .target import ManifoldTarget, TangentGram

__all__ = ["HMCResult", "manifold_hmc"]

#: Newton iterations of one position projection
MAX_PROJECTION_ITER = 30


@dataclass
class HMCResult:
    """Output of :func:`manifold_hmc`.

    Attributes:
        samples: ``(draws, chains, *batch, n)``, every row of every draw feasible.
        acceptance: ``(*batch)`` mean Metropolis acceptance after burn-in (rejected trajectories count as 0).
        reversibility_rejections: ``(*batch)`` fraction of post-burn-in trajectories rejected because a projection
            failed or was not reversible.
        step_size: ``(*batch)`` the step size used after burn-in.
        ess, rhat: ``(*batch, n)`` effective sample size and split R-hat (``hardeq.bounds.diagnostics``).
    """

    samples: Tensor
    acceptance: Tensor
    reversibility_rejections: Tensor
    step_size: Tensor
    ess: Tensor
    rhat: Tensor


class _Whitened:
    """The target in whitened coordinates ``u`` (``z = loc + F u``)."""

    def __init__(self, target: ManifoldTarget) -> None:
        self.t = target
        self.con = target.constraint
        self.cov = target.covariance

    def z(self, u: Tensor) -> Tensor:
        return self.t.loc + self.cov.sqrt_matvec(u)

    def u_of(self, z: Tensor) -> Tensor:
        """A preimage ``u = F^T Sigma^-1 (z - loc)`` (``F u = z - loc``)."""
        w = self.cov.inv_matvec(z - self.t.loc)
        return self.cov.sqrt_t_matmul(w.unsqueeze(-1)).squeeze(-1)

    def G(self, u: Tensor) -> Tensor:
        return self.t.sqrt_t_rows(self.con.jacobian(self.z(u)).detach())

    def potential_and_grad(self, u: Tensor) -> tuple[Tensor, Tensor]:
        r""":math:`U(u)` and :math:`\nabla U(u)` (``log det`` of :math:`G G^\top` by a float64 Cholesky)."""
        with torch.enable_grad():
            uu = u.detach().requires_grad_(True)
            G = self.t.sqrt_t_rows(self.con.jacobian(self.z(uu)))
            S = (G @ G.mT).to(torch.float64)
            L, info = torch.linalg.cholesky_ex(S)
            half_logdet = L.diagonal(dim1=-2, dim2=-1).log().sum(-1)
            g = torch.autograd.grad(half_logdet.sum(), uu, allow_unused=True)[0] if half_logdet.requires_grad \
                else None  # (an affine h: a constant Gram matrix)
        grad = uu.detach() if g is None else uu.detach() + g
        U = 0.5 * u.square().sum(-1) + half_logdet.detach().to(u.dtype)
        return U, grad

    def position_step(self, q0: Tensor, G0: Tensor, v: Tensor, eps: Tensor, active: Tensor
                      ) -> tuple[Tensor, Tensor]:
        r"""Solve :math:`g(q_0 + \epsilon v + G_0^\top\nu) = k` by Newton; returns ``(q1, ok)``."""
        base = q0 + eps.unsqueeze(-1) * v
        nu = torch.zeros(q0.shape[:-1] + (G0.shape[-2],), dtype=q0.dtype, device=q0.device)
        tol = feasibility_tol(q0.dtype)
        done = ~active
        ok = torch.zeros_like(done)
        q = base
        previous = torch.full(done.shape, math.inf, dtype=q0.dtype, device=q0.device)
        for i in range(MAX_PROJECTION_ITER):
            z = self.z(q)
            value = self.con.value(z)
            J = self.con.jacobian(z).detach()
            worst = self.con.row_ratio(z, value, J).amax(-1)
            ok = torch.where(done, ok, worst <= tol)
            # stop at a sixteenth of the tolerance (a margin); failure: not finite, or (past the first steps) not
            # contracting -- no nearby solution along G0^T
            stalled = ~torch.isfinite(worst) | ((i >= 3) & (worst > 0.5 * previous))
            done = done | (worst <= tol / 16) | stalled
            previous = worst
            if bool(done.all()):
                break
            M = (self.t.sqrt_t_rows(J) @ G0.mT).to(torch.float64)
            step, info = torch.linalg.solve_ex(M, (self.con.k - value).to(torch.float64))
            good = (info == 0) & torch.isfinite(step).all(-1)
            done = done | ~good
            nu = torch.where(done.unsqueeze(-1), nu, nu + step.to(q0.dtype))
            q = base + (nu.unsqueeze(-2) @ G0).squeeze(-2)
        return q, ok & active & done  # (an element still iterating at the cap was not checked at its last q)


def _proj(G: Tensor, v: Tensor) -> Tensor:
    return TangentGram(G, G, what="G = J F").tangent(v)


@torch.no_grad()
def manifold_hmc(target: ManifoldTarget, start: Tensor, *, num_samples: int, burn_in: int = 100, thin: int = 1,
                 step_size: float = 0.3, num_steps: int = 8, target_acceptance: float = 0.8,
                 generator: torch.Generator | None = None) -> HMCResult:
    r"""Constrained HMC (module docstring) from feasible ``start`` (``(chains, *batch, n)``).

    Args:
        num_samples: draws kept per chain; burn_in: trajectories discarded (and used to adapt the step size);
        thin: keep every ``thin``-th trajectory.
        step_size: initial step size in whitened units; num_steps: the largest number of leapfrog steps of a
            trajectory (uniform in ``1..num_steps``).
        target_acceptance: the acceptance the burn-in adaptation aims at.

    Raises:
        ManifoldError: ``start`` is not feasible, or ``J Sigma J^T`` is singular at a state.
    """
    for name, value in (("num_samples", num_samples), ("num_steps", num_steps), ("thin", thin)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    if isinstance(burn_in, bool) or not isinstance(burn_in, int) or burn_in < 0:
        raise ValueError(f"burn_in must be a non-negative int, got {burn_in!r}.")
    if not (isinstance(step_size, (int, float)) and step_size > 0 and math.isfinite(step_size)):
        raise ValueError(f"step_size must be a positive finite number, got {step_size!r}.")
    w = _Whitened(target)
    target.constraint.assert_feasible(start, "the HMC start")
    q = w.u_of(start)
    chains_batch = q.shape[:-1]
    batch = target.batch_shape
    dtype, device = q.dtype, q.device
    draw_device = device if generator is None else generator.device  # (a CPU generator drives a CUDA chain too)
    log_eps = torch.full(batch, math.log(step_size), dtype=torch.float64, device=device)
    U, grad = w.potential_and_grad(q)
    G = w.G(q)
    tol = 100 * feasibility_tol(dtype)
    kept: list[Tensor] = []
    acc_sum = torch.zeros(chains_batch, dtype=torch.float64, device=device)
    rev_sum = torch.zeros_like(acc_sum)
    n_kept_iter = 0
    total = burn_in + num_samples * thin
    for it in range(total):
        xi = torch.randn(q.shape, dtype=dtype, device=draw_device, generator=generator).to(device)
        p = _proj(G, xi)
        H0 = U + 0.5 * p.square().sum(-1)
        L = int(torch.randint(1, num_steps + 1, (), device=draw_device, generator=generator))
        jitter = 0.9 + 0.2 * torch.rand((), dtype=torch.float64, device=draw_device, generator=generator).item()
        eps = (log_eps.exp() * jitter).to(dtype).expand(chains_batch)
        qc, pc, Uc, gc, Gc = q, p, U, grad, G
        alive = torch.ones(chains_batch, dtype=torch.bool, device=device)
        for _ in range(L):
            v = _proj(Gc, pc - 0.5 * eps.unsqueeze(-1) * gc)
            q1, ok = w.position_step(qc, Gc, v, eps, alive)
            q1 = torch.where(ok.unsqueeze(-1), q1, qc)
            G1 = w.G(q1)
            p_half = (q1 - qc) / eps.unsqueeze(-1)
            back, ok_back = w.position_step(q1, G1, -_proj(G1, p_half), eps, ok)
            reversible = ok_back & ((back - qc).abs().amax(-1) <= tol * (1 + qc.abs().amax(-1)))
            alive = alive & ok & reversible
            U1, g1 = w.potential_and_grad(q1)
            p1 = _proj(G1, p_half - 0.5 * eps.unsqueeze(-1) * g1)
            keep = alive.unsqueeze(-1)
            qc, pc = torch.where(keep, q1, qc), torch.where(keep, p1, pc)
            Uc, gc, Gc = torch.where(alive, U1, Uc), torch.where(keep, g1, gc), torch.where(keep.unsqueeze(-1), G1, Gc)
        H1 = Uc + 0.5 * pc.square().sum(-1)
        log_ratio = (H0 - H1).to(torch.float64)
        prob = torch.where(alive & torch.isfinite(log_ratio), log_ratio.clamp(max=0).exp(), torch.zeros_like(log_ratio))
        accept = torch.rand(prob.shape, dtype=torch.float64, device=draw_device, generator=generator).to(device) < prob
        q = torch.where(accept.unsqueeze(-1), qc, q)
        U, grad = torch.where(accept, Uc, U), torch.where(accept.unsqueeze(-1), gc, grad)
        G = torch.where(accept.unsqueeze(-1).unsqueeze(-1), Gc, G)
        if it < burn_in:
            rate = 1.0 / (it + 1) ** 0.6
            log_eps = log_eps + rate * (prob.mean(0) - target_acceptance)
        else:
            acc_sum += prob
            rev_sum += (~alive).to(torch.float64)
            n_kept_iter += 1
            if (it - burn_in + 1) % thin == 0:
                kept.append(w.z(q))
    samples = torch.stack(kept)
    target.constraint.assert_feasible(samples, "an HMC draw")
    denom = max(n_kept_iter, 1)
    return HMCResult(samples, (acc_sum / denom).mean(0), (rev_sum / denom).mean(0), log_eps.exp(),
                     effective_sample_size(samples) if samples.shape[0] >= 4 else torch.full(
                         samples.shape[2:], float("nan"), dtype=torch.float64),
                     split_rhat(samples) if samples.shape[0] >= 4 else torch.full(
                         samples.shape[2:], float("nan"), dtype=torch.float64))
