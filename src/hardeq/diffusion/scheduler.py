r"""diffusers integration: :class:`ConstrainedScheduler` wraps a ``DDPMScheduler`` / ``DDIMScheduler`` so that a
plain diffusers loop conditions the :math:`x_0`-prediction on :math:`Ax_0 = k` at the steps of a schedule.

.. code-block:: python

    scheduler = ConstrainedScheduler(DDIMScheduler(num_train_timesteps=1000, clip_sample=False),
                                     channel_sum_constraint(shape, totals), schedule=StartEnd(3, 1))
    scheduler.set_timesteps(50)
    x = torch.randn(shape, generator=g)
    for t in scheduler.timesteps:
        eps = unet(x, t).sample
        x = scheduler.step(eps, t, x, generator=g).prev_sample
    # every image of x satisfies the constraint to round-off

At a conditioned step, :meth:`~ConstrainedScheduler.step` computes diffusers' :math:`\hat x_0` from the model
output, replaces it by :func:`~hardeq.diffusion.constrained_x0` (variance :math:`\beta_t` by default), re-expresses
the replacement in the scheduler's parametrisation (:math:`\varepsilon`, :math:`x_0` or :math:`v`) and calls the
wrapped scheduler's own ``step`` with it (same update, same draws from ``generator``). At the *last* step it
returns the conditioned :math:`x_0` itself as ``prev_sample`` (the wrapped update would rescale it by
:math:`\sqrt{\bar\alpha_0}` with ``set_alpha_to_one=False``, and re-deriving :math:`x_0` from
:math:`\varepsilon` costs round-off), so the output is exact.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..constraints import EqualityConstraint
from ._optional import require_diffusers
from .conditioning import ScaleLike, constrained_x0, resolve_scale
from .image_constraints import check_image_constraint
from .noise import check_generator, derive_generator
from .schedules import Schedule, Steps, resolve_steps

__all__ = ["ConstrainedScheduler", "ConstrainedSchedulerOutput"]

PREDICTION_TYPES = ("epsilon", "sample", "v_prediction")
VARIANCE_TYPES = ("fixed_small", "fixed_small_log", "fixed_large", "fixed_large_log")


@dataclass
class ConstrainedSchedulerOutput:
    """Output of :meth:`ConstrainedScheduler.step` (like diffusers' ``DDIMSchedulerOutput``)."""

    #: :math:`x_{t-1}`, ``(B, C, H, W)``; the conditioned :math:`x_0` after a conditioned last step
    prev_sample: Tensor
    #: :math:`\hat x_0` of this step (conditioned at a conditioned step)
    pred_original_sample: Tensor


class ConstrainedScheduler:
    r"""A ``diffusers.DDPMScheduler`` or ``DDIMScheduler`` whose :math:`x_0`-predictions are conditioned on
    :math:`Ax_0 = k` at the steps of ``schedule``.

    Args:
        scheduler: the wrapped scheduler, built with ``clip_sample=False`` and ``thresholding=False`` (clipping
            :math:`\hat x_0` after conditioning would break the constraint; both default to ``True`` / ``False``
            in diffusers, so pass ``clip_sample=False``). ``prediction_type`` ``"epsilon"``, ``"sample"`` or
            ``"v_prediction"``; DDPM's learned variance types are not supported.
        constraint: :math:`Ax = k` on the flattened images (:func:`channel_sum_constraint`), batch shape ``()`` or
            ``(B,)``; ``None`` makes the wrapper a pass-through. May be reassigned (``.constraint = ...``).
        schedule: a :class:`Schedule` or loop indices into :attr:`timesteps` (index 0: the first step); default
            ``None``: the last step only (when a constraint is given).
        scale: standard deviation of the conditioned steps; default :math:`\sqrt{\beta_t}` (``scheduler.betas[t]``
            at the step's train timestep), a float, a tensor broadcastable to the images, or ``t -> scale``.
        deterministic: use the conditional mean (projection) instead of a sample.
        condition_generator: the conditioning stream; default: derived, at the first conditioned step after each
            :meth:`set_timesteps`, from the state of the ``generator`` passed to :meth:`step` (or torch's global
            RNG) without drawing from it, so that the main stream is that of the unconstrained loop.

    Everything else (``timesteps``, ``config``, ``init_noise_sigma``, ``scale_model_input``, ``add_noise``, ...)
    is the wrapped scheduler's.

    Raises:
        ImportError: diffusers is not installed (``pip install "hardeq[diffusion]"``).
        TypeError: ``scheduler`` is not a DDPMScheduler / DDIMScheduler.
        ValueError: ``clip_sample`` or ``thresholding`` is on, or the prediction / variance type is unsupported.
    """

    def __init__(self, scheduler: object, constraint: EqualityConstraint | None = None,
                 schedule: Schedule | Iterable[int] | None = None, *, scale: ScaleLike = None,
                 deterministic: bool = False, condition_generator: torch.Generator | None = None) -> None:
        diffusers = require_diffusers()
        if not isinstance(scheduler, (diffusers.DDPMScheduler, diffusers.DDIMScheduler)):
            raise TypeError("ConstrainedScheduler wraps a diffusers.DDPMScheduler or diffusers.DDIMScheduler, got "
                            f"{type(scheduler).__name__}.")
        cfg = scheduler.config
        name = type(scheduler).__name__
        if getattr(cfg, "thresholding", False):
            raise ValueError(f"{name} has thresholding=True: dynamic thresholding clips x0_hat after it is "
                             "conditioned, which breaks the constraint A x0 = k. Build the scheduler with "
                             "thresholding=False.")
        if getattr(cfg, "clip_sample", False):
            raise ValueError(f"{name} has clip_sample=True (diffusers' default): clipping x0_hat to "
                             f"[-{cfg.clip_sample_range}, {cfg.clip_sample_range}] after it is conditioned breaks the "
                             f"constraint A x0 = k. Build the scheduler with clip_sample=False, e.g. "
                             f"{name}(..., clip_sample=False) or {name}.from_config(config, clip_sample=False).")
        if cfg.prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {cfg.prediction_type!r}.")
        variance_type = getattr(cfg, "variance_type", None)
        if variance_type is not None and variance_type not in VARIANCE_TYPES:
            raise ValueError(f"{name} has variance_type={variance_type!r}: models that predict their variance are not "
                             f"supported; use one of {VARIANCE_TYPES}.")
        check_generator("condition_generator", condition_generator)
        if constraint is not None and not isinstance(constraint, EqualityConstraint):
            raise TypeError("constraint must be a hardeq.LinearConstraint or hardeq.SumConstraint (e.g. from "
                            f"channel_sum_constraint) or None, got {type(constraint).__name__}.")
        if schedule is not None and not isinstance(schedule, Schedule):
            if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Iterable):
                raise TypeError("schedule must be a hardeq.diffusion Schedule, a sequence of step indices or None, "
                                f"got {type(schedule).__name__}.")
            schedule = Steps(tuple(schedule))
        self.scheduler = scheduler
        self.constraint = constraint
        self.schedule = schedule
        self.scale = scale
        self.deterministic = bool(deterministic)
        self._user_condition_generator = condition_generator
        self._condition_generator = condition_generator

    # ------------------------------------------------------------------ delegation
    def __getattr__(self, name: str):
        if name == "scheduler":  # not yet set (during unpickling)
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    @property
    def timesteps(self) -> Tensor:
        """The wrapped scheduler's timesteps (decreasing); loop index ``i`` is position ``i`` here."""
        return self.scheduler.timesteps

    @property
    def config(self):
        return self.scheduler.config

    def set_timesteps(self, *args, **kwargs) -> None:
        """``scheduler.set_timesteps(...)``; also restarts the derived conditioning stream."""
        self.scheduler.set_timesteps(*args, **kwargs)
        self._condition_generator = self._user_condition_generator

    def conditioned_steps(self) -> tuple[int, ...]:
        """The loop indices (positions in :attr:`timesteps`) that are conditioned."""
        n = len(self.scheduler.timesteps)
        return tuple(sorted(resolve_steps(self.schedule, n, default_last=self.constraint is not None)))

    def __repr__(self) -> str:
        return (f"ConstrainedScheduler({type(self.scheduler).__name__}, constraint={self.constraint!r}, "
                f"schedule={self.schedule!r}, deterministic={self.deterministic})")

    # ------------------------------------------------------------------ the step
    def _index(self, timestep: int | Tensor) -> int:
        ts = self.scheduler.timesteps
        t = int(timestep.item() if isinstance(timestep, Tensor) else timestep)
        hits = (ts == t).nonzero()
        if hits.numel() == 0:
            raise ValueError(f"timestep {t} is not in scheduler.timesteps (call set_timesteps first); got timesteps "
                             f"{ts.tolist()[:5]}...")
        return int(hits[0, 0])

    def _x0(self, model_output: Tensor, t: int, sample: Tensor) -> Tensor:
        ab = self.scheduler.alphas_cumprod[t].to(torch.float64).item()
        kind = self.scheduler.config.prediction_type
        if kind == "epsilon":
            return (sample - (1 - ab) ** 0.5 * model_output) / ab**0.5
        if kind == "sample":
            return model_output
        return ab**0.5 * sample - (1 - ab) ** 0.5 * model_output

    def _output_for(self, x0: Tensor, t: int, sample: Tensor) -> Tensor:
        """The model output that makes the wrapped scheduler's :math:`\\hat x_0` equal ``x0``."""
        ab = self.scheduler.alphas_cumprod[t].to(torch.float64).item()
        kind = self.scheduler.config.prediction_type
        if kind == "epsilon":
            return (sample - ab**0.5 * x0) / (1 - ab) ** 0.5
        if kind == "sample":
            return x0
        return (ab**0.5 * sample - x0) / (1 - ab) ** 0.5

    def step(self, model_output: Tensor, timestep: int | Tensor, sample: Tensor, *args,
             generator: torch.Generator | None = None, return_dict: bool = True, **kwargs):
        r"""diffusers' ``step`` with the :math:`\hat x_0`-prediction conditioned at the scheduled steps.

        Args:
            model_output, timestep, sample: as for the wrapped scheduler (``sample``: ``(B, C, H, W)``).
            generator: the main stream, passed to the wrapped ``step`` (and the source of the derived
                conditioning stream).
            return_dict: return a :class:`ConstrainedSchedulerOutput` (else ``(prev_sample, pred_original_sample)``).
            *args, **kwargs: passed on (``eta``, ``variance_noise``, ... of ``DDIMScheduler.step``).
        """
        check_generator("generator", generator)
        inner = self.scheduler
        if self.constraint is None:
            out = inner.step(model_output, timestep, sample, *args, generator=generator, return_dict=True, **kwargs)
            prev, x0 = out.prev_sample, out.pred_original_sample
        else:
            i = self._index(timestep)
            n = len(inner.timesteps)
            t = int(inner.timesteps[i])
            if i in resolve_steps(self.schedule, n, default_last=True):
                con = check_image_constraint(self.constraint, sample, owner="ConstrainedScheduler.step")
                if self._condition_generator is None and not self.deterministic:
                    self._condition_generator = derive_generator(generator, sample.device)
                scale = resolve_scale(self.scale, t, inner.betas.to(torch.float64))
                x0 = constrained_x0(self._x0(model_output, t, sample), con, scale, self._condition_generator,
                                    self.deterministic)
                out = inner.step(self._output_for(x0, t, sample).to(model_output.dtype), timestep, sample, *args,
                                 generator=generator, return_dict=True, **kwargs)
                prev = x0 if i == n - 1 else out.prev_sample
            else:
                out = inner.step(model_output, timestep, sample, *args, generator=generator, return_dict=True,
                                 **kwargs)
                prev, x0 = out.prev_sample, out.pred_original_sample
        if not return_dict:
            return prev, x0
        return ConstrainedSchedulerOutput(prev_sample=prev, pred_original_sample=x0)
