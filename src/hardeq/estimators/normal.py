r"""Gradient estimators for the exact sample of :math:`\mathcal N(\mu, \Sigma)` given :math:`A z = k`.

Every estimator returns the *same* forward value: the exact Matheron-rule sample

.. math::  z = \hat z + K(k - A\hat z), \quad \hat z = \mu + F\varepsilon,

built from ``noise`` :math:`\varepsilon`. They differ only in the backward pass: a proxy
:math:`m(\theta)` is chosen and the estimator returns ``z.detach() + (m - m.detach())``, so that
:math:`\nabla_\theta \ell = (\partial m/\partial\theta)^\top\,\partial\ell/\partial z`.

All share the signature ``fn(conditioner, loc, noise, **options) -> Tensor``:

* ``conditioner``: a :class:`~hardeq.linalg.conditioning.Conditioner`, the factorisation of
  :math:`A\Sigma A^\top` for one covariance and one constraint. A :class:`~hardeq.ConstrainedNormal` builds
  it once (:attr:`~hardeq.ConstrainedNormal.conditioner`) and hands it to every estimator, so no estimator
  factorises again; on plain tensors, build it as ``Conditioner(DiagonalCovariance(scale), constraint)``.
  Gradients w.r.t. the covariance's tensors and ``k`` flow through it.
* ``loc``: :math:`\mu`, ``(*batch, n)``;
* ``noise``: :math:`\varepsilon`, ``(*sample, *batch, m)`` with ``m = conditioner.cov.noise_size`` (``n``,
  or ``n + r`` for a rank-``r`` low-rank covariance: the first ``n`` entries drive the diagonal part).

Returns a tensor of shape ``(*sample, *batch, n)``. The ``constrained_layer`` estimator is registered by
:mod:`hardeq.baselines`, which owns the constraint layer (the core does not import the baselines).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..linalg.conditioning import Conditioner
from .registry import register_estimator

__all__ = [
    "exact_sample",
    "straight_through",
    "pathwise",
    "marginal_expectation",
    "constrained_marginal",
    "unconstrained_marginal",
    "constrained_reparam",
    "constrained_reparam_independent",
    "random",
]


def straight_through(z: Tensor, proxy: Tensor) -> Tensor:
    """``z`` in the forward pass, the gradient of ``proxy`` in the backward pass."""
    return z.detach() + (proxy - proxy.detach())


def exact_sample(cond: Conditioner, loc: Tensor, noise: Tensor) -> Tensor:
    r"""The Matheron sample :math:`z = \hat z + K(k - A\hat z)`, :math:`\hat z = \mu + F\varepsilon`,
    differentiable in every parameter; ``noise`` ``(*sample, *batch, m)`` -> ``(*sample, *batch, n)``."""
    return cond.condition(loc + cond.cov.sqrt_matvec(noise))


def _detached_sample(cond: Conditioner, loc: Tensor, noise: Tensor) -> Tensor:
    with torch.no_grad():
        return exact_sample(cond, loc, noise)


@register_estimator("pathwise", exact=True)
def pathwise(cond: Conditioner, loc: Tensor, noise: Tensor) -> Tensor:
    r"""Reparameterised Matheron sample, differentiated through end to end.

    Gradient: **exact** for the sample as a function of the noise, hence an **unbiased** estimate of
    :math:`\nabla \mathbb E\,\ell(z)` w.r.t. ``loc``, ``scale``/``scale_tril``/``cov_factor`` and ``k``.
    """
    return exact_sample(cond, loc, noise)


@register_estimator("marginal_expectation")
def marginal_expectation(cond: Conditioner, loc: Tensor, noise: Tensor) -> Tensor:
    r"""Proxy :math:`m = \bar\mu(\theta)`, the conditional mean (the source paper's recommendation).

    Gradient: equal in expectation to the pathwise one w.r.t. ``loc`` and ``k`` (the sample is affine in
    them with the same Jacobian), hence **unbiased there**; **biased** (zero) w.r.t. the scale parameters,
    except through :math:`\bar\mu`'s dependence on :math:`\Sigma`.
    """
    z = _detached_sample(cond, loc, noise)
    return straight_through(z, cond.condition(loc))


def _gaussian_density(x: Tensor, mean: Tensor, variance: Tensor) -> Tensor:
    positive = variance > 0
    safe = torch.where(positive, variance, torch.ones_like(variance))
    density = torch.exp(-0.5 * (x - mean).square() / safe) / torch.sqrt(2 * math.pi * safe)
    return torch.where(positive, density, torch.zeros_like(density))


@register_estimator("constrained_marginal")
def constrained_marginal(cond: Conditioner, loc: Tensor, noise: Tensor) -> Tensor:
    r"""Proxy :math:`m_i = \mathcal N(z_i; \bar\mu_i, \bar\sigma_i^2)`: the conditional marginal density at
    the (detached) sample. A **biased** proxy w.r.t. all parameters (its gradient is the density's, not the
    sample's); coordinates with zero conditional variance contribute no gradient.
    """
    z = _detached_sample(cond, loc, noise)
    proxy = _gaussian_density(z, cond.condition(loc), cond.variance())
    return straight_through(z, proxy)


@register_estimator("unconstrained_marginal")
def unconstrained_marginal(cond: Conditioner, loc: Tensor, noise: Tensor) -> Tensor:
    r"""Proxy :math:`m_i = \mathcal N(z_i; \mu_i, \Sigma_{ii})`: the *unconstrained* marginal density at the
    (detached) sample. A **biased** proxy; the constraint does not enter its gradient.
    """
    z = _detached_sample(cond, loc, noise)
    return straight_through(z, _gaussian_density(z, loc, cond.cov.diagonal()))


@register_estimator("constrained_reparam", exact=True)
def constrained_reparam(cond: Conditioner, loc: Tensor, noise: Tensor) -> Tensor:
    r"""The source paper's "Constrained Reparametrization" under the *shared-noise* reading: the proxy is the
    Matheron sample :math:`m(\theta) = \hat z + K(k - A\hat z)`, :math:`\hat z = \mu + F\varepsilon`, built
    from the forward sample's *own* noise :math:`\varepsilon` (as the ``constrained_layer`` proxy is by
    default).

    Since the proxy *is* the forward sample, ``z.detach() + (m - m.detach())`` equals :func:`pathwise` in
    value and in gradient, bit for bit: **this estimator is identical to** ``pathwise`` (exact per sample,
    unbiased w.r.t. ``loc``, the covariance's tensors and ``k``). It is registered under the paper's name so
    that the name resolves; a study need not train it separately from ``pathwise``. The independent-noise
    reading, whose expected gradient is :func:`marginal_expectation`'s, is
    :func:`constrained_reparam_independent`. Cost: one Matheron sample, as ``pathwise``.

    Shapes: ``loc`` ``(*batch, n)``, ``noise`` ``(*sample, *batch, m)`` -> ``(*sample, *batch, n)``.
    """
    z = _detached_sample(cond, loc, noise)
    return straight_through(z, exact_sample(cond, loc, noise))


@register_estimator("constrained_reparam_independent")
def constrained_reparam_independent(
    cond: Conditioner, loc: Tensor, noise: Tensor, *, proxy_noise: Tensor | None = None
) -> Tensor:
    r"""The source paper's "Constrained Reparametrization" under the *independent-noise* reading: the forward
    value is the exact sample :math:`z = \bar\mu + PF\varepsilon` (noise ``noise``), and the backward pass is
    that of a *second* Matheron sample :math:`m(\theta) = \bar\mu(\theta) + P(\theta)F(\theta)\varepsilon'`
    built from independent noise :math:`\varepsilon'` (``proxy_noise``; a fresh ``randn_like(noise)`` when
    ``None``), where :math:`\bar\mu = \mu + K(k - A\mu)`, :math:`P = I - KA`, :math:`K = \Sigma A^\top
    (A\Sigma A^\top)^{-1}`. The gradient of a loss :math:`\ell` is therefore

    .. math::  \hat g = \Big(\frac{\partial m(\theta, \varepsilon')}{\partial\theta}\Big)^{\!\top}
               \nabla\ell(z(\varepsilon)).

    **Expectation.** :math:`m` is affine in :math:`\varepsilon'` with mean :math:`\bar\mu`, and
    :math:`\varepsilon'` is independent of :math:`\varepsilon`, so
    :math:`\mathbb E\,\hat g = (\partial\bar\mu/\partial\theta)^\top\,\mathbb E\,\nabla\ell(z)`: the
    expected gradient of :func:`marginal_expectation`. The exact gradient is :math:`\nabla_\theta
    \mathbb E\,\ell(z) = \mathbb E\,\hat g + \mathbb E[(\partial(PF\varepsilon)/\partial\theta)^\top
    \nabla\ell(z)]`; the second term vanishes for ``loc`` and ``k`` (:math:`PF\varepsilon` does not depend on
    them), so the estimator is **unbiased w.r.t. ``loc`` and ``k`` and biased w.r.t. the covariance's
    tensors**. For the squared error :math:`\ell = \|z - y\|^2`, with :math:`\mathbb E\,\ell = \|\bar\mu -
    y\|^2 + \operatorname{tr}\bar\Sigma`, :math:`\mathbb E\,\hat g = \nabla_\theta\|\bar\mu - y\|^2`:
    the bias is exactly :math:`-\nabla_\theta \operatorname{tr}\bar\Sigma` (the estimator never sees what
    the conditional variance adds to the loss). Its variance exceeds Marginal Expectation's by the
    :math:`\varepsilon'` term. Both statements are tested by Monte Carlo against a dense float64 oracle.

    The shared-noise reading (:math:`\varepsilon' = \varepsilon`) is :func:`constrained_reparam`, which
    is :func:`pathwise`. Cost: two Matheron samples (one without gradient), twice ``pathwise``'s forward.

    Shapes: ``loc`` ``(*batch, n)``, ``noise`` and ``proxy_noise`` ``(*sample, *batch, m)`` ->
    ``(*sample, *batch, n)``; a ``proxy_noise`` of another shape raises ``ValueError``.
    """
    if proxy_noise is not None:
        if not isinstance(proxy_noise, Tensor):
            raise TypeError(f"proxy_noise must be a Tensor or None, got {type(proxy_noise).__name__}.")
        if proxy_noise.shape != noise.shape:
            raise ValueError(f"proxy_noise must have the shape of noise, {tuple(noise.shape)}; "
                             f"got {tuple(proxy_noise.shape)}.")
    z = _detached_sample(cond, loc, noise)
    eps = torch.randn_like(noise) if proxy_noise is None else proxy_noise
    return straight_through(z, exact_sample(cond, loc, eps))


class _RandomGradient(torch.autograd.Function):
    """Identity on the detached sample; the backward returns N(0, I) for every parameter needing grad."""

    @staticmethod
    def forward(ctx: Any, z: Tensor, *params: Tensor | None) -> Tensor:
        ctx.shapes = [None if p is None else (p.shape, p.dtype, p.device) for p in params]
        return z.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        grads: list[Tensor | None] = [None]
        for needs, spec in zip(ctx.needs_input_grad[1:], ctx.shapes):
            if needs and spec is not None:
                shape, dtype, device = spec
                grads.append(torch.randn(shape, dtype=dtype, device=device))
            else:
                grads.append(None)
        return tuple(grads)


@register_estimator("random")
def random(cond: Conditioner, loc: Tensor, noise: Tensor) -> Tensor:
    r"""Gradient replaced by standard normal noise of each parameter's shape (``loc`` and the covariance's
    tensors; ``k`` gets none): the uninformative reference. **Not** a gradient
    estimator in any sense; its expected cosine with the true gradient is 0.
    """
    z = _detached_sample(cond, loc, noise)
    out: Tensor = _RandomGradient.apply(  # type: ignore[no-untyped-call]  # torch: Function.apply unannotated
        z, loc, *cond.cov.tensors())
    return out
