r"""The :math:`\Sigma`-metric nearest point of the manifold, by Newton's method on the KKT system, and its implicit
gradient.

**Problem.** For ``x`` (``(*sample, *batch, n)``):

.. math::
    z^*(x) = \arg\min_z \tfrac12 (z - x)^\top\Sigma^{-1}(z - x) \quad\text{s.t.}\quad h(z) = k,

with KKT conditions :math:`F(z, \lambda) = [\Sigma^{-1}(z - x) + J^\top\lambda;\ h(z) - k] = 0`.

**Newton step (SQP).** With :math:`c = h(z) - k`, :math:`S = J\Sigma J^\top`, the Lagrangian's Hessian
:math:`H = \Sigma^{-1} + \sum_i \lambda_i\nabla^2 h_i` and the projector :math:`P = I - \Sigma J^\top S^{-1}J` onto
:math:`\ker J`, the step is :math:`d = d_n + d_t`: the normal step :math:`d_n = -\Sigma J^\top S^{-1} c` and the
tangential step :math:`d_t \in \ker J` solving :math:`(I + P\Sigma M) d_t = -P(z - x + \Sigma M d_n)`
(:math:`M = \sum_i\lambda_i\nabla^2 h_i`, applied by Hessian-vector products) by conjugate gradients in the
:math:`\Sigma^{-1}` inner product, in which the operator is self-adjoint. No ``n x n`` matrix is formed. Where CG
meets non-positive curvature the step is the Gauss-Newton one (:math:`M = 0`: the tangent-plane conditioning
:math:`z = x - \Sigma J^\top S^{-1}(J(x - z) + c)`, always a descent direction of the merit function).
The multipliers come from the step: :math:`\lambda^+ = -S^{-1}J(z - x + d + \Sigma M d)`.

**Second chance.** Elements that reach the cap run again from a feasible start (:func:`_restore`: normal steps
with a backtracking search on the worst row): near a saddle of the distance the merit function can stall at
infeasible iterates (measured in docs/nonlinear.md). The other elements keep their result.

**Globalisation.** A backtracking (Armijo) line search on the exact :math:`\ell_1` merit function
:math:`\phi(z) = \tfrac12\|z - x\|^2_{\Sigma^{-1}} + \rho\|h(z) - k\|_1`, :math:`\rho \ge 2\|\lambda\|_\infty`, with a
second-order correction (one more normal step at the trial point) against the Maratos effect; from a feasible
iterate whose step is below :math:`\sqrt\varepsilon` (relative) full steps are taken (the merit function's changes
are round-off there). Converged: every row
feasible (:mod:`~hardeq.manifold.constraint`) and the step :math:`\|d\|_{\Sigma^{-1}} \le 10^3\,\varepsilon\,(1 +
\|z\|_{\Sigma^{-1}} + \|x\|_{\Sigma^{-1}})`; then up to two normal steps where they lower the worst row's ratio
(a margin below the tolerance: float32 iterates stop just under it). Locally quadratic; at most ``max_iter``
iterations (one host read each), then :class:`~hardeq.manifold.ManifoldError` naming the element, the row and the
residual -- which is what a
``k`` with no point on the manifold gives (e.g. :math:`|z|^2 = -1`): the merit function stalls above zero and the
iteration stops at the cap, never hangs.

**Implicit gradient.** :class:`~torch.autograd.Function` ``_Project``: with :math:`\bar g = \partial L/\partial z^*`,
solve the adjoint KKT system :math:`H u + J^\top v = \bar g`, :math:`Ju = 0` (``u`` by the same CG,
:math:`v = S^{-1}J\Sigma(\bar g - Hu)`); then :math:`\bar x = \Sigma^{-1}u`, :math:`\bar k = v`, and the covariance's
tensors get :math:`-u^\top\partial_\theta[\Sigma^{-1}(z^* - x)]`. Parameters captured inside ``h`` get no gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .constraint import ManifoldError, NonlinearConstraint, _first_bad, feasibility_tol
from .target import ManifoldTarget, TangentGram

__all__ = ["project", "kkt_solve", "hessian_vector_operator"]

#: default iteration caps
MAX_NEWTON_ITER = 100
MAX_LINE_SEARCH = 40


def hessian_vector_operator(constraint: NonlinearConstraint, z: Tensor, lam: Tensor) -> Any:
    r"""``v -> M v`` with :math:`M = \nabla^2(\lambda^\top h)(z)`, batched over the leading dimensions (one
    double-backward pass per product; :math:`M v = 0` for an affine ``h``)."""
    with torch.enable_grad():
        zz = z.detach().requires_grad_(True)
        value = constraint.value(zz)
        (g,) = torch.autograd.grad((lam.detach() * value).sum(), zz, create_graph=True)

    def apply(v: Tensor) -> Tensor:
        if not g.requires_grad:
            return torch.zeros_like(v)
        with torch.enable_grad():
            (out,) = torch.autograd.grad(g, zz, v, retain_graph=True, allow_unused=True)
        return torch.zeros_like(v) if out is None else out.detach()

    return apply


def _tangent_cg(target: ManifoldTarget, gram: TangentGram, hvp: Any, b: Tensor, max_iter: int,
                forcing: Tensor | None = None) -> tuple[Tensor, Tensor]:
    r"""Solve :math:`(I + P\Sigma M) u = b` on :math:`\ker J` (``b`` in it) by CG in the :math:`\Sigma^{-1}` inner
    product, to a relative residual ``forcing`` (per element; default ``4 eps``: an inexact Newton step uses a
    larger one far from the solution). Returns ``(u, indefinite)``; ``indefinite`` marks elements where a direction
    of non-positive curvature was met (their ``u`` is not a solution)."""
    cov = target.covariance
    u = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    rr = (r * cov.inv_matvec(r)).sum(-1)
    floor = 4 * torch.finfo(b.dtype).eps
    stop = rr * (floor if forcing is None else forcing.clamp(min=floor)) ** 2
    indefinite = torch.zeros_like(rr, dtype=torch.bool)
    for _ in range(max_iter):
        done = (rr <= stop) | indefinite
        if bool(done.all()):
            break
        Tp = p + gram.tangent(cov.matvec(hvp(p)))
        pTp = (p * cov.inv_matvec(Tp)).sum(-1)
        indefinite = indefinite | (~done & ~(pTp > 0))
        stopped = done | indefinite
        alpha = torch.where(stopped, torch.zeros_like(rr), rr / torch.where(pTp > 0, pTp, torch.ones_like(pTp)))
        u = u + alpha.unsqueeze(-1) * p
        r = r - alpha.unsqueeze(-1) * Tp
        r = gram.tangent(r)  # keep it in ker J against round-off
        rr_new = (r * cov.inv_matvec(r)).sum(-1)
        beta = torch.where(stopped, torch.zeros_like(rr), rr_new / torch.where(rr > 0, rr, torch.ones_like(rr)))
        p = torch.where((done | indefinite).unsqueeze(-1), p, r + beta.unsqueeze(-1) * p)
        rr = torch.where(done | indefinite, rr, rr_new)
    return u, indefinite


def _restore(target: ManifoldTarget, z: Tensor, max_iter: int) -> Tensor:
    r"""Feasibility first: normal (Gauss-Newton) steps :math:`z \leftarrow z - \alpha\Sigma J^\top S^{-1}(h(z) - k)`,
    :math:`\alpha` halved until the worst row's ratio decreases, until every row is feasible or ``max_iter`` steps
    (elements that do not get there are left to the SQP iteration, which reports them)."""
    con = target.constraint
    tol = feasibility_tol(z.dtype)
    for _ in range(max_iter):
        value = con.value(z)
        J = con.jacobian(z).detach()
        worst = con.row_ratio(z, value, J).amax(-1)
        active = ~(worst <= tol)
        if not bool(active.any()):
            break
        try:
            d_n = -TangentGram(J, target.sigma_rows(J)).gain(value - con.k)
        except ManifoldError:
            break  # (a singular Jacobian: the SQP iteration names the element)
        alpha = torch.ones_like(worst)
        moved = ~active
        z_new = z
        for _ in range(30):
            cand = z + alpha.unsqueeze(-1) * d_n
            better = con.row_ratio(cand).amax(-1) < worst
            take = better & ~moved
            z_new = torch.where(take.unsqueeze(-1), cand, z_new)
            moved = moved | better
            if bool(moved.all()):
                break
            alpha = torch.where(moved, alpha, alpha / 2)
        if not bool((moved & active).any()):
            break
        z = z_new
    return z


def _polish(target: ManifoldTarget, z: Tensor, converged: Tensor, steps: int = 2) -> Tensor:
    r"""A margin below the tolerance: up to ``steps`` normal steps :math:`z - \Sigma J^\top S^{-1}(h(z) - k)` on the
    converged elements, each kept only where it lowers the worst row's ratio (the SQP stops as soon as every row
    is feasible, which in float32 can be just under the tolerance; the step moves ``z`` by the size of the
    residual, far below the distance's own round-off)."""
    con = target.constraint
    tol = feasibility_tol(z.dtype)
    for _ in range(steps):
        value = con.value(z)
        J = con.jacobian(z).detach()
        worst = con.row_ratio(z, value, J).amax(-1)
        active = converged & (worst > tol / 16)
        if not bool(active.any()):
            break
        try:
            cand = z - TangentGram(J, target.sigma_rows(J)).gain(value - con.k)
        except ManifoldError:
            break
        better = active & (con.row_ratio(cand).amax(-1) < worst)
        z = torch.where(better.unsqueeze(-1), cand, z)
    return z


def _merit(target: ManifoldTarget, z: Tensor, x: Tensor, rho: Tensor) -> tuple[Tensor, Tensor]:
    c = target.constraint.residual(z)
    return 0.5 * target.covariance.inv_quad(z - x) + rho * c.abs().sum(-1), c


def kkt_solve(target: ManifoldTarget, x: Tensor, *, z0: Tensor | None = None, max_iter: int = MAX_NEWTON_ITER,
              newton: bool = True, what: str = "project") -> tuple[Tensor, Tensor]:
    r"""The nearest point ``z`` of the manifold to ``x`` in the :math:`\Sigma^{-1}` metric and its multipliers
    ``lam``, without gradient (module docstring). ``x``: ``(*sample, *batch, n)`` broadcastable with the target's
    batch; returns ``z`` ``(*sample, *batch, n)`` and ``lam`` ``(*sample, *batch, a)``.

    Args:
        z0: a starting point (default ``x``).
        max_iter: cap on Newton iterations.
        newton: use the Lagrangian's curvature (Newton-CG); ``False`` gives Gauss-Newton (linear convergence).

    Raises:
        ManifoldError: not converged within ``max_iter`` (no point of the manifold, or a singular Jacobian); the
            message names the batch element, the worst row and its residual.
    """
    con = target.constraint
    shape = torch.broadcast_shapes(x.shape, target.batch_shape + (target.n,))
    x = x.detach().expand(shape)
    start = (x if z0 is None else z0.detach().expand(shape)).clone()
    z, lam, converged = _sqp(target, x, start, max_iter, newton, what)
    if not bool(converged.all()):
        # a second chance for the elements that did not converge, from a feasible start (normal steps first):
        # near a saddle of the distance the merit function can stall at infeasible iterates
        retry = torch.where(converged.unsqueeze(-1), z, _restore(target, start, max_iter // 2))
        z2, lam2, converged2 = _sqp(target, x, retry, max_iter, newton, what)
        keep = converged.unsqueeze(-1)
        z, lam = torch.where(keep, z, z2), torch.where(keep, lam, lam2)
        converged = converged | converged2
    z = _polish(target, z, converged)
    tol = feasibility_tol(x.dtype)
    if not bool(converged.all()):
        bad = ~converged
        ratio = con.row_ratio(z).expand(shape[:-1] + (con.num_constraints,))
        where = _first_bad(bad) if bad.dim() else ()
        row = int(ratio[where].argmax())
        res = float(con.residual(z).expand(ratio.shape)[where + (row,)])
        raise ManifoldError(
            f"{what} did not converge in {max_iter} Newton iterations at batch index {where} "
            f"({int(bad.sum())} element(s) fail): row {row} has |h(z) - k| = {abs(res):.3e}, "
            f"{float(ratio[where + (row,)]):.3e} times its scale (tol {tol:.0e}). Either no point of the manifold "
            "h(z) = k exists there (check k), the Jacobian is singular near the iterate, or x is so far from the "
            "manifold that the iteration sits near a saddle of the distance (raise max_iter, or start nearer).")
    return z, lam


def _sqp(target: ManifoldTarget, x: Tensor, z: Tensor, max_iter: int, newton: bool, what: str
         ) -> tuple[Tensor, Tensor, Tensor]:
    """The SQP iteration of :func:`kkt_solve` from ``z``; returns ``(z, lam, converged)``."""
    con, cov = target.constraint, target.covariance
    shape = x.shape
    eps = torch.finfo(x.dtype).eps
    tol = feasibility_tol(x.dtype)
    x_norm = cov.inv_quad(x).sqrt()
    rho = torch.zeros(shape[:-1], dtype=x.dtype, device=x.device)
    lam = torch.zeros(shape[:-1] + (con.num_constraints,), dtype=x.dtype, device=x.device)
    converged = torch.zeros(shape[:-1], dtype=torch.bool, device=x.device)
    cg_iter = min(max(target.n - con.num_constraints, 1) + 2, 60)
    for _ in range(max_iter):
        c = con.residual(z)
        J = con.jacobian(z).detach()
        gram = TangentGram(J, target.sigma_rows(J), what=f"J at the iterate of {what}")
        d_n = -gram.gain(c)
        zx = z - x
        if newton:
            hvp = hessian_vector_operator(con, z, lam)
            b = -gram.tangent(zx + cov.matvec(hvp(d_n)))
            # inexact Newton (Eisenstat-Walker): CG to a relative residual sqrt(|b| / (1 + |z - x|)), at most 1/2,
            # which keeps the local convergence superlinear and spends few CG steps far from the solution
            b_norm = (b * cov.inv_matvec(b)).sum(-1).clamp(min=0).sqrt()
            forcing = (b_norm / (1 + cov.inv_quad(zx).clamp(min=0).sqrt())).sqrt().clamp(max=0.5)
            d_t, indefinite = _tangent_cg(target, gram, hvp, b, cg_iter, forcing)
            d_gn = -gram.tangent(zx)  # the Gauss-Newton tangential step (M = 0)
            d_t = torch.where(indefinite.unsqueeze(-1), d_gn, d_t)
            d = d_n + d_t
            Md = hvp(d)
            lam_new = -gram.solve(gram.jv(zx + d + torch.where(indefinite.unsqueeze(-1), torch.zeros_like(Md),
                                                                 cov.matvec(Md))))
        else:
            d = d_n - gram.tangent(zx)
            lam_new = -gram.solve(gram.jv(zx + d))
        # convergence: feasible now and the step is round-off
        step = cov.inv_quad(d).sqrt()
        feasible = (con.row_ratio(z, c + con.k, J) <= tol).all(-1)
        size = 1 + cov.inv_quad(z).sqrt() + x_norm
        small = step <= 1e3 * eps * size
        converged = converged | (feasible & small)
        if bool(converged.all()):
            break
        # the local phase: feasible and a step below sqrt(eps) -- full Newton steps, no line search (the merit
        # function's changes are round-off there, and the line search could refuse every step)
        local = feasible & (step <= eps ** 0.5 * size) & ~converged
        # line search on the l1 merit, with a second-order correction
        rho = torch.maximum(rho, 2 * lam_new.abs().amax(-1))
        phi0, _ = _merit(target, z, x, rho)
        slope = (d * cov.inv_matvec(zx)).sum(-1) - rho * c.abs().sum(-1)
        alpha = torch.ones_like(rho)
        accepted = converged | local
        z_new = torch.where(local.unsqueeze(-1), z + d, z)
        for trial in range(MAX_LINE_SEARCH):
            cand = z + alpha.unsqueeze(-1) * d
            phi, c_cand = _merit(target, cand, x, rho)
            ok = phi <= phi0 + 1e-4 * alpha * slope + 4 * eps * phi0.abs()
            if trial == 0:  # second-order correction of the full step
                soc = cand - gram.gain(c_cand)
                phi_soc, _ = _merit(target, soc, x, rho)
                ok_soc = ~ok & (phi_soc <= phi0 + 1e-4 * slope + 4 * eps * phi0.abs())
                cand = torch.where(ok_soc.unsqueeze(-1), soc, cand)
                ok = ok | ok_soc
            take = ok & ~accepted
            z_new = torch.where(take.unsqueeze(-1), cand, z_new)
            accepted = accepted | ok
            if bool(accepted.all()):
                break
            alpha = torch.where(accepted, alpha, alpha / 2)
        z = torch.where(converged.unsqueeze(-1), z, z_new)
        lam = torch.where(converged.unsqueeze(-1), lam, lam_new)
    return z, lam, converged


class _Project(torch.autograd.Function):
    """``z* = project(x)`` with the implicit (KKT adjoint) backward; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, target: ManifoldTarget, max_iter: int, x: Tensor, k: Tensor,
                *cov_tensors: Tensor) -> Tensor:
        z, lam = kkt_solve(target, x, max_iter=max_iter)
        ctx.target = target
        ctx.save_for_backward(x, z, lam)
        return z

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        target: ManifoldTarget = ctx.target
        x, z, lam = ctx.saved_tensors
        con, cov = target.constraint, target.covariance
        J = con.jacobian(z).detach()
        gram = TangentGram(J, target.sigma_rows(J), what="J at the projection")
        hvp = hessian_vector_operator(con, z, lam)
        b = gram.tangent(cov.matvec(grad))
        u, indefinite = _tangent_cg(target, gram, hvp, b, max(2 * (target.n - con.num_constraints), 4) + 10)
        if bool(indefinite.any()):
            raise ManifoldError(f"the projection at batch index {_first_bad(indefinite)} is not a strict local "
                                "minimum (the Lagrangian's Hessian is not positive on the tangent space): its "
                                "gradient is undefined.")
        Hu = cov.inv_matvec(u) + hvp(u)
        v = gram.solve(gram.jv(cov.matvec(grad - Hu)))
        x_grad = cov.inv_matvec(u) if ctx.needs_input_grad[2] else None
        k_grad = v if ctx.needs_input_grad[3] else None
        cov_grads: list[Tensor | None] = [None] * (len(ctx.needs_input_grad) - 4)
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[4:]) if need]
        if wanted:
            tensors = [t.detach().requires_grad_(True) for t in cov.tensors()]
            with torch.enable_grad():
                F1 = cov.with_tensors(*tensors).inv_matvec(z - x)
                grads = torch.autograd.grad(F1, [tensors[i] for i in wanted], -u, allow_unused=True)
            for i, g in zip(wanted, grads):
                cov_grads[i] = g
        return (None, None, _sum_to(x_grad, x.shape), _sum_to(k_grad, con.k.shape), *(
            None if g is None else _sum_to(g, t.shape) for g, t in zip(cov_grads, cov.tensors())))


def _sum_to(g: Tensor | None, shape: torch.Size) -> Tensor | None:
    """``g`` summed over the dimensions broadcasting added (a gradient w.r.t. a broadcast input)."""
    if g is None:
        return None
    lead = g.dim() - len(shape)
    if lead > 0:
        g = g.sum(tuple(range(lead)))
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    return g.sum(dims, keepdim=True) if dims else g


def project(target: ManifoldTarget, x: Tensor, *, max_iter: int = MAX_NEWTON_ITER) -> Tensor:
    r"""The :math:`\Sigma^{-1}`-metric nearest point of :math:`\{h = k\}` to ``x`` (``(*sample, *batch, n)``),
    differentiable by implicit differentiation w.r.t. ``x``, ``k`` and the covariance's tensors (module docstring).
    Every row of every element meets the feasibility tolerance, or :class:`~hardeq.manifold.ManifoldError` names
    the first that does not."""
    cov_tensors = target.covariance.tensors()
    z: Tensor = _Project.apply(  # type: ignore[no-untyped-call]  # torch: Function.apply unannotated
        target, max_iter, x, target.constraint.k, *cov_tensors)
    return z
