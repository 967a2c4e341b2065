r"""The conditioned :math:`x_0`-prediction: an exact sample of :math:`\mathcal N(\hat x_0, \sigma^2 I)` given
:math:`A x_0 = k` (or its mean).

With a diagonal covariance :math:`\Sigma = \mathrm{diag}(s^2)` (``s = scale``) Matheron's rule gives

.. math::
    x_0 = z + \Sigma A^\top (A\Sigma A^\top)^{-1}(k - A z), \qquad z \sim \mathcal N(\hat x_0, \Sigma),

an exact sample of :math:`\mathcal N(\hat x_0, \Sigma)` conditioned on :math:`A x_0 = k`, with mean
:math:`\hat x_0 + \Sigma A^\top (A\Sigma A^\top)^{-1}(k - A\hat x_0)` and covariance
:math:`\Sigma - \Sigma A^\top (A\Sigma A^\top)^{-1} A\Sigma`. For an isotropic :math:`\Sigma = \sigma^2 I` the
mean is the orthogonal projection of :math:`\hat x_0` onto :math:`\{Ax = k\}` (independent of :math:`\sigma`).
For a channel-sum constraint (:func:`~hardeq.diffusion.channel_sum_constraint`) and isotropic scale this is,
per image and channel ``c`` with ``m = H*W`` pixels,

.. math::
    \text{mean} = \hat x_0 + \frac{k_c - \sum \hat x_0}{m}\mathbf 1, \qquad
    \text{cov} = \sigma^2\Big(I - \frac{\mathbf 1\mathbf 1^\top}{m}\Big),

computed in O(n) (:class:`~hardeq.ConstrainedNormal`'s ``"grouped"`` path). Every output satisfies the
constraint to round-off.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from .._utils import is_tracing, validate_default
from ..constraints import EqualityConstraint
from ..distributions.normal import ConstrainedNormal
from .image_constraints import check_image_constraint
from .noise import check_generator, randn

__all__ = ["constrained_x0", "ScaleLike", "resolve_scale"]

#: what the samplers accept as ``scale``: ``None`` (the default :math:`\sqrt{\beta_t}`), a positive float, a
#: tensor broadcastable to the images (per-pixel standard deviations), or a callable ``scale(t) -> float | Tensor``
#: of the train timestep ``t``
ScaleLike = float | Tensor | Callable[[int], "float | Tensor"] | None


def resolve_scale(scale: ScaleLike, t: int, betas: Tensor) -> float | Tensor:
    r"""The standard deviation used at train timestep ``t``: :math:`\sqrt{\beta_t}` for ``None``, ``scale(t)`` for
    a callable, ``scale`` otherwise."""
    if scale is None:
        return math.sqrt(float(betas[t]))
    if callable(scale) and not isinstance(scale, Tensor):
        return scale(t)
    return scale


def _flat_scale(scale: float | Tensor, x: Tensor) -> Tensor:
    """Standard deviations as ``(n,)`` (shared by the batch) or ``(B, n)``, in ``x``'s dtype and device."""
    B, n = x.shape[0], math.prod(x.shape[1:])
    if isinstance(scale, bool) or not isinstance(scale, (int, float, Tensor)):
        raise TypeError(f"constrained_x0: scale must be a positive float or a tensor of standard deviations, got "
                        f"{type(scale).__name__}.")
    if not isinstance(scale, Tensor):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"constrained_x0: scale must be a positive finite standard deviation, got {scale!r}.")
        return torch.full((n,), float(scale), dtype=x.dtype, device=x.device)
    s = scale.to(dtype=x.dtype, device=x.device)
    if s.numel() == 1:
        s = s.reshape(1).expand(n)
    else:
        try:
            full = torch.broadcast_to(s, x.shape)
        except RuntimeError:
            raise ValueError(f"constrained_x0: scale of shape {tuple(scale.shape)} does not broadcast to the images' "
                             f"shape {tuple(x.shape)}.") from None
        shared = s.dim() < x.dim() or s.shape[0] == 1
        s = full[0].reshape(n) if shared else full.reshape(B, n)
    message = ("constrained_x0: scale must hold positive finite standard deviations; the conditioning is "
               "degenerate for a zero scale.")
    ok = (torch.isfinite(s) & (s > 0)).all()
    if validate_default(None) and not is_tracing():
        if not bool(ok):
            raise ValueError(message)
    elif torch._C._functorch.maybe_current_level() is None:  # without validation: on the device, deferred
        torch._assert_async(ok, message)
    return s


def constrained_x0(x0_hat: Tensor, constraint: EqualityConstraint, scale: float | Tensor,
                   generator: torch.Generator | None = None, deterministic: bool = False) -> Tensor:
    r"""Replace the prediction :math:`\hat x_0` by an exact sample of :math:`\mathcal N(\hat x_0, \mathrm{diag}(s^2))`
    conditioned on :math:`A x_0 = k` (``deterministic=False``), or by the conditional mean (``deterministic=True``;
    for an isotropic scale, the orthogonal projection of :math:`\hat x_0` onto :math:`\{Ax = k\}`).

    Args:
        x0_hat (Tensor): the prediction, ``(B, C, H, W)`` (any ``(B, *image_shape)``), float32 or float64.
        constraint (EqualityConstraint): acts on the flattened images ``(B, n)``, ``n = C*H*W``; batch shape
            ``()`` or ``(B,)`` (see :func:`channel_sum_constraint`). Converted to ``x0_hat``'s dtype/device.
        scale (float | Tensor): the standard deviation :math:`s` (e.g. :math:`\sqrt{\beta_t}`): a positive float,
            or a tensor broadcastable to ``x0_hat.shape`` (per-image / per-channel / per-pixel).
        generator (torch.Generator, optional): the conditioning stream (``(B, n)`` standard normals are drawn from
            it; torch's global RNG when ``None``). Unused when ``deterministic``.
        deterministic (bool): return the conditional mean instead of a sample.

    Returns:
        Tensor: same shape and dtype as ``x0_hat``; every image satisfies the constraint to round-off.
        Differentiable w.r.t. ``x0_hat`` (and a tensor ``scale``).

    Example:
        >>> from hardeq.diffusion import channel_sum_constraint
        >>> x = torch.randn(2, 3, 4, 4)
        >>> c = channel_sum_constraint(x.shape, torch.tensor([1.0, 2.0, 3.0]))
        >>> y = constrained_x0(x, c, 0.1, generator=torch.Generator().manual_seed(0))
        >>> torch.allclose(y.sum((-2, -1)), torch.tensor([1.0, 2.0, 3.0]).expand(2, 3), atol=1e-5)
        True
    """
    if not isinstance(x0_hat, Tensor):
        raise TypeError(f"constrained_x0: x0_hat must be a torch.Tensor, got {type(x0_hat).__name__}.")
    if not x0_hat.is_floating_point() or x0_hat.dim() < 2:
        raise ValueError(f"constrained_x0: x0_hat must be a floating tensor of shape (B, C, H, W), got dtype "
                         f"{x0_hat.dtype} and shape {tuple(x0_hat.shape)}.")
    check_generator("generator", generator)
    con = check_image_constraint(constraint, x0_hat, owner="constrained_x0")
    B = x0_hat.shape[0]
    loc = x0_hat.reshape(B, -1)
    s = _flat_scale(scale, x0_hat)
    dist = ConstrainedNormal(loc, s, constraint=con)
    if deterministic:
        out = dist.mean
    else:
        noise = randn((B, loc.shape[-1]), generator=generator, device=loc.device, dtype=loc.dtype)
        out = dist.rsample(noise=noise)
    return out.reshape(x0_hat.shape)
