r"""Gradient estimators for the exact sample of :math:`\mathcal N(\mu, \Sigma)` given :math:`A z = k`.

Every estimator returns the *same* forward value: the exact Matheron-rule sample

.. math::  z = \hat z + K(k - A\hat z), \quad \hat z = \mu + L\varepsilon,

built from ``noise`` :math:`\varepsilon`. They differ only in the backward pass: a proxy
:math:`m(\theta)` is chosen and the estimator returns ``z.detach() + (m - m.detach())``, so that
:math:`\nabla_\theta \ell = (\partial m/\partial\theta)^\top\,\partial\ell/\partial z`.

All share the signature ``fn(loc, scale, constraint, noise, *, scale_tril=None, cov_factor=None)``:

* ``loc``: :math:`\mu`, ``(*batch, n)``;
* ``scale``: diagonal standard deviations ``(*batch, n)`` (``None`` with ``scale_tril``; the diagonal
  part's standard deviations with ``cov_factor``);
* ``constraint``: a :class:`~hardeq.LinearConstraint` or :class:`~hardeq.SumConstraint`;
* ``noise``: :math:`\varepsilon`, ``(*sample, *batch, n)`` (``n + r`` with a rank-``r`` ``cov_factor``: the
  first ``n`` entries drive the diagonal part, the last ``r`` the factor).

Returns a tensor of shape ``(*sample, *batch, n)``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..constraints import EqualityConstraint
from ..linalg.conditioning import Conditioner
from ..linalg.covariance import Covariance, DiagonalCovariance, FullCovariance, LowRankCovariance
from .registry import register_estimator

__all__ = [
    "build_covariance",
    "pathwise",
    "marginal_expectation",
    "constrained_marginal",
    "unconstrained_marginal",
    "constrained_layer",
    "constrained_reparam_independent",
    "random",
]


def build_covariance(scale: Tensor | None, scale_tril: Tensor | None, cov_factor: Tensor | None) -> Covariance:
    """The covariance structure named by which arguments are given (see ConstrainedNormal)."""
    if scale_tril is not None:
        return FullCovariance(scale_tril)
    if cov_factor is not None:
        return LowRankCovariance(cov_factor, scale)
    return DiagonalCovariance(scale)


def _straight_through(z: Tensor, proxy: Tensor) -> Tensor:
    return z.detach() + (proxy - proxy.detach())


def _exact_sample(cond: Conditioner, loc: Tensor, noise: Tensor) -> Tensor:
    return cond.condition(loc + cond.cov.sqrt_matvec(noise))


@register_estimator("pathwise", exact=True)
def pathwise(loc, scale, constraint: EqualityConstraint, noise, *, scale_tril=None, cov_factor=None) -> Tensor:
    r"""Reparameterised Matheron sample, differentiated through end to end.

    Gradient: **exact** for the sample as a function of the noise, hence an **unbiased** estimate of
    :math:`\nabla \mathbb E\,\ell(z)` w.r.t. ``loc``, ``scale``/``scale_tril``/``cov_factor`` and ``k``.
    """
    cond = Conditioner(build_covariance(scale, scale_tril, cov_factor), constraint)
    return _exact_sample(cond, loc, noise)


@register_estimator("marginal_expectation")
def marginal_expectation(loc, scale, constraint, noise, *, scale_tril=None, cov_factor=None) -> Tensor:
    r"""Proxy :math:`m = \bar\mu(\theta)`, the conditional mean (the source paper's recommendation).

    Gradient: equal in expectation to the pathwise one w.r.t. ``loc`` and ``k`` (the sample is affine in
    them with the same Jacobian), hence **unbiased there**; **biased** (zero) w.r.t. the scale parameters,
    except through :math:`\bar\mu`'s dependence on :math:`\Sigma`.
    """
    cond = Conditioner(build_covariance(scale, scale_tril, cov_factor), constraint)
    with torch.no_grad():
        z = _exact_sample(cond, loc, noise)
    return _straight_through(z, cond.condition(loc))


def _gaussian_density(x: Tensor, mean: Tensor, variance: Tensor) -> Tensor:
    positive = variance > 0
    safe = torch.where(positive, variance, torch.ones_like(variance))
    density = torch.exp(-0.5 * (x - mean).square() / safe) / torch.sqrt(2 * math.pi * safe)
    return torch.where(positive, density, torch.zeros_like(density))


@register_estimator("constrained_marginal")
def constrained_marginal(loc, scale, constraint, noise, *, scale_tril=None, cov_factor=None) -> Tensor:
    r"""Proxy :math:`m_i = \mathcal N(z_i; \bar\mu_i, \bar\sigma_i^2)`: the conditional marginal density at
    the (detached) sample. A **biased** proxy w.r.t. all parameters (its gradient is the density's, not the
    sample's); coordinates with zero conditional variance contribute no gradient.
    """
    cond = Conditioner(build_covariance(scale, scale_tril, cov_factor), constraint)
    with torch.no_grad():
        z = _exact_sample(cond, loc, noise)
    proxy = _gaussian_density(z, cond.condition(loc), cond.variance())
    return _straight_through(z, proxy)


@register_estimator("unconstrained_marginal")
def unconstrained_marginal(loc, scale, constraint, noise, *, scale_tril=None, cov_factor=None) -> Tensor:
    r"""Proxy :math:`m_i = \mathcal N(z_i; \mu_i, \Sigma_{ii})`: the *unconstrained* marginal density at the
    (detached) sample. A **biased** proxy; the constraint does not enter its gradient.
    """
    cov = build_covariance(scale, scale_tril, cov_factor)
    cond = Conditioner(cov, constraint)
    with torch.no_grad():
        z = _exact_sample(cond, loc, noise)
    return _straight_through(z, _gaussian_density(z, loc, cov.diagonal()))


@register_estimator("constrained_layer")
def constrained_layer(
    loc, scale, constraint, noise, *, scale_tril=None, cov_factor=None, proxy_noise: Tensor | None = None,
    order: Tensor | None = None,
) -> Tensor:
    r"""Proxy :math:`m = \mathrm{CL}(\mu + L\varepsilon')`: the constraint layer (baseline, Stoian et al.)
    applied to a reparameterised *unconstrained* sample. :math:`\varepsilon'` is ``proxy_noise`` if given
    (independent noise, as in the source paper's table), otherwise the forward sample's own noise.
    A **biased** proxy: CL's output is not distributed as the conditional.
    """
    from ..baselines import constraint_layer as cl

    cov = build_covariance(scale, scale_tril, cov_factor)
    cond = Conditioner(cov, constraint)
    with torch.no_grad():
        z = _exact_sample(cond, loc, noise)
    eps = noise if proxy_noise is None else proxy_noise
    return _straight_through(z, cl(loc + cov.sqrt_matvec(eps), constraint, order=order))


@register_estimator("constrained_reparam_independent")
def constrained_reparam_independent(
    loc, scale, constraint, noise, *, scale_tril=None, cov_factor=None, proxy_noise: Tensor | None = None
) -> Tensor:
    r"""Proxy: a pathwise Matheron sample drawn with *independent* noise :math:`\varepsilon'`
    (``proxy_noise``, fresh ``randn`` by default), as the source paper's table describes for its
    "constrained reparametrization". Since :math:`\varepsilon'` is independent of the forward sample, the
    expected gradient is :math:`\mathbb E[\partial\ell/\partial z]^\top\,\partial\bar\mu/\partial\theta`,
    the same as :func:`marginal_expectation`'s: **unbiased w.r.t. ``loc`` and ``k`` only**, biased w.r.t. the
    scales, and with more variance than either. Included to measure what sharing the noise buys.
    """
    cond = Conditioner(build_covariance(scale, scale_tril, cov_factor), constraint)
    with torch.no_grad():
        z = _exact_sample(cond, loc, noise)
    eps = torch.randn_like(noise) if proxy_noise is None else proxy_noise
    return _straight_through(z, _exact_sample(cond, loc, eps))


class _RandomGradient(torch.autograd.Function):
    """Identity on the detached sample; the backward returns N(0, I) for every parameter needing grad."""

    @staticmethod
    def forward(ctx, z, *params):
        ctx.shapes = [None if p is None else (p.shape, p.dtype, p.device) for p in params]
        return z.clone()

    @staticmethod
    def backward(ctx, grad_out):
        grads = [None]
        for needs, spec in zip(ctx.needs_input_grad[1:], ctx.shapes):
            if needs and spec is not None:
                shape, dtype, device = spec
                grads.append(torch.randn(shape, dtype=dtype, device=device))
            else:
                grads.append(None)
        return tuple(grads)


@register_estimator("random")
def random(loc, scale, constraint, noise, *, scale_tril=None, cov_factor=None) -> Tensor:
    r"""Gradient replaced by standard normal noise of each parameter's shape (``loc``, ``scale``,
    ``scale_tril``, ``cov_factor``; ``k`` gets none): the uninformative reference. **Not** a gradient
    estimator in any sense; its expected cosine with the true gradient is 0.
    """
    cond = Conditioner(build_covariance(scale, scale_tril, cov_factor), constraint)
    with torch.no_grad():
        z = _exact_sample(cond, loc, noise)
    return _RandomGradient.apply(z, loc, scale, scale_tril, cov_factor)
