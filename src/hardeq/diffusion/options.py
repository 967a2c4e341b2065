r"""Options objects of the native samplers: one frozen value per sampler, in the manner of diffusers' scheduler
configs.

A call is ``ddim_sample(model, shape, DDIMOptions(num_steps=50, eta=0.0), constraint=c, schedule=Uniform(4))``:
the options say *how* to sample (the forward process, the loop, the conditioned steps' variance, the output),
the call arguments say *what*: the constraint, the schedule of conditioned steps, the random streams, the initial
noise and a per-step callback. Every option has a default, so ``DDIMOptions()`` is diffusers' 50-step DDIM with
the linear schedule of Ho et al. (``beta_start = 1e-4``, ``beta_end = 0.02``, ``T = 1000``).

=====================  =========================================================================================
class                  adds to its parent
=====================  =========================================================================================
:class:`SamplerOptions` the conditioned steps (``deterministic``, ``scale``, ``final``, ``box``), the output
                       (``post``, ``clip_range``, ``dtype``, ``device``) and ``progress``; shared by all three
:class:`NoiseScheduleOptions` the forward process :math:`\beta_t` (``betas`` or ``num_train_timesteps``,
                       ``beta_start``, ``beta_end``, ``beta_schedule``), as diffusers' ``DDPMScheduler`` /
                       ``DDIMScheduler``
:class:`DDPMOptions`   ``variance_type`` of the unconditioned ancestral steps
:class:`DDIMOptions`   the loop: ``num_steps``, ``eta``, ``set_alpha_to_one``, ``timestep_spacing``,
                       ``steps_offset``, ``timesteps``
:class:`FlowOptions`   the Euler time grid (``num_steps`` or ``sigmas``) and ``time_scale``
=====================  =========================================================================================

Options are keyword-only, frozen and compared by value (tensors with :func:`torch.equal`); change one with
:func:`dataclasses.replace` (``replace(opts, eta=1.0)``), which checks the new value as the constructor does.
Every value that can be checked without the constraint and the model is checked when the options are made
(``ValueError`` / ``TypeError`` naming the option, the expectation and what arrived).

The samplers also take the options as keyword arguments (``ddim_sample(model, shape, num_steps=50, eta=0.5)``):
they override the fields of ``options`` (or of the defaults) through :func:`dataclasses.replace`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import torch
from torch import Tensor

from .final import FinalStep, is_final_step
from .noise_schedule import SPACINGS, check_betas, ddim_timesteps, flow_sigmas, make_betas

__all__ = ["SamplerOptions", "NoiseScheduleOptions", "DDPMOptions", "DDIMOptions", "FlowOptions",
           "resolve_options"]

#: the standard deviation of the conditioned steps: ``None`` (the sampler's default), a positive float, a tensor
#: broadcastable to the images (per-pixel standard deviations) or a callable of the step's time
ScaleOption = float | Tensor | Callable[[Any], "float | Tensor"] | None

POST_NAMES = ("project", "project_clip", "clip")
FINAL_NAMES = (None, "box", "sample_box")
VARIANCE_TYPES = ("fixed_small", "fixed_large")
DEFAULT_NUM_STEPS = 50

_O = TypeVar("_O", bound="SamplerOptions")


def _pair(name: str, value: object, owner: str) -> tuple[float, float]:
    """``value`` as a finite ``(lo, hi)`` with ``lo < hi``."""
    ok = isinstance(value, (tuple, list)) and len(value) == 2
    try:
        lo, hi = (float(value[0]), float(value[1])) if ok else (math.nan, math.nan)  # type: ignore[index]
    except (TypeError, ValueError):
        lo = hi = math.nan
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"{owner}: {name} must be a pair (lo, hi) of finite floats with lo < hi, such as (-1.0, 1.0), "
                         f"got {value!r}.")
    return lo, hi


def _flag(name: str, value: object, owner: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be a bool, got {type(value).__name__} ({value!r}).")


def _count(name: str, value: object, owner: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} ({value!r}).")
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value}.")
    return value


def _real(name: str, value: object, owner: str, *, positive: bool = False, nonnegative: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be a finite float, got {value!r}.")
    if (positive and value <= 0) or (nonnegative and value < 0):
        raise ValueError(f"{owner}: {name} must be {'positive' if positive else 'non-negative'}, got {value!r}.")
    return float(value)


def _same(a: object, b: object) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (isinstance(a, Tensor) and isinstance(b, Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.equal(a.cpu(), b.cpu())))
    return bool(a == b)


@dataclass(frozen=True, kw_only=True, eq=False)
class SamplerOptions:
    r"""What the three samplers share: how the conditioned steps are taken and what is returned.

    Attributes:
        deterministic: conditioned steps use the conditional *mean* (the orthogonal projection of
            :math:`\hat x_0` for an isotropic scale) instead of an exact sample. Default ``False``.
        scale: standard deviation :math:`\sigma` of the Gaussian :math:`\mathcal N(\hat x_0, \sigma^2 I)` that a
            conditioned step conditions on :math:`Ax_0 = k`: ``None`` (the sampler's default: :math:`\sqrt{\beta_t}`
            for DDPM / DDIM, the step length for the flow), a positive float, a tensor broadcastable to the images
            ``(B, C, H, W)`` (per-pixel standard deviations), or a callable of the step's time (the train timestep
            ``t``, an int, for DDPM / DDIM; the flow time in ``(0, 1]`` for the flow) returning one of these.
        final: ``None`` (the last step as the schedule says) or ``"box"``: the last step returns the conditional
            *mode* in the box, :func:`~hardeq.diffusion.box_project` of the last step's unconditioned prediction
            onto the constraint (a ``SumConstraint``) and ``box``, in the metric of ``scale`` (isotropic: the
            Euclidean projection). Exact in the sums *and* in ``[lo, hi]``; not a sample. ``"sample_box"``: the
            last step returns a *sample* of the same Gaussian given the constraint and the box (the law
            ``ConstrainedNormal(x0, scale).truncate(lo, hi)``, :class:`~hardeq.TruncatedConstrainedNormal`,
            drawn from the conditioning stream), exact in the sums and in ``[lo, hi]``; ``to_uint8_exact`` then
            keeps the channel totals in 8 bits. A :class:`hardeq.NonlinearConstraint` :math:`h(x) = k` on the
            flattened images (or any object with ``last_step(loc, scale, noise)``,
            :class:`hardeq.diffusion.final.FinalStep`): the last step is taken on its manifold, a ``"linearised"``
            draw of :math:`\mathcal N(\hat x_0, \mathrm{scale}^2 I) \mid h = k` from the conditioning stream
            (``deterministic=True``: its mode, the projection of :math:`\hat x_0`); every row of :math:`h = k`
            holds to the manifold's per-row tolerance. ``constraint`` is then optional (it conditions the scheduled
            steps before the last) and ``box`` is not used.
        box: ``(lo, hi)`` of ``final="box"`` / ``"sample_box"``; default ``(-1.0, 1.0)``, the model's pixel range.
        post: post-processing of the returned :math:`x_0`: ``None``, ``"project"`` (orthogonal projection onto
            the constraint), ``"project_clip"`` (projection, then clipping to ``clip_range``), ``"clip"`` or a
            callable ``x0 -> x0``; the baselines are ``post="project"`` with ``schedule=()``.
        clip_range: ``(lo, hi)`` of the ``"clip"`` options; default ``(-1.0, 1.0)``.
        dtype: of the samples; default (``None``): the model's parameters' (or the initial noise's), else
            float32.
        device: of the samples; default (``None``): the model's parameters' (or the initial noise's), else
            torch's default device (the CPU unless ``torch.set_default_device`` chose another).
        progress: show a tqdm progress bar. Default ``False``.

    Examples:
        >>> o = FlowOptions(num_steps=4, post="project")  # every sampler's options extend these
        >>> isinstance(o, SamplerOptions), o.post, o.box, o.deterministic
        (True, 'project', (-1.0, 1.0), False)
        >>> SamplerOptions(final="clip")
        Traceback (most recent call last):
            ...
        ValueError: SamplerOptions: final must be None (the last step as the schedule says), 'box' ... got 'clip'.
    """

    deterministic: bool = False
    scale: ScaleOption = None
    final: str | FinalStep | None = None
    box: tuple[float, float] = (-1.0, 1.0)
    post: str | Callable[[Tensor], Tensor] | None = None
    clip_range: tuple[float, float] = (-1.0, 1.0)
    dtype: torch.dtype | None = None
    device: torch.device | str | None = None
    progress: bool = False

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _flag("deterministic", self.deterministic, owner)
        _flag("progress", self.progress, owner)
        s = self.scale
        if isinstance(s, Tensor):
            if not s.is_floating_point():
                raise TypeError(f"{owner}: scale must be a floating tensor, got {s.dtype}.")
        elif s is not None and not callable(s):
            _real("scale", s, owner, positive=True)
        if self.final not in FINAL_NAMES and not is_final_step(self.final):
            raise ValueError(f"{owner}: final must be None (the last step as the schedule says), 'box' (the "
                             f"conditional mode in the box, box_project), 'sample_box' (a sample of the conditional "
                             f"truncated to the box) or an object with last_step(loc, scale, noise) such as a "
                             f"hardeq.NonlinearConstraint (the last step on its manifold), got {self.final!r}.")
        object.__setattr__(self, "box", _pair("box", self.box, owner))
        if self.post is not None and not callable(self.post) and self.post not in POST_NAMES:
            raise ValueError(f"{owner}: post must be None, a callable x0 -> x0 or one of {POST_NAMES}, "
                             f"got {self.post!r}.")
        object.__setattr__(self, "clip_range", _pair("clip_range", self.clip_range, owner))
        if self.dtype is not None and (not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point):
            raise TypeError(f"{owner}: dtype must be None or a floating torch.dtype, got {self.dtype!r}.")
        if self.device is not None:
            if not isinstance(self.device, (str, torch.device)):
                raise TypeError(f"{owner}: device must be None, a str or a torch.device, got "
                                f"{type(self.device).__name__}.")
            try:
                torch.device(self.device)
            except RuntimeError as e:
                raise ValueError(f"{owner}: device {self.device!r} is not a torch device ({e}).") from None

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(_same(getattr(self, f.name), getattr(other, f.name)) for f in fields(self))

    __hash__ = None  # type: ignore[assignment]  # options may hold tensors and callables


@dataclass(frozen=True, kw_only=True, eq=False)
class NoiseScheduleOptions(SamplerOptions):
    r"""The forward process of DDPM / DDIM: :math:`\beta_t` for train timesteps ``t = 0, ..., T - 1``, as
    diffusers' ``DDPMScheduler`` / ``DDIMScheduler`` build them (:func:`~hardeq.diffusion.make_betas`).

    Attributes:
        betas: the :math:`\beta_t` themselves, a 1-D floating tensor ``(T,)`` with values in ``(0, 1)`` (kept as
            float64 on the CPU); when given, the four options below are not used. Default ``None``.
        num_train_timesteps: ``T``; default 1000.
        beta_start, beta_end: :math:`\beta_0` and :math:`\beta_{T-1}`; defaults ``1e-4`` and ``0.02`` (Ho et al.).
        beta_schedule: ``"linear"`` (default), ``"scaled_linear"`` or ``"squaredcos_cap_v2"``.

    Examples:
        >>> o = NoiseScheduleOptions(num_train_timesteps=4, beta_start=0.1, beta_end=0.4)
        >>> o.train_betas()
        tensor([0.1000, 0.2000, 0.3000, 0.4000], dtype=torch.float64)
        >>> isinstance(DDPMOptions(), NoiseScheduleOptions), DDPMOptions().num_train_timesteps
        (True, 1000)
    """

    betas: Tensor | None = None
    num_train_timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02
    beta_schedule: str = "linear"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.betas is not None:
            object.__setattr__(self, "betas", check_betas(self.betas))
        else:
            make_betas(self.num_train_timesteps, self.beta_start, self.beta_end, self.beta_schedule)  # checks them

    def train_betas(self) -> Tensor:
        r"""The :math:`\beta_t`, float64 ``(T,)``: ``betas`` if given, else built from the schedule options."""
        if self.betas is not None:
            return self.betas
        return make_betas(self.num_train_timesteps, self.beta_start, self.beta_end, self.beta_schedule)


@dataclass(frozen=True, kw_only=True, eq=False)
class DDPMOptions(NoiseScheduleOptions):
    r"""Options of :func:`~hardeq.diffusion.ddpm_sample`: ancestral sampling over all ``T`` train timesteps.

    Attributes:
        variance_type: the variance :math:`\sigma_t^2` of the unconditioned steps: ``"fixed_small"``
            (:math:`\frac{1 - \bar\alpha_{t-1}}{1 - \bar\alpha_t}\beta_t`, diffusers' default) or
            ``"fixed_large"`` (:math:`\beta_t`). The conditioned steps use ``scale`` (default
            :math:`\sqrt{\beta_t}`), whatever this says.

    The other options: :class:`NoiseScheduleOptions` (the forward process) and :class:`SamplerOptions`.

    Example:
        >>> DDPMOptions(num_train_timesteps=10).train_betas().shape
        torch.Size([10])
    """

    variance_type: str = "fixed_small"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.variance_type not in VARIANCE_TYPES:
            raise ValueError(f"DDPMOptions: variance_type must be one of {VARIANCE_TYPES}, got "
                             f"{self.variance_type!r}.")


@dataclass(frozen=True, kw_only=True, eq=False)
class DDIMOptions(NoiseScheduleOptions):
    r"""Options of :func:`~hardeq.diffusion.ddim_sample`: the DDIM loop over a subset of the train timesteps.

    Attributes:
        num_steps: number of DDIM steps; default (``None``): ``len(timesteps)`` when ``timesteps`` is given,
            else 50 (diffusers' pipelines' default).
        eta: DDIM's stochasticity :math:`\eta \ge 0` (0: deterministic DDIM, the default; 1: DDPM-like).
        set_alpha_to_one: :math:`\bar\alpha` after the last step: 1 (``True``, diffusers' default) or
            :math:`\bar\alpha_0`.
        timestep_spacing: how the ``num_steps`` train timesteps are chosen: ``"leading"`` (default),
            ``"trailing"`` or ``"linspace"`` (:func:`~hardeq.diffusion.ddim_timesteps`).
        steps_offset: added to the ``"leading"`` timesteps; default 0.
        timesteps: explicit strictly decreasing train timesteps in ``[0, T)`` (overrides the two above).

    The other options: :class:`NoiseScheduleOptions` (the forward process) and :class:`SamplerOptions`.

    Example:
        >>> DDIMOptions(num_steps=5).inference_timesteps()
        (800, 600, 400, 200, 0)
    """

    num_steps: int | None = None
    eta: float = 0.0
    set_alpha_to_one: bool = True
    timestep_spacing: str = "leading"
    steps_offset: int = 0
    timesteps: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = "DDIMOptions"
        _real("eta", self.eta, owner, nonnegative=True)
        _flag("set_alpha_to_one", self.set_alpha_to_one, owner)
        if self.timestep_spacing not in SPACINGS:
            raise ValueError(f"{owner}: timestep_spacing must be one of {SPACINGS}, got {self.timestep_spacing!r}.")
        _count("steps_offset", self.steps_offset, owner, minimum=0)
        if self.timesteps is not None:
            ts = self.timesteps.tolist() if isinstance(self.timesteps, Tensor) else self.timesteps
            if not isinstance(ts, Iterable) or isinstance(ts, (str, bytes)):
                raise TypeError(f"{owner}: timesteps must be a sequence of ints, got {type(ts).__name__}.")
            ts = tuple(ts)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ts):
                raise TypeError(f"{owner}: timesteps must be ints, got {ts!r}.")
            object.__setattr__(self, "timesteps", ts)
        if self.num_steps is not None:
            _count("num_steps", self.num_steps, owner)
        try:
            self.inference_timesteps()  # checks num_steps and timesteps against T
        except ValueError as e:
            default = " (num_steps defaults to 50)" if self.num_steps is None and self.timesteps is None else ""
            raise ValueError(f"{owner}: {e}{default}") from None

    def steps(self) -> int:
        """The number of DDIM steps (``num_steps``, or its default)."""
        if self.num_steps is not None:
            return self.num_steps
        return len(self.timesteps) if self.timesteps is not None else DEFAULT_NUM_STEPS

    def inference_timesteps(self) -> tuple[int, ...]:
        """The decreasing train timesteps of the loop: ``timesteps`` if given, else
        :func:`~hardeq.diffusion.ddim_timesteps` of ``T``, the number of steps, ``timestep_spacing`` and
        ``steps_offset``."""
        T = self.betas.shape[0] if self.betas is not None else self.num_train_timesteps
        n = self.steps()
        if self.timesteps is None:
            return ddim_timesteps(T, n, self.timestep_spacing, self.steps_offset)
        ts = self.timesteps
        if len(ts) != n or any(not 0 <= t < T for t in ts) or any(a <= c for a, c in zip(ts, ts[1:])):
            raise ValueError(f"timesteps must be num_steps = {n} strictly decreasing ints in [0, {T}), "
                             f"got {ts}.")
        return ts


@dataclass(frozen=True, kw_only=True, eq=False)
class FlowOptions(SamplerOptions):
    r"""Options of :func:`~hardeq.diffusion.flow_sample`: Euler integration of a rectified flow from
    :math:`t = 1` to 0.

    Attributes:
        num_steps: number of Euler steps on the uniform grid :func:`~hardeq.diffusion.flow_sigmas`; default
            (``None``): ``len(sigmas) - 1`` when ``sigmas`` is given, else 50.
        sigmas: explicit strictly decreasing times in ``(0, 1]`` ending with 0 (``N + 1`` values for ``N``
            steps), e.g. diffusers' ``scheduler.sigmas``; default ``None`` (the uniform grid).
        time_scale: the model receives ``t * time_scale``; default 1.0 (1000 for diffusers' flow-matching
            transformers).

    ``scale`` (:class:`SamplerOptions`) defaults to the step length :math:`\sigma_i - \sigma_{i+1}` here; a
    callable ``scale`` receives the flow time ``t``.

    Example:
        >>> FlowOptions(num_steps=4).time_grid()
        (1.0, 0.75, 0.5, 0.25, 0.0)
    """

    num_steps: int | None = None
    sigmas: tuple[float, ...] | None = None
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = "FlowOptions"
        _real("time_scale", self.time_scale, owner, positive=True)
        if self.num_steps is not None:
            _count("num_steps", self.num_steps, owner)
        if self.sigmas is not None:
            raw = self.sigmas.tolist() if isinstance(self.sigmas, Tensor) else self.sigmas
            try:
                sig = tuple(float(s) for s in raw)
            except (TypeError, ValueError):
                raise TypeError(f"{owner}: sigmas must be a sequence of floats, got {self.sigmas!r}.") from None
            if (len(sig) < 2 or sig[-1] != 0.0 or any(not 0 < s <= 1 for s in sig[:-1])
                    or any(a <= b for a, b in zip(sig, sig[1:]))):
                raise ValueError(f"{owner}: sigmas must be strictly decreasing times in (0, 1] ending with 0 (e.g. "
                                 f"flow_sigmas(N) or diffusers' scheduler.sigmas), got {sig}.")
            if self.num_steps is not None and self.num_steps != len(sig) - 1:
                raise ValueError(f"{owner}: num_steps = {self.num_steps} but sigmas has {len(sig)} values "
                                 f"({len(sig) - 1} steps).")
            object.__setattr__(self, "sigmas", sig)

    def time_grid(self) -> tuple[float, ...]:
        """The ``N + 1`` decreasing times ``1 = sigma_0 > ... > sigma_N = 0``: ``sigmas`` if given, else
        :func:`~hardeq.diffusion.flow_sigmas` of the number of steps."""
        if self.sigmas is not None:
            return self.sigmas
        return flow_sigmas(self.num_steps if self.num_steps is not None else DEFAULT_NUM_STEPS)


def resolve_options(options: _O | None, cls: type[_O], overrides: dict[str, Any], owner: str,
                    call_arguments: tuple[str, ...] = ()) -> _O:
    """The options a sampler runs with: ``options`` (default ``cls()``) with the keyword ``overrides`` replaced
    (:func:`dataclasses.replace`, which checks them as the constructor does).

    Raises:
        TypeError: ``options`` is not a ``cls``, or an override names no option of ``cls``.
    """
    if options is not None and not isinstance(options, cls):
        hint = ""
        if isinstance(options, int) and not isinstance(options, bool) and "num_steps" in {f.name for f in fields(cls)}:
            hint = f"; the number of steps is an option: {cls.__name__}(num_steps={options}) or num_steps={options}"
        raise TypeError(f"{owner}: options must be a {cls.__name__} (or None for the defaults), got "
                        f"{type(options).__name__}{hint}.")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise TypeError(f"{owner} got unexpected keyword argument(s) {unknown}: its call arguments are "
                        f"{list(call_arguments)} and its options (fields of {cls.__name__}, also accepted as "
                        f"keywords) are {names}.")
    if options is None:
        return cls(**overrides)
    return replace(options, **overrides) if overrides else options
