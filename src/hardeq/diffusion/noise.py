r"""Random streams of the samplers: the *main* stream and the separate *conditioning* stream.

The main stream (``generator``) draws exactly what diffusers' loops draw, in the same order: the initial
:math:`x_T`, then the per-step noise (DDPM: every step with ``t > 0``; DDIM: every step when ``eta > 0``).
The noise of the conditioned steps (:func:`~hardeq.diffusion.constrained_x0`) comes from a *separate*
generator, so a constrained and an unconstrained run from the same seed see the same :math:`x_T` and the same
per-step noise, whatever the schedule.

When no conditioning generator is given, one is derived from the *state* of the main stream (a hash of
``generator.get_state()``, or of torch's global RNG state when ``generator`` is ``None``) without drawing
from it: reproducible from the main seed, different for successive calls, and it never shifts the main
stream.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

__all__ = ["randn", "derive_generator", "check_generator"]

_SALT = b"hardeq.diffusion.condition"


def check_generator(name: str, generator: object) -> torch.Generator | None:
    """``generator`` if it is ``None`` or a ``torch.Generator``, else ``TypeError`` naming ``name``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{name} must be a torch.Generator or None, got {type(generator).__name__}.")
    return generator


def randn(shape: tuple[int, ...] | torch.Size, *, generator: torch.Generator | None, device: torch.device,
          dtype: torch.dtype) -> Tensor:
    """Standard normal noise drawn like ``diffusers.utils.torch_utils.randn_tensor`` with one generator: on the
    generator's device (or ``device`` without one), then moved to ``device``. The same seed gives the same
    numbers as diffusers' loops."""
    rand_device = generator.device if generator is not None else device
    return torch.randn(tuple(shape), generator=generator, device=rand_device, dtype=dtype).to(device)


def _global_state(device: torch.device) -> Tensor:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def derive_generator(generator: torch.Generator | None, device: torch.device | str) -> torch.Generator:
    """A new generator for the conditioning stream, seeded from a hash of the main stream's current state
    (``generator``, or torch's global RNG for ``device`` when ``None``); draws nothing from the main stream.

    It lives on the main generator's device (or on ``device``'s type when ``generator`` is ``None``, CPU for
    devices without a generator type of their own).

    Examples:
        >>> g = torch.Generator().manual_seed(0)
        >>> a, b = derive_generator(g, "cpu"), derive_generator(g, "cpu")  # the same state of g: the same stream
        >>> torch.equal(torch.randn(3, generator=a), torch.randn(3, generator=b))
        True
        >>> fresh = torch.Generator().manual_seed(0)
        >>> torch.equal(torch.randn(3, generator=g), torch.randn(3, generator=fresh))  # g has not moved
        True
    """
    device = torch.device(device)
    if generator is not None:
        state, gdev = generator.get_state(), generator.device
    else:
        state = _global_state(device)
        gdev = device if device.type == "cuda" and torch.cuda.is_available() else torch.device("cpu")
    digest = hashlib.blake2b(state.cpu().numpy().tobytes() + _SALT, digest_size=8).digest()
    seed = int.from_bytes(digest, "little") & ((1 << 63) - 1)
    out = torch.Generator(device=gdev)
    out.manual_seed(seed)
    return out
