r"""8-bit images whose channel totals stay exact: largest-remainder rounding.

Plain rounding of :math:`255\,x` to integers moves every channel's pixel sum by up to half a grey level per pixel,
so a brightness constraint that held in floating point is lost when the image is saved as a PNG.
:func:`to_uint8_exact` rounds so that each channel's integer pixel sum equals a given integer total
:math:`T_c` *exactly*:

1. scale: :math:`y = 255\,(x - lo)/(hi - lo)` (float64), :math:`f = \lfloor y \rfloor`, fractional part
   :math:`r = y - f`;
2. the deficit :math:`d_c = T_c - \sum_{i \in c} f_i` of each channel;
3. add 1 to the :math:`d_c` pixels of the channel with the largest :math:`r` (ties: the lower pixel index
   first; pixels with :math:`r = 0` or at 255 are never raised).

Every pixel is :math:`\lfloor y\rfloor` or :math:`\lceil y\rceil`, so it is within one grey level of
:math:`y` (strictly: :math:`|out - y| < 1`), never outside ``[0, 255]``, and the result is the integer image
closest to :math:`y` in the Euclidean norm among those with these channel sums (largest-remainder / Hamilton
apportionment). Where plain rounding already gives the total it gives the same image (unless fractional parts
tie at the cut, where the index decides). Vectorised: one sort per channel, O(n log n).

Targets: ``totals=None`` uses :math:`T_c = \mathrm{round}(255 \sum_{i\in c} y_i / 255)`, the nearest integer to
the image's own scaled channel sum (exact when that sum is an integer, e.g. after :func:`box_project` onto totals
:math:`k_c` with :math:`255 (k_c - m\,lo)/(hi - lo)` integer). Given ``totals`` :math:`k_c` (in ``x``'s units)
are mapped the same way and *rounded to the nearest integer* :math:`T_c`; they must be reachable
(:math:`0 \le d_c \le` the number of pixels with a positive fractional part), i.e. within about half a grey
level per pixel of the image's own sums; otherwise ``ValueError`` (project the image onto the totals first).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["to_uint8_exact"]


def to_uint8_exact(x: Tensor, totals: Tensor | None = None, value_range: tuple[float, float] = (0.0, 1.0)) -> Tensor:
    r"""Quantise images to ``uint8`` keeping every channel's integer pixel sum equal to its integer total (module
    docstring).

    Args:
        x (Tensor): images ``(B, C, H, W)`` (or ``(C, H, W)``) with values in ``value_range`` (up to round-off,
            1e-6 of the range; clamped).
        totals (Tensor, optional): channel totals ``(C,)`` or ``(B, C)`` in ``x``'s units; mapped to grey levels
            :math:`255 (k - m\,lo)/(hi - lo)` and rounded to the nearest integer. Default: the images' own channel
            sums, rounded.
        value_range (tuple): ``(lo, hi)`` of ``x``: ``(0, 1)`` (diffusers' output) or ``(-1, 1)`` (a model's space).

    Returns:
        Tensor: ``uint8`` of ``x``'s shape; ``out.sum((-2, -1), dtype=torch.int64) == T`` exactly, and
        ``|out - 255 (x - lo)/(hi - lo)| < 1`` elementwise.

    Raises:
        ValueError: values outside ``value_range``, or totals the rounding cannot reach.

    Example:
        >>> x = torch.full((1, 1, 2, 2), 0.5)              # 127.5 grey levels each, channel total 510
        >>> to_uint8_exact(x).flatten().tolist()           # plain rounding (half to even) gives 512
        [128, 128, 127, 127]
        >>> int(to_uint8_exact(x).sum())
        510
    """
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() not in (3, 4):
        raise TypeError(f"to_uint8_exact: x must be a floating tensor of shape (B, C, H, W) or (C, H, W), got "
                        f"{type(x).__name__ if not isinstance(x, Tensor) else (x.dtype, tuple(x.shape))}.")
    if not isinstance(value_range, (tuple, list)) or len(value_range) != 2:
        raise ValueError(f"value_range must be a pair (lo, hi), got {value_range!r}.")
    lo, hi = float(value_range[0]), float(value_range[1])
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"value_range must be finite with lo < hi, got {value_range!r}.")
    single = x.dim() == 3
    xb = x.unsqueeze(0) if single else x
    B, C, H, W = xb.shape
    m = H * W
    y = (xb.detach().to(torch.float64) - lo) * (255.0 / (hi - lo))
    if not bool(torch.isfinite(y).all()) or float(y.min()) < -255e-6 or float(y.max()) > 255 * (1 + 1e-6):
        raise ValueError(f"to_uint8_exact: values must lie in value_range = ({lo}, {hi}), got [{float(x.min())}, "
                         f"{float(x.max())}]; bring the images into the range with box_project (exact) first.")
    y = y.clamp(0.0, 255.0).reshape(B, C, m)
    f = y.floor()
    r = y - f
    if totals is None:
        T = y.sum(-1).round()
    else:
        k = torch.as_tensor(totals, dtype=torch.float64, device=x.device)
        if k.dim() not in (1, 2) or k.shape[-1] != C or (k.dim() == 2 and k.shape[0] not in (1, B)):
            raise ValueError(f"to_uint8_exact: totals must have shape (C,) = ({C},) or (B, C) = ({B}, {C}), got "
                             f"{tuple(k.shape)}.")
        T = ((k - m * lo) * (255.0 / (hi - lo))).round().expand(B, C)
    d = (T - f.sum(-1)).to(torch.int64)  # (B, C) pixels to raise
    eligible = (r > 0) & (f < 255)
    n_up = eligible.sum(-1)
    bad = (d < 0) | (d > n_up)
    if bool(bad.any()):
        b, c = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"to_uint8_exact: image {b}, channel {c}: the total of {int(T[b, c])} grey levels cannot be "
                         f"reached by rounding (floor sum {int(f[b, c].sum())}, {int(n_up[b, c])} pixels can be "
                         f"raised); the image's own sum is {float(y[b, c].sum()):.3f}. Project the images onto the "
                         f"totals (box_project) before quantising.")
    key = torch.where(eligible, r, torch.full_like(r, -1.0))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # ties: lower index first
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(m, device=x.device).expand(B, C, m))
    out = (f + (rank < d.unsqueeze(-1)).to(f.dtype)).to(torch.uint8).reshape(B, C, H, W)
    return out[0] if single else out
