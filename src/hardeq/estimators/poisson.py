r"""Gradient estimators for independent Poissons conditioned on their (grouped) sums.

With :math:`z_i \sim \mathrm{Poisson}(\theta_i)` independent and the constraint
:math:`\sum_{i \in g} z_i = k_g` for every group :math:`g`, the conditional law is a product of
multinomials, :math:`z_g \mid k_g \sim \mathrm{Multinomial}(k_g, p_g)` with
:math:`p_i = \theta_i / \sum_{j \in g(i)} \theta_j`, and the conditional marginal of one coordinate is
:math:`\mathrm{Binomial}(k_{g(i)}, p_i)`.

A multinomial sample is not a differentiable function of :math:`\theta`, so every estimator returns the
*same* forward value, the exact sample ``sample`` it is given, and differs only in the backward pass: a proxy
:math:`m(\theta)` is chosen and the estimator returns ``sample.detach() + (m - m.detach())``, so that

.. math::  \nabla_\theta \ell \approx (\partial m / \partial \theta)^\top\, \partial \ell / \partial z .

None of these gradients is unbiased for a general loss (all are registered with ``exact=False``).

All share the signature ``fn(rate, total, sample, *, index=None) -> Tensor``:

* ``rate``: :math:`\theta > 0`, shape ``(*batch, n)`` (its batch dims broadcast with the others');
* ``total``: :math:`k`, integer valued, shape ``(*batch,)`` when ``index`` is ``None`` (one sum over all
  ``n`` coordinates), else ``(*batch, a)`` (one total per group);
* ``sample``: an exact (detached) sample of the conditional law, ``(*sample, *batch, n)``, e.g. from
  :meth:`hardeq.ConstrainedPoisson.sample`;
* ``index``: optional ``LongTensor`` of shape ``(n,)``, the group id in ``[0, a)`` of every coordinate
  (PyG's ``batch`` vector).

They return a tensor equal to ``sample`` (shape ``(*sample, *batch, n)``) that carries the estimator's
gradient w.r.t. ``rate``. ``total`` and ``index`` receive no gradient. Inputs are assumed valid (the
distribution validates them); only shapes are checked here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..ops import binomial_log_pmf, group_probs
from .registry import register_estimator

__all__ = [
    "poisson_constrained_marginal",
    "poisson_marginal_expectation",
    "poisson_random",
    "poisson_unconstrained_marginal",
]


# ----------------------------------------------------------------------------------------------- helpers


def _coordinate_totals(total: Tensor, index: Tensor | None) -> Tensor:
    r"""The total :math:`k_{g(i)}` of each coordinate's group: ``(*batch,) -> (*batch, 1)`` without
    ``index``, ``(*batch, a) -> (*batch, n)`` with it."""
    return total.unsqueeze(-1) if index is None else total.index_select(-1, index)




def _poisson_log_pmf(value: Tensor, rate: Tensor) -> Tensor:
    r"""Poisson log-pmf :math:`x\log\theta - \theta - \log x!` for integer ``value >= 0``, ``rate > 0``."""
    return torch.xlogy(value, rate) - rate - torch.lgamma(value + 1)


def _check_shapes(rate: Tensor, total: Tensor, sample: Tensor, index: Tensor | None) -> None:
    n = rate.shape[-1] if rate.dim() else 0
    if rate.dim() < 1 or sample.dim() < 1 or sample.shape[-1] != n:
        raise ValueError(
            f"sample must have shape (*sample_shape, *batch_shape, n) with n = rate.shape[-1] = {n}, got "
            f"sample.shape = {tuple(sample.shape)} and rate.shape = {tuple(rate.shape)}."
        )
    if index is not None:
        if index.shape != (n,):
            raise ValueError(f"index must have shape (n,) = ({n},), got {tuple(index.shape)}.")
        if total.dim() < 1:
            raise ValueError(f"with index, total must have shape (*batch, a), got {tuple(total.shape)}.")


def _straight_through(sample: Tensor, proxy: Tensor) -> Tensor:
    """``sample`` in the forward pass, the gradient of ``proxy`` in the backward pass."""
    return sample.detach() + (proxy - proxy.detach())


def _num_groups(total: Tensor, index: Tensor | None) -> int:
    return 1 if index is None else total.shape[-1]


# -------------------------------------------------------------------------------------------- estimators


@register_estimator("marginal_expectation", family="poisson", exact=False)
def poisson_marginal_expectation(
    rate: Tensor, total: Tensor, sample: Tensor, *, index: Tensor | None = None
) -> Tensor:
    r"""Proxy: the conditional mean :math:`m_i(\theta) = k_{g(i)}\, p_i(\theta)`.

    The gradient w.r.t. ``rate`` is :math:`(\partial (k p)/\partial\theta)^\top \partial\ell/\partial z`
    evaluated at the exact sample: a biased proxy in general, exact (and sample independent) when the loss
    is linear in :math:`z`, since :math:`\mathbb E[z] = kp`. The paper's recommended estimator.
    Cost: O(n) beyond the sample.

    Shapes:
        rate: ``(*batch, n)``; total: ``(*batch,)`` or ``(*batch, a)`` with ``index``;
        sample: ``(*sample, *batch, n)``; returns ``(*sample, *batch, n)``.
    """
    _check_shapes(rate, total, sample, index)
    p = group_probs(rate, index, _num_groups(total, index))
    m = _coordinate_totals(total, index).to(p.dtype) * p  # shape: (*batch, n)
    return _straight_through(sample, m)


@register_estimator("constrained_marginal", family="poisson", exact=False)
def poisson_constrained_marginal(
    rate: Tensor, total: Tensor, sample: Tensor, *, index: Tensor | None = None
) -> Tensor:
    r"""Proxy: the conditional marginal pmf at the sample, :math:`m_i(\theta) = \mathrm{Bin}(z_i;
    k_{g(i)}, p_i(\theta))`.

    The gradient w.r.t. ``rate`` is the derivative of that pmf (through :math:`p`), chained with
    :math:`\partial\ell/\partial z`: a biased proxy (the counterpart of the Gaussian
    ``constrained_marginal``, which uses :math:`\mathcal N(z_i; \bar\mu_i, \bar\sigma_i^2)`). Groups of a
    single coordinate (:math:`p_i = 1`) get a zero gradient. Cost: O(n) per sample.

    Shapes:
        rate: ``(*batch, n)``; total: ``(*batch,)`` or ``(*batch, a)`` with ``index``;
        sample: ``(*sample, *batch, n)``; returns ``(*sample, *batch, n)``.
    """
    _check_shapes(rate, total, sample, index)
    p = group_probs(rate, index, _num_groups(total, index))
    k = _coordinate_totals(total, index).to(p.dtype)
    m = binomial_log_pmf(sample.detach().to(p.dtype), k, p).exp()  # shape: (*sample, *batch, n)
    return _straight_through(sample, m)


@register_estimator("unconstrained_marginal", family="poisson", exact=False)
def poisson_unconstrained_marginal(
    rate: Tensor, total: Tensor, sample: Tensor, *, index: Tensor | None = None
) -> Tensor:
    r"""Proxy: the *unconstrained* Poisson pmf at the sample, :math:`m_i(\theta) = \mathrm{Poisson}(z_i;
    \theta_i) = \theta_i^{z_i} e^{-\theta_i} / z_i!`.

    The gradient w.r.t. ``rate`` is :math:`\partial m_i/\partial\theta_i = m_i (z_i/\theta_i - 1)` times
    :math:`\partial\ell/\partial z_i` (diagonal; ignores the constraint): a biased proxy. ``total`` and
    ``index`` are accepted for a uniform signature and only used for shape checks. Cost: O(n) per sample.

    Shapes:
        rate: ``(*batch, n)``; total: ``(*batch,)`` or ``(*batch, a)`` with ``index``;
        sample: ``(*sample, *batch, n)``; returns ``(*sample, *batch, n)``.
    """
    _check_shapes(rate, total, sample, index)
    m = _poisson_log_pmf(sample.detach().to(rate.dtype), rate).exp()  # shape: (*sample, *batch, n)
    return _straight_through(sample, m)


class _RandomGradient(torch.autograd.Function):
    """Identity on the (detached) sample; the backward returns N(0, I) noise of ``rate``'s shape."""

    @staticmethod
    def forward(ctx: Any, rate: Tensor, sample: Tensor) -> Tensor:
        ctx.rate_spec = (rate.shape, rate.dtype, rate.device)
        return sample.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, None]:
        shape, dtype, device = ctx.rate_spec
        grad_rate = torch.randn(shape, dtype=dtype, device=device) if ctx.needs_input_grad[0] else None
        return grad_rate, None


@register_estimator("random", family="poisson", exact=False)
def poisson_random(rate: Tensor, total: Tensor, sample: Tensor, *, index: Tensor | None = None) -> Tensor:
    r"""Gradient w.r.t. ``rate`` replaced by standard normal noise :math:`\mathcal N(0, I)` of ``rate``'s
    shape, independent of the loss: the uninformative reference. **Not** a gradient estimator in any sense
    (its expected cosine with the true gradient is 0). Cost: O(size of rate) per backward.

    Shapes:
        rate: ``(*batch, n)``; total: ``(*batch,)`` or ``(*batch, a)`` with ``index``;
        sample: ``(*sample, *batch, n)``; returns ``(*sample, *batch, n)``; ``rate.grad``: ``rate.shape``.
    """
    _check_shapes(rate, total, sample, index)
    out: Tensor = _RandomGradient.apply(  # type: ignore[no-untyped-call]  # torch: Function.apply unannotated
        rate, sample.detach())
    return out
