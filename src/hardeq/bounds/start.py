r"""A feasible start for the chains without solving the mode and without a host read: one sum row per coordinate.

A Markov chain whose stationary law is the truncated conditional needs only a start *in* the polytope
:math:`P = \{Az = k\}\cap[l, u]`, not its mode (a QP with host reads per iteration: :mod:`hardeq.bounds.mode`). In a
training loop every step builds a fresh law (a new ``loc``), so the mode would be solved once per step. Where every
coordinate lies in at most one row (a grouped sum, :class:`~hardeq.SumConstraint`, or one row of any coefficients),
:func:`feasible_start` builds a point of :math:`P` in a fixed sequence of O(n) whole-batch kernels instead.

**The point.** Write each row in the variables :math:`x_i = c_i z_i` (:math:`c_i` the row's coefficient), whose box is
:math:`[x^-_i, x^+_i]` (:math:`c_i l_i, c_i u_i`, swapped where :math:`c_i < 0`); the row is
:math:`\sum_{i \in g} x_i = k_g`. Anchor each coordinate at :math:`a_i = \mathrm{clamp}(\mu_i, l_i, u_i)` and let
:math:`r_g = k_g - \sum_{i\in g} c_i a_i`, :math:`R_g = 2|r_g| + 1`. The finite box
:math:`L_i = \max(x^-_i, c_i a_i - R_g)`, :math:`U_i = \min(x^+_i, c_i a_i + R_g)` has
:math:`\sum_g L < k_g < \sum_g U` whenever the row can be met strictly inside the box (what
:func:`~hardeq.bounds.polytope.check_polytope` certifies when the law is made): a side on which some coordinate is
unbounded moves by :math:`R_g > |r_g|`, and a side on which every coordinate is bounded is the row's own range. Then

.. math:: x = L + \theta_g (U - L), \qquad \theta_g = \frac{k_g - \sum_g L}{\sum_g U - \sum_g L} \in (0, 1),

a convex combination of two points of the box, so :math:`x^- \le x \le x^+` and :math:`\sum_g x = k_g` up to the
round-off of two sums (relative :math:`O(n\varepsilon)` of :math:`\sum|x|`, in float64); :math:`z = x / c` (a
coordinate in no row, :math:`c_i = 0`, stays at :math:`a_i`), cast to the working dtype and clamped into the box:
every bound met exactly, every row within the untruncated per-row tolerance. Coordinates strictly inside their
bounds wherever the row leaves room (:math:`0 < \theta < 1`), so no chain starts on a face it must first leave.

Cost: O(n) per batch element (O(n a) with ``a = 1`` dense row), about 30 ATen calls, no host read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .target import PlaneTarget

__all__ = ["feasible_start"]

_F64 = torch.float64


@torch.no_grad()
def feasible_start(dist: object, lower: Tensor, upper: Tensor) -> Tensor | None:
    """A point of the polytope ``(*batch, n)`` in ``lower.dtype`` (module docstring), or ``None`` where the
    constraint has two or more rows that share coordinates (not a grouped sum): there the caller solves the mode.

    Args:
        dist: a :class:`~hardeq.bounds.target.PlaneTarget` or a ``ConstrainedNormal``.
        lower, upper: ``(*batch, n)`` bounds (infinite entries allowed) of a polytope with volume
            (:func:`~hardeq.bounds.polytope.check_polytope` passed).

    Examples:
        >>> from hardeq.bounds.start import feasible_start
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.tensor([1.0], dtype=torch.float64))
        >>> d = ConstrainedNormal(torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64), 1.0, constraint=total)
        >>> z = feasible_start(d, torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64))
        >>> bool(((z >= 0) & (z <= 1)).all()), round(float(z.sum()), 12)
        (True, 1.0)
    """
    target = PlaneTarget.of(dist)
    con = target.constraint
    index = con.group_index
    if index is None and con.num_constraints != 1:
        return None
    shape = torch.broadcast_shapes(target.shape, lower.shape, upper.shape)
    lo, hi = lower.to(_F64).expand(shape), upper.to(_F64).expand(shape)
    mu = target.loc.detach().to(_F64).expand(shape)
    G = con.num_constraints
    if index is None:
        c = con.dense_rows()[..., 0, :].detach().to(_F64)
        c = c.expand(torch.broadcast_shapes(c.shape, shape))
        index = torch.zeros(shape[-1], dtype=torch.long, device=lo.device)
    else:
        c = torch.ones((), dtype=_F64, device=lo.device).expand(shape)
    k = con.k.detach().to(_F64)
    batch = torch.broadcast_shapes(c.shape[:-1], k.shape[:-1], shape[:-1])
    c, lo, hi, mu = (t.expand(batch + shape[-1:]) for t in (c, lo, hi, mu))
    k = k.expand(batch + (G,))

    def gsum(x: Tensor) -> Tensor:
        return torch.zeros(batch + (G,), dtype=_F64, device=x.device).index_add_(-1, index, x)

    def per_coord(t: Tensor) -> Tensor:
        return t.index_select(-1, index)

    a = torch.minimum(torch.maximum(mu, lo), hi)
    zero = c == 0
    pos = c > 0
    xa = torch.where(zero, torch.zeros_like(a), c * a)
    x_lo = torch.where(zero, xa, torch.where(pos, c * lo, c * hi))       # -inf allowed; 0 * inf never formed
    x_hi = torch.where(zero, xa, torch.where(pos, c * hi, c * lo))
    r = k - gsum(xa)
    R = per_coord(2.0 * r.abs() + 1.0)
    L = torch.maximum(x_lo, xa - R)
    U = torch.minimum(x_hi, xa + R)
    sl, su = gsum(L), gsum(U)
    theta = ((k - sl) / (su - sl).clamp_min(torch.finfo(_F64).tiny)).clamp(0.0, 1.0)
    x = L + per_coord(theta) * (U - L)
    z = torch.where(zero, a, x / torch.where(zero, torch.ones_like(c), c))
    z = z.expand(torch.broadcast_shapes(z.shape, shape)).to(lower.dtype)
    return torch.minimum(torch.maximum(z, lower), upper)
