"""Shared set-up of the native sampling loops (private): arguments, streams, initial noise, steps, progress."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar
from dataclasses import dataclass

import torch
from torch import Tensor

from .._validation import check_device
from ..constraints import EqualityConstraint
from .final import Finish, resolve_final
from .image_constraints import validate_image_constraint
from .noise import check_generator, derive_generator, randn
from .options import SamplerOptions
from .post import resolve_post
from .schedules import Schedule, resolve_steps

__all__ = ["LoopSetup", "setup_loop", "iterate"]


@dataclass
class LoopSetup:
    x: Tensor  # x_T, (B, *image_shape)
    constraint: EqualityConstraint | None  # in x's dtype/device
    steps: frozenset[int]
    condition_generator: torch.Generator | None
    post: Callable[[Tensor], Tensor] | None
    finish: Finish | None = None  # the last step of final= (None: as the schedule says)


def _default_device() -> torch.device:
    """torch's default device for new tensors: the CPU unless ``torch.set_default_device`` (or a
    ``with torch.device(...)`` block) says otherwise."""
    return torch.get_default_device() if hasattr(torch, "get_default_device") else torch.empty(0).device


def _model_dtype_device(model: object) -> tuple[torch.dtype | None, torch.device | None]:
    params = getattr(model, "parameters", None)
    if callable(params):
        try:
            p = next(iter(params()))
        except (StopIteration, TypeError):
            return None, None
        if isinstance(p, Tensor):
            return p.dtype, p.device
    return None, None


def _check_shape(shape: object) -> tuple[int, ...]:
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if (not isinstance(shape, (tuple, list)) or len(shape) < 2
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape)):
        raise ValueError(f"shape must be a tuple of positive ints (B, C, H, W), got {shape!r}.")
    return tuple(shape)


def setup_loop(model: object, shape: object, constraint: EqualityConstraint | None,
               schedule: Schedule | Iterable[int] | None, num_steps: int, options: SamplerOptions, *,
               generator: torch.Generator | None, condition_generator: torch.Generator | None,
               noise: Tensor | None) -> LoopSetup:
    """Check the arguments, derive the conditioning stream (from the main stream's state, before anything is
    drawn from it), draw :math:`x_T` from the main stream (unless ``noise`` is given)."""
    dtype, device, deterministic = options.dtype, options.device, options.deterministic
    check_device(device)
    if not callable(model):
        raise TypeError(f"model must be callable as model(x_t, t), got {type(model).__name__}.")
    check_generator("generator", generator)
    check_generator("condition_generator", condition_generator)
    shape = _check_shape(shape)
    mdtype, mdevice = _model_dtype_device(model)
    if noise is not None:
        if not isinstance(noise, Tensor) or not noise.is_floating_point():
            raise TypeError(f"noise must be a floating torch.Tensor (the initial x_T), got "
                            f"{type(noise).__name__ if not isinstance(noise, Tensor) else noise.dtype}.")
        if tuple(noise.shape) != shape:
            raise ValueError(f"noise (x_T) must have shape {shape}, got {tuple(noise.shape)}.")
        dtype = dtype or noise.dtype
        device = torch.device(device) if device is not None else noise.device
    else:
        dtype = dtype or mdtype or torch.get_default_dtype()
        device = torch.device(device) if device is not None else (mdevice or _default_device())
    if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be a floating dtype, got {dtype}.")
    if constraint is not None:
        con = validate_image_constraint(constraint, shape, owner="sampler").to(device=device, dtype=dtype)
    else:
        con = None
    steps = resolve_steps(schedule, num_steps, default_last=con is not None)
    if steps and con is None:
        raise ValueError(f"schedule {schedule!r} conditions steps {sorted(steps)}, but constraint is None.")
    finish = resolve_final(options.final, options.box, con, deterministic)
    cond_gen = condition_generator
    if cond_gen is None and ((steps and not deterministic) or (finish is not None and finish.random)):
        cond_gen = derive_generator(generator, device)
    if noise is None:
        x = randn(shape, generator=generator, device=device, dtype=dtype)
    else:
        x = noise.to(device=device, dtype=dtype)
    return LoopSetup(x=x, constraint=con, steps=steps, condition_generator=cond_gen,
                     post=resolve_post(options.post, con, options.clip_range), finish=finish)


_T = TypeVar("_T", int, float)


def iterate(timesteps: tuple[_T, ...], progress: bool, desc: str) -> Iterable[tuple[int, _T]]:
    """``enumerate(timesteps)``, with a tqdm progress bar when ``progress``."""
    it = enumerate(timesteps)
    if progress:
        from ._optional import require_tqdm

        bar: Iterable[tuple[int, _T]] = require_tqdm().tqdm(it, total=len(timesteps), desc=desc)
        return bar
    return it
