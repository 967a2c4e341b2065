r"""The samplers' ``final=`` last step, as one object: the box steps (``"box"``, ``"sample_box"``) or an object that
knows how to finish on its own constraint (a :class:`FinalStep`, e.g. :class:`hardeq.NonlinearConstraint`).

The three native loops and :class:`~hardeq.diffusion.ConstrainedScheduler` ask :func:`resolve_final` once for a
:class:`Finish` and, at the last step, call it on the last step's unconditioned prediction :math:`\hat x_0` and
standard deviation ``std``; the last step's Gaussian is :math:`\mathcal N(\hat x_0, \mathrm{diag}(\mathrm{std}^2))`.

* ``"box"`` / ``"sample_box"`` (:class:`BoxFinish`): its mode / a sample given the grouped sums and the pixel box
  (:func:`~hardeq.diffusion.box.final_step`).
* a :class:`FinalStep` (:class:`ObjectFinish`): the images are flattened to ``(B, n)``, the standard deviations to
  ``(n,)`` or ``(B, n)``, and ``final.last_step(loc, scale, noise)`` returns the finished ``(B, n)`` images:
  ``noise`` is ``(B, n)`` standard normals drawn from the conditioning stream (a sample), or ``None`` with
  ``deterministic=True`` (the deterministic finish, e.g. a projection). For a
  :class:`~hardeq.NonlinearConstraint` :math:`h(z) = k` that is a ``"linearised"`` draw of
  :math:`\mathcal N(\hat x_0, \mathrm{std}^2 I) \mid h = k`, or its mode (the projection of :math:`\hat x_0`
  onto the manifold); both meet every row of :math:`h = k` or raise :class:`~hardeq.manifold.ManifoldError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, cast, runtime_checkable

import torch
from torch import Tensor

from ..constraints import EqualityConstraint
from .box import check_final, final_step
from .conditioning import _flat_scale
from .noise import randn

__all__ = ["FinalStep", "Finish", "BoxFinish", "ObjectFinish", "resolve_final", "is_final_step"]


@runtime_checkable
class FinalStep(Protocol):
    """What ``final=`` accepts besides ``None`` / ``"box"`` / ``"sample_box"``: an object with
    ``last_step(loc, scale, noise) -> Tensor`` on flattened images (module docstring)."""

    def last_step(self, loc: Tensor, scale: Tensor, noise: Tensor | None) -> Tensor: ...


def is_final_step(final: object) -> bool:
    """Does ``final`` finish a sampler by itself (has a callable ``last_step``)?"""
    return callable(getattr(final, "last_step", None)) and not isinstance(final, str)


class Finish(Protocol):
    """The last step of ``final=``: ``finish(x0, std, generator, deterministic) -> x``, images in, images out."""

    @property
    def random(self) -> bool:
        """Does it draw from the conditioning stream (then the loops derive one)?"""

    def __call__(self, x0: Tensor, std: float | Tensor, generator: torch.Generator | None,
                 deterministic: bool) -> Tensor: ...


@dataclass(frozen=True)
class BoxFinish:
    """``final="box"`` (the mode in the box) or ``"sample_box"`` (a sample in the box)."""

    kind: str
    box: tuple[float, float]
    constraint: EqualityConstraint

    @property
    def random(self) -> bool:
        return self.kind == "sample_box"

    def __call__(self, x0: Tensor, std: float | Tensor, generator: torch.Generator | None,
                 deterministic: bool) -> Tensor:
        del deterministic  # ("box" is the mode, "sample_box" a sample, whatever the option says)
        return final_step(self.kind, x0, self.constraint, std, self.box, generator)


@dataclass(frozen=True)
class ObjectFinish:
    """A :class:`FinalStep` applied to flattened images (module docstring)."""

    step: FinalStep
    random: bool = True

    def __call__(self, x0: Tensor, std: float | Tensor, generator: torch.Generator | None,
                 deterministic: bool) -> Tensor:
        B, n = x0.shape[0], math.prod(x0.shape[1:])
        loc = x0.reshape(B, n)
        scale = _flat_scale(std, x0)
        noise = None if deterministic else randn((B, n), generator=generator, device=x0.device, dtype=x0.dtype)
        out = self.step.last_step(loc, scale, noise)
        if not isinstance(out, Tensor) or out.shape != loc.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"final.last_step must return the flattened images' shape {(B, n)}, got {got}.")
        return out.reshape(x0.shape)


def resolve_final(final: object, box: object, constraint: EqualityConstraint | None,
                  deterministic: bool = False) -> Finish | None:
    """The :class:`Finish` of ``final=`` (``None``: the last step as the schedule says). A :class:`FinalStep` brings
    its own constraint (``constraint`` then conditions the scheduled steps before it, if any); ``"box"`` /
    ``"sample_box"`` need a grouped-sum ``constraint`` (:func:`~hardeq.diffusion.box.check_final`)."""
    if is_final_step(final):
        return ObjectFinish(cast(FinalStep, final), random=not deterministic)  # (is_final_step: it has last_step)
    lo_hi = check_final(final, box, constraint)
    if lo_hi is None:
        return None
    assert isinstance(final, str) and constraint is not None  # (check_final: a box has both)
    return BoxFinish(final, lo_hi, constraint)
