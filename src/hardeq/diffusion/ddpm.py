r"""Native DDPM sampler (no diffusers needed) with an exactly constrained last step.

The reverse step at train timestep ``t`` (``t = T - 1, ..., 0``, diffusers' indexing) is the Gaussian
:math:`p_\theta(x_{t-1} \mid x_t) = \mathcal N(\mu_\theta(x_t), \sigma_t^2 I)` with

.. math::
    \hat x_0 = \frac{x_t - \sqrt{1 - \bar\alpha_t}\,\varepsilon_\theta(x_t, t)}{\sqrt{\bar\alpha_t}}, \qquad
    \mu_\theta = \frac{\sqrt{\bar\alpha_{t-1}}\,\beta_t}{1 - \bar\alpha_t}\hat x_0
      + \frac{\sqrt{\alpha_t}(1 - \bar\alpha_{t-1})}{1 - \bar\alpha_t} x_t,

(:math:`\bar\alpha_{-1} = 1`) and :math:`\sigma_t^2 = \frac{1 - \bar\alpha_{t-1}}{1 - \bar\alpha_t}\beta_t`
("fixed_small", diffusers' default) or :math:`\beta_t` ("fixed_large").

**Constrained last step.** At ``t = 0`` the mean is :math:`\mu_\theta(x_1) = \hat x_0` and the "fixed_small"
variance is 0: the step is deterministic, and conditioning a point mass on :math:`Ax_0 = k` is degenerate.
The constrained last step therefore samples

.. math::
    x_0 \sim \mathcal N(\mu_\theta(x_1), \beta_0 I) \mid A x_0 = k,

i.e. the DDPM "fixed_large" variance :math:`\sigma^2 = \beta_0` (``1e-4`` for the usual linear schedule; the
paper's :math:`\beta_1` in 1-based indexing), exactly (Matheron's rule, O(n) for a channel-sum constraint);
``DDPMOptions(scale=...)`` overrides the standard deviation, ``deterministic=True`` returns the conditional mean (the
orthogonal projection of :math:`\mu_\theta` for an isotropic variance). The returned :math:`x_0` is the
conditioned sample itself, so it satisfies the constraint to round-off.

Other steps may be conditioned too (``schedule=``): there :math:`\hat x_0` is replaced by its conditioned
sample with variance :math:`\beta_t` before :math:`\mu_\theta` is formed (Algorithm 1 applied to DDPM).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ..constraints import EqualityConstraint
from ._loop import iterate, setup_loop
from .conditioning import constrained_x0, resolve_scale
from .model import EpsModel, predict_noise
from .noise import randn
from .noise_schedule import alphas_cumprod
from .options import DDPMOptions, resolve_options
from .schedules import Schedule

__all__ = ["ddpm_sample"]

CALL_ARGUMENTS = ("model", "shape", "options", "constraint", "schedule", "generator", "condition_generator", "noise",
                  "callback")


@torch.no_grad()
def ddpm_sample(
    model: EpsModel,
    shape: tuple[int, ...] | torch.Size,
    options: DDPMOptions | None = None,
    *,
    constraint: EqualityConstraint | None = None,
    schedule: Schedule | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
    condition_generator: torch.Generator | None = None,
    noise: Tensor | None = None,
    callback: Callable[[int, int, Tensor, Tensor], None] | None = None,
    **overrides: Any,
) -> Tensor:
    r"""Ancestral DDPM sampling over all ``T`` train timesteps, with the last step (or the steps of
    ``schedule``) conditioned exactly on :math:`Ax_0 = k`.

    With ``constraint=None`` (or an empty schedule) this is the loop of ``diffusers.DDPMScheduler``
    (``clip_sample=False``, epsilon prediction) and, for the same ``generator`` seed, returns the same samples.

    Args:
        model: noise predictor ``model(x_t, t) -> eps``; ``x_t`` ``(B, C, H, W)``, ``t`` LongTensor ``(B,)``; a
            ``diffusers.UNet2DModel`` works as is (its ``.sample`` is used).
        shape: ``(B, C, H, W)``.
        options: how to sample (:class:`~hardeq.diffusion.DDPMOptions`: the forward process, ``variance_type``,
            the conditioned steps' ``scale``, ``deterministic``, ``final``, ``post``, dtype, device, ...);
            default ``DDPMOptions()``: diffusers' default 1000-step linear schedule, ``"fixed_small"``.
        constraint: :math:`Ax = k` on the flattened images (:func:`channel_sum_constraint`, or any
            ``LinearConstraint`` / ``SumConstraint`` with ``event_size = C*H*W`` and batch shape ``()`` or ``(B,)``).
        schedule: loop indices ``i`` (``i = 0`` is ``t = T - 1``, ``i = T - 1`` is ``t = 0``) to condition;
            default (``None``): the last step only when a constraint is given.
        generator: the main stream: :math:`x_T` then one ``randn(shape)`` per step with ``t > 0`` (diffusers'
            order).
        condition_generator: the conditioning stream; default: derived from ``generator``'s state without
            drawing from it (:func:`hardeq.diffusion.noise.derive_generator`).
        noise: :math:`x_T` itself, ``shape`` (then nothing is drawn for it).
        callback: called after every step as ``callback(i, t, x_prev, x0_hat)`` (``x0_hat`` conditioned at the
            conditioned steps).
        **overrides: fields of :class:`~hardeq.diffusion.DDPMOptions` replacing those of ``options``
            (``ddpm_sample(model, shape, num_train_timesteps=100)``).

    Returns:
        Tensor: :math:`x_0`, ``(B, C, H, W)``. When the last step is conditioned every image satisfies the
        constraint to round-off (before ``post``).

    Raises:
        TypeError: ``options`` is not a ``DDPMOptions``, or a keyword names neither a call argument nor an option.

    Cost: ``T`` model calls; a conditioned step adds one exact conditional sample (O(pixels) for a channel-sum
    constraint).

    Example:
        >>> c = channel_sum_constraint((2, 3, 4, 4), [1.0, 0.0, -2.0])
        >>> x = ddpm_sample(lambda x, t: 0 * x, (2, 3, 4, 4), DDPMOptions(num_train_timesteps=20), constraint=c,
        ...                 generator=torch.Generator().manual_seed(0))
        >>> x.shape, bool(satisfies_constraint(x, c).all())
        (torch.Size([2, 3, 4, 4]), True)
    """
    o = resolve_options(options, DDPMOptions, overrides, "ddpm_sample", CALL_ARGUMENTS)
    b = o.train_betas()
    scale, deterministic = o.scale, o.deterministic
    T = b.shape[0]
    abar = alphas_cumprod(b).tolist()
    timesteps = tuple(range(T - 1, -1, -1))
    s = setup_loop(model, shape, constraint, schedule, T, o, generator=generator,
                   condition_generator=condition_generator, noise=noise)
    x, last = s.x, T - 1
    for i, t in iterate(timesteps, o.progress, "DDPM"):
        eps = predict_noise(model, x, t)
        ab_t = abar[t]
        ab_prev = abar[t - 1] if t > 0 else 1.0
        beta_t = 1 - ab_t / ab_prev
        x0 = (x - math.sqrt(1 - ab_t) * eps) / math.sqrt(ab_t)
        if s.finish is not None and i == last:
            x = s.finish(x0, resolve_scale(scale, t, b), s.condition_generator, deterministic)
            if callback is not None:
                callback(i, t, x, x)
            break
        conditioned = i in s.steps
        if conditioned:
            assert s.constraint is not None  # (setup_loop: conditioned steps have a constraint)
            x0 = constrained_x0(x0, s.constraint, resolve_scale(scale, t, b), s.condition_generator, deterministic)
        if conditioned and i == last:
            x = x0  # the conditioned sample itself: exact (mu's coefficients are 1 and 0 only up to round-off)
        else:
            c0 = math.sqrt(ab_prev) * beta_t / (1 - ab_t)
            ct = math.sqrt(1 - beta_t) * (1 - ab_prev) / (1 - ab_t)
            mean = c0 * x0 + ct * x
            if t > 0:
                z = randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
                var = beta_t if o.variance_type == "fixed_large" else max((1 - ab_prev) / (1 - ab_t) * beta_t, 1e-20)
                x = mean + math.sqrt(var) * z
            else:
                x = mean
        if callback is not None:
            callback(i, t, x, x0)
    return s.post(x) if s.post is not None else x
