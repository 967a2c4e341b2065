r"""The geometry of one exact-HMC trajectory on the plane (:mod:`hardeq.bounds.hmc`): the operators of the
conditional law (:class:`_Plane`: the projection :math:`I - KA`, velocity draws of :math:`\mathcal N(0, \bar\Sigma)`,
covariance columns for the wall normals) and the first times a coordinate's harmonic motion
:math:`x_i\cos t + v_i\sin t` meets its walls (:func:`_hit_times`; the module docstring of
:mod:`hardeq.bounds.hmc` derives them)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .target import PlaneTarget

_TWO_PI = 2.0 * math.pi


class _Plane:
    """The operators of one conditional law on the plane, as the sampler uses them (no ``n x n`` matrix)."""

    def __init__(self, target: PlaneTarget) -> None:
        cond = target.conditioner
        self.cond = cond
        self.cov = cond.cov
        self.constraint = cond.constraint
        self.dtype = cond.dtype
        self.steps = 1 if self.dtype == torch.float64 else 2
        self.mean = target.mean.detach()
        eps = torch.finfo(self.dtype).eps
        variance = cond.variance().detach().expand(self.mean.shape)
        floor = 16 * eps * self.cov.variance.detach().expand(self.mean.shape)
        #: coordinates the constraint determines (no motion on the plane): never hit, velocity 0
        self.frozen = variance <= floor
        self.any_frozen = bool(self.frozen.any())

    def project(self, u: Tensor) -> Tensor:
        r""":math:`(I - KA)u`, ``(*sample, *batch, n)``: the part of ``u`` in the plane's direction space."""
        for _ in range(self.steps):
            u = u - self.cond.gain_matvec(self.constraint.matvec(u))
        return u.masked_fill(self.frozen, 0.0) if self.any_frozen else u

    def velocity(self, shape: torch.Size, generator: torch.Generator | None) -> Tensor:
        r"""``shape + (n,)`` draws of :math:`\mathcal N(0, \bar\Sigma)`: :math:`(I - KA)\Sigma^{1/2}\varepsilon`."""
        noise = torch.randn(shape + (self.cov.noise_size,), dtype=self.dtype, device=self.mean.device,
                            generator=generator)
        return self.project(self.cov.sqrt_matvec(noise))

    def column(self, index: Tensor) -> Tensor:
        r""":math:`\Sigma e_i` for the coordinate ``index`` ``(*shape)`` of each trajectory, ``(*shape, n)``: one
        covariance product with a one-hot vector (O(n) diagonal, O(n r) low rank, O(n^2) full). The wall normal
        on the plane is its projection, :math:`\bar\Sigma e_i = (I - KA)\Sigma e_i`."""
        # (one_hot reads the indices' range on the host: a scatter does not)
        e = torch.zeros(index.shape + self.mean.shape[-1:], dtype=self.dtype, device=index.device)
        column: Tensor = self.cov.matvec(e.scatter_(-1, index.unsqueeze(-1), 1.0))
        return column


def _hit_times(x: Tensor, v: Tensor, lo: Tensor, hi: Tensor, movable_lo: Tensor,
               movable_hi: Tensor) -> tuple[Tensor, Tensor]:
    """First times ``t >= 0`` at which ``x_i cos t + v_i sin t`` leaves ``[lo_i, hi_i]`` through the lower and the
    upper wall (``inf`` where it does not), each ``(*shape, n)``; ``0`` for a coordinate at or beyond a wall and
    moving out."""
    phi = torch.atan2(v, x)
    v2 = v * v
    d_lo = (x - lo) * (x + lo) + v2                     # R^2 - lo^2
    t_lo = torch.remainder(phi + torch.atan2(d_lo.clamp_min(0.0).sqrt_(), lo), _TWO_PI)
    t_lo.masked_fill_(~(movable_lo & (d_lo >= 0)), math.inf)
    t_lo.masked_fill_(movable_lo & (x <= lo) & (v < 0), 0.0)
    d_hi = (x - hi) * (x + hi) + v2
    t_hi = torch.remainder(phi - torch.atan2(d_hi.clamp_min(0.0).sqrt_(), hi), _TWO_PI)
    t_hi.masked_fill_(~(movable_hi & (d_hi >= 0)), math.inf)
    t_hi.masked_fill_(movable_hi & (x >= hi) & (v > 0), 0.0)
    return t_lo, t_hi
