r"""One blocked Gibbs sweep as a fixed sequence of about 30 whole-batch kernels (no Python per block, no host read).

The state is ``z`` ``(B, C, n)`` float64 (flattened batch first, then chains). A sweep takes one partition of the
:class:`~hardeq.bounds.partition.Pool` (its constants ``slots`` ``(B, Bk, s, 9)``, ``roots`` ``(B, Bk, 2)`` and
coordinate ``index`` ``(B, Bk * s)``) and two uniforms per block, and moves every block along its direction
:math:`d_b` by a draw of :math:`t_b` from its exact conditional law: the normal
:math:`\mathcal N(-\beta_b/\alpha_b, 1/\alpha_b)` truncated to the chord :math:`[t^-_b, t^+_b]` (module
:mod:`hardeq.bounds.gibbs`). In standard units, :math:`x = (t + \beta/\alpha)\sqrt\alpha` lies in :math:`[a, b]`.

**The 1-D draw.** The interval is reflected when :math:`b > 0` (so that its lower end is at most 0, where
:math:`\Phi` keeps its relative accuracy), giving :math:`[l, h]`. Then

* where :math:`h \ge -` :data:`TAIL` (the usual case): the inverse CDF
  :math:`x = \Phi^{-1}(\Phi(l) + U(\Phi(h) - \Phi(l)))`, with :math:`2\Phi(y) = \mathrm{erfc}(-y/\sqrt2)`
  (``erfc``, ``lerp``, ``ndtri``). :math:`\Phi` is computed to relative round-off down to :math:`-37.5`, so the draw's
  CDF is within round-off of the exact one;
* where :math:`h < -` :data:`TAIL` (a mean far outside the box: :math:`\Phi(h)` would underflow): a Metropolis-
  Hastings step with the *Rayleigh* proposal :math:`x' = -\sqrt{h^2 + 2E}`, :math:`E` exponential truncated so that
  :math:`x' \ge l`, whose density :math:`\propto |x|e^{-x^2/2}` differs from the target's :math:`e^{-x^2/2}` by
  the factor :math:`|x|`: accept with probability :math:`\min(1, |x_0| / |x'|)`, :math:`x_0` the current point (at
  least :math:`1 - 1/h^2` or so; else the block stays). The regime and the proposal depend on the line only, not on
  the position on it, so this is an exact Metropolis-within-Gibbs update: the target stays invariant.

Every kernel runs on every block (the two regimes are chosen by ``where``), and a moved coordinate is clamped into
its box, so that each draw is feasible exactly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["TAIL", "sweep"]

#: below :math:`h = -` ``TAIL`` standard deviations the 1-D draw takes the Rayleigh proposal (module docstring)
TAIL = 35.0
_TAIL_E = math.erfc(TAIL / math.sqrt(2.0))      # 2 Phi(-TAIL)
_SQRT2 = math.sqrt(2.0)


class Constants:
    """The 0-d float64 tensors a sweep uses, made once per call on the state's device."""

    def __init__(self, device: torch.device) -> None:
        self.inv_sqrt2 = torch.tensor(1.0 / _SQRT2, dtype=torch.float64, device=device)
        self.zero = torch.zeros((), dtype=torch.float64, device=device)


def sweep(z: Tensor, index: Tensor, slots: Tensor, roots: Tensor, uniforms: Tensor, c: Constants,
          u_bias: Tensor | None = None, gain: Tensor | None = None, shares: Tensor | None = None) -> Tensor:
    r"""One sweep: ``z`` ``(B, C, n)`` -> the next state (a new tensor).

    Args:
        z: the state, float64, contiguous, feasible.
        index, slots, roots: one partition of the pool, ``(B, Bk * s)``, ``(B, Bk, s, 9)``, ``(B, Bk, 2)``.
        uniforms: ``(B, C, Bk, 2)`` in ``(0, 1)``: the first for the draw (either regime), the second, scaled by
            :math:`\sqrt 2`, for the Metropolis-Hastings test of the tail regime.
        u_bias, gain, shares: with the augmentation, :math:`\xi - \mu G` ``(B, C, r)``, :math:`G` ``(B, n, r)`` and
            the partition's :math:`W^\top` ``(B, r, Bk)``.

    Cost: about 30 elementwise or reduction kernels over ``B C n`` numbers (two batched products more with the
    augmentation); no host synchronisation.
    """
    B, C, n = z.shape
    Bk, s = slots.shape[1], slots.shape[2]
    idx = index.unsqueeze(1).expand(B, C, Bk * s)
    x = z.gather(-1, idx).view(B, C, Bk, s)
    sl = slots.unsqueeze(1)
    T = (sl[..., 0:3] - x.unsqueeze(-1)) * sl[..., 5:8]            # (B, C, Bk, s, 3)
    ends = T[..., 0:2].amax(-2)                                     # (t_lo, -t_hi), (B, C, Bk, 2)
    nbib = T[..., 2].sum(-1)                                        # -beta / sqrt(alpha)
    if u_bias is not None:
        assert gain is not None and shares is not None
        u = torch.baddbmm(u_bias, z, gain)                          # u | z, (B, C, r)
        nbib = torch.baddbmm(nbib, u, shares)                       # the mean shift V u, block by block
    nab = torch.addcmul(nbib.unsqueeze(-1), ends, roots.unsqueeze(1))   # (-a, -b)
    mt = torch.copysign(c.inv_sqrt2, nab[..., 1])                   # m / sqrt 2, m = -1: reflected
    yp = nab * mt.unsqueeze(-1)                                     # -(reflected ends) / sqrt 2
    e = torch.special.erfc(yp)                                      # 2 Phi(reflected ends)
    e_lo, e_hi = torch.aminmax(e, dim=-1)
    x_c = torch.special.ndtri(torch.lerp(e_lo, e_hi, uniforms[..., 0]) * 0.5)
    g = torch.addcmul(nbib, mt, x_c, value=_SQRT2)                 # x - x_0 in standard units (central)
    sq = yp * yp                                                    # (reflected ends)^2 / 2
    s_lo, s_hi = torch.aminmax(sq, dim=-1)
    lg = torch.log1p(uniforms[..., 0] * torch.expm1(s_lo - s_hi))
    rad = torch.sqrt(s_lo - lg)                                     # |x'| / sqrt 2, x' the Rayleigh proposal
    accept = uniforms[..., 1] * rad <= nbib.abs()                   # U sqrt2 |x'| / sqrt2 <= |x_0|
    g_t = torch.addcmul(nbib, mt, rad, value=-2.0)
    g = torch.where(e_hi < _TAIL_E, torch.where(accept, g_t, c.zero), g)
    moved = torch.addcmul(x, g.unsqueeze(-1), sl[..., 8])
    moved = torch.clamp(moved, min=sl[..., 3], max=sl[..., 4])
    return z.scatter(-1, idx, moved.view(B, C, Bk * s))
