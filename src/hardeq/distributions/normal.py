r"""The Gaussian conditioned on a hard linear equality constraint."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributions import Distribution, constraints
from torch.distributions.utils import lazy_property

from .._utils import LOG_2PI, check_finite, check_same_dtype_device, check_tensor
from ..constraints import EqualityConstraint
from ..estimators import normal as _normal_estimators  # noqa: F401  (registers the estimators)
from ..estimators.normal import build_covariance
from ..estimators.registry import get_estimator
from ..linalg.conditioning import Conditioner
from .losses import gaussian_expected_abs, gaussian_expected_square

__all__ = ["ConstrainedNormal", "affine_subspace"]


class _AffineSubspace(constraints.Constraint):
    """The support ``{z : A z = k}``, checked to a dtype-aware round-off tolerance."""

    is_discrete = False
    event_dim = 1

    def __init__(self, constraint: EqualityConstraint) -> None:
        self.constraint = constraint
        super().__init__()

    def check(self, value: Tensor) -> Tensor:
        return self.constraint.check(value)

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
        - \tfrac12\log\det(AA^\top).

    Sampling is exact (Matheron's rule): :math:`z = \hat z + K(k - A\hat z)` with
    :math:`\hat z \sim \mathcal N(\mu, \Sigma)`; :meth:`rsample` is differentiable and the default
    ``"pathwise"`` gradient is unbiased. Other estimators (``hardeq.estimators``) share the forward pass.

    Covariance structures (exactly one of):

    * ``scale`` alone: diagonal :math:`\Sigma = \mathrm{diag}(\mathrm{scale}^2)`;
    * ``scale_tril``: full :math:`\Sigma = LL^\top`;
    * ``cov_factor`` with ``scale``: :math:`\Sigma = WW^\top + \mathrm{diag}(\mathrm{scale}^2)`.

    Cost: diagonal :math:`\Sigma` with a dense ``A``: O(n a^2 + a^3) time, O(n a) memory per batch element;
    with a :class:`~hardeq.SumConstraint`: O(n). Nothing ``n x n`` is formed unless ``scale_tril`` is given
    (or :attr:`covariance_matrix` is asked for).

    Args:
        loc (Tensor): :math:`\mu`, shape ``(*batch, n)``.
        scale (Tensor, optional): standard deviations, ``(*batch, n)``.
        scale_tril (Tensor, optional): lower Cholesky factor of :math:`\Sigma`, ``(*batch, n, n)``.
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

    def __init__(
        self,
        loc: Tensor,
        scale: Tensor | None = None,
        *,
        scale_tril: Tensor | None = None,
        cov_factor: Tensor | None = None,
        constraint: EqualityConstraint,
        validate_args: bool | None = None,
    ) -> None:
        check_tensor("loc", loc, min_dim=1)
        if not isinstance(constraint, EqualityConstraint):
            raise TypeError(
                "constraint must be a hardeq.LinearConstraint or hardeq.SumConstraint, got "
                f"{type(constraint).__name__}."
            )
        n = loc.shape[-1]
        if scale_tril is not None:
            if scale is not None or cov_factor is not None:
                raise ValueError("pass either scale_tril alone, scale alone, or cov_factor with scale.")
            check_tensor("scale_tril", scale_tril, min_dim=2)
            if scale_tril.shape[-2:] != (n, n):
                raise ValueError(
                    f"scale_tril must have shape (..., n, n) with n = loc.shape[-1] = {n}, got "
                    f"{tuple(scale_tril.shape)}."
                )
            param_batch = scale_tril.shape[:-2]
        elif scale is not None:
            check_tensor("scale", scale, min_dim=1)
            if scale.shape[-1] != n:
                raise ValueError(
                    f"scale must have shape (..., n) with n = loc.shape[-1] = {n}, got {tuple(scale.shape)}."
                )
            param_batch = scale.shape[:-1]
            if cov_factor is not None:
                check_tensor("cov_factor", cov_factor, min_dim=2)
                if cov_factor.shape[-2] != n:
                    raise ValueError(
                        f"cov_factor must have shape (..., n, r) with n = loc.shape[-1] = {n}, got "
                        f"{tuple(cov_factor.shape)}."
                    )
                param_batch = torch.broadcast_shapes(param_batch, cov_factor.shape[:-2])
        else:
            raise ValueError("one of scale or scale_tril must be given (cov_factor needs scale too).")
        check_same_dtype_device(loc=loc, scale=scale, scale_tril=scale_tril, cov_factor=cov_factor,
                                constraint=constraint.k)
        if constraint.event_size != n:
            raise ValueError(
                f"constraint acts on vectors of size {constraint.event_size}, but loc has size n = {n} "
                f"(loc.shape = {tuple(loc.shape)})."
            )
        try:
            batch_shape = torch.broadcast_shapes(loc.shape[:-1], param_batch, constraint.batch_shape)
        except RuntimeError:
            raise ValueError(
                f"batch shapes do not broadcast: loc {tuple(loc.shape[:-1])}, covariance {tuple(param_batch)}, "
                f"constraint {tuple(constraint.batch_shape)}."
            ) from None
        self.constraint = constraint
        self._unbroadcasted_loc = loc
        self._unbroadcasted_scale = scale
        self._unbroadcasted_scale_tril = scale_tril
        self._unbroadcasted_cov_factor = cov_factor
        self.loc = loc.expand(batch_shape + (n,))
        super().__init__(batch_shape, torch.Size([n]), validate_args=False)
        if validate_args is None:
            validate_args = Distribution._validate_args
        self._validate_args = bool(validate_args)
        if self._validate_args:
            self._check_values()

    # ------------------------------------------------------------------ parameters
    @property
    def arg_constraints(self) -> dict:  # type: ignore[override]
        out = {"loc": constraints.real_vector}
        if self._unbroadcasted_scale_tril is not None:
            out["scale_tril"] = constraints.lower_cholesky
        elif self._unbroadcasted_scale is not None:
            out["scale"] = constraints.independent(constraints.positive, 1)
        if self._unbroadcasted_cov_factor is not None:
            out["cov_factor"] = constraints.independent(constraints.real, 2)
        return out

    def _check_values(self) -> None:
        check_finite("loc", self._unbroadcasted_loc)
        if self._unbroadcasted_scale is not None:
            s = self._unbroadcasted_scale
            check_finite("scale", s)
            if not bool((s > 0).all()):
                raise ValueError(
                    f"scale (shape {tuple(s.shape)}) must be positive, but its minimum is {s.min().item():.3e}."
                )
        if self._unbroadcasted_scale_tril is not None:
            L = self._unbroadcasted_scale_tril
            check_finite("scale_tril", L)
            if not bool(constraints.lower_cholesky.check(L).all()):
                raise ValueError(
                    f"scale_tril (shape {tuple(L.shape)}) must be lower triangular with a positive diagonal."
                )
        if self._unbroadcasted_cov_factor is not None:
            check_finite("cov_factor", self._unbroadcasted_cov_factor)
        if getattr(self.constraint, "_validate_args", False) is False:
            check_finite("constraint value k", self.constraint.k)

    @property
    def scale(self) -> Tensor | None:
        s = self._unbroadcasted_scale
        return None if s is None else s.expand(self.batch_shape + self.event_shape)

    @property
    def scale_tril(self) -> Tensor | None:
        L = self._unbroadcasted_scale_tril
        return None if L is None else L.expand(self.batch_shape + self.event_shape + self.event_shape)

    @property
    def cov_factor(self) -> Tensor | None:
        W = self._unbroadcasted_cov_factor
        return None if W is None else W.expand(self.batch_shape + W.shape[-2:])

    @property
    def noise_size(self) -> int:
        """Size of the last dimension of the ``noise`` that :meth:`rsample` consumes (``n``, or ``n + r``)."""
        return self._conditioner.cov.noise_size

    @constraints.dependent_property(is_discrete=False, event_dim=1)
    def support(self) -> constraints.Constraint:
        return _AffineSubspace(self.constraint)

    # ------------------------------------------------------------------ cached factorisations
    @lazy_property
    def _conditioner(self) -> Conditioner:
        cov = build_covariance(self._unbroadcasted_scale, self._unbroadcasted_scale_tril,
                               self._unbroadcasted_cov_factor)
        return Conditioner(cov, self.constraint)

    @lazy_property
    def mean(self) -> Tensor:  # type: ignore[override]
        r"""Conditional mean :math:`\bar\mu = \mu + K(k - A\mu)`, ``(*batch, n)``."""
        return self._conditioner.condition(self._unbroadcasted_loc).expand(self.batch_shape + self.event_shape)

    @property
    def mode(self) -> Tensor:
        return self.mean

    @lazy_property
    def variance(self) -> Tensor:  # type: ignore[override]
        r"""Conditional marginal variances :math:`\bar\sigma^2_i`, ``(*batch, n)``; 0 where the constraint
        pins a coordinate."""
        return self._conditioner.variance().expand(self.batch_shape + self.event_shape)

    @property
    def stddev(self) -> Tensor:
        return self.variance.sqrt()

    @lazy_property
    def covariance_matrix(self) -> Tensor:
        r"""Dense conditional covariance :math:`\Sigma - KA\Sigma` (rank ``n - a``), ``(*batch, n, n)``.
        Formed only when asked for."""
        return self._conditioner.covariance_matrix().expand(self.batch_shape + self.event_shape * 2)

    # ------------------------------------------------------------------ sampling
    def rsample(
        self, sample_shape: torch.Size | tuple = (), estimator: str = "pathwise", *,
        noise: Tensor | None = None, **estimator_kwargs,
    ) -> Tensor:
        r"""Exact sample of shape ``sample_shape + batch_shape + (n,)``, differentiable.

        Args:
            sample_shape: leading sample dimensions.
            estimator: id of the gradient estimator (``hardeq.estimators.available_estimators()``); every
                estimator returns the same exact sample and differs in the backward pass only.
            noise: the standard normal :math:`\varepsilon` to use, shape ``sample_shape + batch_shape +
                (noise_size,)``; makes the sample a deterministic function (for ``gradcheck``).
            **estimator_kwargs: passed to the estimator (e.g. ``proxy_noise``).
        """
        est = get_estimator(estimator, "normal")
        shape = torch.Size(sample_shape) + self.batch_shape + (self.noise_size,)
        if noise is None:
            noise = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
        elif noise.shape != shape:
            raise ValueError(f"noise must have shape {tuple(shape)}, got {tuple(noise.shape)}.")
        z = est(self._unbroadcasted_loc, self._unbroadcasted_scale, self.constraint, noise,
                scale_tril=self._unbroadcasted_scale_tril, cov_factor=self._unbroadcasted_cov_factor,
                **estimator_kwargs)
        return z.expand(shape[:-1] + self.event_shape)

    def sample(self, sample_shape: torch.Size | tuple = ()) -> Tensor:
        """Exact sample without gradient; uses the cached factorisation."""
        with torch.no_grad():
            shape = torch.Size(sample_shape) + self.batch_shape + (self.noise_size,)
            noise = torch.randn(shape, dtype=self.loc.dtype, device=self.loc.device)
            cond = self._conditioner
            z = cond.condition(self._unbroadcasted_loc + cond.cov.sqrt_matvec(noise))
            return z.expand(shape[:-1] + self.event_shape)

    # ------------------------------------------------------------------ densities
    def log_prob(self, value: Tensor) -> Tensor:
        r"""Log-density on the subspace :math:`\{Az = k\}` (w.r.t. its ``(n - a)``-dimensional Lebesgue
        measure), shape ``sample_shape + batch_shape``. With ``validate_args``, points off the subspace raise
        ``ValueError``; without, the formula is evaluated as is."""
        if self._validate_args:
            self._validate_sample(value)
        cond = self._conditioner
        n = self.event_shape[0]
        log_joint = -0.5 * (n * LOG_2PI + cond.cov.logdet() + cond.cov.inv_quad(value - self._unbroadcasted_loc))
        out = log_joint - self._log_constraint_evidence() - 0.5 * self.constraint.logdet_gram_identity()
        return out.expand(torch.broadcast_shapes(value.shape[:-1], self.batch_shape))

    def _log_constraint_evidence(self) -> Tensor:
        r""":math:`\log\mathcal N(k; A\mu, S)`, shape ``batch_shape``."""
        cond = self._conditioner
        a = self.constraint.num_constraints
        r = self.constraint.k - self.constraint.matvec(self._unbroadcasted_loc)
        return -0.5 * (a * LOG_2PI + cond.logdet() + cond.inv_quad(r))

    def entropy(self) -> Tensor:
        r""":math:`\tfrac{n-a}{2}(1 + \log 2\pi) + \tfrac12[\log\det\Sigma - \log\det S + \log\det AA^\top]`."""
        cond = self._conditioner
        n, a = self.event_shape[0], self.constraint.num_constraints
        h = 0.5 * (n - a) * (1 + LOG_2PI) + 0.5 * (
            cond.cov.logdet() - cond.logdet() + self.constraint.logdet_gram_identity()
        )
        return h.expand(self.batch_shape)

    # ------------------------------------------------------------------ expected losses
    def expected_l2(self, target: Tensor) -> Tensor:
        r""":math:`\mathbb E(z_i - y_i)^2 = (\bar\mu_i - y_i)^2 + \bar\sigma_i^2` per coordinate,
        shape ``broadcast(target, batch_shape + (n,))``. Differentiable in every parameter."""
        return gaussian_expected_square(self.mean - target, self.variance)

    def expected_l1(self, target: Tensor) -> Tensor:
        r""":math:`\mathbb E|z_i - y_i|` (folded-normal mean, :mod:`hardeq.distributions.losses`) per
        coordinate; equals :math:`|\bar\mu_i - y_i|` where :math:`\bar\sigma_i = 0`. Differentiable."""
        return gaussian_expected_abs(self.mean - target, self.variance)

    # ------------------------------------------------------------------ plumbing
    def expand(self, batch_shape: torch.Size | tuple, _instance=None) -> "ConstrainedNormal":
        batch_shape = torch.Size(batch_shape)
        n = self.event_shape[0]
        new = self._get_checked_instance(ConstrainedNormal, _instance)
        new.constraint = self.constraint.expand(batch_shape)
        new._unbroadcasted_loc = self._unbroadcasted_loc.expand(batch_shape + (n,))
        new._unbroadcasted_scale = self._unbroadcasted_scale
        new._unbroadcasted_scale_tril = self._unbroadcasted_scale_tril
        new._unbroadcasted_cov_factor = self._unbroadcasted_cov_factor
        new.loc = new._unbroadcasted_loc
        super(ConstrainedNormal, new).__init__(batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    def __repr__(self) -> str:
        kind = ("scale_tril" if self._unbroadcasted_scale_tril is not None
                else "cov_factor" if self._unbroadcasted_cov_factor is not None else "scale")
        return (f"ConstrainedNormal(n={self.event_shape[0]}, batch_shape={tuple(self.batch_shape)}, "
                f"covariance={kind}, constraint={self.constraint!r})")

