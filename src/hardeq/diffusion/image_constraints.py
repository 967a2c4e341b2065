r"""Linear equality constraints on images ``(B, C, H, W)``, acting on the flattened image ``(B, C*H*W)``.

An image batch ``x`` of shape ``(B, *image_shape)`` is flattened to ``x.reshape(B, n)``,
``n = prod(image_shape)`` (row-major: for ``(C, H, W)`` the coordinate of pixel ``(c, h, w)`` is
``c*H*W + h*W + w``). Any :class:`~hardeq.LinearConstraint` / :class:`~hardeq.SumConstraint` with
``event_size == n`` and batch shape ``()`` (one constraint for the whole batch) or ``(B,)`` (one per image)
constrains such a batch; :func:`channel_sum_constraint` builds the common "each channel sums to ``k_c``" one
as an O(n) :class:`~hardeq.SumConstraint` (never a dense ``A``).
"""

from __future__ import annotations

import math
from typing import cast
from collections.abc import Sequence

import torch
from torch import Tensor

from ..constraints import EqualityConstraint, SumConstraint

__all__ = ["channel_sum_constraint", "channel_sums", "check_image_constraint", "flatten_images",
           "satisfies_constraint", "validate_image_constraint"]


def _image_shape(shape: object, name: str = "shape") -> tuple[int, ...]:
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, Sequence) or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        raise TypeError(f"{name} must be a tuple of ints such as (B, C, H, W) or (C, H, W), got {shape!r}.")
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (3, 4) or any(s <= 0 for s in shape):
        raise ValueError(f"{name} must be (B, C, H, W) or (C, H, W) with positive sizes, got {shape}.")
    return shape


def channel_sum_constraint(shape: Sequence[int] | torch.Size, totals: Tensor | Sequence[float], *,
                           dtype: torch.dtype | None = None,
                           device: torch.device | str | None = None) -> SumConstraint:
    r"""The constraint "each channel of each image sums to :math:`k_c`" on flattened images.

    For images ``x`` of shape ``(B, C, H, W)`` flattened to ``(B, n)``, ``n = C*H*W``:

    .. math::
        \sum_{h, w} x_{b, c, h, w} = k_{b, c} \quad\text{for every image } b \text{ and channel } c,

    a :class:`~hardeq.SumConstraint` with group id ``c`` for every pixel of channel ``c`` (``C`` groups of
    ``H*W`` pixels): O(n) to apply and to condition on, no dense ``A``.

    Args:
        shape: ``(B, C, H, W)`` or ``(C, H, W)`` (``B`` is only used to check ``totals``).
        totals: :math:`k`, shape ``(C,)`` (the same for every image; the constraint's batch shape is ``()``)
            or ``(B, C)`` (one row per image; batch shape ``(B,)``). A sequence of floats is converted.
        dtype: floating dtype of the totals (default: that of ``totals``, or torch's default for a
            sequence). The samplers convert the constraint to the images' dtype and device anyway.
        device: device of the constraint (default: that of ``totals``).

    Returns:
        SumConstraint: ``index`` of shape ``(n,)`` with values ``0..C-1`` (channel ids), ``k = totals``.

    Example:
        >>> c = channel_sum_constraint((2, 3, 4, 4), torch.tensor([1.0, 0.0, -1.0]))
        >>> c.num_constraints, c.event_size, c.batch_shape
        (3, 48, torch.Size([]))
    """
    shape = _image_shape(shape)
    C, H, W = shape[-3:]
    if not isinstance(totals, Tensor):
        if isinstance(totals, (str, bytes)) or not isinstance(totals, Sequence):
            raise TypeError(f"totals must be a torch.Tensor (or a sequence of floats) of shape (C,) or (B, C), "
                            f"got {type(totals).__name__}.")
        totals = torch.as_tensor(totals, dtype=dtype or torch.get_default_dtype())
    if not totals.is_floating_point():
        totals = totals.to(dtype or torch.get_default_dtype())
    totals = totals.to(dtype=dtype, device=device)
    if totals.dim() not in (1, 2) or totals.shape[-1] != C:
        raise ValueError(f"totals must have shape (C,) = ({C},) or (B, C) for images of shape {shape}, got "
                         f"{tuple(totals.shape)}.")
    if totals.dim() == 2 and len(shape) == 4 and totals.shape[0] not in (1, shape[0]):
        raise ValueError(f"totals has shape {tuple(totals.shape)}, but images of shape {shape} need (B, C) = "
                         f"({shape[0]}, {C}) (or (C,) for one total per channel shared by all images).")
    index = torch.arange(C, device=totals.device).repeat_interleave(H * W)
    return SumConstraint(index, totals)


def flatten_images(x: Tensor, name: str = "x") -> Tensor:
    """``x`` of shape ``(B, *image_shape)`` as ``(B, n)`` (a view when possible)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}.")
    if x.dim() < 2:
        raise ValueError(f"{name} must have shape (B, C, H, W) (or (B, n)), got {tuple(x.shape)}.")
    return x.reshape(x.shape[0], -1)


def check_image_constraint(constraint: object, x: Tensor, *, owner: str = "hardeq.diffusion") -> EqualityConstraint:
    """Check that ``constraint`` applies to the flattened batch ``x`` ``(B, *image_shape)``; return it converted
    to ``x``'s dtype and device (see :func:`validate_image_constraint`)."""
    validate_image_constraint(constraint, tuple(x.shape), owner=owner)
    checked = cast(EqualityConstraint, constraint)  # (validate_image_constraint: an EqualityConstraint)
    return checked.to(device=x.device, dtype=x.dtype)


def validate_image_constraint(constraint: object, shape: tuple[int, ...], *,
                              owner: str = "hardeq.diffusion") -> EqualityConstraint:
    """Check that ``constraint`` applies to a batch of images of shape ``shape = (B, *image_shape)`` flattened to
    ``(B, n)``; return it unchanged.

    Raises:
        TypeError: ``constraint`` is not a :class:`~hardeq.EqualityConstraint`.
        ValueError: its ``event_size`` is not ``n = prod(image_shape)`` or its batch shape is neither ``()`` nor
            ``(B,)`` (nor ``(1,)``).
    """
    if not isinstance(constraint, EqualityConstraint):
        raise TypeError(f"{owner}: constraint must be a hardeq.EqualityConstraint (e.g. from channel_sum_constraint), "
                        f"got {type(constraint).__name__}.")
    B, n = shape[0], math.prod(shape[1:])
    if constraint.event_size != n:
        raise ValueError(f"{owner}: the constraint acts on vectors of size {constraint.event_size}, but images of "
                         f"shape {tuple(shape[1:])} flatten to n = {n}.")
    if tuple(constraint.batch_shape) not in ((), (1,), (B,)):
        raise ValueError(f"{owner}: the constraint's batch shape must be () (one for all images) or (B,) = ({B},), "
                         f"got {tuple(constraint.batch_shape)}.")
    return constraint


def channel_sums(x: Tensor) -> Tensor:
    """Per-channel sums of images ``(B, C, H, W)``, shape ``(B, C)``, accumulated in float64 (returned in
    float64), so that they resolve the round-off of float32 samples.

    Examples:
        >>> x = torch.ones(2, 3, 4, 4)
        >>> channel_sums(x)
        tensor([[16., 16., 16.],
                [16., 16., 16.]], dtype=torch.float64)
    """
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError(f"x must be a tensor of shape (B, C, H, W), got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}.")
    return x.to(torch.float64).sum((-2, -1))


def satisfies_constraint(x: Tensor, constraint: EqualityConstraint, rtol: float | None = None) -> Tensor:
    r"""Boolean tensor ``(B,)``: does each image of ``x`` ``(B, *image_shape)`` satisfy the constraint to
    round-off? The residual :math:`|Ax - k|` is evaluated in float64 and compared with
    ``rtol * (1 + max_j (|A||x| + |k|)_j)``, ``rtol`` defaulting to ``1e-5`` for float32 / ``1e-12`` for float64
    images (see :meth:`hardeq.LinearConstraint.check`).

    Examples:
        >>> c = channel_sum_constraint((2, 1, 2, 2), [3.0])
        >>> x = torch.tensor([[[[1.0, 1.0], [0.5, 0.5]]], [[[1.0, 1.0], [0.5, 0.0]]]])  # sums 3 and 2.5
        >>> satisfies_constraint(x, c)
        tensor([ True, False])
    """
    x2 = flatten_images(x)
    if rtol is None:
        rtol = 1e-5 if x.dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-12
    con = check_image_constraint(constraint, x2, owner="satisfies_constraint").to(dtype=torch.float64)
    return con.check(x2.to(torch.float64), rtol=rtol).expand(x.shape[0])
