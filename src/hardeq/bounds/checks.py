r"""Argument checks shared by the samplers: integer counts, the box as tensors, and a feasible start."""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..constraints.base import EqualityConstraint

__all__ = ["StartOffPlane", "_box", "_bound", "_check_int", "_check_start"]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r}).")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return int(value)


def _bound(name: str, value: object, shape: torch.Size, dtype: torch.dtype, device: torch.device,
           default: float, inward: float, read: bool = True) -> Tensor:
    """``value`` (None, a number or a tensor) broadcast to ``shape`` in ``dtype``; a value not representable in
    ``dtype`` is rounded towards the inside of the box (towards ``inward``), so the box never grows."""
    if value is None:
        return torch.full(shape, default, dtype=dtype, device=device)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = torch.tensor(float(value), dtype=torch.float64, device=device)
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, a real number or None, got {type(value).__name__}.")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}.")
    if value.device != device:
        raise ValueError(f"{name} is on device {value.device} but the distribution is on {device}.")
    try:
        wide = torch.broadcast_to(value, shape)
    except RuntimeError:
        raise ValueError(f"{name} must broadcast to batch_shape + (n,) = {tuple(shape)}, got shape "
                         f"{tuple(value.shape)}.") from None
    if read and bool(torch.isnan(wide).any()):
        raise ValueError(f"{name} contains nan; use -inf / +inf for an unbounded coordinate.")
    out = wide.to(dtype)
    moved = out.to(wide.dtype) != wide if wide.dtype != dtype else torch.zeros((), dtype=torch.bool, device=device)
    if not read or bool(moved.any()):  # rounded outward? step one ulp inward
        outward = (out.to(wide.dtype) < wide) if inward > 0 else (out.to(wide.dtype) > wide)
        out = torch.where(outward, torch.nextafter(out, torch.full_like(out, inward)), out)
    return out.contiguous()


def _box(lower: object, upper: object, shape: torch.Size, dtype: torch.dtype,
         device: torch.device, read: bool = True) -> tuple[Tensor, Tensor]:
    """The samplers' ``(lo, hi)``, each ``shape`` in ``dtype`` (:func:`_bound`), checked ``lo <= hi`` (and for nan);
    ``read=False`` skips the checks that read values back (the caller checks them, batched into one read)."""
    lo = _bound("lower", lower, shape, dtype, device, -math.inf, math.inf, read)
    hi = _bound("upper", upper, shape, dtype, device, math.inf, -math.inf, read)
    if read and bool((lo > hi).any()):
        bad = (lo > hi).nonzero()[0].tolist()
        raise ValueError(f"lower must be <= upper everywhere; at index {tuple(bad)} lower = "
                         f"{lo[tuple(bad)].item():.6g} > upper = {hi[tuple(bad)].item():.6g}.")
    return lo, hi


class StartOffPlane(ValueError):
    r"""A sampler's start misses a row of ``A z = k`` by more than :math:`\sqrt\varepsilon` of its size (raised by
    :func:`_check_start`; :class:`~hardeq.TruncatedConstrainedNormal` then starts again from the exact mode where
    the start was its own sync-free one)."""


@torch.no_grad()
def _check_start(start: object, shape: torch.Size, lo: Tensor, hi: Tensor, constraint: EqualityConstraint,
                 dtype: torch.dtype, device: torch.device, read: bool = True) -> Tensor:
    r"""``start`` ``(chains, *batch, n)`` checked (a tensor of that shape on ``device``, inside ``[lo, hi]``, on the
    plane to within :math:`\sqrt\varepsilon` per row) and returned detached in ``dtype``; the samplers' start."""
    if not isinstance(start, Tensor):
        raise TypeError(f"start must be a torch.Tensor of shape (chains, *batch, n), got {type(start).__name__}.")
    if start.dim() != len(shape) + 1 or start.shape[1:] != shape or start.shape[0] < 1:
        raise ValueError(f"start must have shape (chains, *batch_shape, n) = (chains, {', '.join(map(str, shape))}) "
                         f"with chains >= 1, got {tuple(start.shape)}.")
    if not start.is_floating_point() or start.device != device:
        raise TypeError(f"start must be a floating-point tensor on {device}, got {start.dtype} on {start.device}.")
    z0 = start.detach().to(dtype)
    if not read:
        return z0
    outside = ~((z0 >= lo) & (z0 <= hi))
    if bool(outside.any()):
        gap = torch.maximum(lo - z0, z0 - hi).masked_fill(~outside, -math.inf).nan_to_num(math.inf)
        worst = tuple(int(i) for i in torch.unravel_index(gap.argmax(), gap.shape))
        raise ValueError(
            f"start must lie in the box [lower, upper]: {int(outside.sum())} entries are outside (or nan); the "
            f"worst, at index {worst}, is {z0[worst].item():.6g} with bounds [{lo[worst[1:]].item():.6g}, "
            f"{hi[worst[1:]].item():.6g}]. Start from the mode or from rejection draws."
        )
    on_plane = constraint.check(z0, rtol=math.sqrt(torch.finfo(dtype).eps))
    if not bool(on_plane.all()):
        chain = tuple(int(i) for i in (~on_plane).nonzero()[0])
        raise StartOffPlane(f"start must lie on the plane A z = k: chain/batch index {chain} misses a row by more than "
                         f"sqrt(eps) of the row's size. Start from the mode or from rejection draws.")
    return z0
