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
default: the Euclidean projection onto the sums and ``[lo, hi]``).

**Default variance.** The flow has no per-step noise variance like DDPM's :math:`\beta_t`; the default standard
deviation of a conditioned step is the step length :math:`s = \sigma_i - \sigma_{i+1}` (``1/N`` for the uniform
grid: 0.02 at ``N = 50``, the size of :math:`\sqrt{\beta_0}` = 0.01 of DDPM's last step), a convention.
``scale=`` overrides it (a float, a tensor broadcastable to the images, or a callable of the time ``t``). It does
not matter for ``deterministic=True`` or ``final="box"`` with an isotropic scale.

**diffusers.** Without a constraint the loop is ``FlowMatchEulerDiscreteScheduler``'s (deterministic sampling):
pass ``sigmas=scheduler.sigmas`` (after ``set_timesteps``; they end with 0) and
``time_scale=scheduler.config.num_train_timesteps`` (the model then receives ``scheduler.timesteps``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from ..constraints import EqualityConstraint
from ._loop import iterate, setup_loop
from .box import boxed_last_step, check_final
from .conditioning import constrained_x0
from .model import call_model
from .schedules import Schedule

__all__ = ["flow_sample", "flow_sigmas"]

#: a velocity model: ``model(x_t, t) -> v`` with ``t`` a float tensor ``(B,)`` (times ``time_scale``)
VelocityModel = Callable[[Tensor, Tensor], object]


def flow_sigmas(num_steps: int) -> tuple[float, ...]:
    """The uniform time grid ``1, 1 - 1/N, ..., 1/N, 0`` (``N + 1`` values).

    Example:
        >>> flow_sigmas(4)
        (1.0, 0.75, 0.5, 0.25, 0.0)
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}.")
    return tuple(1.0 - j / num_steps for j in range(num_steps)) + (0.0,)


def _check_sigmas(sigmas: Iterable[float] | Tensor) -> tuple[float, ...]:
    sig = tuple(float(s) for s in (sigmas.tolist() if isinstance(sigmas, Tensor) else sigmas))
    if (len(sig) < 2 or sig[-1] != 0.0 or any(not 0 < s <= 1 for s in sig[:-1])
            or any(a <= b for a, b in zip(sig, sig[1:]))):
        raise ValueError(f"sigmas must be strictly decreasing times in (0, 1] ending with 0 (e.g. flow_sigmas(N) or "
                         f"diffusers' scheduler.sigmas), got {sig}.")
    return sig


@torch.no_grad()
def flow_sample(
    model: VelocityModel,
    shape: tuple[int, ...] | torch.Size,
    num_steps: int | None = None,
    constraint: EqualityConstraint | None = None,
    schedule: Schedule | Iterable[int] | None = None,
    *,
    sigmas: Iterable[float] | Tensor | None = None,
    time_scale: float = 1.0,
    scale: float | Tensor | Callable[[float], float | Tensor] | None = None,
    deterministic: bool = False,
    final: str | None = None,
    box: tuple[float, float] = (-1.0, 1.0),
    generator: torch.Generator | None = None,
    condition_generator: torch.Generator | None = None,
    noise: Tensor | None = None,
    post: str | Callable[[Tensor], Tensor] | None = None,
    clip_range: tuple[float, float] = (-1.0, 1.0),
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    callback: Callable[[int, float, Tensor, Tensor], None] | None = None,
) -> Tensor:
    r"""Euler sampling of a rectified-flow velocity model from :math:`t = 1` to :math:`0`, with the
    :math:`\hat x_0`-prediction conditioned on :math:`Ax_0 = k` at the steps of ``schedule`` (module docstring).

    Args:
        model: velocity predictor ``model(x_t, t) -> v`` (:math:`v \approx \varepsilon - x_0`); ``t`` is a float
            tensor ``(B,)`` equal to the time times ``time_scale``; ``.sample`` / tuple outputs are unwrapped.
        shape: ``(B, C, H, W)``.
        num_steps: number of Euler steps on the uniform grid :func:`flow_sigmas`; or give ``sigmas``.
        constraint: :math:`Ax = k` on the flattened images (:func:`channel_sum_constraint`, ...).
        schedule: loop indices to condition (a :class:`Schedule` or indices); default: the last step when a
            constraint is given. Only a schedule containing the last step (or ``final="box"``) makes the output
            exact.
        sigmas: explicit decreasing times in ``(0, 1]`` ending with 0 (``N + 1`` values, ``N`` steps).
        time_scale: the model receives ``t * time_scale`` (1000 for diffusers' flow-matching transformers).
        scale: standard deviation of the conditioned steps (default: the step length; module docstring).
        deterministic: conditioned steps use the conditional mean (the projection for an isotropic scale).
        final: ``None`` or ``"box"``: the last step returns :func:`box_project` of the unconditioned
            :math:`\hat x_0` (the conditional mode in ``box``; exact in the sums and in the box; not a sample).
        box: ``(lo, hi)`` of ``final="box"``.
        generator: the main stream (only :math:`x_1 = \varepsilon` is drawn from it: the Euler sampler is
            deterministic).
        condition_generator: the conditioning stream; default: derived from ``generator`` without drawing.
        noise: :math:`x_1` itself.
        post, clip_range: as :func:`ddim_sample` (baselines: ``schedule=(), post="project"``).
        dtype, device: of the samples; default the model's parameters' (or ``noise``'s), else float32 on CPU.
        progress: show a tqdm progress bar.
        callback: called after every step as ``callback(i, t, x_next, x0_hat)``.

    Returns:
        Tensor: :math:`x_0`, ``(B, C, H, W)``; every image satisfies the constraint to round-off when the last
        step is conditioned or ``final="box"`` (before ``post``).
    """
    if sigmas is None:
        if num_steps is None:
            raise ValueError("flow_sample: give num_steps (uniform time grid) or sigmas.")
        sig = flow_sigmas(num_steps)
    else:
        sig = _check_sigmas(sigmas)
        if num_steps is not None and num_steps != len(sig) - 1:
            raise ValueError(f"flow_sample: num_steps = {num_steps} but sigmas has {len(sig)} values "
                             f"({len(sig) - 1} steps).")
    N = len(sig) - 1
    s = setup_loop(model, shape, constraint, schedule, N, deterministic=deterministic, generator=generator,
                   condition_generator=condition_generator, noise=noise, dtype=dtype, device=device, post=post,
                   clip_range=clip_range)
    box_lh = check_final(final, box, s.constraint)
    x, last = s.x, N - 1
    for i, t in iterate(sig[:-1], progress, "Flow"):
        t_next = sig[i + 1]
        tt = torch.full((x.shape[0],), t * float(time_scale), dtype=x.dtype, device=x.device)
        v = call_model(model, x, tt, "velocity")
        x0 = x - t * v
        std = (t - t_next) if scale is None else (scale(t) if callable(scale) and not isinstance(scale, Tensor)
                                                  else scale)
        if box_lh is not None and i == last:
            x = boxed_last_step(x0, s.constraint, std, box_lh)
            if callback is not None:
                callback(i, t, x, x)
            break
        conditioned = i in s.steps
        if conditioned:
            x0 = constrained_x0(x0, s.constraint, std, s.condition_generator, deterministic)
            v = (x - x0) / t
        x = x0 if conditioned and i == last else x + (t_next - t) * v
        if callback is not None:
            callback(i, t, x, x0)
    return s.post(x) if s.post is not None else x
