r"""The Gaussian conditioned on a hard linear equality constraint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Self

import torch
from torch import Tensor
from torch.distributions import Distribution, constraints
from torch.distributions.utils import lazy_property

from .._utils import check_tensor
from .._validation import image_flatten_hint
from ..constraints import EqualityConstraint
from ..estimators import normal as _normal_estimators  # noqa: F401  (registers the estimators)
from ..estimators.registry import get_estimator
from ..linalg.conditioning import Conditioner, is_tracing
from ..linalg.conditioning.grouped_sample import grouped_rsample
from ..linalg.device import profile as device_profile
from ..linalg.covariance import Covariance
from .losses import gaussian_expected_abs, gaussian_expected_square
from .normal_checks import _assert_values, _broadcast_shapes, _check_values, _sample_shape
from .normal_covariance import _covariance_from_arguments
from .normal_parts import _NormalParts
from .normal_precision import HALF_DTYPES as HALF_DTYPES
from .normal_precision import HALF_SUPPORT_RTOL_EPS as HALF_SUPPORT_RTOL_EPS
from .normal_precision import _AffineSubspace as _AffineSubspace
from .normal_precision import _full_precision

if TYPE_CHECKING:
    from .truncated import TruncatedConstrainedNormal

__all__ = ["ConstrainedNormal", "affine_subspace"]

affine_subspace = _AffineSubspace


class ConstrainedNormal(_NormalParts, Distribution):
    r"""Normal :math:`\mathcal N(\mu, \Sigma)` conditioned on :math:`A z = k`:

    .. math::
        z \mid Az = k \sim \mathcal N\big(\mu + K(k - A\mu),\; \Sigma - KA\Sigma\big),
        \qquad K = \Sigma A^\top S^{-1},\ S = A\Sigma A^\top.

    Supported on the affine subspace :math:`\{z : Az = k\}` (dimension ``n - a``); :meth:`log_prob` is a
    density w.r.t. Lebesgue measure *on that subspace*:

    .. math::
        \log p(z \mid Az = k) = \log\mathcal N(z; \mu, \Sigma) - \log\mathcal N(k; A\mu, S)
        - \tfrac12\log\det(AA^\top),

    evaluated without cancellation (see :meth:`log_prob`).

    Sampling is exact (Matheron's rule): :math:`z = \hat z + K(k - A\hat z)` with
    :math:`\hat z \sim \mathcal N(\mu, \Sigma)`; :meth:`rsample` is differentiable and the default
    ``"pathwise"`` gradient is unbiased. Other estimators (``hardeq.estimators``) share the forward pass.

    The covariance is one object (:class:`~hardeq.DiagonalCovariance`, :class:`~hardeq.FullCovariance`,
    :class:`~hardeq.LowRankCovariance`), passed as ``covariance=``; the keyword shortcuts build it:

    * ``scale`` alone: diagonal :math:`\Sigma = \mathrm{diag}(\mathrm{scale}^2)`; a Python number or a tensor
      that broadcasts to ``loc`` (last dimension 1 or ``n``), as in ``torch.distributions.Normal``;
    * ``scale_tril``: full :math:`\Sigma = LL^\top`;
    * ``covariance_matrix``: full :math:`\Sigma`, factorised once (one Cholesky, :math:`n^3/3` flops);
    * ``precision_matrix``: full :math:`\Sigma = P^{-1}`, as ``torch.distributions.MultivariateNormal`` does it:
      :math:`JPJ = L_f L_f^\top` (:math:`J` reverses the order) gives :math:`P = UU^\top` with
      :math:`U = JL_fJ` upper triangular, so :math:`\Sigma = U^{-\top}U^{-1}` and the lower factor is
      :math:`L = U^{-\top}`: one Cholesky and one triangular solve against the identity (:math:`2n^3/3` flops,
      :math:`O(n^2)` memory); :math:`\Sigma` itself is never formed;
    * ``cov_factor`` with ``scale``: :math:`\Sigma = WW^\top + \mathrm{diag}(\mathrm{scale}^2)`.

    Exactly one form is given (as ``MultivariateNormal`` takes exactly one of ``covariance_matrix``,
    ``precision_matrix`` and ``scale_tril``); several, or none, is a ``ValueError`` naming them. Note the
    keyword ``covariance_matrix`` is the *unconditioned* :math:`\Sigma`, while the attribute
    :attr:`covariance_matrix` is the conditional covariance (as ``loc`` is the unconditioned mean and
    :attr:`mean` the conditional one).

    The distribution factorises :math:`A\Sigma A^\top` once, lazily, into its :attr:`conditioner`; the
    mean, variances, samples of every estimator, densities and KL all reuse it.

    Cost: diagonal :math:`\Sigma` with a dense ``A``: O(n a^2 + a^3) time, O(n + a^2) memory per batch
    element; with a :class:`~hardeq.SumConstraint`: O(n). Nothing ``n x n`` is formed unless ``scale_tril``,
    ``covariance_matrix`` or ``precision_matrix`` is given (or :attr:`covariance_matrix` is asked for).

    Args:
        loc (Tensor): :math:`\mu`, shape ``(*batch, n)``.
        scale (Tensor or float, optional): standard deviations, ``(*batch, n)``, or anything that broadcasts to
            it along the last dimension (a number, ``()``, ``(*batch, 1)``); a number takes ``loc``'s dtype and
            device.
        covariance (Covariance, optional): the covariance object (instead of the shortcuts).
        scale_tril (Tensor, optional): lower Cholesky factor of :math:`\Sigma`, ``(*batch, n, n)``.
        covariance_matrix (Tensor, optional): :math:`\Sigma`, symmetric positive definite, ``(*batch, n, n)``.
        precision_matrix (Tensor, optional): :math:`\Sigma^{-1}`, symmetric positive definite, ``(*batch, n, n)``.
        cov_factor (Tensor, optional): :math:`W`, ``(*batch, n, r)``.
        constraint (EqualityConstraint): :class:`~hardeq.LinearConstraint` or :class:`~hardeq.SumConstraint`;
            its batch dims broadcast with the parameters'.
        validate_args (bool, optional): value checks (finiteness, positivity, rank of ``A``, support of
            ``log_prob`` arguments), as in ``torch.distributions``. Shapes, dtypes, devices are always checked.

    Example:
        >>> d = ConstrainedNormal(torch.zeros(3), torch.ones(3), constraint=LinearConstraint(torch.ones(1, 3),
        ...                       torch.ones(1)))
        >>> z = d.rsample((4,))
        >>> z.shape, torch.allclose(z.sum(-1), torch.ones(4))
        (torch.Size([4, 3]), True)
    """

    has_rsample = True

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # a constraint that names its own law (hardeq.NonlinearConstraint: a Gaussian on a manifold) gets that class
        other = getattr(kwargs.get("constraint"), "distribution_class", None)
        return other(*args, **kwargs) if cls is ConstrainedNormal and other is not None else super().__new__(cls)

    def __init__(
        self,
        loc: Tensor,
        scale: Tensor | float | None = None,
        *,
        covariance: Covariance | None = None,
        scale_tril: Tensor | None = None,
        cov_factor: Tensor | None = None,
        covariance_matrix: Tensor | None = None,
        precision_matrix: Tensor | None = None,
        constraint: EqualityConstraint,
        validate_args: bool | None = None,
    ) -> None:
        check_tensor("loc", loc, min_dim=1)
        if not isinstance(constraint, EqualityConstraint):
            raise TypeError(
                "constraint must be a hardeq.EqualityConstraint (e.g. hardeq.LinearConstraint), got "
                f"{type(constraint).__name__}."
            )
        n = loc.shape[-1]
        validate = Distribution._validate_args if validate_args is None else validate_args
        pending: list[tuple[Tensor, Callable[[], None]]] = []  # (value checks read with _check_values)
        covariance = _covariance_from_arguments(loc, scale, covariance, scale_tril, cov_factor, covariance_matrix,
                                                precision_matrix, constraint, validate, pending)
        if constraint.event_size != n:
            raise ValueError(
                f"constraint acts on vectors of size {constraint.event_size}, but loc has size n = {n} "
                f"(loc.shape = {tuple(loc.shape)}){image_flatten_hint('loc', loc.shape, constraint.event_size)}."
            )
        try:
            batch_shape = _broadcast_shapes(loc.shape[:-1], covariance.batch_shape, constraint.batch_shape)
        except RuntimeError:
            raise ValueError(
                f"batch shapes do not broadcast: loc {tuple(loc.shape[:-1])}, covariance "
                f"{tuple(covariance.batch_shape)}, constraint {tuple(constraint.batch_shape)}."
            ) from None
        if validate_args is None:
            validate_args = Distribution._validate_args
        if validate_args and is_tracing():  # inside a graph: one device-side check, its error deferred
            _assert_values(loc, covariance, constraint.k)
        elif validate_args:  # one host read (the constraint's k too, unless the constraint validated it)
            _check_values(loc, covariance, None if getattr(constraint, "_validate_args", False) else constraint.k,
                          pending)
        #: the dtype every result is returned in (the inputs'); half precision is computed in float32
        self.result_dtype = loc.dtype
        self.loc = loc if loc.shape[:-1] == batch_shape else loc.expand(batch_shape + (n,))
        if loc.dtype in HALF_DTYPES:
            loc = loc.to(torch.float32)
            covariance = covariance.to(dtype=torch.float32)
            constraint = constraint.to(dtype=torch.float32)
        self.constraint = constraint
        self.covariance = covariance
        self._unbroadcasted_loc = loc
        self._logdet_checked = False
        super().__init__(batch_shape, torch.Size([n]), validate_args=False)
        self._validate_args = bool(validate_args)

    # ------------------------------------------------------------------ parameters
    @property
    def arg_constraints(self) -> dict[str, constraints.Constraint]:
        return {"loc": constraints.real_vector, **self.covariance.arg_constraints}

    @property
    def scale(self) -> Tensor | None:
        """Standard deviations of the diagonal (part of the) covariance, ``(*batch, n)``; ``None`` for a full one."""
        s = getattr(self.covariance, "scale", None)
        return None if s is None else self._out(s.expand(self.batch_shape + self.event_shape))

    @property
    def scale_tril(self) -> Tensor | None:
        """``L`` of a full covariance, ``(*batch, n, n)``; ``None`` otherwise."""
        L = getattr(self.covariance, "scale_tril", None)
        return None if L is None else self._out(L.expand(self.batch_shape + self.event_shape + self.event_shape))

    @property
    def cov_factor(self) -> Tensor | None:
        """``W`` of a low-rank covariance, ``(*batch, n, r)``; ``None`` otherwise."""
        W = getattr(self.covariance, "cov_factor", None)
        return None if W is None else self._out(W.expand(self.batch_shape + W.shape[-2:]))

    @property
    def noise_size(self) -> int:
        """Size of the last dimension of the ``noise`` that :meth:`rsample` consumes (``n``, or ``n + r``)."""
        return self.covariance.noise_size

    @constraints.dependent_property(is_discrete=False, event_dim=1)
    def support(self) -> constraints.Constraint:
        return _AffineSubspace(self.constraint)

    # ------------------------------------------------------------------ the one factorisation
    def _out(self, x: Tensor) -> Tensor:
        """``x`` in :attr:`result_dtype` (a no-op except for half-precision inputs)."""
        return x if x.dtype == self.result_dtype else x.to(self.result_dtype)

    @lazy_property
    @_full_precision
    def conditioner(self) -> Conditioner:
        r"""The factorisation of :math:`A\Sigma A^\top` for this covariance and constraint, built on first
        use and shared by every method and estimator. Built with autograd enabled when a parameter requires
        grad (even when first used under ``torch.no_grad()``), so later ``rsample`` calls keep their gradients;
        the conditioner derives its :attr:`~hardeq.linalg.conditioning.Conditioner.requires_grad` itself.
        """
        needs_grad = any(t.requires_grad for t in self.covariance.tensors()) or self.constraint.k.requires_grad
        # the sync-free (static) form under tracing, and where a read-back would synchronise a device
        # (hardeq.linalg.device), validated or not (validation checked the inputs at construction, in one host read);
        # on a CPU a read-back costs nothing and the checked form's float32 factor with its host-side screen is 2-3x
        # faster
        static = is_tracing() or not device_profile(self.loc.device).host_guards
        with torch.set_grad_enabled(needs_grad or torch.is_grad_enabled()):
            return Conditioner(self.covariance, self.constraint, static=static)

    @lazy_property
    @_full_precision
    def _mean(self) -> Tensor:
        needs_grad = self._unbroadcasted_loc.requires_grad or self.conditioner.requires_grad
        with torch.set_grad_enabled(needs_grad or torch.is_grad_enabled()):
            return self.conditioner.condition(self._unbroadcasted_loc)

    @lazy_property
    @_full_precision
    def _loc_residual(self) -> Tensor:
        r""":math:`r = k - A\mu`, ``(*batch, a)``, accumulated in float64 (it cancels when ``loc`` is near the
        plane, and its error is divided by the scale in the density)."""
        wide = torch.float64 if self.loc.dtype in (torch.float16, torch.bfloat16, torch.float32) else self.loc.dtype
        con = self.constraint.to(dtype=wide)
        return (con.k - con.matvec(self._unbroadcasted_loc.to(wide))).to(self.loc.dtype)

    @property
    def mean(self) -> Tensor:
        r"""Conditional mean :math:`\bar\mu = \mu + K(k - A\mu)`, ``(*batch, n)``."""
        return self._out(self._mean).expand(self.batch_shape + self.event_shape)

    @property
    def mode(self) -> Tensor:
        return self.mean

    @lazy_property
    @_full_precision
    def _variance(self) -> Tensor:
        return self.conditioner.variance()

    @property
    def variance(self) -> Tensor:
        r"""Conditional marginal variances :math:`\bar\sigma^2_i`, ``(*batch, n)``; 0 where the constraint
        pins a coordinate."""
        return self._out(self._variance).expand(self.batch_shape + self.event_shape)

    @property
    def stddev(self) -> Tensor:
        return self.variance.sqrt()

    @lazy_property
    @_full_precision
    def covariance_matrix(self) -> Tensor:
        r"""Dense conditional covariance :math:`\Sigma - KA\Sigma` (rank ``n - a``), ``(*batch, n, n)``.
        Formed only when asked for."""
        return self._out(self.conditioner.covariance_matrix()).expand(self.batch_shape + self.event_shape * 2)

    # ------------------------------------------------------------------ sampling
    @_full_precision
    def rsample(
        self, sample_shape: torch.Size | list[int] | tuple[int, ...] = (), estimator: str = "pathwise", *,
        noise: Tensor | None = None, **estimator_kwargs: Any,
    ) -> Tensor:
        r"""Exact sample of shape ``sample_shape + batch_shape + (n,)``, differentiable.

        Args:
            sample_shape: leading sample dimensions.
            estimator: id of the gradient estimator (``hardeq.estimators.available_estimators()``); every
                estimator returns the same exact sample and differs in the backward pass only. Each receives
                this distribution's :attr:`conditioner` (no factorisation is repeated).
            noise: the standard normal :math:`\varepsilon` to use, shape ``sample_shape + batch_shape +
                (noise_size,)``; makes the sample a deterministic function (for ``gradcheck``).
            **estimator_kwargs: passed to the estimator (e.g. ``proxy_noise``).
        """
        est = get_estimator(estimator, "normal")
        eps = self._noise(sample_shape, noise)
        if estimator == "pathwise" and not estimator_kwargs:  # one node, no conditioner; None: the general path
            z = grouped_rsample(self.covariance, self.constraint, self._unbroadcasted_loc, eps)
            if z is not None:  # (it has eps's shape, sample_shape + batch_shape + (n,))
                return self._out(z)
        z = est(self.conditioner, self._unbroadcasted_loc, eps, **estimator_kwargs)
        shape = eps.shape[:-1] + self.event_shape
        z = self._out(z)
        return z if z.shape == shape else z.expand(shape)

    @_full_precision
    def sample(self, sample_shape: torch.Size | list[int] | tuple[int, ...] = ()) -> Tensor:
        """Exact sample without gradient; uses the cached factorisation."""
        sample_shape = _sample_shape(sample_shape)
        cond = self.conditioner
        shape = sample_shape + self.batch_shape + self.event_shape
        with torch.no_grad():  # fused: randn, loc + F eps and the Matheron step on one buffer
            return self._out(cond.sample(self._unbroadcasted_loc, sample_shape)).expand(shape)

    # ------------------------------------------------------------------ densities
    @_full_precision
    def log_prob(self, value: Tensor) -> Tensor:
        r"""Log-density on the subspace :math:`\{Az = k\}` (w.r.t. its ``(n - a)``-dimensional Lebesgue
        measure), shape ``sample_shape + batch_shape``.

        For :math:`Az = k` the two quadratic forms of :math:`\log\mathcal N(z;\mu,\Sigma) -
        \log\mathcal N(k; A\mu, S)` combine exactly into one, so it is evaluated as

        .. math::
            -\tfrac12\big[(n-a)\log 2\pi + \log\det\Sigma - \log\det S + \log\det AA^\top
            + (z - \bar\mu)^\top\Sigma^{-1}(z - \bar\mu)\big],

        which has no cancellation (the difference of two large numbers loses everything in float32 when
        ``loc`` is far from the plane relative to the scale). The deviation :math:`z - \bar\mu = (z - \mu) - Kr`
        (:math:`r = k - A\mu`, accumulated in float64) is formed in float64 and refined so that the error of the
        gain (:math:`\varepsilon\kappa(S)` relative) cancels
        (:meth:`~hardeq.linalg.conditioning.Conditioner.deviation`): float32 agrees with float64 to about 1e-5
        relative with ``loc`` a thousand scales off the plane. With ``validate_args``, points off the subspace
        raise ``ValueError``; without, the formula above is evaluated as is.

        ``value`` must be a floating-point tensor ``(..., n)`` broadcastable with ``batch_shape + (n,)``
        (``TypeError`` / ``ValueError`` naming ``value`` otherwise); it is cast to the distribution's dtype
        (float32 for half-precision inputs) and the result is returned in :attr:`result_dtype`.
        """
        original = value
        value = self._as_event("value", value)
        if self._validate_args and is_tracing():  # inside a graph: the support check on the device, deferred
            if torch._C._functorch.maybe_current_level() is None:  # (no batching rule for a device assertion)
                torch._assert_async(self.support.check(original).all(), "The value argument must be within the "
                                    "support of ConstrainedNormal, the plane {A z = k} (checked on the device).")
        elif self._validate_args:
            self._validate_sample(original)
        # z - mu_bar = (z - mu) - K r without forming mu_bar: mu_bar is only representable to ulp(|mu_bar|),
        # which can be a large fraction of a small scale; r = k - A mu is accumulated in float64.
        cond = self.conditioner
        # (static, eagerly: a factor with its own fused log-density, linalg.conditioning.static_dense, where it applies)
        fused = getattr(cond.factor, "log_density", None) if cond.static and not is_tracing() else None
        out = fused(value, self._unbroadcasted_loc) if fused is not None else None
        if out is None:
            d = cond.deviation(value, self._unbroadcasted_loc, self._loc_residual)
            out = self._log_normaliser() - 0.5 * cond.inv_quad_covariance(d)
        return self._out(out).expand(torch.broadcast_shapes(value.shape[:-1], self.batch_shape))

    @_full_precision
    def entropy(self) -> Tensor:
        r""":math:`\tfrac{n-a}{2}(1 + \log 2\pi) + \tfrac12[\log\det\Sigma - \log\det S + \log\det AA^\top]`."""
        n, a = self.event_shape[0], self.constraint.num_constraints
        return self._out(0.5 * (n - a) - self._log_normaliser()).expand(self.batch_shape)

    # ------------------------------------------------------------------ expected losses

    @_full_precision
    def expected_l2(self, target: Tensor) -> Tensor:
        r""":math:`\mathbb E(z_i - y_i)^2 = (\bar\mu_i - y_i)^2 + \bar\sigma_i^2` per coordinate,
        shape ``broadcast(target, batch_shape + (n,))``. Differentiable in every parameter.

        ``target``: a floating-point tensor ``(..., n)`` broadcastable with ``batch_shape + (n,)`` (``TypeError`` /
        ``ValueError`` naming ``target`` otherwise), finite when ``validate_args`` is on (``ValueError`` for NaN or
        infinite entries; without validation they give NaN / inf losses)."""
        target = self._as_target(target)
        shape = torch.broadcast_shapes(target.shape, self.batch_shape + self.event_shape)
        return self._out(gaussian_expected_square(self._mean - target, self._variance)).expand(shape)

    @_full_precision
    def expected_l1(self, target: Tensor) -> Tensor:
        r""":math:`\mathbb E|z_i - y_i|` (folded-normal mean, :mod:`hardeq.distributions.losses`) per
        coordinate; equals :math:`|\bar\mu_i - y_i|` where :math:`\bar\sigma_i = 0`. Differentiable. ``target`` as
        in :meth:`expected_l2`."""
        target = self._as_target(target)
        shape = torch.broadcast_shapes(target.shape, self.batch_shape + self.event_shape)
        return self._out(gaussian_expected_abs(self._mean - target, self._variance)).expand(shape)

    # ------------------------------------------------------------------ bounds
    def truncate(self, lower: Tensor | float | None = None, upper: Tensor | float | None = None,
                 **kwargs: Any) -> TruncatedConstrainedNormal:
        r"""This law restricted to the box ``lower <= z <= upper``: a :class:`~hardeq.TruncatedConstrainedNormal`
        (exactly feasible samples, the mode in the box, the restricted density).

        Args:
            lower, upper: ``None`` (unbounded), a number, or a tensor broadcastable to ``batch_shape + (n,)``.
            **kwargs: ``normaliser_samples``, ``grad_samples``, ``pilot_samples``, ``validate_args``
                (:class:`~hardeq.TruncatedConstrainedNormal`).

        Raises:
            ValueError: bounds with ``lower >= upper`` somewhere, or a polytope :math:`\{Az = k\}\cap[l, u]` that is
                empty or has no volume on the plane (the message names the batch element and the row or group).
        """
        from .truncated import TruncatedConstrainedNormal

        return TruncatedConstrainedNormal(self, lower, upper, **kwargs)

    # ------------------------------------------------------------------ plumbing
    def expand(self, batch_shape: torch.Size | list[int] | tuple[int, ...], _instance: Self | None = None) -> Self:
        batch_shape = _sample_shape(batch_shape, "batch_shape")
        try:
            ok = torch.broadcast_shapes(batch_shape, self.batch_shape) == batch_shape
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"batch_shape must be a shape that {tuple(self.batch_shape)} (this batch_shape) expands "
                             f"to, got {tuple(batch_shape)}.")
        n = self.event_shape[0]
        new: Self = self._get_checked_instance(  # type: ignore[no-untyped-call]  # torch: unannotated helper
            ConstrainedNormal, _instance)
        new.constraint = self.constraint.expand(batch_shape)
        new.covariance = self.covariance
        new._unbroadcasted_loc = self._unbroadcasted_loc.expand(batch_shape + (n,))
        new.loc = self.loc.expand(batch_shape + (n,))
        new.result_dtype = self.result_dtype
        new._logdet_checked = False
        super(ConstrainedNormal, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    def __repr__(self) -> str:
        return (f"ConstrainedNormal(n={self.event_shape[0]}, batch_shape={tuple(self.batch_shape)}, "
                f"covariance={self.covariance!r}, constraint={self.constraint!r})")
