r"""The Gaussian conditioned on :math:`Az = k` and truncated to a box: :class:`TruncatedConstrainedNormal`."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Protocol, Self, TypeVar, cast

import torch
from torch import Tensor
from torch.distributions import Distribution, constraints

from ..bounds.mode import ModeNotFound, truncated_mode
from ..bounds.target import PlaneTarget
from ..bounds.normaliser import exact_log_normaliser, line_bounds, null_direction, subset_log_normaliser, surrogate
from ..bounds.polytope import as_bound, check_bounds, check_polytope
from ..bounds.rejection import AUTO_THRESHOLD, ROUND_ELEMENTS, rejection_sample
from ..bounds.sum_normaliser import SumRowLayout, sum_row_layout, sum_row_log_normaliser
from ..bounds.result import TruncatedSamples
from ..bounds.training import PersistentChains
from ..bounds.volume import check_line_section, check_volume
from ..constraints.base import EqualityConstraint
from ..linalg.conditioning import Conditioner
from ..linalg.covariance import Covariance

__all__ = ["TruncatedConstrainedNormal"]

# This module does not import hardeq.distributions.normal (which imports it in ConstrainedNormal.truncate): the
# base distribution is read through the structural type _Base, and the two small helpers below are this module's own.
_F = TypeVar("_F", bound=Callable[..., Any])


class _Base(Protocol):
    """What :class:`TruncatedConstrainedNormal` uses of its base :class:`~hardeq.ConstrainedNormal`."""

    _unbroadcasted_loc: Tensor
    _validate_args: bool
    covariance: Covariance
    constraint: EqualityConstraint

    @property
    def conditioner(self) -> Conditioner: ...

    @property
    def batch_shape(self) -> torch.Size: ...

    @property
    def event_shape(self) -> torch.Size: ...

    @property
    def result_dtype(self) -> torch.dtype: ...

    @property
    def support(self) -> constraints.Constraint: ...

    def log_prob(self, value: Tensor) -> Tensor: ...

    def expand(self, batch_shape: torch.Size, _instance: Any = None) -> Any: ...

    def _out(self, t: Tensor) -> Tensor: ...

    def _as_event(self, name: str, value: Tensor) -> Tensor: ...


def _full_precision(method: _F) -> _F:
    """Run ``method`` with autocast disabled on the parameters' device (as the base distribution's methods do): under
    ``torch.autocast`` a float32 matmul would otherwise run in a half dtype and lose the per-row accuracy."""

    @functools.wraps(method)
    def wrapper(self: TruncatedConstrainedNormal, *args: Any, **kwargs: Any) -> Any:
        device_type = self._unbroadcasted_loc.device.type
        if not torch.is_autocast_enabled(device_type):
            return method(self, *args, **kwargs)
        with torch.autocast(device_type, enabled=False):
            return method(self, *args, **kwargs)

    return cast(_F, wrapper)


def _sample_shape(sample_shape: object, name: str = "sample_shape") -> torch.Size:
    """``sample_shape`` as a ``torch.Size`` of non-negative ints, or ``TypeError`` / ``ValueError`` naming it."""
    try:
        shape = torch.Size(cast("Iterable[int]", sample_shape))
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a tuple (or torch.Size) of ints, got {sample_shape!r}.") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"{name} must have non-negative sizes, got {tuple(shape)}.")
    return shape

#: methods of :meth:`TruncatedConstrainedNormal.sample_with_info`
METHODS = ("auto", "rejection", "gibbs", "hmc")
#: per-row tolerance of the untruncated law, by compute dtype (the library's exactness promise)
ROW_RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}
#: a batch element whose untruncated draws put fewer than this many in the box gets the subset-simulation
#: normaliser (:func:`~hardeq.bounds.normaliser.subset_log_normaliser`): the plain fraction's relative error would
#: exceed 1/8 (and with none inside it has no value at all)
SUBSET_BELOW_IN_BOX = 64
#: kernel moves per level of the subset-simulation normaliser
SUBSET_ITERATIONS = 4


class _BoxOnPlane(constraints.Constraint):
    """The support :math:`\\{z : Az = k,\\ l \\le z \\le u\\}`: the box exactly, the plane as
    :class:`~hardeq.ConstrainedNormal`'s support checks it (per row, to round-off)."""

    is_discrete = False
    event_dim = 1

    def __init__(self, plane: constraints.Constraint, lower: Tensor, upper: Tensor) -> None:
        self.plane, self.lower, self.upper = plane, lower, upper
        super().__init__()

    def check(self, value: Tensor) -> Tensor:
        v = value.to(self.lower.dtype)
        on_plane: Tensor = self.plane.check(value)
        return ((v >= self.lower) & (v <= self.upper)).all(-1) & on_plane

    def __repr__(self) -> str:
        return f"BoxOnPlane({self.plane!r})"


class TruncatedConstrainedNormal(Distribution):
    r""":math:`z \sim \mathcal N(\mu, \Sigma)` given :math:`Az = k` and :math:`l \le z \le u`: a
    :class:`~hardeq.ConstrainedNormal` restricted to a box. Made by :meth:`ConstrainedNormal.truncate`.

    The law has density

    .. math::
        p_{\text{trunc}}(z) = \frac{p(z \mid Az = k)\,\mathbf 1[l \le z \le u]}{Z},\qquad
        Z = P(l \le z \le u \mid Az = k),

    on the plane :math:`\{Az = k\}` (w.r.t. its ``(n - a)``-dimensional Lebesgue measure, as
    :meth:`ConstrainedNormal.log_prob`). Every covariance structure and constraint type of the base distribution
    works, batched as it is.

    **What a user gets.**

    * :meth:`sample` / :meth:`sample_with_info`: every draw satisfies ``lower <= z <= upper`` exactly (``>=``,
      ``<=`` in the distribution's dtype) and every row of :math:`Az = k` within the untruncated per-row tolerance.
      ``method="rejection"`` is exact in law (iid draws of the untruncated conditional kept when in the box);
      ``method="gibbs"`` is random-partition blocked Gibbs on the plane (:func:`hardeq.bounds.blocked_gibbs`: pairs
      of coordinates inside a group for a grouped sum, blocks of ``a + 1`` coordinates along null vectors of ``A``
      otherwise), for every covariance with a diagonal part (low-rank, block-diagonal and full ones by data
      augmentation, :mod:`hardeq.bounds.augment`), exact in its stationary law;
      ``method="hmc"`` is exact Hamiltonian Monte Carlo on the plane (Pakman & Paninski 2014), for every
      covariance, exact in its stationary law. For both Markov chains the law is reached asymptotically in the
      number of steps and draws of one chain are correlated: see ``ess`` and ``rhat`` of :meth:`sample_with_info`.
      ``method="auto"`` (default) picks the sampler with the most effective samples per (modelled) second on a short
      pilot (:func:`hardeq.bounds.choice.choose_method`): rejection where the acceptance, measured on
      ``pilot_samples`` draws, is at least ``threshold`` (0.1: at most ten untruncated draws per kept one), Gibbs
      where it applies (:func:`hardeq.bounds.gibbs_unsupported`), HMC where it could win; the chains start from
      :attr:`mode`. The method used is named in the result.
    * :attr:`mode`: the maximiser of the density on the polytope, exact up to round-off
      (:mod:`hardeq.bounds.mode`).
    * :meth:`log_prob`: ``log p(z | Az = k) - log Z`` in the box, ``-inf`` outside it. :attr:`normaliser_exact`
      says which normaliser it uses: **exact** for one free dimension (``n - a == 1``: a normal CDF difference,
      differentiable, exact gradient); **exact up to a stated grid error** for a diagonal covariance and one row or a
      grouped sum (the density of a sum of independent truncated normals, a 1-D convolution:
      :mod:`hardeq.bounds.sum_normaliser`; the error estimate in :attr:`log_normaliser_stderr`, differentiable);
      otherwise a **Monte Carlo estimate** from ``normaliser_samples`` untruncated
      draws with its standard error in :attr:`log_normaliser_stderr`; where fewer than 64 of them fall in the box
      (a box the model makes unlikely, e.g. at the start of training), a **subset-simulation estimate** through
      nested boxes (:func:`~hardeq.bounds.normaliser.subset_log_normaliser`), with its standard error.
      Its gradient w.r.t. ``loc`` and the scales
      then comes from :math:`\nabla\log Z = \mathbb E_{\text{trunc}}[\nabla\log p(z\mid Az=k)]` on
      ``grad_samples`` draws of the truncated law (unbiased; variance
      :math:`\mathrm{Var}_{\text{trunc}}[\nabla\log p]/S_{\text{eff}}`); ``k`` gets no gradient through a Monte Carlo
      normaliser (:mod:`hardeq.bounds.normaliser` says why).
    * ``mean``, ``variance`` and ``entropy`` have no closed form and are not provided; estimate them from samples.

    Args:
        base (ConstrainedNormal): the untruncated conditional.
        lower, upper (None | float | Tensor): the box; ``None`` is unbounded (``-inf`` / ``+inf``), a number applies
            to every coordinate, a tensor broadcasts to ``batch_shape + (n,)`` (entries may be infinite).
        normaliser_samples (int): untruncated draws of the Monte Carlo normaliser (``n - a > 1``).
        grad_samples (int): truncated draws of the normaliser's gradient estimate.
        pilot_samples (int): untruncated draws of ``method="auto"``'s acceptance pilot.
        normaliser (str): ``"auto"`` (exact for ``n - a == 1`` or one sum row with a diagonal covariance, else Monte
            Carlo), ``"exact"`` (``ValueError`` unless one of those) or ``"monte-carlo"`` (forced, e.g. to check the estimator against the exact one).
        training (bool | PersistentChains): training mode (:mod:`hardeq.bounds.training`): :meth:`log_prob` returns
            the *unnormalised* :math:`\log p(z \mid Az = k)` in the box, and its gradient carries the estimate of
            :math:`-\nabla\log Z` from a few sweeps of persistent chains (``hardeq.bounds.PersistentChains``, kept
            across optimiser steps; ``True``: chains of this object only) instead of estimating :math:`\log Z`;
            biased, cheap. Ignored where ``n - a == 1`` (the exact normaliser is as cheap); used on one sum row too
            (whose exact normaliser costs an FFT per coordinate; it stays available in :attr:`log_normaliser`).
        validate_args (bool, optional): as ``torch.distributions``; passed to the plane check of :meth:`log_prob`
            through ``base``.

    Raises:
        TypeError / ValueError: a bound of the wrong type, shape, device or dtype, ``NaN``, ``lower >= upper`` in a
            coordinate; a polytope :math:`\{Az = k\}\cap[l, u]` that is empty or has no volume on the plane (a face
            or a single point), naming the batch element and the row or group (:mod:`hardeq.bounds.polytope`).

    Example:
        >>> import hardeq
        >>> d = hardeq.ConstrainedNormal(torch.full((4,), 0.25), 0.3, constraint=hardeq.SumConstraint(
        ...     torch.zeros(4, dtype=torch.long), torch.ones(1))).truncate(0.0, 1.0)   # long-only weights
        >>> z = d.sample((1000,))
        >>> bool((z >= 0).all() and (z <= 1).all()), bool(torch.allclose(z.sum(-1), torch.ones(1000)))
        (True, True)
    """

    arg_constraints: dict[str, constraints.Constraint] = {}  # noqa: RUF012
    has_rsample = False

    def __init__(self, base: _Base, lower: Tensor | float | None = None,
                 upper: Tensor | float | None = None, *, normaliser_samples: int = 4096, grad_samples: int = 256,
                 pilot_samples: int = 256, normaliser: str = "auto", training: bool | PersistentChains = False,
                 validate_args: bool | None = None) -> None:
        PlaneTarget.of(base, "base")  # TypeError unless base is a ConstrainedNormal (read structurally)
        if not all(hasattr(base, a) for a in ("log_prob", "_out", "_as_event", "expand")):
            raise TypeError(f"base must be a hardeq.ConstrainedNormal, got {type(base).__name__}.")
        for name, value in (("normaliser_samples", normaliser_samples), ("grad_samples", grad_samples),
                            ("pilot_samples", pilot_samples)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}.")
        if normaliser not in ("auto", "exact", "monte-carlo"):
            raise ValueError(f"normaliser must be 'auto', 'exact' or 'monte-carlo', got {normaliser!r}.")
        free = base.event_shape[0] - base.constraint.num_constraints
        if normaliser == "exact" and free != 1 and sum_row_layout(base) is None:
            raise ValueError(f"normaliser='exact' needs one free dimension (n - a == 1) or one sum row (a grouped sum, "
                             f"or one row) with a diagonal covariance, got n - a = {free}, "
                             f"{base.constraint.num_constraints} rows; use 'auto' (a Monte Carlo estimate with its "
                             "standard error).")
        self._normaliser = normaliser
        if isinstance(training, bool):
            self.training: PersistentChains | None = PersistentChains() if training else None
        elif isinstance(training, PersistentChains):
            self.training = training
        else:
            raise TypeError(f"training must be a bool or a hardeq.bounds.PersistentChains, got "
                            f"{type(training).__name__}.")
        self.base = base
        loc = base._unbroadcasted_loc
        shape = base.batch_shape + base.event_shape
        self._lo = as_bound("lower", lower, shape, loc.dtype, loc.device, -math.inf)
        self._hi = as_bound("upper", upper, shape, loc.dtype, loc.device, math.inf)
        check_bounds(self._lo, self._hi)
        self.row_rtol = ROW_RTOL[loc.dtype]
        check_polytope(base.constraint, self._lo, self._hi, self.row_rtol)
        self.normaliser_samples = normaliser_samples
        self.grad_samples = grad_samples
        self.pilot_samples = pilot_samples
        self._cache: dict[str, Any] = {}  # "direction", "mc", "pilot", ...: computed once
        super().__init__(base.batch_shape, base.event_shape, validate_args=False)
        self._validate_args = base._validate_args if validate_args is None else bool(validate_args)
        with torch.no_grad():  # an empty polytope, or one of no volume on the plane, is refused here
            if self.free_dim == 1:
                lows, highs, moves, pinned_out, _, _ = line_bounds(base, self._lo, self._hi, self._direction())
                check_line_section(lows, highs, moves, pinned_out, loc.dtype)

    def _check_volume(self) -> None:
        """With two or more rows (not a grouped sum) and ``n - a >= 2``, whether a combination of rows and bounds
        leaves the polytope without volume or empty (:func:`~hardeq.bounds.volume.check_volume`): once, before
        anything that needs the density (the normaliser, :meth:`log_prob`, the samplers); :attr:`mode` does not
        need it and works on a face too."""
        if "volume" in self._cache:
            return
        base = self.base
        con = base.constraint
        if self.free_dim >= 2 and con.group_index is None and con.num_constraints >= 2:
            def second_opinion(lo: Tensor, hi: Tensor) -> bool:
                try:
                    truncated_mode(base, lo.to(self._lo.dtype), hi.to(self._lo.dtype))
                except ModeNotFound:
                    return False
                return True

            with torch.no_grad():
                check_volume(con, base._unbroadcasted_loc, base.covariance.variance, self._lo, self._hi,
                             base.conditioner.variance(), self._lo.dtype, second_opinion)
        self._cache["volume"] = True

    # ------------------------------------------------------------------ shape and support
    @property
    def _unbroadcasted_loc(self) -> Tensor:  # read by the full-precision guard of the methods
        return self.base._unbroadcasted_loc

    @property
    def lower(self) -> Tensor:
        """The lower bounds, ``batch_shape + (n,)`` (``-inf`` where unbounded)."""
        return self.base._out(self._lo)

    @property
    def upper(self) -> Tensor:
        """The upper bounds, ``batch_shape + (n,)`` (``+inf`` where unbounded)."""
        return self.base._out(self._hi)

    @property
    def free_dim(self) -> int:
        """Dimension of the plane, ``n - a``."""
        return self.event_shape[0] - self.base.constraint.num_constraints

    @property
    def normaliser_exact(self) -> bool:
        """Whether :attr:`log_normaliser` (and :meth:`log_prob`) is exact: one free dimension (``n - a == 1``), or
        up to its stated grid error one sum row with a diagonal covariance (:mod:`hardeq.bounds.sum_normaliser`)."""
        return self._normaliser != "monte-carlo" and (self.free_dim == 1 or self._sum_layout() is not None)

    @property
    def _line_exact(self) -> bool:
        """The exact normaliser of one free dimension (a CDF difference, as cheap as the density)."""
        return self.free_dim == 1 and self._normaliser != "monte-carlo"

    def _sum_layout(self) -> SumRowLayout | None:
        """:func:`~hardeq.bounds.sum_normaliser.sum_row_layout` of the base law (computed once)."""
        if "sum_layout" not in self._cache:
            self._cache["sum_layout"] = sum_row_layout(self.base) if self.free_dim >= 2 else None
        layout: SumRowLayout | None = self._cache["sum_layout"]
        return layout

    def _sum_row(self) -> tuple[Tensor, Tensor]:
        """``(log Z, error)`` of one sum row (:mod:`hardeq.bounds.sum_normaliser`), compute dtype, differentiable
        (cached when no gradient is needed); the Monte Carlo normaliser where the grid failed (an extreme tilt)."""
        needs = self._needs_grad()
        if not needs and "sum_row" in self._cache:
            cached: tuple[Tensor, Tensor] = self._cache["sum_row"]
            return cached
        layout = self._sum_layout()
        assert layout is not None
        self._check_volume()
        log_z, error = sum_row_log_normaliser(self.base, self._lo, self._hi, layout)
        bad = ~(torch.isfinite(error) & torch.isfinite(log_z))
        if bool(bad.any()):
            mc, stderr, _ = self._mc()
            log_z, error = torch.where(bad, mc, log_z), torch.where(bad, stderr, error)
        out = (log_z.to(self._lo.dtype), error.to(self._lo.dtype))
        if not needs:
            self._cache["sum_row"] = (out[0].detach(), out[1].detach())
        return out

    @constraints.dependent_property(is_discrete=False, event_dim=1)
    def support(self) -> constraints.Constraint:
        return _BoxOnPlane(self.base.support, self._lo, self._hi)

    # ------------------------------------------------------------------ mode
    @property
    @_full_precision
    def mode(self) -> Tensor:
        r"""The maximiser of the density on the polytope, ``batch_shape + (n,)``: the projection of :math:`\mu` in the
        covariance metric onto :math:`\{Az = k\}\cap[l, u]`, solved exactly (:mod:`hardeq.bounds.mode`; cached).
        ``lower <= mode <= upper`` exactly; every row within the untruncated tolerance. Not differentiable."""
        return self.base._out(self._compute_mode())

    def _compute_mode(self) -> Tensor:
        """:attr:`mode` in the compute dtype (cached)."""
        if "mode" not in self._cache:
            self._cache["mode"] = truncated_mode(self.base, self._lo, self._hi)
        mode: Tensor = self._cache["mode"]
        return mode

    # ------------------------------------------------------------------ normaliser
    def _direction(self) -> Tensor:
        """The unit null vector of ``A`` (``n - a == 1``), computed once."""
        if "direction" not in self._cache:
            self._cache["direction"] = null_direction(self.base.constraint).detach()
        direction: Tensor = self._cache["direction"]
        return direction

    @torch.no_grad()
    def _count_in_box(self, num: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """MC normaliser from ``num`` untruncated draws, in chunks that bound memory."""
        B, n = self.batch_shape.numel(), self.event_shape[0]
        chunk = max(1, ROUND_ELEMENTS // max(1, B * n))
        inside = torch.zeros(self.batch_shape, dtype=torch.float64, device=self._lo.device)
        cond, loc = self.base.conditioner, self.base._unbroadcasted_loc
        done = 0
        while done < num:
            m = min(chunk, num - done)
            z = cond.sample(loc, (m,), generator=generator)
            inside += ((z >= self._lo) & (z <= self._hi)).all(-1).to(torch.float64).sum(0)
            done += m
        acc = inside / num
        stderr = torch.where(acc > 0, ((1 - acc) / (num * acc.clamp_min(1e-300))).sqrt(),
                             torch.full_like(acc, float("inf")))
        return acc.log(), stderr, acc

    def _mc(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(log Z, stderr, acceptance)``: the untruncated draws' fraction in the box, replaced by subset
        simulation in the batch elements where fewer than :data:`SUBSET_BELOW_IN_BOX` of them fell inside."""
        if "mc" not in self._cache:
            self._check_volume()
            log_z, stderr, acc = self._count_in_box(self.normaliser_samples)
            rare = acc * self.normaliser_samples < SUBSET_BELOW_IN_BOX
            if bool(rare.any()):
                with torch.no_grad():
                    log_s, se_s, _ = subset_log_normaliser(self.base, self._lo, self._hi, self._kernel,
                                                           num=max(64, self.normaliser_samples // 4),
                                                           iterations=SUBSET_ITERATIONS)
                log_z, stderr = torch.where(rare, log_s, log_z), torch.where(rare, se_s, stderr)
            self._cache["mc"] = (log_z, stderr, acc)
        mc: tuple[Tensor, Tensor, Tensor] = self._cache["mc"]
        return mc

    def _kernel(self, lower: Tensor, upper: Tensor, start: Tensor, steps: int) -> Tensor:
        """``steps`` moves of blocked Gibbs (where it applies) or exact HMC for the law truncated to
        ``[lower, upper]``, from ``start`` ``(chains, *batch, n)``; the states after them (subset simulation's
        kernel)."""
        from ..bounds.gibbs import blocked_gibbs, gibbs_unsupported
        from ..bounds.hmc import exact_hmc

        if gibbs_unsupported(self.base) is None:
            return blocked_gibbs(self.base, lower, upper, start, num_samples=1, burn_in=steps - 1).samples[0]
        return exact_hmc(self.base, lower, upper, start, num_samples=1, burn_in=steps - 1, allow_stuck=True).samples[0]

    @property
    @_full_precision
    def log_normaliser(self) -> Tensor:
        r""":math:`\log Z = \log P(l \le z \le u \mid Az = k)`, ``batch_shape``: exact when :attr:`normaliser_exact`
        (differentiable), else the Monte Carlo estimate :math:`\log(N_{\text{in}}/N)` over ``normaliser_samples``
        draws (detached), whose standard error is :attr:`log_normaliser_stderr`. In a batch element where fewer
        than :data:`SUBSET_BELOW_IN_BOX` draws fell in the box the value is the subset-simulation estimate
        (:func:`~hardeq.bounds.normaliser.subset_log_normaliser`: ``normaliser_samples // 4`` chains of blocked
        Gibbs or exact HMC through nested boxes), finite however small :math:`Z` is (down to log Z of about -1,386)."""
        if self._line_exact:
            return self.base._out(exact_log_normaliser(self.base, self._lo, self._hi, self._direction()))
        if self.normaliser_exact:
            return self.base._out(self._sum_row()[0])
        return self.base._out(self._mc()[0].to(self._lo.dtype))

    @property
    def log_normaliser_stderr(self) -> Tensor:
        r"""Standard error of :attr:`log_normaliser`, ``batch_shape``: 0 when exact on a line, the grid's error
        estimate :math:`|\log\hat Z_h - \log\hat Z_{2h}|` (a bound, :mod:`hardeq.bounds.sum_normaliser`) on one
        sum row, else the delta-method
        :math:`\sqrt{(1 - \hat Z)/(N\hat Z)}` of the plain fraction, or subset simulation's calibrated error where
        that is used (:func:`~hardeq.bounds.normaliser.subset_log_normaliser`)."""
        if self._line_exact:
            return torch.zeros(self.batch_shape, dtype=self.base.result_dtype, device=self._lo.device)
        if self.normaliser_exact:
            return self.base._out(self._sum_row()[1].detach())
        return self.base._out(self._mc()[1].to(self._lo.dtype))

    @property
    def acceptance(self) -> Tensor:
        """Acceptance of rejection sampling, ``batch_shape``: :math:`Z` itself when exact on a line (``n - a == 1``), else the pilot's measured
        fraction over ``pilot_samples`` draws (what ``method="auto"`` compares with its threshold)."""
        if self._line_exact:
            with torch.no_grad():
                return self.log_normaliser.detach().to(torch.float64).exp()
        if "pilot" not in self._cache:
            self._check_volume()
            self._cache["pilot"] = self._count_in_box(self.pilot_samples)[2]
        pilot: Tensor = self._cache["pilot"]
        return pilot

    def _needs_grad(self) -> bool:
        base = self.base
        return torch.is_grad_enabled() and (base._unbroadcasted_loc.requires_grad
                                            or any(t.requires_grad for t in base.covariance.tensors())
                                            or base.constraint.k.requires_grad)

    def _training_log_z(self, value: Tensor) -> Tensor:
        """Training mode: no :math:`\\log Z`, only the zero-valued surrogate whose gradient is the persistent chains'
        estimate of :math:`\\nabla\\log Z` (:mod:`hardeq.bounds.training`); ``batch_shape``, compute dtype."""
        chains = self.training
        assert chains is not None
        if not self._needs_grad():
            return torch.zeros(self.batch_shape, dtype=self._lo.dtype, device=self._lo.device)
        self._warn_k()
        base, lo, hi = self.base, self._lo, self._hi
        shape = self.batch_shape + self.event_shape
        rtol = math.sqrt(torch.finfo(lo.dtype).eps)
        with torch.no_grad():
            start = chains.start(shape, lo, hi, lambda z: base.constraint.check(z, rtol=rtol),
                                 base._as_event("value", value), self._compute_mode)
            draws = self._chain(start, chains.sweeps)
        chains.state = draws[-1].detach()
        chains.steps += 1
        return surrogate(self._plane_log_prob(), draws.flatten(0, 1))

    @torch.no_grad()
    def _chain(self, start: Tensor, sweeps: int) -> Tensor:
        """``sweeps`` states ``(sweeps, chains, *batch, n)`` of blocked Gibbs (exact HMC where Gibbs does not
        apply, stuck chains allowed) from ``start``, in the compute dtype."""
        from ..bounds.gibbs import blocked_gibbs, gibbs_unsupported
        from ..bounds.hmc import exact_hmc

        if gibbs_unsupported(self.base) is None:
            return blocked_gibbs(self.base, self._lo, self._hi, start, num_samples=sweeps, burn_in=0).samples
        return exact_hmc(self.base, self._lo, self._hi, start, num_samples=sweeps, burn_in=0,
                         allow_stuck=True).samples

    def _plane_log_prob(self) -> Callable[[Tensor], Tensor]:
        """The untruncated conditional log-density on the plane with ``k`` detached (the normaliser's surrogate
        carries no gradient to ``k``; :mod:`hardeq.bounds.normaliser`)."""
        base = self.base
        if base.constraint.k.requires_grad:
            con = base.constraint.with_k(base.constraint.k.detach())
            make: Any = type(base)
            base = make(base._unbroadcasted_loc, covariance=base.covariance, constraint=con, validate_args=False)
        return base.log_prob

    def _warn_k(self) -> None:
        if self.base.constraint.k.requires_grad and not self._cache.get("warned_k"):
                self._cache["warned_k"] = True
                warnings.warn("k requires grad, but with n - a > 1 the Monte Carlo normaliser of "
                              "TruncatedConstrainedNormal.log_prob carries no gradient to k (k moves the box's section "
                              "of the plane; the identity grad log Z = E[grad log p] covers loc and the scales only). "
                              "Treat k as data here, or use one free dimension (exact normaliser).", UserWarning,
                              stacklevel=4)

    def _log_z(self) -> Tensor:
        """:math:`\\log Z` for :meth:`log_prob`, compute dtype: exact with autograd, or the MC value plus the
        zero-valued surrogate that carries the gradient estimate."""
        if self._line_exact:
            return exact_log_normaliser(self.base, self._lo, self._hi, self._direction())
        if self.normaliser_exact:
            return self._sum_row()[0]
        log_z = self._mc()[0].to(self._lo.dtype)
        if self._needs_grad():
            self._warn_k()
            if "grad_draws" not in self._cache:
                self._cache["grad_draws"] = self._sample_compute((self.grad_samples,), "auto").samples.detach()
            log_z = log_z + surrogate(self._plane_log_prob(), self._cache["grad_draws"])
        return log_z

    @_full_precision
    def log_prob(self, value: Tensor) -> Tensor:
        r"""Log-density of the truncated law on the plane, ``sample_shape + batch_shape``: :math:`\log p(z\mid Az=k)
        - \log Z` where ``lower <= value <= upper`` (exact comparison), ``-inf`` elsewhere; points off the plane are
        handled as :meth:`ConstrainedNormal.log_prob` does (``ValueError`` with ``validate_args``). The normaliser is
        exact or a Monte Carlo estimate (class docstring; :attr:`normaliser_exact`); gradients flow to ``loc``, the
        scales and (exact case) ``k``, including the normaliser's.

        Cost: one :meth:`ConstrainedNormal.log_prob`; the first call of a Monte Carlo normaliser also draws
        ``normaliser_samples`` untruncated vectors and, when a gradient is needed, ``grad_samples`` truncated ones
        (cached on this object)."""
        self._check_volume()
        lp = self.base.log_prob(value)
        v = self.base._as_event("value", value)
        # a NaN value is neither inside nor outside: its NaN log-density is passed on, never -inf
        inside = ((v >= self._lo) & (v <= self._hi)).all(-1) | torch.isnan(v).any(-1)
        training = self.training is not None and not self._line_exact
        out = lp - self.base._out(self._training_log_z(value) if training else self._log_z())
        return torch.where(inside, out, torch.full_like(out, -float("inf")))

    # ------------------------------------------------------------------ sampling
    def sample(self, sample_shape: torch.Size | list[int] | tuple[int, ...] = (), method: str = "auto",
               **kwargs: Any) -> Tensor:
        """Draws of shape ``sample_shape + batch_shape + (n,)``, every one feasible exactly (class docstring);
        :meth:`sample_with_info` for the arguments and for the method used and its diagnostics."""
        return self.sample_with_info(sample_shape, method, **kwargs).samples

    @_full_precision
    def sample_with_info(self, sample_shape: torch.Size | list[int] | tuple[int, ...] = (), method: str = "auto", *,
                         chains: int | None = None, burn_in: int = 100, thin: int = 1,
                         travel_time: tuple[float, float] | None = None, threshold: float = AUTO_THRESHOLD,
                         max_draws: int | None = None, generator: torch.Generator | None = None) -> TruncatedSamples:
        r"""Draws of the truncated law and how they were made.

        Args:
            sample_shape: leading sample dimensions.
            method: ``"rejection"`` (exact iid), ``"gibbs"`` (blocked Gibbs on the plane, any covariance with a
                diagonal part; ``ValueError`` naming ``"hmc"`` otherwise), ``"hmc"`` (exact HMC on the plane; both
                exact in their stationary law; :class:`~hardeq.bounds.ChainStuck` where an HMC chain cannot move)
                or ``"auto"``: the most effective samples per modelled second on a short pilot of each sampler that
                applies (rejection where the pilot acceptance, the smallest over the batch, is at least
                ``threshold``; :func:`hardeq.bounds.choice.choose_method`); an HMC choice whose chain cannot move
                falls back to Gibbs where it applies.
            chains: Markov chains per batch element (Gibbs or HMC; default ``prod(sample_shape)``: one draw per chain
                after ``burn_in``, so draws are as independent as the burn-in makes them); each chain then gives
                ``ceil(prod(sample_shape) / chains)`` draws ``thin`` steps apart. Chains start at :attr:`mode`.
            burn_in, thin: sweeps (Gibbs) or trajectories (HMC) discarded first, and kept every ``thin``-th.
            travel_time: HMC only (``ValueError`` with ``method="gibbs"``): the interval of the uniform random
                travel time, default that of :func:`hardeq.bounds.exact_hmc`.
            threshold: the acceptance at which ``"auto"`` switches to rejection.
            max_draws: rejection's cap on untruncated draws per batch element
                (:func:`hardeq.bounds.rejection_sample`).
            generator: for reproducible draws.

        Returns:
            :class:`~hardeq.bounds.TruncatedSamples`: ``samples`` (``sample_shape + batch_shape + (n,)``, in the
            distribution's dtype), ``method``, ``acceptance`` (rejection), ``ess`` and ``rhat`` (Gibbs and HMC; for
            rejection ``ess`` is the number of draws).

        Every returned draw satisfies ``lower <= z <= upper`` exactly and every row of ``A z = k`` within the
        untruncated per-row tolerance.

        Cost: rejection, about ``prod(sample_shape) / acceptance`` untruncated draws per batch element (measured:
        2.6-2.8x the untruncated sampler at acceptance 0.45, n = 16); HMC, ``burn_in + ceil(num / chains) * thin``
        trajectories of ``chains`` chains per batch element, each trajectory O(n a) per wall bounce (far more than
        an untruncated draw: with the default one chain per draw and ``burn_in=100``, about 2,700x the untruncated
        sampler at n = 16 on a loaded CPU; fewer chains with ``thin`` trade independence for time); Gibbs,
        ``burn_in + ceil(num / chains) * thin`` sweeps of ``chains`` chains, each O(n) for a grouped sum and O(n a)
        for a dense ``A`` (no bounces: its cost does not grow where coordinates press against a wall, where HMC's
        does). ``"auto"`` weighs these costs against each sampler's mixing on its pilot.
        """
        out = self._sample_compute(sample_shape, method, chains=chains, burn_in=burn_in, thin=thin,
                                   travel_time=travel_time, threshold=threshold, max_draws=max_draws,
                                   generator=generator)
        out.samples = self.base._out(out.samples)
        return out

    @torch.no_grad()
    def _sample_compute(self, sample_shape: object, method: str, *, chains: int | None = None, burn_in: int = 100,
                        thin: int = 1, travel_time: tuple[float, float] | None = None,
                        threshold: float = AUTO_THRESHOLD,
                        max_draws: int | None = None, generator: torch.Generator | None = None) -> TruncatedSamples:
        sample_shape = _sample_shape(sample_shape)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
        self._check_volume()
        num = sample_shape.numel()
        batch, n = self.batch_shape, self.event_shape[0]
        from ..bounds.gibbs import blocked_gibbs, gibbs_unsupported

        auto = method == "auto"
        if auto:
            # with a generator the pilots draw from it too (not cached), so that the method chosen is reproducible
            acc = self.acceptance if generator is None or self._line_exact else \
                self._count_in_box(self.pilot_samples, generator)[2]
            from ..bounds.choice import choose_method

            method = choose_method(self.base, self._lo, self._hi, self.mode.to(self._lo.dtype), num=max(num, 1),
                                   chains=chains if chains is not None else max(num, 1),
                                   acceptance=float(acc.min()), threshold=threshold, generator=generator,
                                   burn_in=burn_in, thin=thin)[0]
        elif method == "gibbs":
            reason = gibbs_unsupported(self.base)
            if reason is not None:
                raise ValueError(reason)
            if travel_time is not None:
                raise ValueError(f"travel_time is an HMC control; method='gibbs' takes none, got {travel_time!r}.")
        if method == "rejection":
            z, acc = rejection_sample(self.base, self._lo, self._hi, num, max_draws=max_draws, generator=generator)
            ess = torch.full(batch + (n,), float(num), dtype=torch.float64, device=z.device)
            return TruncatedSamples(z.reshape(sample_shape + batch + (n,)), "rejection", acc, ess, None)
        from ..bounds import ChainStuck
        from ..bounds.hmc import exact_hmc

        if chains is None:
            chains = max(num, 1)
        if isinstance(chains, bool) or not isinstance(chains, int) or chains < 1:
            raise ValueError(f"chains must be a positive int, got {chains!r}.")
        per_chain = max(1, math.ceil(num / chains))
        start = self.mode.to(self._lo.dtype).expand((chains,) + batch + (n,))
        if method == "gibbs":
            res_g = blocked_gibbs(self.base, self._lo, self._hi, start, num_samples=per_chain, burn_in=burn_in,
                                  thin=thin, generator=generator)
            samples, ess, rhat = res_g.samples, res_g.ess, res_g.rhat
        else:
            kwargs: dict[str, Any] = {} if travel_time is None else {"travel_time": travel_time}
            try:
                res = exact_hmc(self.base, self._lo, self._hi, start, num_samples=per_chain, burn_in=burn_in,
                                thin=thin, generator=generator, **kwargs)
            except ChainStuck:
                if not auto or gibbs_unsupported(self.base) is not None:
                    raise
                method = "gibbs"                               # auto's HMC could not move: Gibbs (no bounces) can
                res_g = blocked_gibbs(self.base, self._lo, self._hi, start, num_samples=per_chain, burn_in=burn_in,
                                      thin=thin, generator=generator)
                samples, ess, rhat = res_g.samples, res_g.ess, res_g.rhat
            else:
                samples, ess, rhat = res.samples, res.ess, res.rhat
        z = samples.reshape((per_chain * chains,) + batch + (n,))[:num]
        z = torch.minimum(torch.maximum(z.to(self._lo.dtype), self._lo), self._hi)
        return TruncatedSamples(z.reshape(sample_shape + batch + (n,)), method, None, ess, rhat)

    # ------------------------------------------------------------------ plumbing
    def expand(self, batch_shape: torch.Size | list[int] | tuple[int, ...], _instance: Self | None = None) -> Self:
        """The same law with ``batch_shape`` expanded (the base's :meth:`~ConstrainedNormal.expand` and the bounds
        expanded; the feasibility checks are repeated, O(n a)); a subclass expands to its own class."""
        batch_shape = _sample_shape(batch_shape, "batch_shape")
        base = self.base.expand(batch_shape)
        n = self.event_shape[0]
        return type(self)(base, self._lo.expand(batch_shape + (n,)),
                                          self._hi.expand(batch_shape + (n,)),
                                          normaliser_samples=self.normaliser_samples, grad_samples=self.grad_samples,
                                          pilot_samples=self.pilot_samples, normaliser=self._normaliser,
                                          training=self.training if self.training is not None else False,
                                          validate_args=self._validate_args)

    def __repr__(self) -> str:
        lo, hi = self._lo, self._hi

        def fmt(t: Tensor) -> str:
            return f"{float(t.flatten()[0]):g}" if bool((t == t.flatten()[0]).all()) else f"tensor{tuple(t.shape)}"

        return (f"TruncatedConstrainedNormal(n={self.event_shape[0]}, batch_shape={tuple(self.batch_shape)}, "
                f"lower={fmt(lo)}, upper={fmt(hi)}, normaliser={'exact' if self.normaliser_exact else 'monte-carlo'}, "
                f"base={self.base!r})")

