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

import numpy as np
import torch
from torch import Tensor

from ..constraints import EqualityConstraint
from ._loop import iterate, setup_loop
from .box import boxed_last_step, check_final
from .conditioning import ScaleLike, constrained_x0, resolve_scale
from .model import EpsModel, predict_noise
from .noise import randn
from .noise_schedule import alphas_cumprod, check_betas, make_betas
from .schedules import Schedule

__all__ = ["ddim_sample", "ddim_timesteps"]

SPACINGS = ("leading", "trailing", "linspace")


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


@torch.no_grad()
def ddim_sample(
    model: EpsModel,
    shape: tuple[int, ...] | torch.Size,
    num_steps: int,
    constraint: EqualityConstraint | None = None,
    schedule: Schedule | Iterable[int] | None = None,
    *,
    eta: float = 0.0,
    deterministic: bool = False,
    scale: ScaleLike = None,
    betas: Tensor | None = None,
    num_train_timesteps: int = 1000,
    beta_start: float = 1e-4,
    beta_end: float = 0.02,
    beta_schedule: str = "linear",
    set_alpha_to_one: bool = True,
    timestep_spacing: str = "leading",
    steps_offset: int = 0,
    timesteps: Iterable[int] | None = None,
    generator: torch.Generator | None = None,
    condition_generator: torch.Generator | None = None,
    noise: Tensor | None = None,
    post: str | Callable[[Tensor], Tensor] | None = None,
    final: str | None = None,
    box: tuple[float, float] = (-1.0, 1.0),
    clip_range: tuple[float, float] = (-1.0, 1.0),
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    callback: Callable[[int, int, Tensor, Tensor], None] | None = None,
) -> Tensor:
    r"""DDIM sampling in ``num_steps`` steps with the :math:`\hat x_0`-prediction conditioned on :math:`Ax_0 = k`
    at the steps of ``schedule`` (Algorithm 1; see the module docstring for the update).

    With ``constraint=None`` (or ``schedule=()``) this is the loop of ``diffusers.DDIMScheduler``
    (``clip_sample=False``, epsilon prediction, the same ``eta``, ``set_alpha_to_one``, ``timestep_spacing``,
    ``steps_offset``) and, for the same ``generator`` seed, returns the same samples.

    Args:
        model: noise predictor ``model(x_t, t) -> eps`` (``t``: LongTensor ``(B,)``); a ``diffusers.UNet2DModel``
            works as is.
        shape: ``(B, C, H, W)``.
        num_steps: number of DDIM steps.
        constraint: :math:`Ax = k` on the flattened images (see :func:`channel_sum_constraint`).
        schedule: a :class:`Schedule` (``Uniform(4)``, ``StartEnd(3, 1)``, ...) or loop indices; default
            (``None``): the last step only when a constraint is given. Only a schedule containing
            ``num_steps - 1`` makes the output exact.
        eta: DDIM's stochasticity (0: deterministic DDIM, 1: DDPM-like).
        deterministic: conditioned steps use the conditional mean (projection under :math:`\sigma_t^2 I`)
            instead of a sample.
        scale: standard deviation :math:`\sigma_t` of the conditioned steps: default :math:`\sqrt{\beta_t}` (at
            the train timestep of the step); a float, a tensor broadcastable to ``shape`` or ``t -> scale``.
        betas, num_train_timesteps, beta_start, beta_end, beta_schedule: the forward process (as diffusers).
        set_alpha_to_one: :math:`\bar\alpha` after the last step: 1 (diffusers' default) or :math:`\bar\alpha_0`.
        timestep_spacing, steps_offset: how the ``num_steps`` timesteps are chosen (:func:`ddim_timesteps`).
        timesteps: explicit decreasing train timesteps (overrides the three above; ``num_steps`` must match).
        generator: the main stream (:math:`x_T`, then one ``randn(shape)`` per step when ``eta > 0``).
        condition_generator: the conditioning stream; default: derived from ``generator``'s state without
            drawing from it.
        noise: :math:`x_T` itself.
        post: ``None``, ``"project"``, ``"project_clip"``, ``"clip"`` or a callable applied to the output; the
            baselines are e.g. ``schedule=(), post="project"``.
        final: ``None``, or ``"box"``: the last step returns the conditional *mode* in the box,
            :func:`box_project` of the last step's unconditioned :math:`\hat x_0` onto
            the constraint (a ``SumConstraint``) and ``box``, in the metric of the last step's variance (default
            isotropic: the Euclidean projection); a conditioned last step of ``schedule`` is replaced by it, the
            other conditioned steps are kept. Exact in the sums *and* in ``[lo, hi]``; not a sample.
        box: ``(lo, hi)`` of ``final="box"``.
        clip_range: ``(lo, hi)`` of the ``"clip"`` options.
        dtype, device: of the samples; default the model's parameters' (or ``noise``'s), else float32 on CPU.
        progress: show a tqdm progress bar.
        callback: called after every step as ``callback(i, t, x_prev, x0_hat)``.

    Returns:
        Tensor: :math:`x_0`, ``(B, C, H, W)``; exact (every image satisfies the constraint to round-off) when the
        schedule contains the last step (before ``post``).
    """
    b = check_betas(betas) if betas is not None else make_betas(num_train_timesteps, beta_start, beta_end,
                                                                beta_schedule)
    T = b.shape[0]
    if timesteps is None:
        ts = ddim_timesteps(T, num_steps, timestep_spacing, steps_offset)
    else:
        ts = tuple(int(t) for t in timesteps)
        if len(ts) != num_steps or any(not 0 <= t < T for t in ts) or any(a <= c for a, c in zip(ts, ts[1:])):
            raise ValueError(f"timesteps must be {num_steps} strictly decreasing ints in [0, {T}), got {ts}.")
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not math.isfinite(eta) or eta < 0:
        raise ValueError(f"eta must be a non-negative float, got {eta!r}.")
    abar = alphas_cumprod(b).tolist()
    final_abar = 1.0 if set_alpha_to_one else abar[0]
    s = setup_loop(model, shape, constraint, schedule, num_steps, deterministic=deterministic, generator=generator,
                   condition_generator=condition_generator, noise=noise, dtype=dtype, device=device, post=post,
                   clip_range=clip_range)
    box_lh = check_final(final, box, s.constraint)
    x, last = s.x, num_steps - 1
    for i, t in iterate(ts, progress, "DDIM"):
        ab_t = abar[t]
        ab_prev = abar[ts[i + 1]] if i < last else final_abar
        eps = predict_noise(model, x, t)
        x0 = (x - math.sqrt(1 - ab_t) * eps) / math.sqrt(ab_t)
        if box_lh is not None and i == last:
            x = boxed_last_step(x0, s.constraint, resolve_scale(scale, t, b), box_lh)
            if callback is not None:
                callback(i, t, x, x)
            break
        conditioned = i in s.steps
        if conditioned:
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
