r"""Whether the polytope :math:`P = \{Az = k\}\cap[l, u]` has volume on the plane, decided before any normaliser.

The truncated law has a density on the ``(n - a)``-dimensional plane only when :math:`P` has positive
``(n - a)``-dimensional volume. :func:`~hardeq.bounds.polytope.check_polytope` certifies an empty or flat polytope
one row at a time, which is exact for a grouped sum and for one row. With two or more rows a *combination* of rows
can fix a direction, e.g. :math:`z_0 + z_1 + z_3 = 1` and :math:`z_1 - z_2 + z_3 = 1` give :math:`z_0 + z_2 = 0`,
which the bounds :math:`z \ge 0` turn into :math:`z_0 = z_2 = 0`: a face of no volume, on which a Monte Carlo
normaliser would report a confident finite :math:`\log Z` where :math:`Z = 0`.

**The test.** :math:`P` has full dimension on the plane iff some point of the plane lies *strictly* inside every
bound that the plane does not already fix (a coordinate whose conditional variance on the plane is 0 is fixed by
the rows alone and may sit on its bound). Round-off forbids "strictly" as such, so the box is shrunk and grown by
:math:`t\,s_i` per coordinate: :math:`s_i = \min(\bar\sigma_i, (u_i - l_i)/4)` (the conditional standard deviation
on the plane, never more than a quarter of the coordinate's width) and :math:`t` = :data:`VOLUME_TOL` (``1e-9`` in
float64, ``1e-5`` in float32). A feasibility solve (the mode's dual Newton method in the box's diagonal metric,
:func:`~hardeq.bounds.mode.dual_newton` with :func:`~hardeq.bounds.start_dual.box_metric`) on each decides:

* the grown box has no point of the plane: **empty**;
* the grown box has one, the shrunk box none: **no volume** (a face or a single point; or a polytope thinner than
  :math:`t` conditional standard deviations in a direction that combines rows), refused with the coordinates the
  solve found at a bound;
* the shrunk box has one: full dimension, certified (that point is strictly inside).

On a line (``n - a == 1``) the same test is exact and cheap: the box cuts the line to a standardized interval
per coordinate, shrunk and grown by :math:`t` (:func:`check_line_section`).

Cost: one or two batched dual Newton solves, O(a^2 n) per iteration; run once when the law is made.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .mode import _dense_solver, _finish_on_active_set, accept_rtol, dual_newton
from .start_dual import box_metric

if TYPE_CHECKING:
    from ..constraints import EqualityConstraint

__all__ = ["VOLUME_TOL", "check_line_section", "check_volume", "shrunk_box", "volume_tol"]

#: the shrink (in conditional standard deviations, at most a quarter of a coordinate's width) below which a
#: polytope counts as having no volume, by the distribution's dtype
VOLUME_TOL = {torch.float64: 1e-9, torch.float32: 1e-5}


def volume_tol(dtype: torch.dtype) -> float:
    """:data:`VOLUME_TOL` for ``dtype`` (the float32 value for coarser dtypes)."""
    return VOLUME_TOL.get(dtype, VOLUME_TOL[torch.float32])


def _margin(lo: Tensor, hi: Tensor, sd: Tensor, frozen: Tensor, tol: float) -> Tensor:
    """``t s_i`` per coordinate (module docstring), 0 where the plane fixes the coordinate."""
    width = (hi - lo).nan_to_num(posinf=torch.finfo(lo.dtype).max)
    s = torch.minimum(sd, width / 4)
    return torch.where(frozen, torch.zeros_like(s), tol * s)


def shrunk_box(lower: Tensor, upper: Tensor, variance: Tensor, plane_variance: Tensor,
               dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    r"""The box shrunk by :math:`t\,s_i` per coordinate (module docstring; not where the plane fixes the
    coordinate), float64 ``(*batch, n)``: a point of the plane in it certifies that the polytope has volume. No host
    read."""
    f64 = torch.float64
    lo, hi = lower.detach().to(f64), upper.detach().to(f64)
    pv = plane_variance.detach().to(f64)
    frozen = pv <= 16 * torch.finfo(dtype).eps * variance.detach().to(f64)
    margin = _margin(lo, hi, pv.clamp_min(0).sqrt(), frozen, volume_tol(dtype))
    return lo + margin, hi - margin


def _names(mask: Tensor, limit: int = 8) -> str:
    idx = mask.nonzero().flatten().tolist()
    out = ", ".join(str(i) for i in idx[:limit])
    return out + (f" and {len(idx) - limit} more" if len(idx) > limit else "")


@torch.no_grad()
def check_volume(constraint: EqualityConstraint, loc: Tensor, variance: Tensor, lower: Tensor, upper: Tensor,
                 plane_variance: Tensor, dtype: torch.dtype,
                 second_opinion: Callable[[Tensor, Tensor], bool] | None = None) -> None:
    r"""``ValueError`` unless the polytope has volume on the plane (module docstring).

    Args:
        constraint: the equality constraint (any type; its dense rows are used, ``a x n`` float64).
        loc, variance: ``(*batch, n)``: the point the feasibility solve projects, and the law's variances (which
            coordinates the plane fixes). The solve itself runs in the box's metric
            (:func:`~hardeq.bounds.start_dual.box_metric`: any positive metric finds a point, and the law's
            variances, spanning many decades, stalled it: 6 of 200 random polytopes with volume were refused).
        lower, upper: ``(*batch, n)``, infinite entries allowed.
        plane_variance: ``(*batch, n)`` conditional variances on the plane (0 where the rows fix a coordinate).
        dtype: the distribution's dtype (sets :func:`volume_tol` and the solve's acceptance).
        second_opinion: ``f(lo, hi) -> bool``, whether every batch element has a point of the plane in ``[lo, hi]``
            (``(*batch, n)``), by a slower and more robust solver (the truncated mode with the distribution's
            covariance); asked only where the fast solve found none, so that a stall of the fast solve never refuses
            a valid problem nor calls a face empty.

    Raises:
        ValueError: the polytope is empty, or has no volume on the plane; names the batch element and the
            coordinates found at a bound.
    """
    f64 = torch.float64
    batch = torch.broadcast_shapes(loc.shape[:-1], lower.shape[:-1], upper.shape[:-1], plane_variance.shape[:-1],
                                   constraint.k.shape[:-1])
    n = loc.shape[-1]
    B = batch.numel()

    def flat(t: Tensor) -> Tensor:
        return t.detach().to(f64).expand(batch + (t.shape[-1],)).reshape(B, t.shape[-1])

    mu, v, lo, hi, pv = (flat(t) for t in (loc, variance, lower, upper, plane_variance))
    k = flat(constraint.k)
    A = constraint.dense_matrix().detach().to(f64)
    A = A.expand(batch + A.shape[-2:]).reshape(B, *A.shape[-2:]) if A.dim() > 2 else A
    Aabs = A.abs()
    eps = torch.finfo(dtype).eps
    frozen = pv <= 16 * eps * v
    margin = _margin(lo, hi, pv.clamp_min(0).sqrt(), frozen, volume_tol(dtype))
    accept = accept_rtol(dtype)

    def matvec(x: Tensor) -> Tensor:
        return (A @ x.unsqueeze(-1)).squeeze(-1)

    def rmatvec(lam: Tensor) -> Tensor:
        return (A.mT @ lam.unsqueeze(-1)).squeeze(-1)

    def abs_matvec(x: Tensor) -> Tensor:
        return (Aabs @ x.unsqueeze(-1)).squeeze(-1)

    def feasible(lo_: Tensor, hi_: Tensor) -> tuple[Tensor, Tensor]:
        w = box_metric(lo_, hi_)  # (the box's metric: the law's variances can span decades that stall the solve)
        z, _, ok = dual_newton(mu, w, lo_, hi_, k, matvec, rmatvec, abs_matvec, _dense_solver(A, w), accept=accept)
        if not bool(ok.all()):
            z, ok = _finish_on_active_set(z, ok, mu, w, lo_, hi_, A, k, accept)
        return z, ok

    _, inner = feasible(lo + margin, hi - margin)
    if bool(inner.all()):
        return
    shape = batch + (n,)
    if second_opinion is not None and second_opinion((lo + margin).reshape(shape), (hi - margin).reshape(shape)):
        return
    z, outer = feasible(lo - margin, hi + margin)
    bad = ~inner
    first = int(bad.nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), batch)) if len(batch) else ()
    tol = volume_tol(dtype)
    fast_outer = outer.clone()
    if not bool(outer[first]) and second_opinion is not None:
        outer[first] = second_opinion(lo.reshape(shape), hi.reshape(shape))
    if not bool(outer[first]):
        raise ValueError(
            f"the polytope {{A z = k}} ∩ [lower, upper] is empty for batch element {index}: no point of the plane "
            f"lies in the box, even with the box widened by {tol:g} conditional standard deviations per coordinate "
            "(the rows together cannot be met inside the bounds, although each row alone can). Widen the bounds or "
            "change k.")
    at_bound = (~frozen[first]) & (((z[first] - lo[first]).abs() <= 2 * margin[first])
                                   | ((hi[first] - z[first]).abs() <= 2 * margin[first]))
    where = (f"; coordinates {_names(at_bound)} sit at a bound wherever the rows hold"
             if bool(fast_outer[first]) and bool(at_bound.any()) else "")
    raise ValueError(
        f"the polytope {{A z = k}} ∩ [lower, upper] has no volume on the plane for batch element {index}: the rows "
        f"together with the bounds fix a direction (a face or a single point{where}), "
        f"so no point of the plane lies {tol:g} conditional standard deviations "
        "inside every bound. P(box | plane) = 0 and the truncated law has no density there. Drop the fixed "
        "coordinates from the model (or add their values to the rows), or widen the bounds.")


@torch.no_grad()
def check_line_section(alpha_lo: Tensor, beta_hi: Tensor, finite: Tensor, pinned_out: Tensor,
                       dtype: torch.dtype) -> None:
    r"""For a line (``n - a == 1``): ``ValueError`` when the box's section is empty or a single point.

    Args:
        alpha_lo, beta_hi: ``(*batch, n)``: each coordinate's standardized interval on the line
            (``-inf`` / ``+inf`` where the coordinate does not bound it), as
            :func:`~hardeq.bounds.normaliser.line_bounds` gives them.
        finite: ``(*batch, n)``: where the coordinate moves along the line at all.
        pinned_out: ``(*batch)``: where a coordinate that does not move lies outside its bounds (empty).
        dtype: the distribution's dtype (:func:`volume_tol`).

    The section is :math:`[\max_i \alpha_i, \min_i \beta_i]`; each coordinate's interval is shrunk and grown by
    ``t`` (at most a quarter of its own width): empty when the grown one is, a single point when only the shrunk one
    is (module docstring)."""
    tol = volume_tol(dtype)
    if bool(pinned_out.any()):
        idx = tuple(int(i) for i in pinned_out.nonzero()[0]) if pinned_out.dim() else ()
        raise ValueError(f"the polytope {{A z = k}} ∩ [lower, upper] of batch element {idx} is empty: the plane is a "
                         "line (n - a = 1) and a coordinate the rows fix lies outside its bounds. Widen the bounds "
                         "or change k.")
    width = (beta_hi - alpha_lo).nan_to_num(posinf=torch.finfo(alpha_lo.dtype).max)
    m = torch.where(finite, torch.minimum(torch.full_like(width, tol), width / 4), torch.zeros_like(width))
    inner_ok = (alpha_lo + m).amax(-1) < (beta_hi - m).amin(-1)
    if bool(inner_ok.all()):
        return
    outer = (alpha_lo - m).amax(-1) <= (beta_hi + m).amin(-1)
    bad = ~inner_ok
    idx = tuple(int(i) for i in bad.nonzero()[0]) if bad.dim() else ()
    a_, b_ = float(alpha_lo.amax(-1)[idx]), float(beta_hi.amin(-1)[idx])
    what = "a single point" if bool(outer[idx]) else "empty"
    raise ValueError(f"the polytope {{A z = k}} ∩ [lower, upper] of batch element {idx} is {what}: the plane is a "
                     f"line (n - a = 1) and the box cuts it to the standardized interval [{a_:.6g}, {b_:.6g}] "
                     f"(tested to {tol:g} standard deviations). Widen the bounds or change k.")
