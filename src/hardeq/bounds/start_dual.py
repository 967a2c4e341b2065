r"""A start for the chains where rows share coordinates, without a host read: a fixed number of dual Newton steps.

Where two rows of ``A`` share a coordinate, :func:`~hardeq.bounds.start.feasible_start` has no closed form, and the
exact mode (:mod:`hardeq.bounds.mode`, a QP) reads the host at every iteration: 28-59 reads for a fresh law of 30
coordinates and 2-5 rows. A chain needs a point of the polytope :math:`P = \{Az = k\}\cap[l, u]`, not its mode.

**The point.** The projection of :math:`\mu` onto :math:`P` in a diagonal metric :math:`v`: for multipliers
:math:`\lambda \in \mathbb R^a`, :math:`z(\lambda) = \mathrm{clip}(\mu + v\odot A^\top\lambda,\ l,\ u)` lies in
the box for *every* :math:`\lambda`, and the rows hold where :math:`F(\lambda) = Az(\lambda) - k = 0`, the stationary
point of the concave dual :math:`\theta(\lambda) = \tfrac12\lVert z(\lambda) - \mu\rVert^2_{v^{-1}} -
\lambda^\top F(\lambda)` (:mod:`hardeq.bounds.mode` has the derivation).

**The metric** is the box's, not the law's: :math:`v_i` is coordinate ``i``'s squared width where finite, 1 where
not (:func:`box_metric`). Any positive :math:`v` gives a point of :math:`P`, and the law's variances, which can span
many decades, make the Newton systems ill-conditioned. On 59 random hard polytopes (boxes down to 0.01 wide, up to
2n/3 rows, rows scaled over six decades, variances over twelve; all with volume by construction) 32 were left
uncertified with :math:`v = \mathrm{diag}\,\Sigma` and 7 with the box's metric, after 40 steps; the exact mode's
solve, which must use :math:`\Sigma`, failed on 22 of them.

**The iteration**: the semismooth Newton method of :func:`~hardeq.bounds.mode_dual.dual_newton`, with no
data-dependent branch:

* it starts at the untruncated problem's multipliers :math:`\lambda_0 = (AVA^\top)^{-1}(k - A\mu)` (exact where
  that projection lies in the box);
* :data:`DUAL_START_STEPS` Newton steps :math:`\delta = -(A\,\mathrm{diag}(v\odot w)A^\top + \text{ridge})^{-1}F`
  (``w`` is 1 at a coordinate strictly inside the box and :data:`BOUND_WEIGHT` at one on a bound, a regularised
  generalised Jacobian; the ridge is :data:`~hardeq.bounds.mode_base.JACOBIAN_RIDGE` of the diagonal), each
  trying the :data:`LINE_SEARCH_TRIES` lengths :math:`1, \tfrac14, \tfrac1{16}, \dots` at once and taking the
  longest that meets Armijo's condition on :math:`\theta` (none: the step is skipped; a failed factorisation gives
  NaN, which meets nothing);
* :data:`POLISH_STEPS` unregularised steps on the identified active set, each kept only where it lowers the largest
  relative row residual.

**What is guaranteed.** ``z`` lies in the box exactly (a clip, then a clamp in the working dtype). The rows are
*not* checked here: the semismooth iteration ends on the exact active set in a few steps on the problems we
measured, but a fixed count cannot promise it. The samplers check their start anyway (every row within
:math:`\sqrt\varepsilon` of its size, in the one host read they make before their sweeps), and
:class:`~hardeq.TruncatedConstrainedNormal` falls back to the exact mode where that check fails (the mode's error
then names an empty polytope). ``met`` is that verdict on the device, for callers that want it.

Cost: per batch element, :data:`DUAL_START_STEPS` times (an ``a x a`` Cholesky and ``1 + LINE_SEARCH_TRIES``
products with ``A``, O(a^2 n + a^3)), float64, about 76 ATen calls per step (3,282 in all), no host read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .mode_base import JACOBIAN_RIDGE
from .target import PlaneTarget

__all__ = ["DUAL_START_STEPS", "LINE_SEARCH_TRIES", "POLISH_STEPS", "box_metric", "dual_start"]

#: safeguarded Newton steps of :func:`dual_start`
DUAL_START_STEPS = 40
#: step lengths 1, 1/2, ..., 2^-(LINE_SEARCH_TRIES - 1) tried at once per step
LINE_SEARCH_TRIES = 8
#: ratio of successive step lengths tried
LINE_SEARCH_RATIO = 0.25
#: weight of a coordinate at a bound in the safeguarded steps' Jacobian (1 for a free one)
BOUND_WEIGHT = 1e-3
#: unregularised steps on the active set at the end, each kept where it helps
POLISH_STEPS = 3

_F64 = torch.float64
#: Armijo's sufficient-ascent constant (as in :func:`~hardeq.bounds.mode_dual.dual_newton`)
_ARMIJO = 1e-4


def box_metric(lower: Tensor, upper: Tensor) -> Tensor:
    """The metric of the feasibility solve, ``(B, n)`` float64: each coordinate's squared box width where finite,
    1 where it is not (module docstring, "The metric")."""
    width = (upper - lower).to(_F64)
    return torch.where(torch.isfinite(width), width.square(), torch.ones_like(width)).clamp_min(torch.finfo(_F64).tiny)


@torch.no_grad()
def dual_start(dist: object, lower: Tensor, upper: Tensor, rtol: float | None = None) -> tuple[Tensor, Tensor]:
    r"""A point of the box near the plane, ``(*batch, n)`` in ``lower``'s dtype, and ``met`` ``(*batch)``: whether
    every row of it (in float64, before the cast) is within ``rtol`` of its size :math:`(|A||z| + |k|)_i` (module
    docstring).

    Args:
        dist: a :class:`~hardeq.bounds.target.PlaneTarget` or a ``ConstrainedNormal`` with a dense or sparse
            constraint (its rows are materialised: ``a x n`` float64).
        lower, upper: ``(*batch, n)`` bounds (infinite entries allowed); the point is returned in their dtype.
        rtol: default :math:`\sqrt\varepsilon` of ``lower``'s dtype (the samplers' start check).

    Examples:
        >>> from hardeq.bounds.start_dual import dual_start
        >>> A = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
        >>> d = ConstrainedNormal(torch.zeros(4, dtype=torch.float64), 1.0,
        ...                       constraint=LinearConstraint(A, torch.tensor([1.5, 1.5], dtype=torch.float64)))
        >>> z, met = dual_start(d, torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
        >>> bool(met), bool(((z >= 0) & (z <= 1)).all()), torch.allclose(A @ z, torch.tensor([1.5, 1.5],
        ...                                                                 dtype=torch.float64))
        (True, True, True)
    """
    target = PlaneTarget.of(dist)
    con = target.constraint
    batch = torch.broadcast_shapes(target.shape, lower.shape, upper.shape)[:-1]
    n, B = target.event_size, max(1, batch.numel())
    rows = con.dense_rows().detach().to(_F64)
    a = rows.shape[-2]
    A = rows.expand(batch + (a, n)).reshape(B, a, n)

    def flat(t: Tensor, size: int) -> Tensor:
        return t.detach().to(_F64).expand(batch + (size,)).reshape(B, size)

    mu = flat(target.loc, n)
    lo, hi, k = flat(lower, n), flat(upper, n), flat(con.k, a)
    v = box_metric(lo, hi)
    A_abs = A.abs()
    diag = (A.square() * v.unsqueeze(-2)).sum(-1)  # diag(A V A^T), (B, a): the ridge's scale

    def matvec(z: Tensor) -> Tensor:  # (*, B, n) -> (*, B, a)
        return (A @ z.unsqueeze(-1)).squeeze(-1)

    def primal(lam: Tensor) -> tuple[Tensor, Tensor]:  # (*, B, a) -> y, clip(y): (*, B, n) each
        y = torch.addcmul(mu, v, (lam.unsqueeze(-2) @ A).squeeze(-2))
        return y, torch.minimum(torch.maximum(y, lo), hi)

    def theta(lam: Tensor, z: Tensor) -> Tensor:
        out: Tensor = 0.5 * ((z - mu).square() / v).sum(-1) - (lam * (matvec(z) - k)).sum(-1)
        return out

    def solve(w: Tensor, r: Tensor, ridge: float) -> Tensor:
        """:math:`(A\\,\\mathrm{diag}(w)A^\\top + \\text{ridge})^{-1}r` by the equilibrated Cholesky; NaN where it
        fails (no host read)."""
        J = (A * w.unsqueeze(-2)) @ A.mT
        J = J + torch.diag_embed(ridge * diag + torch.finfo(_F64).tiny)
        s = J.diagonal(0, -2, -1).sqrt()
        L, info = torch.linalg.cholesky_ex(J / (s.unsqueeze(-1) * s.unsqueeze(-2)))
        x = torch.cholesky_solve((r / s).unsqueeze(-1), L).squeeze(-1) / s
        return x.masked_fill((info != 0).unsqueeze(-1), float("nan"))

    def worst_row(z: Tensor) -> Tensor:  # largest relative residual per batch element, NaN-safe (NaN: inf)
        size = (A_abs @ z.abs().unsqueeze(-1)).squeeze(-1) + k.abs()
        rel = (matvec(z) - k).abs() / size.clamp_min(torch.finfo(_F64).tiny)
        return rel.amax(-1).nan_to_num(float("inf"))

    lam = solve(v, k - matvec(mu), JACOBIAN_RIDGE).nan_to_num(0.0)
    lengths = torch.pow(LINE_SEARCH_RATIO, torch.arange(LINE_SEARCH_TRIES, dtype=_F64, device=mu.device)).unsqueeze(-1)
    for _ in range(DUAL_START_STEPS):
        y, z = primal(lam)
        F = matvec(z) - k
        free = ((y > lo) & (y < hi)).to(_F64)
        delta = -solve(v * free.add_(1.0 - free, alpha=BOUND_WEIGHT), F, JACOBIAN_RIDGE)
        slope = -(F * delta).sum(-1)  # directional derivative of theta along delta (>= 0)
        th0 = theta(lam, z)
        cand = lam + lengths.unsqueeze(-1) * delta  # (tries, B, a)
        ok = theta(cand, primal(cand)[1]) >= th0 + _ARMIJO * lengths * slope - 1e-15 * th0.abs()  # (tries, B)
        first = ok.to(torch.uint8).argmax(0)  # the longest length that ascends enough
        chosen = cand.gather(0, first.view(1, B, 1).expand(1, B, a)).squeeze(0)
        lam = torch.where(ok.any(0).unsqueeze(-1), chosen, lam)
    for _ in range(POLISH_STEPS):
        y, z = primal(lam)
        cand = lam - solve(v * ((y > lo) & (y < hi)), matvec(z) - k, 1e-14)
        better = worst_row(primal(cand)[1]) < worst_row(z)
        lam = torch.where(better.unsqueeze(-1), cand, lam)
    z = primal(lam)[1]
    met = worst_row(z) <= (torch.finfo(lower.dtype).eps ** 0.5 if rtol is None else rtol)
    out = z.to(lower.dtype).reshape(batch + (n,))
    return torch.minimum(torch.maximum(out, lower.expand_as(out)), upper.expand_as(out)), met.reshape(batch)
