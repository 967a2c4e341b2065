r"""The mode of a Gaussian conditioned on :math:`Az = k` and truncated to a box: an exact quadratic program.

.. math::
    z^\star = \arg\min_z\ (z - \mu)^\top\Sigma^{-1}(z - \mu)
    \quad\text{s.t.}\quad Az = k,\qquad l \le z \le u,

the projection of :math:`\mu` in the covariance metric onto the polytope :math:`\{Az = k\}\cap[l, u]`. It is
strictly convex, so the minimiser is unique, and it is the solution of the *equality-constrained* problem on its
own active set (the coordinates at a bound); every algorithm here finds that active set and finishes with an exact
solve on it, in float64.

**Diagonal** :math:`\Sigma = \mathrm{diag}(v)` (any constraint). The KKT conditions give
:math:`z(\lambda) = \mathrm{clip}(\mu + v \odot A^\top\lambda,\ l,\ u)` for the equality multipliers
:math:`\lambda \in \mathbb R^a`, which solve the piecewise-linear system :math:`F(\lambda) = Az(\lambda) - k = 0`.
:math:`F` is minus the gradient of the concave dual function
:math:`\theta(\lambda) = \tfrac12\lVert z(\lambda) - \mu\rVert^2_{v^{-1}} - \lambda^\top(Az(\lambda) - k)`, so a
semismooth Newton method with a line search on :math:`\theta` converges globally; its generalized Jacobian
is the ``a x a`` matrix :math:`J = A\,\mathrm{diag}(v \odot f)\,A^\top` (``f`` marks the coordinates strictly inside
the box). Where the unit step fails Armijo's test, the line search continues from the exact maximiser along the direction
(:math:`\theta` is piecewise quadratic along a line: a breakpoint search) instead of halving: where fewer
coordinates are free than rows, ``J`` is singular and its ridge makes the Newton step far too long, and halving
from a unit step freed one bound per iteration. Once the active set is right, one Newton step is the exact solve on it (``F`` is linear there), and the
iteration stops with every row within round-off.

* grouped sums (:class:`~hardeq.SumConstraint`): ``J`` is diagonal (per-group sums of ``v f``); the multipliers
  are first found exactly by the breakpoint search per group (:func:`grouped_box_multipliers`, below), so the
  Newton iteration only removes the round-off of its cumulative sums: O(n log n) in all.
* dense or sparse ``A``: ``J`` is formed from the ``a x n`` rows (O(a^2 n) per iteration, plus an ``a^3``
  Cholesky).

**General** :math:`\Sigma` (full, low-rank, block-diagonal): active-set methods on the equality-constrained
subproblem with the working set's bounds added as rows :math:`R = [A;\ E_W]`,

.. math::
    z_W = \mu + \Sigma R^\top y,\qquad (R\Sigma R^\top)\,y = r - R\mu

(the conditional mean of :math:`\mathcal N(\mu, \Sigma)` given :math:`Rz = r`: the conditioner's formula with the
active bounds as extra rows; equilibrated Cholesky and two refinement steps remove the round-off of an
ill-conditioned :math:`R\Sigma R^\top`; :math:`\Sigma^{-1}(z_W - \mu) = R^\top y`, so the last entries of ``y`` are
the bounds' multipliers :math:`\nu`). Batch elements iterate together, with the working sets padded by zero rows.

1. Start: the feasible point :math:`z_0` of the diagonal problem with :math:`v = \mathrm{diag}\,\Sigma`
   (or the error that the polytope is empty).
2. Primal-dual active set (Hintermüller, Ito & Kunisch 2003), warm-started with the bounds active at :math:`z_0`:
   solve on the predicted sets, predict again from :math:`\nu_i + c_i(l_i - z_i) > 0` (lower) and
   :math:`-\nu_i + c_i(z_i - u_i) > 0` (upper), :math:`c_i = 1/\Sigma_{ii}`; a repeated prediction is a KKT point,
   i.e. the exact mode. Several bounds change per iteration; at most :data:`MAX_PDAS` iterations (it can cycle
   when :math:`\Sigma^{-1}` is far from an M-matrix).
3. The elements not settled: the primal active-set method (Nocedal & Wright, *Numerical Optimization*,
   Alg. 16.3) from :math:`z_0`, warm-started with its active bounds: step towards the subproblem's solution as far
   as the box allows (adding the blocking bound, whose :math:`p_i \ne 0` along a direction in the null space of the
   current rows keeps the rows independent), and at the subproblem's solution drop the bound whose multiplier has
   the wrong sign (:math:`\Sigma^{-1}(z - \mu)` must push into an active lower bound and out of an upper one).
   One bound changes per iteration. In floating point :math:`p_i \ne 0` is not a test: at a degenerate vertex
   (more bounds active than ``n - a``) a coordinate the rows fix has a step of round-off, and its bound would make
   the rows dependent. The ratio test therefore skips the coordinates whose unit vector lies in the rows' span
   (to :data:`DETERMINED_RTOL`, a property of the rows alone: they are clamped into the box instead); without
   that the method refused such problems or cycled.
4. Where the variances span many decades, the subproblem leaves the rows off by up to 1e-6 relative: the residual
   is moved onto the free coordinates (:func:`_polish_rows`) until every row is within round-off.

Cost per iteration: :math:`\Sigma R^\top` (``m = a + |W|`` products with :math:`\Sigma`: O(n m) diagonal-plus-low-rank,
O(n^2 m) full) and an ``m x m`` Cholesky, so O(n m) memory: with many active bounds ``m`` approaches ``n``. Measured
(n = 200, a = 8, rank-3 low-rank, 8 batch elements, ~120 active bounds each): 45 subproblem solves.

The result is cast to the distribution's dtype and clamped into the box (``lower <= z <= upper`` holds exactly);
every row of :math:`Az = k` then meets the per-row tolerance of the untruncated distribution. The mode is not
differentiable (a piecewise-linear map of the parameters); it is computed without gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .mode_base import (ACCEPT_RTOL, CONVERGED_RTOL, JACOBIAN_RIDGE, MAX_ACTIVE_SET_FACTOR, MAX_NEWTON,
                        ModeNotFound, _Operator, _Solver, accept_rtol, clamped_rtol)
from .start_dual import box_metric
from .mode_dual import _dense_solver, _min_norm_solve, dual_newton, grouped_box_mode, grouped_box_multipliers
from .mode_general import DETERMINED_RTOL, MAX_PDAS, active_set, primal_dual_active_set
from .target import PlaneTarget

if TYPE_CHECKING:
    from ..constraints import EqualityConstraint

__all__ = ["ACCEPT_RTOL", "CONVERGED_RTOL", "DETERMINED_RTOL", "JACOBIAN_RIDGE", "MAX_ACTIVE_SET_FACTOR", "MAX_NEWTON",
           "MAX_PDAS", "ModeNotFound", "accept_rtol", "active_set", "clamped_rtol", "dual_newton", "grouped_box_mode",
           "grouped_box_multipliers", "primal_dual_active_set", "truncated_mode", "_Solver", "_dense_solver",
           "_min_norm_solve"]


# ====================================================================== the dispatcher
def _operators(con: EqualityConstraint, batch: torch.Size) -> tuple[_Operator, _Operator]:
    """``(matvec, abs_matvec)`` on ``(B, n)`` float64 vectors for the constraint (float64), flattened over
    ``batch``."""
    B = batch.numel()
    if con.group_index is not None:
        index, a = con.group_index, con.num_constraints

        def gsum(x: Tensor) -> Tensor:
            return torch.zeros(x.shape[:-1] + (a,), dtype=x.dtype, device=x.device).index_add_(-1, index, x)

        return gsum, gsum
    A = con.dense_matrix().detach()
    A = A.expand(batch + A.shape[-2:]).reshape(B, *A.shape[-2:]) if A.dim() > 2 else A
    Aabs = A.abs()
    return (lambda x: (A @ x.unsqueeze(-1)).squeeze(-1)), (lambda x: (Aabs @ x.unsqueeze(-1)).squeeze(-1))


def truncated_mode(dist: object, lower: Tensor, upper: Tensor) -> Tensor:
    r"""The mode of ``dist`` (a :class:`~hardeq.ConstrainedNormal`) truncated to ``[lower, upper]``
    (``(*batch, n)`` tensors in the distribution's compute dtype, ``±inf`` where unbounded): module docstring for
    the algorithms. Returns ``(*batch, n)`` in the compute dtype, ``lower <= z <= upper`` exactly, every row within
    the untruncated per-row tolerance.

    Raises:
        ModeNotFound (a ``ValueError``): no point of the plane in the box was found (the polytope is empty); the
            message names the batch element, the row and its residual.

    Examples:
        >>> from hardeq.bounds import truncated_mode
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([3.0], dtype=torch.float64))
        >>> d = ConstrainedNormal(torch.tensor([2.0, 0.0, 0.0], dtype=torch.float64), 1.0, constraint=total)
        >>> d.mean  # untruncated: the excess 1 shared equally
        tensor([2.3333, 0.3333, 0.3333], dtype=torch.float64)
        >>> truncated_mode(d, torch.zeros(3, dtype=torch.float64), torch.full((3,), 1.5, dtype=torch.float64))
        tensor([1.5000, 0.7500, 0.7500], dtype=torch.float64)
    """
    f64 = torch.float64
    target = PlaneTarget.of(dist)
    dtype = target.loc.dtype
    accept = accept_rtol(dtype)
    batch = target.batch_shape
    n = target.event_size
    B = batch.numel()
    con = target.constraint.to(dtype=f64)
    cov = target.covariance.to(dtype=f64)
    with torch.no_grad():
        mu = target.loc.detach().to(f64).expand(batch + (n,))
        lo = lower.detach().to(f64).expand(batch + (n,))
        hi = upper.detach().to(f64).expand(batch + (n,))
        k = con.k.detach().expand(batch + (con.num_constraints,))
        v = cov.variance.detach().expand(batch + (n,))
        for name, t in (("loc", mu), ("the covariance's variances", v), ("k", k)):
            if not bool(torch.isfinite(t).all()):
                where = tuple(int(i) for i in (~torch.isfinite(t)).nonzero()[0])
                raise ValueError(f"the truncated mode needs a finite {name}; got {float(t[where])} at index {where} "
                                 "(batch..., coordinate).")
        flat = (mu.reshape(B, n), v.reshape(B, n), lo.reshape(B, n), hi.reshape(B, n))
        kf = k.reshape(B, -1)
        matvec, abs_matvec = _operators(con, batch)
        inside = torch.zeros(B, dtype=torch.bool, device=mu.device)
        primal = torch.zeros(B, dtype=torch.bool, device=mu.device)  # diagonal Sigma: finished by the primal methods
        mean = mu  # replaced by the conditional mean below where it is used
        if con.group_index is not None:
            sizes = con.group_sizes
            assert sizes is not None  # (a grouped constraint counts its members)
            z, ok = grouped_box_mode(*flat, con.group_index, sizes, kf, accept)
        else:
            # where the untruncated mode (the conditional mean, exact per row) lies in the box it is the answer:
            # no iteration needs to reach it (the dual Newton method can stall at its acceptance level when the
            # variances span many decades, and then refused a feasible problem)
            mean = target.mean.detach()
            inside = ((mean >= lower) & (mean <= upper)).all(-1).reshape(B)
            if bool(inside.all()):
                return mean.clone()
            A = con.dense_matrix().detach()
            Af = A.expand(batch + A.shape[-2:]).reshape(B, *A.shape[-2:]) if A.dim() > 2 else A

            def rmatvec(lam: Tensor) -> Tensor:
                out: Tensor = (Af.mT @ lam.unsqueeze(-1)).squeeze(-1)
                return out

            z, _, ok = dual_newton(*flat, kf, matvec, rmatvec, abs_matvec, _dense_solver(Af, flat[1]),
                                   accept=accept)
            z = torch.where(inside.unsqueeze(-1), mean.to(f64).reshape(B, n), z)
            ok = ok | inside
            # a converged dual solve is the mode (z(lambda) minimises the Lagrangian over the box, and the rows
            # hold); where it stalled, what follows is a point of P only, which the primal methods below finish
            primal = ~ok
            if not bool(ok.all()):  # (a general covariance's start point: the same diagonal problem, finished)
                z, ok = _finish_on_active_set(z, ok, *flat, Af, kf, accept)
            if not bool(ok.all()):  # variances over many decades stall it: a point of P in the box's metric
                box_v = box_metric(flat[2], flat[3])
                z_box, _, ok_box = dual_newton(flat[0], box_v, flat[2], flat[3], kf, matvec, rmatvec, abs_matvec,
                                               _dense_solver(Af, box_v), accept=accept)
                if not bool((ok | ok_box).all()):
                    z_box, ok_box = _finish_on_active_set(z_box, ok_box, flat[0], box_v, flat[2], flat[3], Af, kf,
                                                          accept)
                use = ~ok & ok_box
                z, ok = torch.where(use.unsqueeze(-1), z_box, z), ok | ok_box
        _raise_unless(ok, z, matvec, abs_matvec, kf, batch, "the mode's dual Newton iteration")
        z = z.reshape(batch + (n,))
        if not cov.is_diagonal or bool(primal.any()):  # (from a point of P, the primal methods find the mode)
            A = con.dense_matrix().detach()
            A = A.expand(batch + A.shape[-2:])
            z_pd, settled = primal_dual_active_set(mu, cov, A, k, lo, hi, z, batch)
            if cov.is_diagonal:  # only where the dual solve stalled: elsewhere it is the exact mode already
                settled = settled | ~primal.reshape(batch)
                z_pd = torch.where(primal.reshape(batch).unsqueeze(-1), z_pd, z)
            z = torch.where(settled.unsqueeze(-1), z_pd, z)
            z, ok = active_set(mu, cov, A, k, lo, hi, z, batch, done=settled)
            # clamped before the rows are checked: a coordinate the rows fix may end a round-off outside the box
            z = torch.minimum(torch.maximum(z, lo), hi)
            zf = _polish_rows(z.reshape(B, n), *flat[1:], A.reshape(B, *A.shape[-2:]), kf)
            z = zf.reshape(batch + (n,))
            unsettled = ~ok.reshape(B) & ~inside
            if bool(unsettled.any()):
                raise ModeNotFound(
                    f"the mode's active-set method did not settle in {MAX_ACTIVE_SET_FACTOR * n + 10} iterations for "
                    f"batch element {_element_index(unsettled, batch)} (it can cycle at a degenerate vertex of the "
                    "polytope {A z = k} ∩ [lower, upper]); no exact mode was found.")
            res_ok = _rows_ok(zf, matvec, abs_matvec, kf, clamped_rtol(dtype))
            _raise_unless(res_ok | inside, zf, matvec, abs_matvec, kf, batch, "the mode's active-set method")
            z = torch.where(inside.reshape(batch).unsqueeze(-1), mean.to(f64), z)
        z = torch.minimum(torch.maximum(z, lo), hi)
        out = z.to(dtype)
        return torch.minimum(torch.maximum(out, lower.expand_as(out)), upper.expand_as(out))


def _finish_on_active_set(z: Tensor, ok: Tensor, mu: Tensor, v: Tensor, lo: Tensor, hi: Tensor, A: Tensor,
                          k: Tensor, accept: float = ACCEPT_RTOL) -> tuple[Tensor, Tensor]:
    r"""Where the dual Newton iteration stalled short of its acceptance level (variances over many decades), the
    exact solution on the active set it identified: the coordinates at a bound stay there, and the free ones are
    the conditional mean of :math:`N(\mu_F, \mathrm{diag}(v_F))` given :math:`A_F z_F = k - A_{\bar F} z_{\bar F}`,
    by the library's float64 conditioner (exact per row, refined as it needs). Where no more coordinates are free
    than there are rows, the equations alone fix them (the mode is a vertex of the polytope, degenerate when more
    bounds than ``n - a`` are active, and there is no conditional law to take the mean of):
    :math:`z_F = A_F^{-1}(k - A_{\bar F} z_{\bar F})` (least squares for a degenerate vertex), kept when every
    row meets ``accept`` (:func:`accept_rtol`). Kept where it lies in the box. One small conditioning (or
    ``a x a`` solve) per element that needs it; ``z``, ``ok`` ``(B, n)``, ``(B,)``."""
    from ..constraints import LinearConstraint
    from ..errors import NotPSDError
    from ..linalg.conditioning import Conditioner
    from ..linalg.covariance import DiagonalCovariance

    z, ok = z.clone(), ok.clone()
    for b in (~ok).nonzero().flatten().tolist():
        Ab = A[b] if A.dim() > 2 else A
        free = (z[b] > lo[b]) & (z[b] < hi[b])
        if not bool(free.any()):
            continue
        rhs = k[b] - Ab[:, ~free] @ z[b][~free]
        A_free = Ab[:, free]
        try:
            if A_free.shape[-1] <= A_free.shape[-2]:  # a vertex: the rows fix the free coordinates
                zf = (torch.linalg.solve(A_free, rhs) if A_free.shape[-1] == A_free.shape[-2]
                      else torch.linalg.lstsq(A_free, rhs.unsqueeze(-1)).solution.squeeze(-1))  # (degenerate)
                # round-off may put a coordinate the rows fix at 0 a hair outside the box: clamped, and the point
                # kept only if every row of the whole of it then meets the acceptance level
                zf = torch.minimum(torch.maximum(zf, lo[b][free]), hi[b][free])
                zb = z[b].clone()
                zb[free] = zf
                if not bool(((Ab @ zb - k[b]).abs() <= accept * (Ab.abs() @ zb.abs() + k[b].abs())).all()):
                    continue
            else:
                zf = Conditioner(DiagonalCovariance(v[b][free].sqrt()), LinearConstraint(
                    A_free, rhs, validate_args=False)).condition(mu[b][free])
        except (NotPSDError, ValueError, RuntimeError):  # (torch.linalg.LinAlgError is a RuntimeError)
            continue  # the rows are not independent on the free set: leave the element to the caller's error
        if bool(((zf >= lo[b][free]) & (zf <= hi[b][free])).all()):
            z[b, free] = zf
            ok[b] = True
    return z, ok


def _polish_rows(z: Tensor, v: Tensor, lo: Tensor, hi: Tensor, A: Tensor, k: Tensor, steps: int = 8) -> Tensor:
    r"""The rows' residual :math:`r = k - Az` of an active-set solution moved onto its free coordinates ``F``
    (strictly inside the box): :math:`z_F \leftarrow z_F + D_F A_F^\top (A_F D_F A_F^\top)^{-1} r` with
    :math:`D = \mathrm{diag}\,\Sigma`, clamped into the box, until every row is within :data:`CONVERGED_RTOL` (at
    most ``steps`` times). Where the variances span many decades, the subproblem's two refinement steps leave the
    rows up to 1e-6 relative off, and snapping the working set's bounds to their values moves them too (measured:
    5e-12 relative at variances from 1e-6 to 2e5); each step divides that by 1e5 or more there, and the
    correction is of that size, so the point stays the mode to the same order. Elements whose free columns do not
    span the rows are left as they are. ``z``, ``v``, ``lo``, ``hi`` ``(B, n)``; ``A`` ``(a, n)`` or ``(B, a, n)``; ``k`` ``(B, a)``. One
    ``a x a`` Cholesky per step."""
    free = (z > lo) & (z < hi)
    D = torch.where(free, v, torch.zeros_like(v))
    AD = A * D.unsqueeze(-2)  # (B, a, n)
    J = AD @ A.mT
    d = J.diagonal(0, -2, -1).clamp_min(torch.finfo(J.dtype).tiny).sqrt()
    L, info = torch.linalg.cholesky_ex(J / (d.unsqueeze(-1) * d.unsqueeze(-2)))
    usable = (info == 0).unsqueeze(-1)
    L = torch.where(usable.unsqueeze(-1), L, torch.eye(J.shape[-1], dtype=J.dtype, device=J.device))
    for _ in range(steps):
        r = k - (A @ z.unsqueeze(-1)).squeeze(-1)
        if bool((r.abs() <= CONVERGED_RTOL * ((A.abs() @ z.abs().unsqueeze(-1)).squeeze(-1) + k.abs())).all()):
            break
        y = torch.cholesky_solve((r / d).unsqueeze(-1), L).squeeze(-1) / d
        step = (AD.mT @ y.unsqueeze(-1)).squeeze(-1)
        z = torch.where(usable, torch.minimum(torch.maximum(z + step, lo), hi), z)
    return z


def _rows_ok(z: Tensor, matvec: _Operator, abs_matvec: _Operator, k: Tensor, rtol: float) -> Tensor:
    r = matvec(z) - k
    ok: Tensor = (r.abs() <= rtol * (abs_matvec(z.abs()) + k.abs())).all(-1)
    return ok


def _raise_unless(ok: Tensor, z: Tensor, matvec: _Operator, abs_matvec: _Operator, k: Tensor, batch: torch.Size,
                  where: str) -> None:
    if bool(ok.all()):
        return
    flat = int((~ok).nonzero()[0])
    index = _element_index(~ok, batch)
    zb = z.reshape(-1, z.shape[-1])
    r = (matvec(zb) - k)[flat]
    scale = (abs_matvec(zb.abs()) + k.abs())[flat]
    rel = r.abs() / scale.clamp_min(torch.finfo(scale.dtype).tiny)
    row = int(rel.argmax())
    raise ModeNotFound(
        f"{where} found no point of the plane A z = k inside the box for batch element {index}: row {row} misses "
        f"its right-hand side k = {float(k[flat, row]):.6g} by {float(r[row]):.3g} (relative {float(rel[row]):.3g}) at "
        "the closest point reached. The polytope {A z = k} ∩ [lower, upper] is empty (or too thin for float64); "
        "check the bounds against the constraint.")


def _element_index(failed: Tensor, batch: torch.Size) -> tuple[int, ...]:
    """The batch index of the first ``True`` in the flat ``(B,)`` mask ``failed``."""
    flat = int(failed.nonzero()[0])
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), batch)) if len(batch) else ()
