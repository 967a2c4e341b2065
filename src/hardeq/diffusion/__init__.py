r"""Hard linear equality constraints for diffusion models, by exact conditioning of the :math:`x_0`-prediction.

A DDPM / DDIM sampling loop predicts, at every step, the clean image
:math:`\hat x_0 = (x_t - \sqrt{1 - \bar\alpha_t}\,\varepsilon_\theta(x_t, t)) / \sqrt{\bar\alpha_t}`. At the steps of
a *schedule* this package replaces :math:`\hat x_0` by an exact sample of :math:`\mathcal N(\hat x_0, \sigma_t^2 I)`
conditioned on :math:`A x_0 = k` (Matheron's rule via :class:`hardeq.ConstrainedNormal`; O(n) for per-channel sums),
and continues the loop from it. When the last step is conditioned, every returned image satisfies the constraint
to round-off.

* constraints on images: :func:`channel_sum_constraint` (each channel sums to :math:`k_c`), or any
  :class:`~hardeq.LinearConstraint` / :class:`~hardeq.SumConstraint` on the flattened image;
* schedules: :class:`Uniform`, :class:`StartEnd`, :class:`StartSpaced`, :class:`EndSpaced`, :class:`Steps`;
* the conditioned replacement: :func:`constrained_x0`;
* native samplers (no diffusers): :func:`ddpm_sample` (exact last step), :func:`ddim_sample` (Algorithm 1),
  :func:`flow_sample` (rectified flow), each configured by one frozen options object (:class:`DDPMOptions`,
  :class:`DDIMOptions`, :class:`FlowOptions`; shared fields in :class:`SamplerOptions`);
* diffusers integration: :class:`ConstrainedScheduler` around ``DDPMScheduler`` / ``DDIMScheduler``;
* post-processing baselines: :func:`project_onto`, :func:`project_and_clip` (``post=`` of the samplers).

``diffusers`` is optional (``pip install "hardeq[diffusion]"``); it is imported only by
:class:`ConstrainedScheduler`. See ``docs/diffusion.md``.
"""

from __future__ import annotations

from typing import Any

import importlib

from .box import box_project
from .conditioning import constrained_x0
from .ddim import ddim_sample
from .ddpm import ddpm_sample
from .flow import flow_sample
from .image_constraints import channel_sum_constraint, channel_sums, satisfies_constraint
from .noise import derive_generator
from .noise_schedule import ddim_timesteps, flow_sigmas, make_betas
from .options import DDIMOptions, DDPMOptions, FlowOptions, NoiseScheduleOptions, SamplerOptions
from .post import clip_to, project_and_clip, project_onto
from .quantize import to_uint8_exact
from .schedules import EndSpaced, Schedule, StartEnd, StartSpaced, Steps, Uniform

__all__ = [
    "Schedule",
    "Uniform",
    "StartEnd",
    "StartSpaced",
    "EndSpaced",
    "Steps",
    "channel_sum_constraint",
    "channel_sums",
    "satisfies_constraint",
    "constrained_x0",
    "ddpm_sample",
    "ddim_sample",
    "SamplerOptions",
    "NoiseScheduleOptions",
    "DDPMOptions",
    "DDIMOptions",
    "FlowOptions",
    "ddim_timesteps",
    "make_betas",
    "derive_generator",
    "project_onto",
    "project_and_clip",
    "clip_to",
    "box_project",
    "to_uint8_exact",
    "flow_sample",
    "flow_sigmas",
    "ConstrainedScheduler",
    "ConstrainedSchedulerOutput",
]


def __getattr__(name: str) -> Any:
    """``ConstrainedScheduler`` / ``ConstrainedSchedulerOutput`` load on first access: their module subclasses
    diffusers' ``SchedulerMixin`` and imports diffusers (``ImportError`` naming the extra when it is missing)."""
    if name in ("ConstrainedScheduler", "ConstrainedSchedulerOutput"):
        return getattr(importlib.import_module(".scheduler", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
