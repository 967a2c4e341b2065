r"""diffusers integration: :class:`ConstrainedScheduler`, a diffusers scheduler (``SchedulerMixin`` +
``ConfigMixin``) that runs a ``DDPMScheduler`` / ``DDIMScheduler`` and conditions its :math:`x_0`-prediction on
:math:`Ax_0 = k` at the steps of a schedule.

.. code-block:: python

    scheduler = ConstrainedScheduler(DDIMScheduler(num_train_timesteps=1000, clip_sample=False),
                                     channel_sum_constraint(shape, totals), schedule=StartEnd(3, 1))
    pipe = DDPMPipeline(unet, scheduler)                       # runs the DDIM base with eta = 0
    images = pipe(batch_size=4, output_type="np").images       # (x / 2 + 0.5).clamp(0, 1) of exact samples
    pipe.save_pretrained(path)                                 # scheduler/scheduler_config.json holds it all
    pipe = DDPMPipeline.from_pretrained(path)                  # the same constraint, schedule and base config

At a conditioned step, :meth:`~ConstrainedScheduler.step` computes diffusers' :math:`\hat x_0` from the model
output, replaces it by :func:`~hardeq.diffusion.constrained_x0` (variance :math:`\beta_t` by default), re-expresses
the replacement in the scheduler's parametrisation (:math:`\varepsilon`, :math:`x_0` or :math:`v`) and calls the
base scheduler's own ``step`` with it (same update, same draws from ``generator``). At the *last* step it
returns the conditioned :math:`x_0` itself as ``prev_sample`` (the base update would rescale it by
:math:`\sqrt{\bar\alpha_0}` with ``set_alpha_to_one=False``, and re-deriving :math:`x_0` from
:math:`\varepsilon` costs round-off), so the output is exact.

**In the pixel box.** diffusers' pipelines clamp the returned sample, ``(x / 2 + 0.5).clamp(0, 1)``; an exact
sample with pixels outside ``[-1, 1]`` then misses its channel totals after the clamp. With
``final="sample_box"`` the last step returns instead a *sample* of the last step's Gaussian
:math:`\mathcal N(\hat x_0, \mathrm{scale}^2 I)` given the constraint and the box ``[lo, hi]`` (default
``(-1, 1)``; :func:`~hardeq.diffusion.box.sampled_last_step`); ``final="box"`` returns its mode
(:func:`~hardeq.diffusion.box_project`). Either is inside the box, so the clamp changes nothing and the
pipeline's images meet the totals (in ``[0, 1]`` units, :math:`(k + m)/2` for a channel of ``m`` pixels);
:func:`~hardeq.diffusion.to_uint8_exact` keeps them in 8 bits.

**The config.** ``scheduler_config.json`` records ``base_scheduler`` (``{"class_name": "DDIMScheduler",
"config": {...}}``), ``constraint``, ``schedule``, ``scale``, ``deterministic``, ``final`` and ``box`` as JSON (the
specs of ``hardeq.diffusion._scheduler_spec``). ``config`` refuses to be consumed by *another* scheduler's
``from_config`` (a ``TypeError`` naming the fix): that is what ``DDIMPipeline.__init__`` does
(``DDIMScheduler.from_config(scheduler.config)``), and the result would silently drop the constraint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch import Tensor

from ..constraints import EqualityConstraint
from . import _scheduler_spec as spec
from ._optional import require_diffusers
from .box import FINAL_OPTIONS, _check_box
from .final import FinalStep, is_final_step, resolve_final
from .conditioning import ScaleLike, constrained_x0, resolve_scale
from .image_constraints import check_image_constraint
from .noise import check_generator, derive_generator
from .schedules import Schedule, resolve_steps

diffusers = require_diffusers()  # ImportError naming the extra; hardeq.diffusion imports this module lazily
# A saved pipeline records this component as ["hardeq.diffusion.scheduler", "ConstrainedScheduler"] (the class's
# module); diffusers' loader then looks the base classes (SchedulerMixin) up in that module's namespace.
from diffusers.configuration_utils import ConfigMixin, FrozenDict  # noqa: E402
from diffusers.schedulers.scheduling_utils import SchedulerMixin  # noqa: E402
from diffusers.utils.outputs import BaseOutput  # noqa: E402

__all__ = ["ConstrainedScheduler", "ConstrainedSchedulerOutput"]

PREDICTION_TYPES = ("epsilon", "sample", "v_prediction")
VARIANCE_TYPES = ("fixed_small", "fixed_small_log", "fixed_large", "fixed_large_log")
BASE_SCHEDULERS = ("DDPMScheduler", "DDIMScheduler")

_FOREIGN_FROM_CONFIG = (
    "this is the config of a hardeq ConstrainedScheduler, and another scheduler class's from_config(...) would "
    "silently drop its constraint A x0 = k. diffusers' DDIMPipeline does this in its __init__ "
    "(DDIMScheduler.from_config(scheduler.config)): build the pipeline with the base scheduler and set the "
    "constrained one afterwards, pipe = DDIMPipeline(unet, cs.scheduler); pipe.scheduler = cs (or use "
    "DDPMPipeline(unet, cs), which keeps it). To load a saved DDIMPipeline: cs = "
    "ConstrainedScheduler.from_pretrained(path, subfolder='scheduler'); pipe = DDIMPipeline.from_pretrained(path, "
    "scheduler=cs.scheduler); pipe.scheduler = cs. To change the base scheduler: "
    "ConstrainedScheduler(NewScheduler.from_config(cs.scheduler.config), cs.constraint, cs.schedule).")


class _BaseScheduler(Protocol):
    """What is used of the wrapped ``diffusers.DDPMScheduler`` / ``DDIMScheduler``."""

    config: Any  # diffusers' FrozenDict (keys also as attributes)
    timesteps: Tensor
    num_inference_steps: int | None
    init_noise_sigma: float
    betas: Tensor
    alphas_cumprod: Tensor

    def __len__(self) -> int: ...
    def scale_model_input(self, sample: Tensor, timestep: int | None = None) -> Tensor: ...
    def add_noise(self, original_samples: Tensor, noise: Tensor, timesteps: Tensor) -> Tensor: ...
    def get_velocity(self, sample: Tensor, noise: Tensor, timesteps: Tensor) -> Tensor: ...
    def set_timesteps(self, *args: Any, **kwargs: Any) -> None: ...
    def step(self, *args: Any, **kwargs: Any) -> Any: ...


class _ConstrainedConfig(FrozenDict):
    """The config of a :class:`ConstrainedScheduler` as diffusers' ``FrozenDict``, except that diffusers'
    ``extract_init_dict`` (the first thing any ``SomeScheduler.from_config(config)`` does) raises: only
    :meth:`ConstrainedScheduler.from_config` may consume it (it hands diffusers a plain ``dict`` copy)."""

    def get(self, key: str, default: Any = None) -> Any:
        if key == "_use_default_values":  # diffusers.ConfigMixin.extract_init_dict's first read
            raise TypeError(_FOREIGN_FROM_CONFIG)
        return super().get(key, default)


@dataclass
class ConstrainedSchedulerOutput(BaseOutput):
    """Output of :meth:`ConstrainedScheduler.step` (a diffusers ``BaseOutput``, like ``DDIMSchedulerOutput``).

    Examples:
        >>> import diffusers
        >>> c = channel_sum_constraint((1, 1, 2, 2), [1.0])
        >>> cs = ConstrainedScheduler(diffusers.DDPMScheduler(num_train_timesteps=10, clip_sample=False), c)
        >>> x = torch.randn(1, 1, 2, 2, generator=torch.Generator().manual_seed(0))
        >>> out = cs.step(torch.zeros(1, 1, 2, 2), cs.timesteps[-1], x)  # the last step, conditioned
        >>> type(out).__name__, out.prev_sample.shape, bool(satisfies_constraint(out.pred_original_sample, c))
        ('ConstrainedSchedulerOutput', torch.Size([1, 1, 2, 2]), True)
    """

    #: :math:`x_{t-1}`, ``(B, C, H, W)``; the conditioned :math:`x_0` after a conditioned last step
    prev_sample: Tensor
    #: :math:`\hat x_0` of this step (conditioned at a conditioned step)
    pred_original_sample: Tensor


def _json_value(value: Any) -> Any:
    """A base-config value as JSON (diffusers keeps ``trained_betas`` as given: a list, an array or a tensor)."""
    if isinstance(value, (np.ndarray, Tensor)):
        return value.tolist()
    return value


def _base_spec(scheduler: _BaseScheduler) -> dict[str, Any]:
    return {"class_name": type(scheduler).__name__,
            "config": {k: _json_value(v) for k, v in scheduler.config.items() if not k.startswith("_")}}


def _base_from_spec(base: object) -> _BaseScheduler:
    """The base scheduler: an instance as is, or built from ``{"class_name": ..., "config": {...}}``."""
    if isinstance(base, dict):
        name = base.get("class_name")
        if name not in BASE_SCHEDULERS or not isinstance(base.get("config"), dict):
            raise ValueError(f"ConstrainedScheduler: base_scheduler must be {{'class_name': one of {BASE_SCHEDULERS}, "
                             f"'config': {{...}}}}, got {base!r}.")
        built: _BaseScheduler = getattr(diffusers, name).from_config(base["config"])
        return built
    if base is None:
        raise TypeError("ConstrainedScheduler needs a base scheduler: ConstrainedScheduler(DDIMScheduler(..., "
                        "clip_sample=False), constraint, schedule).")
    if not isinstance(base, (diffusers.DDPMScheduler, diffusers.DDIMScheduler)):
        raise TypeError("ConstrainedScheduler wraps a diffusers.DDPMScheduler or diffusers.DDIMScheduler, got "
                        f"{type(base).__name__}.")
    return cast(_BaseScheduler, base)  # (checked: a DDPMScheduler or DDIMScheduler)


def _check_base(scheduler: _BaseScheduler) -> None:
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


class ConstrainedScheduler(SchedulerMixin, ConfigMixin):
    r"""A diffusers scheduler that runs a ``DDPMScheduler`` or ``DDIMScheduler`` (the *base*) and conditions its
    :math:`x_0`-predictions on :math:`Ax_0 = k` at the steps of ``schedule``.

    Every argument but ``condition_generator`` is recorded in :attr:`config` as JSON, so that ``save_pretrained``
    / ``from_pretrained`` / ``from_config`` round-trip it, alone and inside a pipeline. Each argument takes the
    runtime object or its JSON spec (what the config holds; see ``hardeq.diffusion._scheduler_spec``).

    Args:
        base_scheduler: a ``DDPMScheduler`` / ``DDIMScheduler`` instance (kept as is, timesteps included) or
            ``{"class_name": "DDIMScheduler", "config": {...}}``. Built with ``clip_sample=False`` and
            ``thresholding=False`` (clipping :math:`\hat x_0` after conditioning would break the constraint;
            ``clip_sample`` defaults to ``True`` in diffusers). ``prediction_type`` ``"epsilon"``, ``"sample"`` or
            ``"v_prediction"``; DDPM's learned variance types are not supported.
        constraint: :math:`Ax = k` on the flattened images (:func:`channel_sum_constraint`), batch shape ``()`` or
            ``(B,)``, or its spec (``{"kind": "channel_sum", "channels": C, "event_size": C*H*W, "totals":
            [...]}``, ``"sum"``, ``"linear"``); ``None`` makes the scheduler a pass-through. May be reassigned
            (``.constraint = ...``; the config follows).
        schedule: a :class:`Schedule`, loop indices into :attr:`timesteps` (index 0: the first step) or a spec
            (``{"kind": "Uniform", "n": 4}``); default ``None``: the last step only (when a constraint is given).
        scale: standard deviation of the conditioned steps; default :math:`\sqrt{\beta_t}` (``betas[t]`` at the
            step's train timestep), a float, a tensor broadcastable to the images, or ``t -> scale`` (a tensor or a
            callable is used but not saved: ``save_pretrained`` raises).
        deterministic: use the conditional mean (projection) instead of a sample.
        final: ``None`` (default: the last step as the schedule says), ``"box"`` (the last step returns the
            conditional mode in ``box``) or ``"sample_box"`` (a sample of the conditional truncated to ``box``);
            both need a grouped-sum constraint (e.g. :func:`channel_sum_constraint`) and condition the last step
            whatever the schedule says. A :class:`~hardeq.NonlinearConstraint` on the flattened images: the last
            step is a ``"linearised"`` sample on its manifold (the projection with ``deterministic``), with or
            without ``constraint``; it is not saved (``save_pretrained`` raises).
        box: ``(lo, hi)`` of ``final``, in the model's space; default ``(-1.0, 1.0)`` (the pipelines' clamp range).
        condition_generator: the conditioning stream (never saved); default: derived, at the first conditioned
            step after each :meth:`set_timesteps`, from the state of the ``generator`` passed to :meth:`step` (or
            torch's global RNG) without drawing from it, so that the main stream is that of the unconstrained loop.

    The sampling interface (``timesteps``, ``set_timesteps``, ``init_noise_sigma``, ``scale_model_input``,
    ``add_noise``, ``get_velocity``, ``betas``, ``alphas_cumprod``, ``len()``) is the base scheduler's
    (:attr:`scheduler`); its config is ``cs.scheduler.config``.

    Pipelines: ``DDPMPipeline(unet, cs)`` keeps it. ``DDIMPipeline(unet, cs)`` raises ``TypeError`` (its
    ``__init__`` rebuilds the scheduler as ``DDIMScheduler.from_config(cs.config)``, which would drop the
    constraint): build ``DDIMPipeline(unet, cs.scheduler)`` and set ``pipe.scheduler = cs``.

    Raises:
        ImportError: diffusers is not installed (``pip install "hardeq[diffusion]"``).
        TypeError: ``base_scheduler`` is not a DDPMScheduler / DDIMScheduler (or its spec), or a bad constraint /
            schedule type.
        ValueError: ``clip_sample`` or ``thresholding`` is on, the prediction / variance type is unsupported, or a
            spec is malformed.

    Examples:
        >>> import diffusers
        >>> c = channel_sum_constraint((2, 1, 4, 4), [3.0])
        >>> cs = ConstrainedScheduler(diffusers.DDIMScheduler(num_train_timesteps=50, clip_sample=False), c)
        >>> cs.set_timesteps(5)
        >>> x = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(0))
        >>> for t in cs.timesteps:  # a stand-in noise predictor 0.5 x
        ...     x = cs.step(0.5 * x, t, x).prev_sample
        >>> cs.conditioned_steps(), bool(satisfies_constraint(x, c).all())  # the last step conditioned: exact sums
        ((4,), True)
    """

    config_name = "scheduler_config.json"  # type: ignore[assignment]  # diffusers: ConfigMixin declares it None
    ignore_for_config = ["condition_generator"]
    _internal_dict: FrozenDict  # set by diffusers' register_to_config
    order = 1

    # The config is registered by hand, not by @register_to_config: the decorator would record the arguments as
    # given (a scheduler object, a constraint object); the config records their JSON specs.
    def __init__(self, base_scheduler: object = None, constraint: EqualityConstraint | dict[str, Any] | None = None,
                 schedule: Schedule | list[int] | dict[str, Any] | None = None,
                 scale: ScaleLike | dict[str, Any] = None,
                 deterministic: bool = False, condition_generator: torch.Generator | None = None,
                 final: str | FinalStep | None = None, box: tuple[float, float] | list[float] = (-1.0, 1.0)) -> None:
        base = _base_from_spec(base_scheduler)
        _check_base(base)
        check_generator("condition_generator", condition_generator)
        self.scheduler: _BaseScheduler = base
        self.register_to_config(base_scheduler=_base_spec(base))
        self.constraint = constraint
        self.schedule = schedule
        self.scale = scale
        self.deterministic = deterministic
        self.box = box
        self.final = final
        self._user_condition_generator = condition_generator
        self._condition_generator = condition_generator

    # ------------------------------------------------------------------ the config
    @property
    def config(self) -> FrozenDict:
        """The recorded config (a ``FrozenDict`` that only :meth:`from_config` of this class consumes)."""
        return _ConstrainedConfig(self._internal_dict)

    @classmethod
    def from_config(cls, config: FrozenDict | dict[str, Any] | None = None, return_unused_kwargs: bool = False,
                    **kwargs: Any) -> ConstrainedScheduler | tuple[ConstrainedScheduler, dict[str, Any]]:
        """diffusers' ``from_config`` (a :class:`ConstrainedScheduler`'s own config is accepted)."""
        if isinstance(config, _ConstrainedConfig):
            config = dict(config)
        out: ConstrainedScheduler | tuple[ConstrainedScheduler, dict[str, Any]] = super().from_config(
            config,  # type: ignore[arg-type]  # diffusers: its default None, typed as not None
            return_unused_kwargs=return_unused_kwargs, **kwargs)
        return out

    def save_config(self, save_directory: str | os.PathLike[str], push_to_hub: bool = False, **kwargs: Any) -> None:
        """diffusers' ``save_config`` (``save_pretrained`` calls it); refuses a config with unsaved entries.

        Raises:
            ValueError: the constraint, schedule or scale has no JSON spec (e.g. a tensor ``scale``).
        """
        missing = spec.unsaved_entries(self._internal_dict)
        if missing:
            raise ValueError(f"ConstrainedScheduler.save_pretrained: {', '.join(missing)} cannot be written as JSON, "
                             "so the saved scheduler would not reproduce this one. Use a hardeq constraint (every "
                             "EqualityConstraint saves its to_config()), a built-in schedule and a float or None "
                             "scale, or pass the others "
                             "again when loading: ConstrainedScheduler.from_pretrained(path, scale=...).")
        super().save_config(save_directory, push_to_hub=push_to_hub, **kwargs)

    @property
    def constraint(self) -> EqualityConstraint | None:
        """The constraint (``None``: pass-through); assigning it updates the config."""
        return self._constraint

    @constraint.setter
    def constraint(self, value: EqualityConstraint | dict[str, Any] | None) -> None:
        if value is not None and not isinstance(value, (EqualityConstraint, dict)):
            raise TypeError("constraint must be a hardeq.EqualityConstraint (e.g. from channel_sum_constraint), a "
                            f"config dict from its to_config() or None, got {type(value).__name__}.")
        value = spec.constraint_from_spec(value) if isinstance(value, dict) else value
        self._constraint = value
        self.register_to_config(constraint=spec.constraint_spec(value))

    @property
    def schedule(self) -> Schedule | None:
        """The conditioning schedule (``None``: the last step); assigning it updates the config."""
        return self._schedule

    @schedule.setter
    def schedule(self, value: object) -> None:
        self._schedule = spec.schedule_from_spec(value)
        self.register_to_config(schedule=spec.schedule_spec(self._schedule))

    @property
    def scale(self) -> ScaleLike:
        """The standard deviation of the conditioned steps (``None``: :math:`\\sqrt{\\beta_t}`)."""
        return self._scale

    @scale.setter
    def scale(self, value: ScaleLike | dict[str, Any]) -> None:
        self._scale = spec.scale_from_spec(value)
        self.register_to_config(scale=spec.scale_spec(self._scale))

    @property
    def deterministic(self) -> bool:
        """Condition on the mean (projection) instead of sampling."""
        return self._deterministic

    @deterministic.setter
    def deterministic(self, value: bool) -> None:
        self._deterministic = bool(value)
        self.register_to_config(deterministic=self._deterministic)

    @property
    def final(self) -> str | FinalStep | None:
        """The last step: ``None`` (as the schedule says), ``"box"`` (the mode in :attr:`box`), ``"sample_box"``
        (a sample in :attr:`box`) or a :class:`~hardeq.NonlinearConstraint` (a sample on its manifold, or the
        projection with :attr:`deterministic`; not saved); assigning it updates the config."""
        return self._final

    @final.setter
    def final(self, value: str | FinalStep | None) -> None:
        if value not in FINAL_OPTIONS and not is_final_step(value):
            raise ValueError(f"final must be one of {FINAL_OPTIONS} (None: the last step as the schedule says; 'box': "
                             f"the conditional mode in the box; 'sample_box': a sample in the box) or an object with "
                             f"last_step(loc, scale, noise) such as a hardeq.NonlinearConstraint, got {value!r}.")
        self._final = value
        self.register_to_config(final=value if value in FINAL_OPTIONS else spec.unsaved(value))

    @property
    def box(self) -> tuple[float, float]:
        """``(lo, hi)`` of :attr:`final`; assigning it updates the config."""
        return self._box

    @box.setter
    def box(self, value: tuple[float, float] | list[float]) -> None:
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise ValueError(f"box must be a pair (lo, hi) such as (-1.0, 1.0), got {value!r}.")
        self._box = _check_box(*value)
        self.register_to_config(box=list(self._box))

    # ------------------------------------------------------------------ the base scheduler's interface
    @property
    def timesteps(self) -> Tensor:
        """The base scheduler's timesteps (decreasing); loop index ``i`` is position ``i`` here."""
        return self.scheduler.timesteps

    @property
    def num_inference_steps(self) -> int | None:
        return self.scheduler.num_inference_steps

    @property
    def init_noise_sigma(self) -> float:
        return self.scheduler.init_noise_sigma

    @property
    def betas(self) -> Tensor:
        return self.scheduler.betas

    @property
    def alphas_cumprod(self) -> Tensor:
        return self.scheduler.alphas_cumprod

    def scale_model_input(self, sample: Tensor, timestep: int | None = None) -> Tensor:
        return self.scheduler.scale_model_input(sample, timestep)

    def add_noise(self, original_samples: Tensor, noise: Tensor, timesteps: Tensor) -> Tensor:
        return self.scheduler.add_noise(original_samples, noise, timesteps)

    def get_velocity(self, sample: Tensor, noise: Tensor, timesteps: Tensor) -> Tensor:
        return self.scheduler.get_velocity(sample, noise, timesteps)

    def __len__(self) -> int:
        return len(self.scheduler)

    def set_timesteps(self, *args: Any, **kwargs: Any) -> None:
        """``scheduler.set_timesteps(...)``; also restarts the derived conditioning stream."""
        self.scheduler.set_timesteps(*args, **kwargs)
        self._condition_generator = self._user_condition_generator

    def conditioned_steps(self) -> tuple[int, ...]:
        """The loop indices (positions in :attr:`timesteps`) that are conditioned."""
        n = len(self.scheduler.timesteps)
        return tuple(sorted(resolve_steps(self.schedule, n, default_last=self.constraint is not None)))

    def __repr__(self) -> str:
        final = "" if self.final is None else f", final={self.final!r}, box={self.box}"
        return (f"ConstrainedScheduler({type(self.scheduler).__name__}, constraint={self.constraint!r}, "
                f"schedule={self.schedule!r}, deterministic={self.deterministic}{final})")

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
            x0: Tensor = (sample - (1 - ab) ** 0.5 * model_output) / ab**0.5
            return x0
        if kind == "sample":
            return model_output
        x0 = ab**0.5 * sample - (1 - ab) ** 0.5 * model_output
        return x0

    def _output_for(self, x0: Tensor, t: int, sample: Tensor) -> Tensor:
        """The model output that makes the wrapped scheduler's :math:`\\hat x_0` equal ``x0``."""
        ab = self.scheduler.alphas_cumprod[t].to(torch.float64).item()
        kind = self.scheduler.config.prediction_type
        if kind == "epsilon":
            out: Tensor = (sample - ab**0.5 * x0) / (1 - ab) ** 0.5
            return out
        if kind == "sample":
            return x0
        out = (ab**0.5 * sample - x0) / (1 - ab) ** 0.5
        return out

    def step(self, model_output: Tensor, timestep: int | Tensor, sample: Tensor, *args: Any,
             generator: torch.Generator | None = None, return_dict: bool = True,
             **kwargs: Any) -> ConstrainedSchedulerOutput | tuple[Tensor, Tensor]:
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
        if self.constraint is None and not is_final_step(self.final):
            out = inner.step(model_output, timestep, sample, *args, generator=generator, return_dict=True, **kwargs)
            prev, x0 = out.prev_sample, out.pred_original_sample
        else:
            i = self._index(timestep)
            n = len(inner.timesteps)
            t = int(inner.timesteps[i])
            if self.final is not None and i == n - 1:
                prev = self._final_step(model_output, t, sample, generator)
                if not return_dict:
                    return prev, prev
                return ConstrainedSchedulerOutput(prev_sample=prev, pred_original_sample=prev)
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

    def _final_step(self, model_output: Tensor, t: int, sample: Tensor, generator: torch.Generator | None) -> Tensor:
        r"""The last step of ``final="box"`` / ``"sample_box"``: the mode or a sample of
        :math:`\mathcal N(\hat x_0, \mathrm{scale}^2 I)` given the constraint and the box, where :math:`\hat x_0`
        is the base scheduler's (unconditioned) prediction; the base ``step`` is not called (the last update would
        only rescale :math:`\hat x_0`)."""
        con = (None if self.constraint is None
               else check_image_constraint(self.constraint, sample, owner="ConstrainedScheduler.step"))
        finish = resolve_final(self.final, self.box, con, self.deterministic)
        assert finish is not None  # (called with final set only)
        if self._condition_generator is None and finish.random:
            self._condition_generator = derive_generator(generator, sample.device)
        scale = resolve_scale(self.scale, t, self.scheduler.betas.to(torch.float64))
        x0 = self._x0(model_output, t, sample).to(sample.dtype)
        return finish(x0, scale, self._condition_generator, self.deterministic).to(sample.dtype)

