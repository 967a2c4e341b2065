r"""The Gaussian conditioned on :math:`Az = k` and truncated to a box: :class:`TruncatedConstrainedNormal`.

The class holds the public surface (construction and its checks, the bounds, the support, the mode, the normaliser's
properties, :meth:`~TruncatedConstrainedNormal.log_prob`, sampling, ``expand``); the machinery behind it is in mixins
of one job each: :mod:`.truncated_normaliser` (the normaliser), :mod:`.truncated_log_z` (``log_prob``'s
:math:`\log Z`, its gradient and training mode), :mod:`.truncated_sampling` (the method choice and the samplers),
and :mod:`.truncated_support` (what they read, the support, the small helpers).
"""

from __future__ import annotations

import math
from typing import Any, Self

import torch
from torch import Tensor
from torch.distributions import Distribution, constraints

from ..bounds.mode import truncated_mode
from ..bounds.normaliser import exact_log_normaliser, line_bounds
from ..bounds.polytope import as_bound, check_box_and_polytope
from ..bounds.checks import StartOffPlane
from ..bounds.start import feasible_start
from ..bounds.start_dual import dual_start
from ..bounds.rejection import AUTO_THRESHOLD
from ..bounds.result import TruncatedSamples
from ..bounds.sum_normaliser import sum_row_layout
from ..bounds.target import PlaneTarget
from ..bounds.training import PersistentChains
from ..bounds.volume import check_line_section
from .truncated_log_z import _LogZParts
from .truncated_normaliser import SUBSET_BELOW_IN_BOX as SUBSET_BELOW_IN_BOX
from .truncated_normaliser import SUBSET_ITERATIONS as SUBSET_ITERATIONS
from .truncated_normaliser import _NormaliserParts
from .truncated_sampling import METHODS as METHODS
from .truncated_sampling import _SamplingParts
from .truncated_support import ROW_RTOL as ROW_RTOL
from .normal_checks import _sample_shape
from .truncated_support import _Base, _BoxOnPlane, _full_precision

__all__ = ["TruncatedConstrainedNormal"]


class TruncatedConstrainedNormal(_SamplingParts, _LogZParts, _NormaliserParts, Distribution):
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
      a point of the polytope built without a host read where every coordinate lies in at most one row
      (:func:`hardeq.bounds.start.feasible_start`), else from :attr:`mode`. The method used is named in the result.
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
            Carlo), ``"exact"`` (``ValueError`` unless one of those) or ``"monte-carlo"`` (forced, e.g. to check the
            estimator against the exact one).
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
        self.row_rtol = ROW_RTOL[loc.dtype]
        check_box_and_polytope(base.constraint, self._lo, self._hi, self.row_rtol)  # one host read
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

    def _chain_start(self) -> Tensor:
        """The chains' start ``(*batch, n)`` in the compute dtype, built without a host read: a point of the polytope
        where every coordinate lies in at most one row (:func:`hardeq.bounds.start.feasible_start`), else the
        :attr:`mode` where it is known, else a fixed number of dual Newton steps towards it
        (:func:`hardeq.bounds.start_dual.dual_start`), which the samplers' start check verifies (on failure,
        sampling starts again from the exact mode: :meth:`_start_from_mode`)."""
        point = feasible_start(self.base, self._lo, self._hi)
        if point is not None:
            return point
        if "mode" in self._cache:
            return self._compute_mode()
        if "start" not in self._cache:
            self._cache["start"] = dual_start(self.base, self._lo, self._hi)[0]
        start: Tensor = self._cache["start"]
        return start

    def _start_is_approximate(self) -> bool:
        """Is :meth:`_chain_start` the unverified dual start (not a closed-form point nor the exact mode)?"""
        return "start" in self._cache and "mode" not in self._cache

    def _start_from_mode(self) -> None:
        """Replace the dual start by the exact mode, after the full volume check: their host reads, and their
        precise errors for an empty polytope or one without volume."""
        del self._cache["start"]
        self._check_volume()
        self._compute_mode()

    # ------------------------------------------------------------------ normaliser
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
        """Acceptance of rejection sampling, ``batch_shape``: :math:`Z` itself when exact on a line (``n - a == 1``),
        else the pilot's measured fraction over ``pilot_samples`` draws (what ``method="auto"`` compares with its
        threshold)."""
        if self._line_exact:
            with torch.no_grad():
                return self.log_normaliser.detach().to(torch.float64).exp()
        if "pilot" not in self._cache:
            self._check_volume()
            self._cache["pilot"] = self._count_in_box(self.pilot_samples)[2]
        pilot: Tensor = self._cache["pilot"]
        return pilot

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
        training = self.training is not None and not self._line_exact
        # a training step's persistent chains read the host anyway: the volume check is folded into that read
        verdict = self._deferred_volume_check() if training and self._needs_grad() else None
        if verdict is None:
            self._check_volume()
        lp = self.base.log_prob(value)
        v = self.base._as_event("value", value)
        # a NaN value is neither inside nor outside: its NaN log-density is passed on, never -inf
        inside = ((v >= self._lo) & (v <= self._hi)).all(-1) | torch.isnan(v).any(-1)
        if training:
            try:
                log_z = self._training_log_z(value, verdict)
            except StartOffPlane:
                if verdict is None:
                    raise
                del self._cache["start"]
                self._check_volume()  # (its reads, and its precise error for an empty polytope or a face)
                log_z = self._training_log_z(value, None)
        else:
            log_z = self._log_z()
        out = lp - self.base._out(log_z)
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
                ``ceil(prod(sample_shape) / chains)`` draws ``thin`` steps apart. Chains start at a point of the
                polytope (:func:`hardeq.bounds.start.feasible_start`: no host read, no QP; a grouped sum or one
                row), else at :attr:`mode`.
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

