r"""Calling the noise-prediction model :math:`\varepsilon_\theta(x_t, t)` (private helper of the samplers)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["predict_noise", "call_model", "EpsModel"]

#: a noise-prediction model: ``model(x_t, t) -> eps`` with ``x_t`` of shape ``(B, C, H, W)`` and ``t`` a
#: LongTensor of shape ``(B,)``; the output may be a tensor, a tuple whose first item is the tensor, or an object
#: with a ``.sample`` tensor (``diffusers.UNet2DModel``)
EpsModel = Callable[[Tensor, Tensor], object]


def predict_noise(model: EpsModel, x: Tensor, t: int) -> Tensor:
    """``model(x, t)`` as a tensor of ``x``'s shape; ``t`` is passed as a LongTensor ``(B,)`` on ``x``'s device."""
    timesteps = torch.full((x.shape[0],), int(t), dtype=torch.long, device=x.device)
    return call_model(model, x, timesteps, "noise")


def call_model(model: Callable[[Tensor, Tensor], object], x: Tensor, timesteps: Tensor, what: str) -> Tensor:
    """``model(x, timesteps)`` unwrapped to a tensor of ``x``'s shape and dtype (a tensor, a tuple whose first item
    is the tensor, or an object with a ``.sample`` tensor); ``what`` names the prediction in error messages."""
    out = model(x, timesteps)
    if hasattr(out, "sample") and isinstance(out.sample, Tensor):
        out = out.sample
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        out = out[0]
    if not isinstance(out, Tensor):
        raise TypeError(f"model(x_t, t) must return the predicted {what} as a tensor (or an object with a .sample "
                        f"tensor, like diffusers' UNet2DModel), got {type(out).__name__}.")
    if out.shape != x.shape:
        raise ValueError(f"model(x_t, t) must return the predicted {what} with the shape of x_t {tuple(x.shape)}, "
                         f"got {tuple(out.shape)} (models that also predict a variance are not supported).")
    return out.to(x.dtype)
