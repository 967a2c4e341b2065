r"""VAE building blocks with hard linear equality constraints: a constrained latent, a constrained observation
model, and the importance-sampled log-likelihood.

* :class:`ConstrainedGaussianLatent` -- encoder features :math:`h` to the posterior
  :math:`q(z\mid x) = \mathcal N(\mu(h), \mathrm{diag}\,\sigma(h)^2 \mid Az = k)` and the prior
  :math:`p(z) = \mathcal N(0, s^2 I \mid Az = k)` on the *same* plane, so :math:`\mathrm{KL}(q\Vert p)` is the
  closed form registered with ``torch.distributions.kl_divergence`` (finite: both live on the plane).
* :class:`ConstrainedGaussianObservation` -- decoder mean and log-variance to
  :math:`p(x\mid z) = \mathcal N(m, \mathrm{diag}\, e^{v} \mid Ax = k)`, whose ``log_prob`` is the exact density on
  the ``(n - a)``-dimensional plane of the data.
* :func:`importance_log_likelihood` -- :math:`\log p(x) \approx \log \frac1K\sum_k w_k`,
  :math:`\log w_k = \log p(x\mid z_k) + \log p(z_k) - \log q(z_k\mid x)` (Burda et al., 2016).

Units. A density on the plane :math:`\{Az = k\}` is w.r.t. its own ``(n - a)``-dimensional Lebesgue measure;
it is not comparable with a density on :math:`\mathbb R^n` (different units). Compare constrained models with
constrained models, or condition the unconstrained model at evaluation time (``condition=True`` on an
observation layer built with a constraint, see :class:`ConstrainedGaussianObservation`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.distributions import Distribution, Independent, Normal, kl_divergence

from ..constraints import EqualityConstraint
from ..distributions.normal import ConstrainedNormal

__all__ = ["ConstrainedGaussianLatent", "ConstrainedGaussianObservation", "importance_log_likelihood"]


def _check_constraint(constraint: EqualityConstraint | None, size: int, name: str) -> None:
    if constraint is None:
        return
    if not isinstance(constraint, EqualityConstraint):
        raise TypeError(f"constraint must be a hardeq.EqualityConstraint (e.g. hardeq.SumConstraint) or None, got "
                        f"{type(constraint).__name__}.")
    if constraint.event_size != size:
        raise ValueError(f"constraint acts on vectors of size {constraint.event_size}, but {name} = {size}.")


class ConstrainedGaussianLatent(nn.Module):
    r"""Features to a Gaussian posterior conditioned on :math:`Az = k`, with a prior on the same plane.

    Two linear heads predict :math:`\mu` and :math:`\log\sigma^2` (the usual VAE parameterisation), clamped to
    ``[-max_log_var, max_log_var]``; the posterior is :math:`\mathcal N(\mu, \mathrm{diag}\,\sigma^2)` conditioned
    on the constraint, sampled exactly with ``posterior.rsample(estimator=...)`` (any id of
    ``hardeq.estimators.available_estimators()``). The prior is :math:`\mathcal N(0, s^2 I)` conditioned on the
    same constraint (``prior_scale`` :math:`s`). With ``constraint=None`` both are ordinary diagonal Gaussians
    (``Independent(Normal)``), the unconstrained VAE.

    Args:
        in_features (int): size of the encoder features.
        latent_features (int): ``n``, the size of :math:`z`.
        constraint (EqualityConstraint, optional): :math:`Az = k` on the latent, batch shape ``()`` (one plane for
            every input), e.g. ``SumConstraint(torch.zeros(n, dtype=torch.long), torch.zeros(1))`` for
            :math:`\sum_i z_i = 0`.
        prior_scale (float): :math:`s`.
        max_log_var (float): bound on :math:`|\log\sigma^2|` (keeps early training finite).

    Shapes:
        features ``(*batch, in_features)`` -> posterior with ``batch_shape = batch``, ``event_shape = (n,)``;
        :meth:`kl` -> ``(*batch,)``.

    Example:
        >>> from hardeq import SumConstraint
        >>> layer = ConstrainedGaussianLatent(16, 4, SumConstraint(torch.zeros(4, dtype=torch.long), torch.zeros(1)))
        >>> q = layer(torch.randn(8, 16))
        >>> z = q.rsample(estimator="pathwise")
        >>> z.shape, bool(z.sum(-1).abs().max() < 1e-5), layer.kl(q).shape
        (torch.Size([8, 4]), True, torch.Size([8]))
    """

    def __init__(self, in_features: int, latent_features: int, constraint: EqualityConstraint | None = None, *,
                 prior_scale: float = 1.0, max_log_var: float = 20.0) -> None:
        super().__init__()
        _check_constraint(constraint, latent_features, "latent_features")
        if constraint is not None and constraint.batch_shape != torch.Size():
            raise ValueError(f"constraint must have batch shape () (one plane for all inputs), got "
                             f"{tuple(constraint.batch_shape)}.")
        if not prior_scale > 0:
            raise ValueError(f"prior_scale must be positive, got {prior_scale}.")
        self.in_features, self.latent_features = in_features, latent_features
        self.constraint, self.prior_scale, self.max_log_var = constraint, float(prior_scale), float(max_log_var)
        self.mean = nn.Linear(in_features, latent_features)
        self.log_var = nn.Linear(in_features, latent_features)

    def _constraint(self, like: Tensor) -> EqualityConstraint | None:
        c = self.constraint
        return None if c is None else c.to(like.device, like.dtype)

    def forward(self, features: Tensor) -> Distribution:
        if features.shape[-1] != self.in_features:
            raise ValueError(f"features must have shape (..., {self.in_features}), got {tuple(features.shape)}.")
        loc = self.mean(features)
        scale = (0.5 * self.log_var(features).clamp(-self.max_log_var, self.max_log_var)).exp()
        c = self._constraint(loc)
        if c is None:
            return Independent(Normal(loc, scale), 1)
        return ConstrainedNormal(loc, scale, constraint=c)

    def prior(self, like: Tensor | None = None) -> Distribution:
        """:math:`p(z)`, batch shape ``()``, in ``like``'s dtype/device (default: the layer's parameters')."""
        like = self.mean.weight if like is None else like
        loc = torch.zeros(self.latent_features, dtype=like.dtype, device=like.device)
        scale = torch.full_like(loc, self.prior_scale)
        c = self._constraint(loc)
        if c is None:
            return Independent(Normal(loc, scale), 1)
        return ConstrainedNormal(loc, scale, constraint=c)

    def kl(self, posterior: Distribution) -> Tensor:
        r""":math:`\mathrm{KL}(q(z\mid x)\Vert p(z))` in closed form, ``(*batch,)``."""
        return kl_divergence(posterior, self.prior(posterior.mean))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, latent_features={self.latent_features}, "
                f"constraint={'none' if self.constraint is None else type(self.constraint).__name__}")


class ConstrainedGaussianObservation(nn.Module):
    r"""Decoder mean :math:`m` and log-variance :math:`v` to :math:`p(x\mid z) = \mathcal N(m, \mathrm{diag}\,e^{v})`
    conditioned on :math:`Ax = k`.

    ``log_prob(x)`` of the returned distribution is the exact log-density on the plane
    (:meth:`hardeq.ConstrainedNormal.log_prob`), its ``mean`` the conditional mean :math:`m + K(k - Am)` -- a
    reconstruction that satisfies the constraint exactly -- and ``sample()`` an exact sample. The variance is
    :math:`\mathrm{softplus}`-free: :math:`e^{v}` with :math:`v` clamped to ``[min_log_var, max_log_var]``.

    ``forward(mean, log_var, condition=False)`` returns the *unconstrained* ``Independent(Normal)`` instead: the
    same layer serves an unconstrained model (``constraint=None``) and lets a model trained unconstrained be
    conditioned at evaluation time (build it with the constraint, train with ``condition=False``, evaluate with
    ``condition=True``).

    Args:
        constraint (EqualityConstraint, optional): :math:`Ax = k` on the data, batch shape ``()`` or the batch's.
        min_log_var, max_log_var (float): clamp of :math:`v`.

    Shapes:
        mean, log_var ``(*batch, n)`` -> distribution with ``batch_shape = batch``, ``event_shape = (n,)``.

    Example:
        >>> from hardeq import SumConstraint
        >>> obs = ConstrainedGaussianObservation(SumConstraint(torch.zeros(6, dtype=torch.long), torch.ones(1)))
        >>> p = obs(torch.rand(3, 6), torch.zeros(3, 6))
        >>> bool(torch.allclose(p.mean.sum(-1), torch.ones(3))), p.log_prob(p.sample()).shape
        (True, torch.Size([3]))
    """

    def __init__(self, constraint: EqualityConstraint | None = None, *, min_log_var: float = -12.0,
                 max_log_var: float = 6.0) -> None:
        super().__init__()
        if constraint is not None and not isinstance(constraint, EqualityConstraint):
            raise TypeError(f"constraint must be a hardeq.EqualityConstraint (e.g. hardeq.SumConstraint) or None, "
                            f"got {type(constraint).__name__}.")
        if not min_log_var < max_log_var:
            raise ValueError(f"min_log_var must be below max_log_var, got {min_log_var} and {max_log_var}.")
        self.constraint, self.min_log_var, self.max_log_var = constraint, float(min_log_var), float(max_log_var)

    def forward(self, mean: Tensor, log_var: Tensor, *, condition: bool = True) -> Distribution:
        if mean.shape != log_var.shape:
            raise ValueError(f"mean and log_var must have the same shape, got {tuple(mean.shape)} and "
                             f"{tuple(log_var.shape)}.")
        scale = (0.5 * log_var.clamp(self.min_log_var, self.max_log_var)).exp()
        if not condition or self.constraint is None:
            return Independent(Normal(mean, scale), 1)
        _check_constraint(self.constraint, mean.shape[-1], "the data size")
        return ConstrainedNormal(mean, scale, constraint=self.constraint.to(mean.device, mean.dtype))

    def extra_repr(self) -> str:
        return f"constraint={'none' if self.constraint is None else type(self.constraint).__name__}"


def importance_log_likelihood(log_weights: Tensor, dim: int = 0) -> Tensor:
    r"""Importance-sampled log-likelihood :math:`\log\frac1K\sum_{k=1}^K w_k` from log-weights
    :math:`\log w_k = \log p(x\mid z_k) + \log p(z_k) - \log q(z_k\mid x)`, :math:`z_k \sim q(\cdot\mid x)`
    (Burda et al., 2016), computed with ``logsumexp``. A lower bound on :math:`\log p(x)` in expectation that
    tightens as ``K`` grows; with ``K = 1`` it is the one-sample ELBO.

    When the latent is constrained, all three densities must be on the same plane (the layers above do
    that) and the proposal is the constrained posterior.

    Args:
        log_weights: ``(..., K, ...)``, the ``K`` samples along ``dim``.
        dim: the sample dimension.

    Returns:
        ``log_weights`` with ``dim`` reduced.

    Example:
        >>> importance_log_likelihood(torch.log(torch.tensor([[1.0], [3.0]])))  # log mean(1, 3) = log 2
        tensor([0.6931])
    """
    if not isinstance(log_weights, Tensor) or not log_weights.is_floating_point():
        raise TypeError("log_weights must be a floating-point tensor.")
    if log_weights.dim() == 0:
        raise ValueError("log_weights must have a sample dimension, got a scalar.")
    if bool(torch.isnan(log_weights).any()):
        raise ValueError("log_weights contains NaN.")
    k = log_weights.shape[dim]
    return torch.logsumexp(log_weights, dim=dim) - math.log(k)
