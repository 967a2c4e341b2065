r"""Native Euler sampler for flow matching (rectified flow) with an exact last step.

Rectified flow interpolates :math:`x_t = (1 - t)\,x_0 + t\,\varepsilon` (:math:`t \in [0, 1]`, :math:`x_1 = \varepsilon`
noise) and learns the velocity :math:`v_\theta(x_t, t) \approx E[\varepsilon - x_0 \mid x_t]`
(:math:`dx_t/dt = v`). The sampler integrates from :math:`t = 1` to :math:`0` over decreasing times
:math:`\sigma_0 > \sigma_1 > \dots > \sigma_N = 0` with Euler steps; at step ``i`` (:math:`t = \sigma_i`):

1. :math:`v = v_\theta(x_t, t \cdot \text{time\_scale})`, the clean-image prediction
   :math:`\hat x_0 = x_t - t\,v`;
2. if ``i`` is in the schedule: :math:`\hat x_0 \leftarrow` an exact sample of
   :math:`\mathcal N(\hat x_0, s^2 I) \mid A\hat x_0 = k` (Matheron's rule, :func:`constrained_x0`; its mean with
   ``deterministic=True``), and :math:`v \leftarrow (x_t - \hat x_0) / t`;
3. Euler: :math:`x_{\sigma_{i+1}} = x_t + (\sigma_{i+1} - \sigma_i)\,v`.

At the last step (:math:`\sigma_N = 0`) the Euler update is :math:`x_t - t\,v = \hat x_0`, so the conditioned
last step returns the conditioned :math:`\hat x_0` itself: exact to round-off. ``final="box"`` returns instead the
conditional mode in the box, :func:`box_project` of the unconditioned :math:`\hat x_0` (isotropic metric by
default: the Euclidean projection onto the sums and ``[lo, hi]``); ``final="sample_box"`` a sample of
:math:`\mathcal N(\hat x_0, s^2 I)` given the sums and the box (:func:`~hardeq.diffusion.box.sampled_last_step`).

**Default variance.** The flow has no per-step noise variance like DDPM's :math:`\beta_t`; the default standard
deviation of a conditioned step is the step length :math:`s = \sigma_i - \sigma_{i+1}` (``1/N`` for the uniform
grid: 0.02 at ``N = 50``, the size of :math:`\sqrt{\beta_0}` = 0.01 of DDPM's last step), a convention.
``FlowOptions(scale=...)`` overrides it (a float, a tensor broadcastable to the images, or a callable of the time
``t``). It does not matter for ``deterministic=True`` or ``final="box"`` with an isotropic scale.

**diffusers.** Without a constraint the loop is ``FlowMatchEulerDiscreteScheduler``'s (deterministic sampling):
pass ``FlowOptions(sigmas=scheduler.sigmas, time_scale=scheduler.config.num_train_timesteps)`` (``sigmas`` after
``set_timesteps``; they end with 0; the model then receives ``scheduler.timesteps``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ..constraints import EqualityConstraint
from ._loop import iterate, setup_loop
from .conditioning import constrained_x0
from .model import call_model
from .noise_schedule import flow_sigmas
from .options import FlowOptions, resolve_options
from .schedules import Schedule

__all__ = ["flow_sample", "flow_sigmas"]

#: a velocity model: ``model(x_t, t) -> v`` with ``t`` a float tensor ``(B,)`` (times ``time_scale``)
VelocityModel = Callable[[Tensor, Tensor], object]

CALL_ARGUMENTS = ("model", "shape", "options", "constraint", "schedule", "generator", "condition_generator", "noise",
                  "callback")


@torch.no_grad()
def flow_sample(
    model: VelocityModel,
    shape: tuple[int, ...] | torch.Size,
    options: FlowOptions | None = None,
    *,
    constraint: EqualityConstraint | None = None,
    schedule: Schedule | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
    condition_generator: torch.Generator | None = None,
    noise: Tensor | None = None,
    callback: Callable[[int, float, Tensor, Tensor], None] | None = None,
    **overrides: Any,
) -> Tensor:
    r"""Euler sampling of a rectified-flow velocity model from :math:`t = 1` to :math:`0`, with the
    :math:`\hat x_0`-prediction conditioned on :math:`Ax_0 = k` at the steps of ``schedule`` (module docstring).

    Args:
        model: velocity predictor ``model(x_t, t) -> v`` (:math:`v \approx \varepsilon - x_0`); ``t`` is a float
            tensor ``(B,)`` equal to the time times ``time_scale``; ``.sample`` / tuple outputs are unwrapped.
        shape: ``(B, C, H, W)``.
        options: how to sample (:class:`~hardeq.diffusion.FlowOptions`: the time grid ``num_steps`` or
            ``sigmas``, ``time_scale``, the conditioned steps' ``scale`` (default: the step length),
            ``deterministic``, ``final``, ``post``, dtype, device, ...); default ``FlowOptions()``: 50
            uniform Euler steps.
        constraint: :math:`Ax = k` on the flattened images (:func:`channel_sum_constraint`, ...).
        schedule: loop indices to condition (a :class:`Schedule` or indices); default: the last step when a
            constraint is given. Only a schedule containing the last step (or ``final``) makes the output
            exact.
        generator: the main stream (only :math:`x_1 = \varepsilon` is drawn from it: the Euler sampler is
            deterministic).
        condition_generator: the conditioning stream; default: derived from ``generator`` without drawing.
        noise: :math:`x_1` itself, ``shape``.
        callback: called after every step as ``callback(i, t, x_next, x0_hat)``.
        **overrides: fields of :class:`~hardeq.diffusion.FlowOptions` replacing those of ``options``
            (``flow_sample(model, shape, num_steps=20)``).

    Returns:
        Tensor: :math:`x_0`, ``(B, C, H, W)``; every image satisfies the constraint to round-off when the last
        step is conditioned or ``final`` (before ``post``).

    Raises:
        TypeError: ``options`` is not a ``FlowOptions``, or a keyword names neither a call argument nor an option.

    Cost: ``N`` model calls; a conditioned step adds one exact conditional sample (O(pixels) for a channel-sum
    constraint).

    Example:
        >>> c = channel_sum_constraint((2, 1, 4, 4), [3.0])
        >>> x = flow_sample(lambda x, t: 0 * x, (2, 1, 4, 4), FlowOptions(num_steps=10, final="box", box=(0.0, 1.0)),
        ...                 constraint=c, generator=torch.Generator().manual_seed(0))
        >>> x.shape, bool(satisfies_constraint(x, c).all()), bool(((x >= 0) & (x <= 1)).all())
        (torch.Size([2, 1, 4, 4]), True, True)
    """
    o = resolve_options(options, FlowOptions, overrides, "flow_sample", CALL_ARGUMENTS)
    sig = o.time_grid()
    scale, deterministic, time_scale = o.scale, o.deterministic, o.time_scale
    N = len(sig) - 1
    s = setup_loop(model, shape, constraint, schedule, N, o, generator=generator,
                   condition_generator=condition_generator, noise=noise)
    x, last = s.x, N - 1
    for i, t in iterate(sig[:-1], o.progress, "Flow"):
        t_next = sig[i + 1]
        tt = torch.full((x.shape[0],), t * float(time_scale), dtype=x.dtype, device=x.device)
        v = call_model(model, x, tt, "velocity")
        x0 = x - t * v
        std = (t - t_next) if scale is None else (scale(t) if callable(scale) and not isinstance(scale, Tensor)
                                                  else scale)
        if s.finish is not None and i == last:
            x = s.finish(x0, std, s.condition_generator, deterministic)
            if callback is not None:
                callback(i, t, x, x)
            break
        conditioned = i in s.steps
        if conditioned:
            assert s.constraint is not None  # (setup_loop: conditioned steps have a constraint)
            x0 = constrained_x0(x0, s.constraint, std, s.condition_generator, deterministic)
            v = (x - x0) / t
        x = x0 if conditioned and i == last else x + (t_next - t) * v
        if callback is not None:
            callback(i, t, x, x0)
    return s.post(x) if s.post is not None else x
