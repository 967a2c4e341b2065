r"""The mode for a diagonal covariance (:mod:`hardeq.bounds.mode`, whose docstring has the mathematics): the
breakpoint search per group of a grouped sum, and the dual semismooth Newton method for any constraint."""

from __future__ import annotations


import torch
from torch import Tensor

from .mode_base import (ACCEPT_RTOL, CONVERGED_RTOL, JACOBIAN_RIDGE, MAX_NEWTON, _Operator, _Solver)

__all__ = ["dual_newton", "grouped_box_mode", "grouped_box_multipliers"]


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
        for attempt in range(60):
            cand = lam + t.unsqueeze(-1) * delta
            _, zc = primal(cand)
            ok = (theta(cand, zc) >= th0 + 1e-4 * t * slope - 1e-15 * th0.abs()) & ~accepted
            new_lam = torch.where(ok.unsqueeze(-1), cand, new_lam)
            accepted = accepted | ok
            if bool(accepted.all()):
                break
            # the unit step failed: the exact maximiser along delta, then halving from there
            t = torch.where(accepted, t, _exact_step(y, v, lo, hi, rmatvec(delta), (k * delta).sum(-1))
                            if attempt == 0 else 0.5 * t)
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


def _exact_step(y: Tensor, v: Tensor, lo: Tensor, hi: Tensor, g: Tensor, kd: Tensor) -> Tensor:
    r"""The exact line search of :func:`dual_newton`: the maximiser :math:`t^\star` of the concave piecewise-quadratic
    :math:`\phi(t) = \theta(\lambda + t\delta)`, whose derivative
    :math:`\phi'(t) = k^\top\delta - \sum_i g_i\,\mathrm{clip}(y_i + t v_i g_i, l_i, u_i)` (:math:`g = A^\top\delta`,
    ``y`` the unclipped primal point at :math:`\lambda`) is non-increasing and piecewise linear. Each term is
    :math:`\mathrm{clip}(g_iy_i + t\,v_ig_i^2,\ \min(g_il_i, g_iu_i),\ \max(g_il_i, g_iu_i))`, so
    :math:`\phi'(t) = 0` is the one-group breakpoint search of :func:`grouped_box_multipliers`. Where :math:`J` is
    singular (fewer coordinates free than rows), its ridge makes the Newton step some 1e10 times too long, and
    halving from ``t = 1`` took one bound per iteration: 113 coordinates under 55 rows needed 800 iterations, and
    the cap of 100 refused feasible problems. Returns ``(B,)``; 1 where :math:`t^\star` is not positive and finite
    (the Armijo halving then decides). A sort of ``2n`` breakpoints per element, only where the unit step failed."""
    B, n = y.shape
    vg = v * g * g
    flat = vg == 0  # (g_i = 0, or its square underflows: the term does not move)
    pos = g > 0
    gl, gu = g * lo, g * hi
    mu_ = torch.where(flat, 0.0, g * y)
    v_ = torch.where(flat, 1.0, vg)
    l_ = torch.where(flat, 0.0, torch.where(pos, gl, gu))
    u_ = torch.where(flat, 0.0, torch.where(pos, gu, gl))
    index = torch.zeros(n, dtype=torch.long, device=y.device)
    sizes = torch.full((1,), n, dtype=torch.long, device=y.device)
    target = torch.minimum(torch.maximum(kd, l_.sum(-1)), u_.sum(-1)).unsqueeze(-1)  # (beyond: the last breakpoint)
    t = grouped_box_multipliers(mu_, v_, l_, u_, index, sizes, target).squeeze(-1)
    return torch.where(torch.isfinite(t) & (t > 0), t, torch.ones_like(t))


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
