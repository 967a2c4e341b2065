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
semismooth Newton method with an Armijo line search on :math:`\theta` converges globally; its generalized Jacobian
is the ``a x a`` matrix :math:`J = A\,\mathrm{diag}(v \odot f)\,A^\top` (``f`` marks the coordinates strictly inside
the box). Once the active set is right, one Newton step is the exact solve on it (``F`` is linear there), and the
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
   the rows dependent. The ratio test therefore skips the coordinates whose conditional variance given the rows
   is below :data:`DETERMINED_RTOL` of their variance (they are clamped into the box instead); without that the
   method refused such problems or cycled.

Cost per iteration: :math:`\Sigma R^\top` (``m = a + |W|`` products with :math:`\Sigma`: O(n m) diagonal-plus-low-rank,
O(n^2 m) full) and an ``m x m`` Cholesky, so O(n m) memory: with many active bounds ``m`` approaches ``n``. Measured
(n = 200, a = 8, rank-3 low-rank, 8 batch elements, ~120 active bounds each): 45 subproblem solves.

The result is cast to the distribution's dtype and clamped into the box (``lower <= z <= upper`` holds exactly);
every row of :math:`Az = k` then meets the per-row tolerance of the untruncated distribution. The mode is not
differentiable (a piecewise-linear map of the parameters); it is computed without gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..constraints import EqualityConstraint
    from ..distributions.normal import ConstrainedNormal
    from ..linalg.covariance import Covariance

#: a linear operator on ``(B, .)`` float64 vectors (``A z``, ``A^T lambda``, ``|A| x``)
_Operator = Callable[[Tensor], Tensor]


class _Solver(Protocol):
    """``solve(w, r, exact=False)``, the linear solve of :func:`dual_newton`."""

    def __call__(self, w: Tensor, r: Tensor, exact: bool = False) -> Tensor: ...

__all__ = ["grouped_box_multipliers", "grouped_box_mode", "truncated_mode", "ModeNotFound"]

#: per-row relative residual (of |A||z| + |k|) at which the float64 iterations stop
CONVERGED_RTOL = 1e-13
#: per-row relative residual accepted at the end (round-off of a long row's sum may stall above CONVERGED_RTOL);
#: at most half the library's float64 tolerance 1e-12 of |A||z|, since |k| <= |A||z| on the plane
ACCEPT_RTOL = 4e-13
#: Newton iterations of the diagonal dual method, and iterations of the general active-set method per bound
MAX_NEWTON = 100
MAX_ACTIVE_SET_FACTOR = 4


def accept_rtol(dtype: torch.dtype) -> float:
    """The per-row relative residual (of ``|A||z| + |k|``) at which a float64 mode is accepted for a distribution
    in ``dtype``: :data:`ACCEPT_RTOL` in float64; in a coarser dtype half its machine epsilon (float32: 6e-8), no
    more than the rounding of the mode to that dtype adds anyway. A float32 problem whose polytope meets the box only
    at a vertex can be empty in exact arithmetic on its rounded data and still feasible to float32 precision."""
    return max(ACCEPT_RTOL, torch.finfo(dtype).eps / 2)


def clamped_rtol(dtype: torch.dtype) -> float:
    """The per-row relative residual accepted after a general covariance's mode is clamped into the box:
    :func:`accept_rtol` in float64; in a coarser dtype 16 times its machine epsilon (float32: 1.9e-6, within the
    library's float32 per-row tolerance 1e-5). The active-set method ends on the float64 plane, and where a float32
    plane misses a degenerate vertex by its round-off, the clamp of a coordinate the rows fix moves the point off the
    plane by about that much (measured up to 2.5e-7 relative)."""
    return accept_rtol(dtype) if dtype == torch.float64 else max(accept_rtol(dtype), 16 * torch.finfo(dtype).eps)


#: relative Levenberg term of the dual Newton system (a row whose coordinates are all at bounds has J_ii = 0)
JACOBIAN_RIDGE = 1e-12


class ModeNotFound(ValueError):
    """The mode solver could not meet a row of ``A z = k`` inside the box: the polytope is empty (or so thin that
    float64 cannot find a point in it). The message names the batch element and row and gives the residual.

    Examples:
        >>> from hardeq.bounds import truncated_mode
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([3.0], dtype=torch.float64))
        >>> d = ConstrainedNormal(torch.zeros(3, dtype=torch.float64), 1.0, constraint=total)
        >>> truncated_mode(d, torch.zeros(3, dtype=torch.float64), torch.full((3,), 0.5, dtype=torch.float64))
        Traceback (most recent call last):
            ...
        hardeq.bounds.mode.ModeNotFound: the mode's ... found no point of the plane A z = k inside the box ...
    """


# ====================================================================== grouped sums, diagonal covariance
def grouped_box_multipliers(mu: Tensor, v: Tensor, lo: Tensor, hi: Tensor, index: Tensor, sizes: Tensor,
                            k: Tensor) -> Tensor:
    r"""The per-group multiplier :math:`\lambda_c` with :math:`\sum_{i\in c}\mathrm{clip}(\mu_i + \lambda_c v_i,
    l_i, u_i) = k_c`, by an exact breakpoint search; all inputs float64.

    :math:`g_c(\lambda) = \sum_{i \in c} \mathrm{clip}(\mu_i + \lambda v_i, l_i, u_i)` is continuous, piecewise linear
    and non-decreasing, with breakpoints :math:`(l_i - \mu_i)/v_i` (slope :math:`+v_i`) and :math:`(u_i - \mu_i)/v_i`
    (slope :math:`-v_i`). With a group's ``2m`` breakpoints :math:`p_j` sorted and :math:`d_j` their slope changes,
    :math:`g(p_j) = \sum_i l_i + S_jp_j - \sum_{l\le j} d_lp_l` (:math:`S_j = \sum_{l \le j} d_l`), so the segment
    where :math:`g` crosses :math:`k` is found by counting the breakpoints with :math:`g(p_j) < k`, and on it
    :math:`\lambda = p_j + (k - g(p_j))/S_j`. An infinite bound is replaced by a finite one whose breakpoint lies
    outside a bracket :math:`[\lambda_-, \lambda_+]` of the crossing (beyond every finite breakpoint, ``g`` is linear
    and its crossing is explicit), which leaves :math:`g` unchanged on the bracket.

    Args:
        mu, v, lo, hi: ``(B, n)``; ``v > 0``; ``lo`` may hold ``-inf``, ``hi`` ``+inf``.
        index: ``(n,)`` group ids; sizes: ``(a,)`` members per group; k: ``(B, a)``, inside
            :math:`[\sum_c l_i, \sum_c u_i]`.

    Returns:
        ``(B, a)`` float64 multipliers (exact up to the round-off of the cumulative sums).

    Cost: a sort of ``2n`` breakpoints per batch element and a few cumulative sums.
    """
    B, n = mu.shape
    a = sizes.shape[0]
    dev = mu.device
    gi = index.expand(B, n)

    def gsum(x: Tensor) -> Tensor:
        return torch.zeros(B, a, dtype=x.dtype, device=dev).index_add_(1, index, x)

    fin_lo, fin_hi = torch.isfinite(lo), torch.isfinite(hi)
    if bool(fin_lo.all()) and bool(fin_hi.all()):
        return _breakpoint_search(mu, v, lo, hi, index, sizes, k)
    p_lo = torch.where(fin_lo, (lo - mu) / v, torch.zeros_like(mu))
    p_hi = torch.where(fin_hi, (hi - mu) / v, torch.zeros_like(mu))
    big = torch.tensor(float("inf"), dtype=mu.dtype, device=dev)
    pmin = torch.full((B, a), float("inf"), dtype=mu.dtype, device=dev)
    pmax = torch.full((B, a), -float("inf"), dtype=mu.dtype, device=dev)
    pmin = pmin.scatter_reduce(1, gi, torch.where(fin_lo, p_lo, big), "amin")
    pmin = pmin.scatter_reduce(1, gi, torch.where(fin_hi, p_hi, big), "amin")
    pmax = pmax.scatter_reduce(1, gi, torch.where(fin_lo, p_lo, -big), "amax")
    pmax = pmax.scatter_reduce(1, gi, torch.where(fin_hi, p_hi, -big), "amax")
    none = ~torch.isfinite(pmin)  # a group with no finite bound at all
    pmin = torch.where(none, torch.zeros_like(pmin), pmin)
    pmax = torch.where(none, torch.zeros_like(pmax), pmax)
    # beyond every finite breakpoint g is linear: below, sum(finite lo) + sum_{lo=-inf}(mu + lam v)
    v_lo, v_hi = gsum(torch.where(fin_lo, 0.0, v)), gsum(torch.where(fin_hi, 0.0, v))
    c_lo = gsum(torch.where(fin_lo, lo, mu))
    c_hi = gsum(torch.where(fin_hi, hi, mu))
    lam_minus = torch.where(v_lo > 0, torch.minimum(pmin, (k - c_lo) / torch.where(v_lo > 0, v_lo, 1.0)), pmin)
    lam_plus = torch.where(v_hi > 0, torch.maximum(pmax, (k - c_hi) / torch.where(v_hi > 0, v_hi, 1.0)), pmax)
    margin = 1.0 + lam_minus.abs() + lam_plus.abs()
    lo = torch.where(fin_lo, lo, mu + (lam_minus - margin).gather(1, gi) * v)
    hi = torch.where(fin_hi, hi, mu + (lam_plus + margin).gather(1, gi) * v)
    return _breakpoint_search(mu, v, lo, hi, index, sizes, k)


def _breakpoint_search(mu: Tensor, v: Tensor, lo: Tensor, hi: Tensor, index: Tensor, sizes: Tensor,
                       k: Tensor) -> Tensor:
    """The breakpoint search of :func:`grouped_box_multipliers` for finite bounds."""
    B, n = mu.shape
    a = sizes.shape[0]
    dev = mu.device

    def gsum(x: Tensor) -> Tensor:
        return torch.zeros(B, a, dtype=x.dtype, device=dev).index_add_(1, index, x)


    # breakpoints (B, 2n) and their slope changes, in contiguous groups, each sorted
    if bool((index[1:] >= index[:-1]).all()) and bool((sizes == sizes[0]).all()):
        # channel layout (equal contiguous groups): one batched sort of (B, a, 2m)
        m2 = 2 * int(sizes[0])
        p = torch.stack([(lo - mu) / v, (hi - mu) / v], dim=-1).reshape(B, a, m2)
        d = torch.stack([v, -v], dim=-1).reshape(B, a, m2)
        p, o = torch.sort(p, dim=-1, stable=True)
        p, d = p.reshape(B, 2 * n), d.gather(-1, o).reshape(B, 2 * n)
        gid = index.repeat_interleave(2).expand(B, 2 * n)
    else:
        # any grouping: sort by breakpoint, then (stably) by group
        p = torch.cat([(lo - mu) / v, (hi - mu) / v], dim=1)
        d = torch.cat([v, -v], dim=1)
        p, o1 = torch.sort(p, dim=1, stable=True)
        d = d.gather(1, o1)
        gid, o2 = torch.sort(torch.cat([index, index])[o1], dim=1, stable=True)
        p, d = p.gather(1, o2), d.gather(1, o2)
    size2 = 2 * sizes
    start = torch.cumsum(size2, 0) - size2
    S_all, DP_all = torch.cumsum(d, 1), torch.cumsum(d * p, 1)
    zero = torch.zeros(B, 1, dtype=mu.dtype, device=dev)
    S = S_all - torch.cat([zero, S_all], 1)[:, start].gather(1, gid)
    DP = DP_all - torch.cat([zero, DP_all], 1)[:, start].gather(1, gid)
    g = gsum(lo).gather(1, gid) + S * p - DP
    below = g < k.gather(1, gid)
    cnt = torch.zeros(B, a, dtype=torch.long, device=dev).scatter_add_(1, gid, below.long())
    j = (start + cnt - 1).clamp_min(start)
    pj, gj, Sj = p.gather(1, j), g.gather(1, j), S.gather(1, j)
    step = torch.where(Sj > 0, (k - gj) / torch.where(Sj > 0, Sj, torch.ones_like(Sj)), torch.zeros_like(Sj))
    lam = torch.where(cnt == 0, pj, pj + step)
    return torch.where(cnt == size2, p[:, start + size2 - 1], lam)


def grouped_box_mode(mu: Tensor, v: Tensor, lo: Tensor, hi: Tensor, index: Tensor, sizes: Tensor,
                     k: Tensor, accept: float = ACCEPT_RTOL) -> tuple[Tensor, Tensor]:
    r"""Mode for grouped sums and a diagonal covariance: the breakpoint multipliers
    (:func:`grouped_box_multipliers`) polished by the dual Newton iteration (one step on the identified active set
    removes the cumulative sums' round-off). Inputs as there, float64. Returns ``(z, converged)``: ``z`` ``(B, n)``
    float64 inside the box, ``converged`` ``(B,)`` bool (every row within ``accept``: :func:`accept_rtol`)."""
    lam0 = grouped_box_multipliers(mu, v, lo, hi, index, sizes, k)
    B, n = mu.shape
    a = sizes.shape[0]

    def matvec(z: Tensor) -> Tensor:
        return torch.zeros(z.shape[:-1] + (a,), dtype=z.dtype, device=z.device).index_add_(-1, index, z)

    def rmatvec(lam: Tensor) -> Tensor:
        return lam.index_select(-1, index)

    ridge = JACOBIAN_RIDGE * matvec(v) + torch.finfo(v.dtype).tiny

    def solve(w: Tensor, r: Tensor, exact: bool = False) -> Tensor:
        if exact:  # a group with no free member: no step
            J = matvec(w)
            return torch.where(J > 0, r / torch.where(J > 0, J, 1.0), torch.zeros_like(r))
        return r / (matvec(w) + ridge)

    # one Newton step on the active set of the breakpoint multipliers (the exact solve there, as F is linear on
    # it) removes the cumulative sums' round-off; the safeguarded iteration then only checks (or finishes) it
    y = mu + v * rmatvec(lam0)
    free = ((y > lo) & (y < hi)).to(v.dtype)
    lam0 = lam0 - solve(v * free, matvec(torch.minimum(torch.maximum(y, lo), hi)) - k)
    z, _, ok = dual_newton(mu, v, lo, hi, k, matvec, rmatvec, matvec, solve, lam0, accept=accept)
    return z, ok


# ====================================================================== diagonal covariance, any constraint
def dual_newton(mu: Tensor, v: Tensor, lo: Tensor, hi: Tensor, k: Tensor, matvec: _Operator, rmatvec: _Operator,
                abs_matvec: _Operator, solve: _Solver,
                lam0: Tensor | None = None, max_iter: int = MAX_NEWTON,
                accept: float = ACCEPT_RTOL) -> tuple[Tensor, Tensor, Tensor]:
    r"""Semismooth Newton on :math:`F(\lambda) = A\,\mathrm{clip}(\mu + v\odot A^\top\lambda, l, u) - k = 0` with an
    Armijo line search on the concave dual :math:`\theta` (module docstring); float64, batched over ``B``.

    Args:
        mu, v, lo, hi: ``(B, n)``; k: ``(B, a)``.
        matvec, rmatvec, abs_matvec: :math:`Az`, :math:`A^\top\lambda`, :math:`|A|x` on ``(B, .)``.
        solve: ``solve(w, r, exact=False)`` returns :math:`(A\,\mathrm{diag}(w)A^\top + \text{ridge})^{-1}r`,
            ``(B, a)`` (``exact=True``: the minimum-norm solution without the ridge).
        lam0: starting multipliers ``(B, a)`` (zeros: the conditional mean's neighbourhood).
        accept: the per-row relative residual accepted at the end (:func:`accept_rtol`).

    Returns:
        ``(z, lam, converged)``: ``z`` ``(B, n)`` in the box, ``lam`` ``(B, a)``, ``converged`` ``(B,)``.
    """
    B = mu.shape[0]
    lam = torch.zeros_like(k) if lam0 is None else lam0.clone()

    def primal(lam_: Tensor) -> tuple[Tensor, Tensor]:
        y = mu + v * rmatvec(lam_)
        return y, torch.minimum(torch.maximum(y, lo), hi)

    def theta(lam_: Tensor, z_: Tensor) -> Tensor:
        out: Tensor = 0.5 * ((z_ - mu).square() / v).sum(-1) - (lam_ * (matvec(z_) - k)).sum(-1)
        return out

    y, z = primal(lam)
    done = torch.zeros(B, dtype=torch.bool, device=mu.device)
    stuck = torch.zeros(B, dtype=torch.bool, device=mu.device)
    for _ in range(max_iter):
        F = matvec(z) - k
        scale = abs_matvec(z.abs()) + k.abs()
        done = (F.abs() <= CONVERGED_RTOL * scale).all(-1)
        if bool(done.all()):
            return z, lam, done
        free = ((y > lo) & (y < hi)).to(v.dtype)
        delta = -solve(v * free, F)
        slope = -(F * delta).sum(-1)  # directional derivative of theta along delta (>= 0)
        th0 = theta(lam, z)
        t = torch.ones(B, dtype=mu.dtype, device=mu.device)
        accepted = done | stuck
        new_lam = lam.clone()
        for _ in range(60):
            cand = lam + t.unsqueeze(-1) * delta
            _, zc = primal(cand)
            ok = (theta(cand, zc) >= th0 + 1e-4 * t * slope - 1e-15 * th0.abs()) & ~accepted
            new_lam = torch.where(ok.unsqueeze(-1), cand, new_lam)
            accepted = accepted | ok
            if bool(accepted.all()):
                break
            t = torch.where(accepted, t, 0.5 * t)
        lam = torch.where(done.unsqueeze(-1), lam, new_lam)
        y, z = primal(lam)
        stuck = stuck | ~accepted  # no ascent step: at the dual's supremum to round-off (or unbounded); stop there
        if bool((done | stuck).all()):
            break
    # finish with exact (unregularised) Newton steps on the identified active set where the safeguarded iteration
    # stalled at round-off (its Levenberg term and the line search's resolution of theta): kept where they help
    for _ in range(3):
        F = matvec(z) - k
        scale = abs_matvec(z.abs()) + k.abs()
        rel = (F.abs() / scale.clamp_min(torch.finfo(scale.dtype).tiny)).amax(-1)
        done = rel <= CONVERGED_RTOL
        if bool(done.all()):
            break
        free = ((y > lo) & (y < hi)).to(v.dtype)
        cand = lam - solve(v * free, F, exact=True)
        yc, zc = primal(cand)
        Fc = matvec(zc) - k
        rel_c = (Fc.abs() / (abs_matvec(zc.abs()) + k.abs()).clamp_min(torch.finfo(scale.dtype).tiny)).amax(-1)
        better = (rel_c < rel) & ~done
        lam = torch.where(better.unsqueeze(-1), cand, lam)
        y, z = torch.where(better.unsqueeze(-1), yc, y), torch.where(better.unsqueeze(-1), zc, z)
    F = matvec(z) - k
    done = (F.abs() <= accept * (abs_matvec(z.abs()) + k.abs())).all(-1)
    return z, lam, done


def _min_norm_solve(J: Tensor, r: Tensor) -> Tensor:
    """The minimum-norm least-squares solution of ``J x = r`` for a symmetric positive semi-definite ``J``
    (``(*, a, a)``, ``r`` ``(*, a)``): LAPACK's SVD-based ``gelsd`` on the CPU; on other devices, whose
    ``lstsq`` offers only ``gels`` (full rank only), the Hermitian pseudo-inverse (an eigendecomposition, the
    same default cut-off ``eps * a`` of the largest eigenvalue)."""
    if J.device.type == "cpu":
        solution: Tensor = torch.linalg.lstsq(J, r.unsqueeze(-1), driver="gelsd").solution
        return solution.squeeze(-1)
    pinv: Tensor = torch.linalg.pinv(J, hermitian=True)
    return (pinv @ r.unsqueeze(-1)).squeeze(-1)


def _dense_solver(A: Tensor, v: Tensor) -> _Solver:
    """``solve(w, r)`` for a dense ``A`` (``(*, a, n)`` float64, broadcasting over ``B``): the equilibrated Cholesky
    of :math:`A\\,\\mathrm{diag}(w)A^\\top` plus the relative ridge."""
    base = (A.square() * v.unsqueeze(-2)).sum(-1)  # diag(A diag(v) A^T), (B, a)

    def solve(w: Tensor, r: Tensor, exact: bool = False) -> Tensor:
        J = (A * w.unsqueeze(-2)) @ A.mT
        if exact:  # the minimum-norm Newton step on the active set (rows with no free coordinate get none)
            return _min_norm_solve(J, r)
        J = J + torch.diag_embed(JACOBIAN_RIDGE * base + torch.finfo(J.dtype).tiny)
        s = J.diagonal(0, -2, -1).sqrt()
        L, info = torch.linalg.cholesky_ex(J / (s.unsqueeze(-1) * s.unsqueeze(-2)))
        x: Tensor = torch.cholesky_solve((r / s).unsqueeze(-1), L).squeeze(-1) / s
        bad = info != 0
        if bool(bad.any()):  # a numerically singular J: least squares
            x2 = _min_norm_solve(J, r)
            x = torch.where(bad.unsqueeze(-1), x2, x)
        return x

    return solve


# ====================================================================== general covariance
def _eq_qp(mu: Tensor, cov: Covariance, A: Tensor, k: Tensor, W: Tensor, values: Tensor,
           batch_shape: torch.Size, determined: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    r"""The equality-constrained QP with the bounds of ``W`` as rows: :math:`z = \mu + \Sigma R^\top y`,
    :math:`(R\Sigma R^\top)y = r - R\mu`, :math:`R = [A; E_W]`, :math:`r = [k; \text{values}_W]`, batched with the
    working sets padded by zero rows; equilibrated Cholesky and two refinement steps. Returns ``(z, nu, ok)``: ``z``
    ``(*batch, n)`` (the ``W`` coordinates set to their values exactly), ``nu`` ``(*batch, n)`` the multipliers of the
    bound rows (0 off ``W``; :math:`\Sigma^{-1}(z - \mu) = A^\top\lambda + \nu`), ``ok`` ``(*batch)`` (factorised:
    the rows are independent), and with ``determined`` the mask ``(*batch, n)`` of the coordinates the rows fix:
    those whose conditional variance given :math:`Rz = r`,
    :math:`\Sigma_{jj} - (\Sigma R^\top)_j (R\Sigma R^\top)^{-1} (R\Sigma)_j`, is at most
    :data:`DETERMINED_RTOL` of :math:`\Sigma_{jj}` (``None`` without; one more ``m x n`` triangular solve).
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
    G = torch.cholesky_solve(SR.mT / s.unsqueeze(-1), L) / s.unsqueeze(-1)  # (*batch, a + m, n): S^-1 R Sigma
    prior = cov.variance.expand(z.shape)
    conditional = prior - (SR.mT * G).sum(-2)
    return z, nu, ok, (conditional <= DETERMINED_RTOL * prior) | W


#: iterations of the primal-dual active-set phase before the primal method takes over
MAX_PDAS = 10
#: a coordinate whose conditional variance given the working rows is at most this fraction of its variance is
#: taken as fixed by them (its computed step is round-off; float64 leaves about 1e-16 times the conditioning)
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


def truncated_mode(dist: ConstrainedNormal, lower: Tensor, upper: Tensor) -> Tensor:
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
    accept = accept_rtol(dist._unbroadcasted_loc.dtype)
    batch = dist.batch_shape
    n = dist.event_shape[0]
    B = batch.numel()
    con = dist.constraint.to(dtype=f64)
    cov = dist.covariance.to(dtype=f64)
    with torch.no_grad():
        mu = dist._unbroadcasted_loc.detach().to(f64).expand(batch + (n,))
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
        mean = mu  # replaced by the conditional mean below where it is used
        if con.group_index is not None:
            sizes = con.group_sizes
            assert sizes is not None  # (a grouped constraint counts its members)
            z, ok = grouped_box_mode(*flat, con.group_index, sizes, kf, accept)
        else:
            # where the untruncated mode (the conditional mean, exact per row) lies in the box it is the answer:
            # no iteration needs to reach it (the dual Newton method can stall at its acceptance level when the
            # variances span many decades, and then refused a feasible problem)
            mean = dist.mean.detach()
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
            if not bool(ok.all()):  # (a general covariance's start point: the same diagonal problem, finished)
                z, ok = _finish_on_active_set(z, ok, *flat, Af, kf, accept)
        _raise_unless(ok, z, matvec, abs_matvec, kf, batch, "the mode's dual Newton iteration")
        z = z.reshape(batch + (n,))
        if not cov.is_diagonal:
            A = con.dense_matrix().detach()
            A = A.expand(batch + A.shape[-2:])
            z_pd, settled = primal_dual_active_set(mu, cov, A, k, lo, hi, z, batch)
            z = torch.where(settled.unsqueeze(-1), z_pd, z)
            z, ok = active_set(mu, cov, A, k, lo, hi, z, batch, done=settled)
            # clamped before the rows are checked: a coordinate the rows fix may end a round-off outside the box
            z = torch.minimum(torch.maximum(z, lo), hi)
            zf = z.reshape(B, n)
            unsettled = ~ok.reshape(B) & ~inside
            if bool(unsettled.any()):
                raise ModeNotFound(
                    f"the mode's active-set method did not settle in {MAX_ACTIVE_SET_FACTOR * n + 10} iterations for "
                    f"batch element {_element_index(unsettled, batch)} (it can cycle at a degenerate vertex of the "
                    "polytope {A z = k} ∩ [lower, upper]); no exact mode was found.")
            res_ok = _rows_ok(zf, matvec, abs_matvec, kf, clamped_rtol(dist._unbroadcasted_loc.dtype))
            _raise_unless(res_ok | inside, zf, matvec, abs_matvec, kf, batch, "the mode's active-set method")
            z = torch.where(inside.reshape(batch).unsqueeze(-1), mean.to(f64), z)
        z = torch.minimum(torch.maximum(z, lo), hi)
        out = z.to(dist._unbroadcasted_loc.dtype)
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
    from ..distributions.normal import ConstrainedNormal
    from ..errors import NotPSDError

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
                zf = ConstrainedNormal(mu[b][free], v[b][free].sqrt(), constraint=LinearConstraint(
                    A_free, rhs, validate_args=False), validate_args=False).mean
        except (NotPSDError, ValueError, RuntimeError):  # (torch.linalg.LinAlgError is a RuntimeError)
            continue  # the rows are not independent on the free set: leave the element to the caller's error
        if bool(((zf >= lo[b][free]) & (zf <= hi[b][free])).all()):
            z[b, free] = zf
            ok[b] = True
    return z, ok


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
