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
import numbers
from typing import SupportsFloat, cast

import torch
from torch import Tensor, nn
from torch.distributions import Distribution, Independent, Normal, kl_divergence

from .._utils import assert_deferred
from ..constraints import EqualityConstraint
from ..distributions.normal import ConstrainedNormal
from ._device import DeviceCheckedModule

__all__ = ["ConstrainedGaussianLatent", "ConstrainedGaussianObservation", "importance_log_likelihood"]


def _check_constraint(constraint: EqualityConstraint | None, size: int, name: str) -> None:
    if constraint is None:
        return
    if not isinstance(constraint, EqualityConstraint):
        raise TypeError(f"constraint must be a hardeq.EqualityConstraint (e.g. hardeq.SumConstraint) or None, got "
                        f"{type(constraint).__name__}.")
    if constraint.event_size != size:
        raise ValueError(f"constraint acts on vectors of size {constraint.event_size}, but {name} = {size}.")


class ConstrainedGaussianLatent(DeviceCheckedModule):
    r"""Features to a Gaussian posterior conditioned on :math:`Az = k`, with a prior on the same plane.

    Two linear heads predict :math:`\mu` and :math:`\log\sigma^2` (the usual VAE parameterisation), clamped to
    ``[-max_log_var, max_log_var]``; the posterior is :math:`\mathcal N(\mu, \mathrm{diag}\,\sigma^2)` conditioned
    on the constraint, sampled exactly with ``posterior.rsample(estimator=...)`` (any id of
    ``hardeq.estimators.available_estimators()``). The prior is :math:`\mathcal N(0, s^2 I)` conditioned on the
    same constraint (``prior_scale`` :math:`s`). With ``constraint=None`` both are ordinary diagonal Gaussians
    (``Independent(Normal)``), the unconstrained VAE.

    Per-sample planes (a conditional VAE): ``forward(features, constraint_value=k)`` replaces the right-hand side
    of the layer's constraint for this call by ``k`` (a number or a tensor broadcastable to ``(*batch, a)``, e.g.
    one row per example, ``(B, a)``), and ``forward(features, constraint=c)`` uses another constraint
    altogether (any batch shape that broadcasts with the features'). The posterior then has one plane per
    example, and :meth:`prior` / :meth:`kl` given that posterior put the prior on the *same* planes
    (``layer.prior(q)`` for importance weights), so the KL stays finite and exact.

    Args:
        in_features (int): size of the encoder features.
        latent_features (int): ``n``, the size of :math:`z`.
        constraint (EqualityConstraint, optional): :math:`Az = k` on the latent, e.g.
            ``SumConstraint(torch.zeros(n, dtype=torch.long), torch.zeros(1))`` for :math:`\sum_i z_i = 0`; batch
            shape ``()`` (one plane for every input) or one that broadcasts with the features' batch shape.
        prior_scale (float): :math:`s`.
        max_log_var (float): bound on :math:`|\log\sigma^2|` (keeps early training finite).

    Shapes:
        features ``(*batch, in_features)``, constraint_value ``(*batch, a)`` (broadcastable) -> posterior with
        ``batch_shape = broadcast(batch, k batch)``, ``event_shape = (n,)``; :meth:`kl` -> that batch shape.

    Example:
        >>> from hardeq import SumConstraint
        >>> layer = ConstrainedGaussianLatent(16, 4, SumConstraint(torch.zeros(4, dtype=torch.long), torch.zeros(1)))
        >>> q = layer(torch.randn(8, 16))
        >>> z = q.rsample(estimator="pathwise")
        >>> z.shape, bool(z.sum(-1).abs().max() < 1e-5), layer.kl(q).shape
        (torch.Size([8, 4]), True, torch.Size([8]))
        >>> q = layer(torch.randn(8, 16), constraint_value=torch.arange(8.0).unsqueeze(-1))  # sum z = 0, 1, ..., 7
        >>> torch.allclose(q.rsample().sum(-1), torch.arange(8.0), atol=1e-5), layer.kl(q).shape
        (True, torch.Size([8]))
    """

    def __init__(self, in_features: int, latent_features: int, constraint: EqualityConstraint | None = None, *,
                 prior_scale: float = 1.0, max_log_var: float = 20.0) -> None:
        super().__init__()
        _check_constraint(constraint, latent_features, "latent_features")
        if not prior_scale > 0:
            raise ValueError(f"prior_scale must be positive, got {prior_scale}.")
        self.in_features, self.latent_features = in_features, latent_features
        self.constraint, self.prior_scale, self.max_log_var = constraint, float(prior_scale), float(max_log_var)
        self.mean = nn.Linear(in_features, latent_features)
        self.log_var = nn.Linear(in_features, latent_features)

    def _constraint(self, like: Tensor, constraint_value: Tensor | float | None = None,
                    constraint: EqualityConstraint | None = None) -> EqualityConstraint | None:
        """The plane of this call in ``like``'s dtype / device: ``constraint``, else the layer's constraint with
        ``constraint_value`` as its right-hand side (if given), else the layer's constraint (or None)."""
        if constraint is not None:
            if constraint_value is not None:
                raise ValueError("pass constraint_value (a new k for the layer's constraint) or constraint (a whole "
                                 "new constraint), not both.")
            _check_constraint(constraint, self.latent_features, "latent_features")
            return constraint.to(like.device, like.dtype)
        c = self.constraint
        if c is None:
            if constraint_value is not None:
                raise ValueError("constraint_value needs a layer built with a constraint (its A); this layer has "
                                 "constraint=None. Pass constraint= (a whole constraint) instead.")
            return None
        c = c.to(like.device, like.dtype)
        if constraint_value is None:
            return c
        return c.with_k(_as_right_hand_side(constraint_value, c.num_constraints, like))

    def forward(self, features: Tensor, constraint_value: Tensor | float | None = None, *,
                constraint: EqualityConstraint | None = None) -> Distribution:
        """The posterior for ``features`` ``(*batch, in_features)``, on the layer's plane, on the layer's ``A`` with
        right-hand side ``constraint_value``, or on ``constraint``."""
        if features.shape[-1] != self.in_features:
            raise ValueError(f"features must have shape (..., {self.in_features}), got {tuple(features.shape)}.")
        loc = self.mean(features)
        scale = (0.5 * self.log_var(features).clamp(-self.max_log_var, self.max_log_var)).exp()
        c = self._constraint(loc, constraint_value, constraint)
        if c is None:
            return Independent(Normal(loc, scale), 1)
        try:
            torch.broadcast_shapes(loc.shape[:-1], c.batch_shape)
        except RuntimeError:
            raise ValueError(f"the constraint's batch shape {tuple(c.batch_shape)} (from its k, shape "
                             f"{tuple(c.k.shape)}) does not broadcast with the features' batch shape "
                             f"{tuple(loc.shape[:-1])}; pass one right-hand side per example, (*batch, a).") from None
        return ConstrainedNormal(loc, scale, constraint=c)

    def prior(self, like: Tensor | Distribution | None = None, *, constraint_value: Tensor | float | None = None,
              constraint: EqualityConstraint | None = None) -> Distribution:
        r""":math:`p(z) = \mathcal N(0, s^2 I)` conditioned on the plane of a posterior, of a right-hand side or of
        the layer.

        Args:
            like: a posterior returned by :meth:`forward` (the prior takes its planes, batch shape included, and
                its dtype / device), or a tensor whose dtype / device to use (default: the layer's parameters').
            constraint_value, constraint: as in :meth:`forward` (not with a posterior ``like``).

        Returns:
            batch shape ``()`` on the layer's plane, else that of the planes.
        """
        if isinstance(like, ConstrainedNormal):
            if constraint_value is not None or constraint is not None:
                raise ValueError("prior(posterior) takes the posterior's planes; do not pass constraint_value or "
                                 "constraint with it.")
            constraint, like = like.constraint, like.mean
        elif isinstance(like, Distribution):
            like = like.mean
        like = self.mean.weight if like is None else like
        loc = torch.zeros(self.latent_features, dtype=like.dtype, device=like.device)
        scale = torch.full_like(loc, self.prior_scale)
        c = self._constraint(loc, constraint_value, constraint)
        if c is None:
            return Independent(Normal(loc, scale), 1)
        return ConstrainedNormal(loc, scale, constraint=c)

    def kl(self, posterior: Distribution) -> Tensor:
        r""":math:`\mathrm{KL}(q(z\mid x)\Vert p(z))` in closed form, ``(*batch,)``, with the prior on the
        posterior's planes (per example when the posterior has per-example planes)."""
        return kl_divergence(posterior, self.prior(posterior))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, latent_features={self.latent_features}, "
                f"constraint={'none' if self.constraint is None else type(self.constraint).__name__}")


class ConstrainedGaussianObservation(DeviceCheckedModule):
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

    The data are flat vectors: the last dimension is the data size ``n`` that the constraint acts on. Images
    ``(B, C, H, W)`` are flattened first, ``mean.flatten(1)``, ``log_var.flatten(1)`` and ``x.flatten(1)`` for
    ``log_prob`` (``ValueError`` with that hint, naming the shape received, when the trailing dimensions
    multiply to ``n`` but the last one is not ``n``).

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
        if self.constraint is not None:
            _check_flat(mean, self.constraint.event_size)
        scale = (0.5 * log_var.clamp(self.min_log_var, self.max_log_var)).exp()
        if not condition or self.constraint is None:
            return Independent(Normal(mean, scale), 1)
        _check_constraint(self.constraint, mean.shape[-1], "the data size")
        return ConstrainedNormal(mean, scale, constraint=self.constraint.to(mean.device, mean.dtype))

    def extra_repr(self) -> str:
        return f"constraint={'none' if self.constraint is None else type(self.constraint).__name__}"


def _as_right_hand_side(value: object, a: int, like: Tensor) -> Tensor:
    """``constraint_value`` (a number or a floating / integer tensor) as ``(..., a)`` in ``like``'s dtype / device;
    a number, ``()`` or a last dimension of 1 is shared by the ``a`` rows."""
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return torch.full((a,), float(cast(SupportsFloat, value)), dtype=like.dtype,  # (complex: TypeError)
                          device=like.device)
    if not isinstance(value, Tensor) or value.dtype == torch.bool or value.is_complex():
        what = value.dtype if isinstance(value, Tensor) else type(value).__name__
        raise TypeError(f"constraint_value must be a Python number or a floating / integer torch.Tensor, got {what}.")
    if value.device != like.device:
        raise ValueError(f"constraint_value is on device {value.device} but the features are on {like.device}.")
    shape = tuple(value.shape)
    if value.dim() == 0 or value.shape[-1] == 1:
        value = value.expand(value.shape[:-1] + (a,))
    if value.shape[-1] != a:
        hint = " (one value per example of a one-row constraint is (*batch, 1), e.g. k.unsqueeze(-1))" if a == 1 else ""
        raise ValueError(f"constraint_value must have shape (..., {a}) (a = {a} rows of the layer's constraint; a "
                         f"number, () or a last dimension of 1 is shared by the rows), got {shape}{hint}.")
    return value.to(like.dtype)


def _check_flat(data: Tensor, n: int) -> None:
    """``ValueError`` for data whose last dimension is not the constraint's size ``n``, with a flattening hint."""
    if data.dim() >= 1 and data.shape[-1] == n:
        return
    shape = tuple(data.shape)
    start = next((s for s in range(len(shape)) if math.prod(shape[s:]) == n), None)
    if start is not None:
        dims = " x ".join(str(d) for d in shape[start:])
        hint = (f"the trailing dimensions {dims} hold the {n} values the constraint acts on: flatten them, "
                f"mean.flatten({start}) and log_var.flatten({start}) (and x.flatten({start}) for log_prob)")
    else:
        hint = "flatten image-shaped data to (*batch, n) first (e.g. x.flatten(1))"
    raise ValueError(f"mean must have shape (*batch, n) with n = {n} (the constraint acts on vectors of size {n}), got "
                     f"{shape} (last dimension {shape[-1] if shape else None}); {hint}.")


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
    # (no host read: asserted on the device, raised at its next synchronisation; a CPU raises the ValueError at once)
    assert_deferred(~torch.isnan(log_weights).any(), "log_weights contains NaN.",
                    lambda: ValueError("log_weights contains NaN."))
    k = log_weights.shape[dim]
    return torch.logsumexp(log_weights, dim=dim) - math.log(k)
