r"""Native DDIM sampler (no diffusers needed) with conditioned :math:`x_0`-predictions (the paper's Algorithm 1).

At loop step ``i`` with train timestep ``t`` and the next one ``t' < t`` (:math:`\bar\alpha_{t'} = 1` after the
last step with ``set_alpha_to_one=True``, else :math:`\bar\alpha_0`):

1. :math:`\varepsilon = \varepsilon_\theta(x_t, t)`,
   :math:`\hat x_0 = (x_t - \sqrt{1 - \bar\alpha_t}\,\varepsilon) / \sqrt{\bar\alpha_t}`;
2. if ``i`` is in the schedule: :math:`\hat x_0 \leftarrow` an exact sample of
   :math:`\mathcal N(\hat x_0, \sigma_t^2 I) \mid A\hat x_0 = k` (default :math:`\sigma_t^2 = \beta_t`), or its mean
   with ``deterministic=True``; then :math:`\varepsilon \leftarrow (x_t - \sqrt{\bar\alpha_t}\,\hat x_0) /
   \sqrt{1 - \bar\alpha_t}`;
3. the DDIM update :math:`x_{t'} = \sqrt{\bar\alpha_{t'}}\,\hat x_0 + \sqrt{1 - \bar\alpha_{t'} - s_t^2}\,
   \varepsilon + s_t z`, :math:`s_t = \eta\sqrt{\tfrac{1 - \bar\alpha_{t'}}{1 - \bar\alpha_t}
   (1 - \tfrac{\bar\alpha_t}{\bar\alpha_{t'}})}`, :math:`z \sim \mathcal N(0, I)` from the main stream
   (drawn at every step when ``eta > 0``, as diffusers does).

**Final step.** When the last step is conditioned, the sampler returns the conditioned :math:`\hat x_0`
itself. With ``set_alpha_to_one=True`` the update of step 3 is :math:`1\cdot\hat x_0 + 0\cdot\varepsilon` anyway,
but with ``set_alpha_to_one=False`` it would return :math:`\sqrt{\bar\alpha_0}\,\hat x_0 +
\sqrt{1 - \bar\alpha_0}\,\varepsilon` (a rescaled, slightly noised image), which breaks :math:`Ax_0 = k`; the
conditioned :math:`x_0` is what the last step estimates, so it is returned (the unconditioned loop follows
diffusers exactly).
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
from .noise_schedule import alphas_cumprod, ddim_timesteps
from .options import DDIMOptions, resolve_options
from .schedules import Schedule

__all__ = ["ddim_sample", "ddim_timesteps"]

CALL_ARGUMENTS = ("model", "shape", "options", "constraint", "schedule", "generator", "condition_generator", "noise",
                  "callback")


@torch.no_grad()
def ddim_sample(
    model: EpsModel,
    shape: tuple[int, ...] | torch.Size,
    options: DDIMOptions | None = None,
    *,
    constraint: EqualityConstraint | None = None,
    schedule: Schedule | Iterable[int] | None = None,
    generator: torch.Generator | None = None,
    condition_generator: torch.Generator | None = None,
    noise: Tensor | None = None,
    callback: Callable[[int, int, Tensor, Tensor], None] | None = None,
    **overrides: Any,
) -> Tensor:
    r"""DDIM sampling with the :math:`\hat x_0`-prediction conditioned on :math:`Ax_0 = k` at the steps of
    ``schedule`` (Algorithm 1; see the module docstring for the update).

    With ``constraint=None`` (or ``schedule=()``) this is the loop of ``diffusers.DDIMScheduler``
    (``clip_sample=False``, epsilon prediction, the same ``eta``, ``set_alpha_to_one``, ``timestep_spacing``,
    ``steps_offset``) and, for the same ``generator`` seed, returns the same samples.

    Args:
        model: noise predictor ``model(x_t, t) -> eps`` (``t``: LongTensor ``(B,)``); a ``diffusers.UNet2DModel``
            works as is.
        shape: ``(B, C, H, W)``.
        options: how to sample (:class:`~hardeq.diffusion.DDIMOptions`: the number of steps, ``eta``, the forward
            process, the conditioned steps' ``scale``, ``deterministic``, ``final``, ``post``, dtype,
            device, ...); default ``DDIMOptions()``: 50 steps of deterministic DDIM over diffusers' default
            linear schedule.
        constraint: :math:`Ax = k` on the flattened images (:func:`channel_sum_constraint`, or any
            ``LinearConstraint`` / ``SumConstraint`` with ``event_size = C*H*W`` and batch shape ``()`` or ``(B,)``).
        schedule: a :class:`Schedule` (``Uniform(4)``, ``StartEnd(3, 1)``, ...) or loop indices ``i`` (``i = 0``
            the first, noisiest step); default (``None``): the last step only when a constraint is given. Only a
            schedule containing the last step makes the output exact.
        generator: the main stream (:math:`x_T`, then one ``randn(shape)`` per step when ``eta > 0``).
        condition_generator: the conditioning stream; default: derived from ``generator``'s state without
            drawing from it.
        noise: :math:`x_T` itself, ``shape``.
        callback: called after every step as ``callback(i, t, x_prev, x0_hat)``.
        **overrides: fields of :class:`~hardeq.diffusion.DDIMOptions` replacing those of ``options``
            (``ddim_sample(model, shape, num_steps=20, eta=1.0)``).

    Returns:
        Tensor: :math:`x_0`, ``(B, C, H, W)``; exact (every image satisfies the constraint to round-off) when the
        schedule contains the last step (before ``post``).

    Raises:
        TypeError: ``options`` is not a ``DDIMOptions``, or a keyword names neither a call argument nor an option.

    Cost: ``num_steps`` model calls; a conditioned step adds one exact conditional sample (O(pixels) for a
    channel-sum constraint).

    Example:
        >>> c = channel_sum_constraint((2, 1, 4, 4), [1.0])
        >>> x = ddim_sample(lambda x, t: 0 * x, (2, 1, 4, 4), DDIMOptions(num_steps=5, num_train_timesteps=50),
        ...                 constraint=c, schedule=StartEnd(1, 1), generator=torch.Generator().manual_seed(0))
        >>> x.shape, bool(satisfies_constraint(x, c).all())
        (torch.Size([2, 1, 4, 4]), True)
    """
    o = resolve_options(options, DDIMOptions, overrides, "ddim_sample", CALL_ARGUMENTS)
    b = o.train_betas()
    ts = o.inference_timesteps()
    num_steps, eta, scale, deterministic = len(ts), o.eta, o.scale, o.deterministic
    abar = alphas_cumprod(b).tolist()
    final_abar = 1.0 if o.set_alpha_to_one else abar[0]
    s = setup_loop(model, shape, constraint, schedule, num_steps, o, generator=generator,
                   condition_generator=condition_generator, noise=noise)
    x, last = s.x, num_steps - 1
    for i, t in iterate(ts, o.progress, "DDIM"):
        ab_t = abar[t]
        ab_prev = abar[ts[i + 1]] if i < last else final_abar
        eps = predict_noise(model, x, t)
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
            eps = (x - math.sqrt(ab_t) * x0) / math.sqrt(1 - ab_t)
        var = (1 - ab_prev) / (1 - ab_t) * (1 - ab_t / ab_prev)
        std = eta * math.sqrt(max(var, 0.0))
        x_new = math.sqrt(ab_prev) * x0 + math.sqrt(max(1 - ab_prev - std**2, 0.0)) * eps
        if eta > 0:
            x_new = x_new + std * randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
        x = x0 if conditioned and i == last else x_new
        if callback is not None:
            callback(i, t, x, x0)
    return s.post(x) if s.post is not None else x
