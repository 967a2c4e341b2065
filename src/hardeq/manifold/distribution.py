r""":class:`ManifoldNormal`: :math:`\mathcal N(\mu, \Sigma)` conditioned on a nonlinear equality :math:`h(z) = k`.

``ConstrainedNormal(loc, ..., constraint=NonlinearConstraint(...))`` returns one (the constraint names its
distribution class; :class:`~hardeq.ConstrainedNormal` hands the arguments over).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributions import Distribution, constraints

from .._utils import check_finite, check_same_dtype_device, check_tensor, stale_without_graph
from ..linalg.covariance import Covariance, DiagonalCovariance, FullCovariance, LowRankCovariance
from .constraint import NonlinearConstraint
from .linearised import importance_weights, linearised_rsample
from .projection import project
from .rattle import manifold_hmc
from .target import ManifoldTarget, TangentGram

__all__ = ["ManifoldNormal", "ManifoldSamples", "METHODS"]

#: sampling methods
METHODS = ("linearised", "manifold_hmc")
_LOG_2PI = math.log(2 * math.pi)


@dataclass
class ManifoldSamples:
    """Draws of :class:`ManifoldNormal` and how they were made.

    Attributes:
        samples: ``sample_shape + batch_shape + (n,)``, every row of :math:`h(z) = k` within the per-row tolerance.
        method: ``"linearised"`` (independent draws of an approximate law) or ``"manifold_hmc"`` (exact stationary
            law, correlated within a chain).
        acceptance, reversibility_rejections, step_size: ``(*batch)`` HMC figures (``None`` for linearised).
        ess, rhat: ``(*batch, n)`` effective sample size and split R-hat of the HMC chains (``None`` for linearised).
    """

    samples: Tensor
    method: str
    acceptance: Tensor | None = None
    reversibility_rejections: Tensor | None = None
    step_size: Tensor | None = None
    ess: Tensor | None = None
    rhat: Tensor | None = None


class _Manifold(constraints.Constraint):
    """The support :math:`\\{h(z) = k\\}`, checked per row (:meth:`NonlinearConstraint.check`)."""

    is_discrete = False
    event_dim = 1

    def __init__(self, constraint: NonlinearConstraint) -> None:
        self.constraint = constraint
        super().__init__()

    def check(self, value: Tensor) -> Tensor:
        return self.constraint.check(value)


def _covariance(n: int, scale: Tensor | float | None, covariance: Covariance | None, scale_tril: Tensor | None,
                cov_factor: Tensor | None, like: Tensor) -> Covariance:
    forms = [name for name, t in (("scale", scale), ("covariance", covariance), ("scale_tril", scale_tril))
             if t is not None]
    if cov_factor is not None and scale is None:
        raise ValueError("cov_factor needs scale too (Sigma = W W^T + diag(scale^2)).")
    if len(forms) != 1:
        raise ValueError("pass exactly one of scale (alone or with cov_factor), scale_tril and covariance, got "
                         f"{forms or 'none'}.")
    if covariance is not None:
        if not isinstance(covariance, Covariance):
            raise TypeError(f"covariance must be a hardeq.Covariance, got {type(covariance).__name__}.")
        cov = covariance
    elif scale_tril is not None:
        cov = FullCovariance(check_tensor("scale_tril", scale_tril, min_dim=2))
    else:
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            scale = torch.tensor(float(scale), dtype=like.dtype, device=like.device)
        scale = check_tensor("scale", scale)
        if scale.dim() == 0 or scale.shape[-1] == 1:
            scale = scale.expand(scale.shape[:-1] + (n,))
        cov = DiagonalCovariance(scale) if cov_factor is None else LowRankCovariance(cov_factor, scale)
    if cov.event_size != n:
        raise ValueError(f"the covariance has event size {cov.event_size}, but loc has size n = {n}.")
    return cov


class ManifoldNormal(Distribution):
    r""":math:`z \sim \mathcal N(\mu, \Sigma)` conditioned on :math:`h(z) = k`: a law on the manifold
    :math:`\mathcal M = \{h = k\}` (dimension ``n - a``) with density w.r.t. its surface (Hausdorff) measure

    .. math:: p(z) = \frac1Z\,\frac{\mathcal N(z; \mu, \Sigma)}{\sqrt{\det J(z)J(z)^\top}}

    (co-area formula; docs/nonlinear.md). For an affine ``h`` it is the linear :class:`~hardeq.ConstrainedNormal`.

    * :meth:`project` / :attr:`mode`: the :math:`\Sigma`-nearest point of :math:`\mathcal M` (Newton on the KKT
      system, implicit gradient; :mod:`hardeq.manifold.projection`). :attr:`mode` is ``project(loc)``, the maximiser
      of :math:`\mathcal N(z;\mu,\Sigma)` on :math:`\mathcal M` -- the mode of :math:`p` when
      :math:`\det JJ^\top` is constant on :math:`\mathcal M` (spheres, affine ``h``), near it otherwise.
    * :meth:`rsample` / :meth:`sample`: ``method="linearised"`` (tangent-plane conditioning and a return along the
      normal space: exactly feasible, approximate in law, differentiable; :mod:`hardeq.manifold.linearised`) or
      ``"manifold_hmc"`` (constrained HMC, exact in its stationary law, not differentiable;
      :mod:`hardeq.manifold.rattle`).
    * :meth:`log_prob`: :math:`\log p` with :math:`Z` from :meth:`log_normaliser` (Laplace at the mode: the
      tangent-plane conditional's normaliser, exact for affine ``h``).

    Args:
        loc: :math:`\mu`, ``(*batch, n)``, float32 or float64.
        scale, covariance, scale_tril, cov_factor: the covariance, as for :class:`~hardeq.ConstrainedNormal`.
        constraint: a :class:`~hardeq.NonlinearConstraint` of ``loc``'s dtype and device.
        validate_args: value checks (finite ``loc``, ``log_prob`` arguments on the manifold).

    Example:
        >>> circle = NonlinearConstraint(lambda z: (z ** 2).sum(-1, keepdim=True),
        ...                              torch.tensor([4.0], dtype=torch.float64))
        >>> d = ConstrainedNormal(torch.tensor([1.0, 0.5], dtype=torch.float64), 0.5, constraint=circle)
        >>> type(d).__name__, d.mode.shape, bool(circle.check(d.mode))
        ('ManifoldNormal', torch.Size([2]), True)
        >>> z = d.rsample((4,))
        >>> z.shape, bool(circle.check(z).all())
        (torch.Size([4, 2]), True)
    """

    has_rsample = True

    def __init__(self, loc: Tensor, scale: Tensor | float | None = None, *, covariance: Covariance | None = None,
                 scale_tril: Tensor | None = None, cov_factor: Tensor | None = None,
                 constraint: NonlinearConstraint, validate_args: bool | None = None) -> None:
        check_tensor("loc", loc, min_dim=1)
        if not isinstance(constraint, NonlinearConstraint):
            raise TypeError(f"constraint must be a hardeq.NonlinearConstraint, got {type(constraint).__name__}.")
        n = loc.shape[-1]
        cov = _covariance(n, scale, covariance, scale_tril, cov_factor, loc)
        check_same_dtype_device(loc=loc, covariance=cov.tensors()[0], constraint=constraint.k)
        if constraint.num_constraints >= n:
            raise ValueError(f"the constraint has a = {constraint.num_constraints} rows but loc has n = {n} "
                             "coordinates; a nonlinear constraint needs a < n.")
        try:
            batch_shape = torch.broadcast_shapes(loc.shape[:-1], cov.batch_shape, constraint.batch_shape)
        except RuntimeError:
            raise ValueError(f"batch shapes do not broadcast: loc {tuple(loc.shape[:-1])}, covariance "
                             f"{tuple(cov.batch_shape)}, constraint {tuple(constraint.batch_shape)}.") from None
        validate = Distribution._validate_args if validate_args is None else validate_args
        if validate:
            check_finite("loc", loc)
            cov.check_values()
        self.loc = loc.expand(batch_shape + (n,))
        self.covariance = cov
        self.constraint = constraint.expand(batch_shape) if constraint.batch_shape != batch_shape else constraint
        self.constraint.value(self.loc)  # h's output shape and dtype, checked once
        super().__init__(batch_shape, torch.Size([n]), validate_args=False)
        self._validate_args = bool(validate)

    # ------------------------------------------------------------------ pieces
    @property
    def target(self) -> ManifoldTarget:
        """The :class:`~hardeq.manifold.ManifoldTarget` the algorithms take."""
        return ManifoldTarget(self.loc, self.covariance, self.constraint)

    @constraints.dependent_property(is_discrete=False, event_dim=1)
    def support(self) -> constraints.Constraint:
        return _Manifold(self.constraint)

    @property
    def arg_constraints(self) -> dict[str, constraints.Constraint]:
        return {"loc": constraints.real_vector, **self.covariance.arg_constraints}

    def _as_points(self, name: str, x: object) -> Tensor:
        x = check_tensor(name, x, min_dim=1)
        if x.dtype != self.loc.dtype:
            raise TypeError(f"{name} must have the distribution's dtype {self.loc.dtype}, got {x.dtype}.")
        if x.shape[-1] != self.event_shape[0]:
            raise ValueError(f"{name} must have shape (..., n) with n = {self.event_shape[0]}, got {tuple(x.shape)}.")
        try:
            torch.broadcast_shapes(x.shape, self.batch_shape + self.event_shape)
        except RuntimeError:
            raise ValueError(f"{name} of shape {tuple(x.shape)} does not broadcast with batch_shape + (n,) = "
                             f"{tuple(self.batch_shape + self.event_shape)}.") from None
        return x

    def project(self, x: Tensor, *, max_iter: int = 100) -> Tensor:
        r"""The :math:`\Sigma^{-1}`-metric nearest point of :math:`\mathcal M` to ``x`` (``(..., n)`` broadcastable
        with ``batch_shape + (n,)``); every row feasible or :class:`~hardeq.manifold.ManifoldError`; differentiable
        (implicitly) w.r.t. ``x``, ``k`` and the covariance."""
        return project(self.target, self._as_points("x", x), max_iter=max_iter)

    @property
    def mode(self) -> Tensor:
        """``project(loc)``, ``batch_shape + (n,)`` (see the class docstring); computed once, and again when it was
        computed under ``torch.no_grad()`` and a gradient is wanted now (so a detached first use never cuts the
        gradient of a later :meth:`log_prob` or :meth:`rsample`)."""
        cached: Tensor | None = self.__dict__.get("_mode")
        if stale_without_graph(cached, self.loc, self.constraint.k, *self.covariance.tensors()):
            cached = self.__dict__["_mode"] = project(self.target, self.loc)
        assert cached is not None  # (set just above when missing)
        return cached

    # ------------------------------------------------------------------ sampling
    def rsample(self, sample_shape: torch.Size | list[int] | tuple[int, ...] = (), method: str = "linearised",
                noise: Tensor | None = None) -> Tensor:
        """Differentiable draws of the ``"linearised"`` law, ``sample_shape + batch_shape + (n,)``; ``noise``: the
        tangent plane sampler's standard normal noise (:meth:`hardeq.ConstrainedNormal.rsample`)."""
        if method != "linearised":
            raise ValueError(f"rsample supports method='linearised' only (HMC draws are not reparameterised), got "
                             f"{method!r}; use sample(method='manifold_hmc').")
        return linearised_rsample(self.target, self.mode, torch.Size(sample_shape), noise)

    def sample(self, sample_shape: torch.Size | list[int] | tuple[int, ...] = (), method: str = "linearised",
               **kwargs: Any) -> Tensor:
        """Detached draws; see :meth:`sample_with_info`."""
        return self.sample_with_info(sample_shape, method, **kwargs).samples

    def sample_with_info(self, sample_shape: torch.Size | list[int] | tuple[int, ...] = (),
                         method: str = "linearised",
                         *, chains: int | None = None, burn_in: int = 100, thin: int = 1, step_size: float = 0.3,
                         num_steps: int = 8, generator: torch.Generator | None = None) -> ManifoldSamples:
        r"""Draws and how they were made.

        Args:
            method: ``"linearised"`` or ``"manifold_hmc"``.
            chains: HMC chains per batch element (default ``prod(sample_shape)``: one draw per chain after
                ``burn_in``); each gives ``ceil(prod(sample_shape) / chains)`` draws ``thin`` trajectories apart,
                from :attr:`mode`.
            burn_in, thin, step_size, num_steps: HMC controls (:func:`hardeq.manifold.rattle.manifold_hmc`).
            generator: HMC's random numbers (the linearised sampler uses torch's global generator).
        """
        shape = torch.Size(sample_shape)
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
        if method == "linearised":
            with torch.no_grad():
                return ManifoldSamples(self.rsample(shape), method)
        num = shape.numel()
        chains = max(num, 1) if chains is None else chains
        if isinstance(chains, bool) or not isinstance(chains, int) or chains < 1:
            raise ValueError(f"chains must be a positive int, got {chains!r}.")
        per_chain = max(1, math.ceil(num / chains))
        n = self.event_shape[0]
        with torch.no_grad():
            start = self.mode.detach().expand((chains,) + self.batch_shape + (n,))
            res = manifold_hmc(self.target, start, num_samples=per_chain, burn_in=burn_in, thin=thin,
                               step_size=step_size, num_steps=num_steps, generator=generator)
        z = res.samples.reshape((per_chain * chains,) + self.batch_shape + (n,))[:num]
        return ManifoldSamples(z.reshape(shape + self.batch_shape + (n,)), method, res.acceptance,
                               res.reversibility_rejections, res.step_size, res.ess, res.rhat)

    # ------------------------------------------------------------------ densities
    def unnormalised_log_prob(self, value: Tensor) -> Tensor:
        r""":math:`\log\mathcal N(z; \mu, \Sigma) - \tfrac12\log\det J(z)J(z)^\top`, ``broadcast(value.shape[:-1],
        batch_shape)``: the log density w.r.t. the Hausdorff measure of :math:`\mathcal M` up to :math:`-\log Z`.
        Differentiable in ``value``, ``loc`` and the covariance."""
        value = self._as_points("value", value)
        if self._validate_args:
            self.constraint.assert_feasible(value.detach(), "value", error=ValueError)
        n = self.event_shape[0]
        J = self.constraint.jacobian(value)
        log_n = -0.5 * (n * _LOG_2PI + self.covariance.logdet() + self.covariance.inv_quad(value - self.loc))
        gram = (J @ J.mT).to(torch.float64)
        half_logdet: Tensor = torch.linalg.cholesky(gram).diagonal(dim1=-2, dim2=-1).log().sum(-1)
        return log_n - half_logdet.to(value.dtype)

    def log_normaliser(self, method: str = "laplace", num_samples: int = 4096) -> tuple[Tensor, Tensor]:
        r"""``(log Z, stderr)``, each ``batch_shape``.

        * ``"laplace"``: :math:`\log\mathcal N(J_*z^*; J_*\mu, J_*\Sigma J_*^\top)` -- the normaliser of
          :math:`\mathcal N(z)/\sqrt{\det J_*J_*^\top}` on the tangent plane at the mode; exact for affine ``h``,
          with a relative error of the order of the curvature of :math:`\mathcal M` times the spread of the law
          (docs/nonlinear.md gives it on the test cases); ``stderr`` is 0 (not an error bound).
        * ``"importance"``: the Laplace value times :math:`\mathbb E[w]`, ``w`` the importance weights of
          ``num_samples`` linearised draws against the exact density
          (:func:`~hardeq.manifold.linearised.importance_weights`);
          ``stderr`` is the delta-method Monte Carlo standard error of :math:`\log Z`. It covers the part of
          :math:`\mathcal M` the return map reaches (mass beyond it is missed).
        """
        if method not in ("laplace", "importance"):
            raise ValueError(f"method must be 'laplace' or 'importance', got {method!r}.")
        mode = self.mode
        J = self.constraint.jacobian(mode)
        gram = TangentGram(J, self.target.sigma_rows(J))
        r = (J @ (mode - self.loc).unsqueeze(-1)).squeeze(-1)
        a = self.constraint.num_constraints
        log_z = (-0.5 * (a * _LOG_2PI + gram.logdet() + (r.to(torch.float64) * gram.solve(r.to(torch.float64)))
                         .sum(-1))).to(self.loc.dtype)
        if method == "laplace":
            return log_z, torch.zeros_like(log_z)
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 2:
            raise ValueError(f"num_samples must be an int >= 2, got {num_samples!r}.")
        log_w = importance_weights(self.target, mode.detach(), num_samples)
        log_mean = torch.logsumexp(log_w, 0) - math.log(num_samples)
        w = (log_w - log_mean).exp()
        stderr = w.std(0) / math.sqrt(num_samples)
        return log_z + log_mean.to(log_z.dtype), stderr.to(log_z.dtype)

    def log_prob(self, value: Tensor) -> Tensor:
        r""":meth:`unnormalised_log_prob` minus the Laplace :meth:`log_normaliser` (exact for affine ``h``; an
        approximation of stated error otherwise)."""
        out: Tensor = self.unnormalised_log_prob(value) - self.log_normaliser("laplace")[0]
        return out

    # ------------------------------------------------------------------ not supported
    def truncate(self, lower: Any = None, upper: Any = None, **kwargs: Any) -> Any:
        """Not supported: bounds on a nonlinear manifold need a sampler that moves on :math:`\\mathcal M \\cap` box
        (HMC reflecting on the walls inside the manifold) and a normaliser for it; neither exists yet."""
        raise NotImplementedError(
            "truncate(lower, upper) is not supported with a NonlinearConstraint: it needs constrained HMC that "
            "reflects on the box walls within the manifold h(z) = k, and a normaliser of the truncated law on it; "
            "neither is implemented. Linear constraints (hardeq.LinearConstraint) support truncate.")

    def expand(self, batch_shape: Any, _instance: Any = None) -> ManifoldNormal:
        batch_shape = torch.Size(batch_shape)
        return ManifoldNormal(self.loc.expand(batch_shape + self.event_shape), covariance=self.covariance,
                              constraint=self.constraint.expand(batch_shape), validate_args=self._validate_args)

    def __repr__(self) -> str:
        return (f"ManifoldNormal(n={self.event_shape[0]}, batch_shape={tuple(self.batch_shape)}, "
                f"covariance={self.covariance!r}, constraint={self.constraint!r})")


# the constraint names the distribution it conditions on (what ConstrainedNormal(..., constraint=...) returns)
NonlinearConstraint.distribution_class = ManifoldNormal
