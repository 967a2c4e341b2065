r"""The Gaussian conditioned on a hard linear equality constraint."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable, Protocol, Self, TypeVar, cast

import torch
from torch import Tensor
from torch.distributions import Distribution, constraints
from torch.distributions.utils import lazy_property

from .._utils import LOG_2PI, check_finite, check_same_dtype_device, check_tensor
from .._validation import image_flatten_hint, not_a_tensor
from ..constraints import EqualityConstraint
from ..constraints._cache import _NO_HOST_READS
from ..estimators import normal as _normal_estimators  # noqa: F401  (registers the estimators)
from ..estimators.registry import get_estimator
from ..linalg.conditioning import Conditioner, is_tracing
from ..linalg.conditioning.grouped_sample import grouped_rsample
from ..linalg.conditioning.static_dense import SINGULAR_SCALE_MESSAGE
from ..linalg.device import profile as device_profile
from ..linalg.covariance import Covariance, DiagonalCovariance, FullCovariance, LowRankCovariance
from .losses import gaussian_expected_abs, gaussian_expected_square

if TYPE_CHECKING:
    from .truncated import TruncatedConstrainedNormal

_F = TypeVar("_F", bound=Callable[..., Any])


class _OnDevice(Protocol):
    """A distribution whose methods run under :func:`_full_precision` (its parameters' device)."""

    @property
    def _unbroadcasted_loc(self) -> Tensor: ...

    _validate_args: bool

__all__ = ["ConstrainedNormal", "affine_subspace"]

#: dtypes accepted and computed in float32 (results are returned in the input dtype)
HALF_DTYPES = (torch.float16, torch.bfloat16)
#: per-row tolerance of the support check for a half-precision value, in units of its eps (a point of the plane
#: rounded to half precision misses a row by at most eps / 2 times (|A||z|)_i)
HALF_SUPPORT_RTOL_EPS = 8.0


def _full_precision(method: _F) -> _F:
    """Run ``method`` with autocast disabled on the parameters' device: under ``torch.autocast`` a float32
    matmul would otherwise run in bfloat16 / float16 and lose the per-row accuracy of the conditioner; and, with
    on a device where a read-back synchronises (:func:`hardeq.linalg.device.profile`), inside
    :func:`hardeq.constraints._cache.no_host_reads` (the constraints' caches check their tensors on the device), with
    ``validate_args`` on or off."""

    @functools.wraps(method)
    def wrapper(self: _OnDevice, *args: Any, **kwargs: Any) -> Any:
        device_type = self._unbroadcasted_loc.device.type
        # (no_host_reads, without its generator; not under torch.compile, which cannot trace it and skips the caches)
        # (on a CPU, where a read-back synchronises nothing, only when the device profile is forced: linalg.device)
        # (validated or not: with validate_args=True the inputs were checked at construction, with one host read)
        sync_free = not device_profile(self._unbroadcasted_loc.device).host_guards
        token = _NO_HOST_READS.set(True) if sync_free and not torch.compiler.is_compiling() else None
        try:
            if not torch.is_autocast_enabled(device_type):
                return method(self, *args, **kwargs)
            with torch.autocast(device_type, enabled=False):
                return method(self, *args, **kwargs)
        finally:
            if token is not None:
                _NO_HOST_READS.reset(token)

    return cast(_F, wrapper)  # (functools.wraps keeps the signature)


class _AffineSubspace(constraints.Constraint):
    """The support ``{z : A z = k}``, checked to a dtype-aware round-off tolerance."""

    is_discrete = False
    event_dim = 1

    def __init__(self, constraint: EqualityConstraint) -> None:
        self.constraint = constraint
        super().__init__()

    def check(self, value: Tensor) -> Tensor:
        if value.dtype in HALF_DTYPES:  # checked in the constraint's precision, to the half-precision rounding
            rtol = HALF_SUPPORT_RTOL_EPS * torch.finfo(value.dtype).eps
            return self.constraint.check(value.to(self.constraint.dtype), rtol=rtol)
        return self.constraint.check(value.to(self.constraint.dtype))

    def __repr__(self) -> str:
        return f"AffineSubspace({self.constraint!r})"


affine_subspace = _AffineSubspace


class ConstrainedNormal(Distribution):
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
        if isinstance(scale, Tensor):
            pass
        elif isinstance(scale, numbers.Real) and not isinstance(scale, bool):  # as torch.distributions.Normal
            scale = torch.tensor(float(scale), dtype=loc.dtype, device=loc.device)
        elif scale is not None and not isinstance(scale, torch.Tensor):
            raise not_a_tensor("scale", scale, note=" (a real Python number is also accepted, as in "
                               "torch.distributions.Normal)")
        validate = Distribution._validate_args if validate_args is None else validate_args
        pending: list[tuple[Tensor, Callable[[], None]]] = []  # (value checks read with _check_values)
        covariance = _build_covariance(n, scale, covariance, scale_tril, cov_factor, covariance_matrix,
                                       precision_matrix, validate, pending)
        if scale is not None and cov_factor is None and scale_tril is None and covariance_matrix is None \
                and precision_matrix is None:  # (the common form)
            check_same_dtype_device(loc=loc, scale=scale, constraint=constraint.k)
        else:
            given = {"scale": scale, "scale_tril": scale_tril, "cov_factor": cov_factor,
                     "covariance_matrix": covariance_matrix, "precision_matrix": precision_matrix}
            given = {name: t for name, t in given.items() if t is not None} or {"covariance": covariance.tensors()[0]}
            check_same_dtype_device(loc=loc, **given, constraint=constraint.k)
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
    def _noise(self, sample_shape: torch.Size | list[int] | tuple[int, ...], noise: Tensor | None) -> Tensor:
        loc = self._unbroadcasted_loc
        if noise is None and sample_shape == ():  # (one draw, the training-loop call: no shape to check)
            return torch.randn(self._batch_shape + (self.noise_size,), dtype=loc.dtype, device=loc.device)
        shape = _sample_shape(sample_shape) + self.batch_shape + (self.noise_size,)
        if noise is None:
            return torch.randn(shape, dtype=loc.dtype, device=loc.device)
        check_tensor("noise", noise)
        if noise.shape != shape:
            raise ValueError(f"noise must have shape sample_shape + batch_shape + (noise_size,) = {tuple(shape)}, "
                             f"got {tuple(noise.shape)}.")
        if noise.device != loc.device:
            raise ValueError(f"noise is on device {noise.device} but loc is on {loc.device}; pass noise on "
                             f"{loc.device}.")
        return noise.to(loc.dtype)

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
    def _log_normaliser(self) -> Tensor:
        r""":math:`-\tfrac12[(n - a)\log 2\pi + \log\det\Sigma - \log\det S + \log\det AA^\top]`, ``batch_shape``."""
        n, a = self.event_shape[0], self.constraint.num_constraints
        plane_logdet = self.conditioner.plane_logdet()
        if not self._logdet_checked:  # once per distribution: a host read, or (static) a deferred device check
            message = SINGULAR_SCALE_MESSAGE
            finite = torch.isfinite(plane_logdet.detach()).all()
            if not self.conditioner.static:
                if not bool(finite):
                    raise ValueError(message)
            elif torch._C._functorch.maybe_current_level() is None:  # (no batching rule for a device assertion)
                try:
                    torch._assert_async(finite, message)
                except RuntimeError:  # raised at once on a CPU, eagerly
                    raise ValueError(message) from None
            self._logdet_checked = True
        out: Tensor = -0.5 * ((n - a) * LOG_2PI + plane_logdet)
        return out

    def _as_event(self, name: str, value: object) -> Tensor:
        """``value`` checked as a floating tensor ``(..., n)`` that broadcasts with ``batch_shape + (n,)``, on the
        parameters' device, in the compute dtype; raises ``TypeError``/``ValueError`` naming ``name``."""
        value = check_tensor(name, value, min_dim=1)
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}; cast it first "
                            f"(e.g. {name}.to({self.result_dtype})).")
        expected = self.batch_shape + self.event_shape
        try:
            torch.broadcast_shapes(value.shape, expected)
            ok = value.shape[-1] == self.event_shape[0]
        except RuntimeError:
            ok = False
        if not ok:
            shape, n = tuple(value.shape), self.event_shape[0]
            start = next((s for s in range(len(shape) - 1) if math.prod(shape[s:]) == n), None)
            hint = "" if start is None else (
                f"; its trailing dimensions {' x '.join(map(str, shape[start:]))} hold n = {n} values (an image?): "
                f"flatten them, {name}.flatten({start - len(shape)})")
            raise ValueError(f"{name} must have shape (..., n) broadcastable with batch_shape + (n,) = "
                             f"{tuple(expected)}, got {shape}{hint}.")
        loc = self._unbroadcasted_loc
        if value.device != loc.device:
            raise ValueError(f"{name} is on device {value.device} but loc is on {loc.device}; pass {name} on "
                             f"{loc.device}.")
        return value.to(loc.dtype)

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
    def _as_target(self, target: object) -> Tensor:
        """``target`` checked as in :meth:`_as_event` and, with ``validate_args``, finite (a NaN target would
        give a NaN loss silently)."""
        target = self._as_event("target", target)
        if self._validate_args:
            check_finite("target", target)
        return target

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


def _check_values(loc: Tensor, covariance: Covariance, k: Tensor | None = None,
                  pending: list[tuple[Tensor, Callable[[], None]]] | None = None) -> None:
    r"""``check_finite("loc", loc)``, ``covariance.check_values()`` and (when given) the finiteness of ``k``, with
    **one host read**: the verdicts of every check are one device boolean, read once: :math:`\sum\mu + \sum k`
    finite (a NaN or an infinity anywhere propagates to it) and the covariance's own verdict
    (``Covariance._value_verdict``; for a diagonal one :math:`\min\sigma + 0\cdot\sum\sigma \ge` ``tiny``: every
    scale finite and a positive normal number), from reductions without autograd nodes. Only when it is false (or
    when a sum overflows) do the precise checks run, each naming its argument, the first bad element and its value
    (more reads, on the way to the error). A covariance without a verdict (a structure of one's own) runs its
    ``check_values`` after the read. ``pending``: more ``(verdict, explain)`` pairs for that read (the checks of a
    ``covariance_matrix`` / ``precision_matrix``); on failure their ``explain()`` runs first."""
    parts = [t.detach() if t.requires_grad else t for t in (loc, k) if t is not None and t.numel()]
    verdict: Tensor | None = None
    if parts:
        total = parts[0].sum()
        for t in parts[1:]:
            total = total + t.sum()
        verdict = total * 0 == 0  # (finite: x * 0 is 0; NaN for NaN and inf)
    cls = type(covariance)
    owner = next(c for c in cls.__mro__ if "check_values" in c.__dict__)
    own = covariance._value_verdict() if "_value_verdict" in owner.__dict__ else None
    for part in [own] + [ok for ok, _ in pending or ()]:
        if part is not None:
            verdict = part if verdict is None else verdict & part
    if verdict is None or bool(verdict):  # the one host read
        if own is None:
            covariance.check_values()
        return
    for _, explain in pending or ():
        explain()
    check_finite("loc", loc)
    covariance.check_values()
    if k is not None:
        check_finite("constraint right-hand side k", k)


def _assert_values(loc: Tensor, covariance: Covariance, k: Tensor) -> None:
    """The value checks of validation without a host read (under ``torch.compile``, ``torch.func`` or CUDA-graph
    capture): ``loc`` and ``k`` finite, the covariance's tensors finite and, for a diagonal one, every scale a
    positive normal number; one ``torch._assert_async`` (a GPU raises at its next synchronisation). Skipped inside
    a ``torch.func`` transform (no batching rule for a device assertion)."""
    if torch._C._functorch.maybe_current_level() is not None:
        return
    ok = torch.isfinite(loc.detach()).all() & torch.isfinite(k.detach()).all()
    for t in covariance.tensors():
        ok = ok & torch.isfinite(t.detach()).all()
    scale = covariance.scale if type(covariance) is DiagonalCovariance else None
    if scale is not None:
        ok = ok & (scale.detach() >= torch.finfo(scale.dtype).tiny).all()
    torch._assert_async(ok, "ConstrainedNormal (validate_args=True, checked on the device): loc, the constraint's "
                            "k and the covariance must be finite, and scale positive (a normal number).")


def _broadcast_shapes(*shapes: torch.Size) -> torch.Size:
    """``torch.broadcast_shapes``, without its cost (tens of microseconds of Python) when the shapes are equal or
    empty, the common case."""
    first = shapes[0]
    if all(s == first or not s for s in shapes[1:]):
        return torch.Size(first)
    shape: torch.Size = torch.broadcast_shapes(*shapes)
    return shape


def _sample_shape(sample_shape: object, name: str = "sample_shape") -> torch.Size:
    """``sample_shape`` as a ``torch.Size`` of non-negative ints, or ``TypeError`` / ``ValueError`` naming it."""
    try:
        shape = torch.Size(cast("Iterable[int]", sample_shape))  # (anything else: TypeError, reported below)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a tuple (or torch.Size) of ints, got {sample_shape!r}.") from None
    if any(s < 0 for s in shape):
        raise ValueError(f"{name} must have non-negative sizes, got {tuple(shape)}.")
    return shape


def _build_covariance(n: int, scale: Tensor | None, covariance: Covariance | None, scale_tril: Tensor | None,
                      cov_factor: Tensor | None, covariance_matrix: Tensor | None = None,
                      precision_matrix: Tensor | None = None, validate: bool = False,
                      pending: list[tuple[Tensor, Callable[[], None]]] | None = None) -> Covariance:
    """The covariance object from ``covariance=`` or the keyword shortcuts (exactly one form), shape-checked."""
    if scale is not None and covariance is None and scale_tril is None and covariance_matrix is None \
            and precision_matrix is None:
        return _scale_covariance(n, scale, cov_factor)  # (the common form, with nothing to reject)
    forms = {"scale": scale, "scale_tril": scale_tril, "covariance_matrix": covariance_matrix,
             "precision_matrix": precision_matrix}
    given = [name for name, t in forms.items() if t is not None]
    if covariance is None and len(given) > 1:
        raise ValueError(f"pass exactly one of scale (alone or with cov_factor), scale_tril, covariance_matrix, "
                         f"precision_matrix and covariance, got {' and '.join(given)}.")
    if covariance is not None and (covariance_matrix is not None or precision_matrix is not None):
        raise ValueError("pass covariance= alone, or one of the shortcuts, not both; got covariance and "
                         f"{'covariance_matrix' if covariance_matrix is not None else 'precision_matrix'}.")
    if covariance is None and cov_factor is not None and scale is None:
        raise ValueError("cov_factor needs scale too (Sigma = W W^T + diag(scale^2)); got cov_factor without scale"
                         + (f" (with {given[0]})." if given else "."))
    if covariance is not None:
        if scale is not None or scale_tril is not None or cov_factor is not None:
            raise ValueError("pass covariance= alone, or one of the shortcuts (scale, scale_tril, cov_factor with "
                             "scale), not both.")
        if not isinstance(covariance, Covariance):
            raise TypeError("covariance must be a hardeq.Covariance (e.g. hardeq.DiagonalCovariance, "
                            "hardeq.BlockDiagonalCovariance or a subclass of your own), got "
                            f"{type(covariance).__name__}.")
    elif scale_tril is not None:
        if scale is not None or cov_factor is not None:
            raise ValueError("pass either scale_tril alone, scale alone, or cov_factor with scale.")
        check_tensor("scale_tril", scale_tril, min_dim=2)
        if scale_tril.shape[-2:] != (n, n):
            raise ValueError(f"scale_tril must have shape (..., n, n) with n = loc.shape[-1] = {n}, got "
                             f"{tuple(scale_tril.shape)}.")
        covariance = FullCovariance(scale_tril)
    elif covariance_matrix is not None or precision_matrix is not None:
        covariance = FullCovariance(_scale_tril_from(n, covariance_matrix, precision_matrix, validate, pending))
    else:
        raise ValueError("one of scale, scale_tril / covariance_matrix / precision_matrix, or covariance must be "
                         "given (cov_factor needs scale too).")
    if covariance.event_size != n:
        raise ValueError(f"covariance has event size {covariance.event_size}, but loc has size n = {n}.")
    return covariance


def _scale_covariance(n: int, scale: Tensor, cov_factor: Tensor | None) -> Covariance:
    """The covariance of ``scale`` (diagonal) or of ``cov_factor`` with ``scale`` (low rank plus diagonal),
    shape-checked."""
    check_tensor("scale", scale)
    if scale.dim() == 0 or scale.shape[-1] == 1:  # broadcast along the event, as torch.distributions.Normal
        scale = scale.expand(scale.shape[:-1] + (n,))
    if scale.shape[-1] != n:
        raise ValueError(f"scale must have shape (..., n) with n = loc.shape[-1] = {n}, got {tuple(scale.shape)}; "
                         "a number, or a tensor whose last dimension is 1, broadcasts along it.")
    if cov_factor is None:
        return DiagonalCovariance(scale)
    check_tensor("cov_factor", cov_factor, min_dim=2)
    if cov_factor.shape[-2] != n:
        raise ValueError(f"cov_factor must have shape (..., n, r) with n = loc.shape[-1] = {n}, got "
                         f"{tuple(cov_factor.shape)}.")
    return LowRankCovariance(cov_factor, scale)


def _scale_tril_from(n: int, covariance_matrix: Tensor | None, precision_matrix: Tensor | None,
                     validate: bool, pending: list[tuple[Tensor, Callable[[], None]]] | None = None) -> Tensor:
    r"""Lower Cholesky factor :math:`L` (:math:`LL^\top = \Sigma`) of ``covariance_matrix``, or of the inverse of
    ``precision_matrix`` without forming it: :math:`JPJ = L_fL_f^\top` gives :math:`P = UU^\top`,
    :math:`U = JL_fJ` upper, so :math:`L = U^{-\top}` (one Cholesky and one triangular solve, :math:`2n^3/3`
    flops). ``ValueError`` naming the argument for a wrong shape, an asymmetric matrix (with ``validate``) or one
    that is not positive definite. With ``validate`` and ``pending``, the value checks are not read here: their
    verdict and the function that raises the precise error are appended to ``pending`` (read with the
    distribution's other checks, :func:`_check_values`)."""
    name, M = ("covariance_matrix", covariance_matrix) if covariance_matrix is not None else \
        ("precision_matrix", precision_matrix)
    M = check_tensor(name, M, min_dim=2)
    if M.shape[-2:] != (n, n):
        raise ValueError(f"{name} must have shape (..., n, n) with n = loc.shape[-1] = {n}, got {tuple(M.shape)}.")
    original = M
    if M.dtype in HALF_DTYPES:  # factorised in float32, the precision half-precision distributions compute in
        M = M.to(torch.float32)
    flipped = M if name == "covariance_matrix" else M.flip(-2, -1)
    factor: Tensor
    factor, info = torch.linalg.cholesky_ex(flipped)

    def explain() -> None:  # the precise checks, each raising a ValueError that names what it found
        if validate:
            check_finite(name, original)
            if not bool(torch.isclose(original, original.mT, rtol=1e-5, atol=1e-8).all()):
                raise ValueError(f"{name} (shape {tuple(original.shape)}) must be symmetric; its largest asymmetry "
                                 f"|M - M^T| is {(original - original.mT).abs().max().item():.3g}.")
        if bool((info != 0).any()):
            where = tuple(int(i) for i in (info != 0).nonzero()[0]) if info.dim() else ()
            order = int(info[where])
            raise ValueError(f"{name} must be positive definite, but its Cholesky factorisation fails"
                             f"{f' at batch index {where}' if where else ''} (leading minor of order {order}"
                             f"{' of the reversed matrix' if name == 'precision_matrix' else ''} is not positive).")

    if is_tracing():
        if validate:
            check_finite(name, M)
    elif validate and pending is not None:  # finite, symmetric, factorised: read with the distribution's checks
        data = original.detach()
        pending.append(((data.sum() * 0 == 0) & torch.isclose(data, data.mT, rtol=1e-5, atol=1e-8).all()
                        & (info == 0).all(), explain))
    else:
        explain()
    if name == "covariance_matrix":
        return factor
    lower_t = factor.flip(-2, -1).mT  # U^T, lower triangular
    eye = torch.eye(n, dtype=M.dtype, device=M.device)
    inverse: Tensor = torch.linalg.solve_triangular(lower_t, eye, upper=False)  # (U^T)^{-1} = U^{-T}
    return inverse
