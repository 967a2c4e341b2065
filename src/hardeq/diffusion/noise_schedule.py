r"""Noise schedules :math:`\beta_t` of the forward process, as in diffusers (``DDPMScheduler`` / ``DDIMScheduler``),
and the time grids of the samplers (:func:`ddim_timesteps`, :func:`flow_sigmas`).

:math:`\alpha_t = 1 - \beta_t`, :math:`\bar\alpha_t = \prod_{s \le t}\alpha_s` for train timesteps
``t = 0, ..., T - 1`` (diffusers' indexing: ``t = 0`` is the least noisy level,
:math:`x_t = \sqrt{\bar\alpha_t}\,x_0 + \sqrt{1 - \bar\alpha_t}\,\varepsilon`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

__all__ = ["make_betas", "alphas_cumprod", "ddim_timesteps", "flow_sigmas"]

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
SPACINGS = ("leading", "trailing", "linspace")


def make_betas(num_train_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02,
               beta_schedule: str = "linear") -> Tensor:
    r"""The :math:`\beta_t`, shape ``(T,)``, float64, with the same values as diffusers' schedulers (which build
    them in float32): ``"linear"`` (``linspace(beta_start, beta_end, T)``), ``"scaled_linear"``
    (``linspace(sqrt(beta_start), sqrt(beta_end), T)**2``) or ``"squaredcos_cap_v2"`` (the cosine schedule of
    Nichol & Dhariwal, capped at 0.999).

    Examples:
        >>> make_betas(4, 0.1, 0.4)
        tensor([0.1000, 0.2000, 0.3000, 0.4000], dtype=torch.float64)
        >>> make_betas(4, 0.01, 0.09, "scaled_linear")  # linspace(0.1, 0.3, 4) ** 2
        tensor([0.0100, 0.0278, 0.0544, 0.0900], dtype=torch.float64)
    """
    if isinstance(num_train_timesteps, bool) or not isinstance(num_train_timesteps, int) or num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be a positive int, got {num_train_timesteps!r}.")
    T = num_train_timesteps
    if beta_schedule == "linear":
        betas = torch.linspace(beta_start, beta_end, T, dtype=torch.float32)
    elif beta_schedule == "scaled_linear":
        betas = torch.linspace(beta_start**0.5, beta_end**0.5, T, dtype=torch.float32) ** 2
    elif beta_schedule == "squaredcos_cap_v2":
        def abar(t: float) -> float:
            return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
        betas = torch.tensor([min(1 - abar((i + 1) / T) / abar(i / T), 0.999) for i in range(T)],
                             dtype=torch.float32)
    else:
        raise ValueError(f"beta_schedule must be one of {BETA_SCHEDULES}, got {beta_schedule!r}.")
    return betas.to(torch.float64)


def check_betas(betas: object) -> Tensor:
    """``betas`` as a float64 tensor ``(T,)`` with values in ``(0, 1)``."""
    if not isinstance(betas, Tensor) or betas.dim() != 1 or betas.numel() == 0 or not betas.is_floating_point():
        raise ValueError(f"betas must be a non-empty 1-D floating tensor (T,), got "
                         f"{tuple(betas.shape) if isinstance(betas, Tensor) else type(betas).__name__}.")
    b = betas.detach().to(device="cpu", dtype=torch.float64)
    if not bool(((b > 0) & (b < 1)).all()):
        raise ValueError("betas must lie in (0, 1).")
    return b


def alphas_cumprod(betas: Tensor) -> Tensor:
    r""":math:`\bar\alpha_t = \prod_{s \le t}(1 - \beta_s)`, float64, shape ``(T,)``."""
    return torch.cumprod(1 - betas.to(torch.float64), 0)


def ddim_timesteps(num_train_timesteps: int, num_steps: int, timestep_spacing: str = "leading",
                   steps_offset: int = 0) -> tuple[int, ...]:
    """The train timesteps of a ``num_steps``-step loop, decreasing, as ``diffusers.DDIMScheduler.set_timesteps``:
    ``"leading"`` (diffusers' default): ``(j * (T // num_steps) for j < num_steps)`` reversed, plus
    ``steps_offset``; ``"trailing"``: ``round(arange(T, 0, -T / num_steps)) - 1``; ``"linspace"``:
    ``round(linspace(0, T - 1, num_steps))`` reversed.

    Example:
        >>> ddim_timesteps(1000, 5), ddim_timesteps(1000, 5, "trailing")
        ((800, 600, 400, 200, 0), (999, 799, 599, 399, 199))
    """
    T = num_train_timesteps
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or not 1 <= num_steps <= T:
        raise ValueError(f"num_steps must be an int in [1, num_train_timesteps = {T}], got {num_steps!r}.")
    if timestep_spacing == "leading":
        ts = (np.arange(0, num_steps) * (T // num_steps)).round()[::-1].astype(np.int64) + steps_offset
    elif timestep_spacing == "trailing":
        ts = np.round(np.arange(T, 0, -T / num_steps)).astype(np.int64) - 1
    elif timestep_spacing == "linspace":
        ts = np.linspace(0, T - 1, num_steps).round()[::-1].astype(np.int64)
    else:
        raise ValueError(f"timestep_spacing must be one of {SPACINGS}, got {timestep_spacing!r}.")
    out = tuple(int(t) for t in ts)
    if min(out) < 0 or max(out) >= T:
        raise ValueError(f"timesteps {out} leave [0, {T}); reduce steps_offset = {steps_offset}.")
    return out


def flow_sigmas(num_steps: int) -> tuple[float, ...]:
    """The uniform time grid ``1, 1 - 1/N, ..., 1/N, 0`` (``N + 1`` values).

    Example:
        >>> flow_sigmas(4)
        (1.0, 0.75, 0.5, 0.25, 0.0)
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}.")
    return tuple(1.0 - j / num_steps for j in range(num_steps)) + (0.0,)
