r"""Closed-form expected losses of a binomial, differentiable in its probability.

For :math:`Z \sim \mathrm{Bin}(k, p)` with pmf :math:`b(m; k, p)` and cdf :math:`F(m; k, p)`:

.. math::
    \mathbb E (Z - y)^2 = k p (1 - p) + (k p - y)^2 ,

.. math::
    \mathbb E |Z - y| = (k p - y)\,\big(1 - 2F(j; k, p)\big) + 2 (k - j)\, p\, b(j; k, p),
    \qquad j = \lfloor y \rfloor .

Derivation of the L1 form: :math:`|Z - y| = (Z - y) + 2 (y - Z)^+`, and with :math:`j = \lfloor y\rfloor`,
:math:`\mathbb E (y - Z)^+ = y F(j) - \mathbb E[Z\,\mathbf 1\{Z \le j\}]`. The binomial identity
:math:`\sum_{z \le j} (z - kp)\, b(z) = -(k - j)\, p\, b(j)` (induction on ``j``; it telescopes because
:math:`(z - kp)\, b(z) = p(1-p)\, \partial_p b(z)`) gives
:math:`\mathbb E[Z\,\mathbf 1\{Z\le j\}] = kp F(j) - (k - j) p\, b(j)`, hence
:math:`\mathbb E (y - Z)^+ = (y - kp) F(j) + (k - j) p\, b(j)` and the form above. It holds for every real
``y`` (``F(j) = 0, b(j) = 0`` for ``j < 0``; ``F(j) = 1`` for ``j >= k``; ``b(j) = 0`` for ``j > k``), is
piecewise linear in ``y`` and reduces to :math:`kp` at ``y = 0`` and :math:`k(1 - p)` at ``y = k``.

Gradients w.r.t. :math:`p` use :math:`\partial_p F(m; k, p) = -k\, b(m; k - 1, p)` (the regularised
incomplete beta :math:`F(m; k, p) = I_{1-p}(k - m, m + 1)` differentiated in its argument) through a custom
``autograd.Function``, and autograd through ``lgamma``/``log`` for :math:`b`. Double backward is supported.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..estimators.poisson import _binomial_log_pmf

__all__ = ["binomial_cdf", "binomial_expected_l1", "binomial_expected_l2"]

#: Largest number of pmf terms held in memory at once by the cdf's cumulative sum.
_CDF_CHUNK_ELEMENTS = 2**20


def _binomial_cdf_forward(value: Tensor, total_count: Tensor, probs: Tensor) -> Tensor:
    r""":math:`F(x; k, p) = \sum_{m=0}^{x} b(m; k, p)` for broadcast tensors with integer ``0 <= x <= k``.

    Summed in float64 over ``m = 0 .. max(x)`` in chunks of at most ``_CDF_CHUNK_ELEMENTS`` pmf values.
    Cost: O(N (max x + 1)) time and O(min(N (max x + 1), 2^20)) memory for N entries.
    """
    out = torch.zeros(probs.shape, dtype=torch.float64, device=probs.device)
    if probs.numel() == 0:
        return out.to(probs.dtype)
    x = value.detach().to(torch.float64).unsqueeze(-1)
    k = total_count.detach().to(torch.float64).unsqueeze(-1)
    p = probs.detach().to(torch.float64).unsqueeze(-1)
    num_terms = int(x.max().item()) + 1
    block = max(1, _CDF_CHUNK_ELEMENTS // probs.numel())
    for start in range(0, num_terms, block):  # loop over chunks of m, not over coordinates
        m = torch.arange(start, min(num_terms, start + block), dtype=torch.float64, device=probs.device)
        pmf = _binomial_log_pmf(torch.minimum(m, k), k, p).exp()  # shape: (*N, block)
        out += pmf.masked_fill(m > x, 0.0).sum(-1)
    return out.clamp_(0.0, 1.0).to(probs.dtype)


class _BinomialCDF(torch.autograd.Function):
    r""":math:`F(x; k, p)`, differentiable in ``p`` only: :math:`\partial_p F = -k\, b(x; k - 1, p)`.

    Inputs are broadcast tensors of one shape with integer ``0 <= x <= k - 1`` and ``0 < p < 1`` (the caller
    keeps the degenerate cases out, so that the backward never evaluates ``b`` outside its support). The
    backward is written with differentiable ops on the saved ``p``, so double backward works.
    """

    @staticmethod
    def forward(ctx, value: Tensor, total_count: Tensor, probs: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(value, total_count, probs)
        return _binomial_cdf_forward(value, total_count, probs)

    @staticmethod
    def backward(ctx, grad_output: Tensor):  # type: ignore[override]
        value, total_count, probs = ctx.saved_tensors
        grad_probs = None
        if ctx.needs_input_grad[2]:
            density = _binomial_log_pmf(value, total_count - 1, probs).exp()
            grad_probs = -grad_output * total_count * density
        return None, None, grad_probs


def binomial_cdf(value: Tensor, total_count: Tensor, probs: Tensor) -> Tensor:
    r"""Binomial cdf :math:`F(x; k, p) = P(Z \le x)` for :math:`Z \sim \mathrm{Bin}(k, p)`, differentiable in
    ``probs`` with :math:`\partial_p F(x; k, p) = -k\, b(x; k - 1, p)`.

    Args:
        value (Tensor): :math:`x`, any real (``F`` is evaluated at :math:`\lfloor x\rfloor`).
        total_count (Tensor): :math:`k`, non-negative integer valued.
        probs (Tensor): :math:`p \in [0, 1]`.

    Returns:
        Tensor: broadcast shape of the inputs, dtype of ``probs``.

    Cost: a float64 cumulative sum of pmf values, O(N (max x + 1)) time for N entries, memory bounded by
    chunks of 2^20 terms. Accurate to round-off in absolute terms (not in relative terms deep in the upper
    tail, where :math:`1 - F` is tiny).
    """
    x, k, p = torch.broadcast_tensors(
        torch.floor(value.detach()).to(probs.dtype), total_count.to(probs.dtype), probs
    )
    return _cdf_with_edges(x, k, p)


def _cdf_with_edges(j: Tensor, k: Tensor, p: Tensor) -> Tensor:
    """``F(j; k, p)`` for integer ``j`` of any sign, broadcast inputs; degenerate ``p`` in {0, 1} allowed."""
    interior = (p > 0) & (p < 1)
    inside = (j >= 0) & (j < k) & interior  # the only entries needing the sum (and a gradient)
    one = torch.ones_like(p)
    j_s = torch.where(inside, j, torch.zeros_like(j))
    k_s = torch.where(inside, k, one)
    p_s = torch.where(inside, p, 0.5 * one)
    F = _BinomialCDF.apply(j_s, k_s, p_s)
    # outside: j < 0 -> 0; j >= k -> 1; p = 0 (Z = 0) -> [j >= 0]; p = 1 (Z = k) -> [j >= k]
    atom = k * (p >= 1)
    edge = (j >= torch.where(interior, torch.where(j < 0, one, k), atom)).to(p.dtype)
    return torch.where(inside, F, edge)


def binomial_expected_l1(target: Tensor, total_count: Tensor, probs: Tensor) -> Tensor:
    r"""Exact :math:`\mathbb E|Z - y|` for :math:`Z \sim \mathrm{Bin}(k, p)`:

    .. math::
        \mathbb E |Z - y| = (k p - y)\,\big(1 - 2F(j; k, p)\big) + 2 (k - j)\, p\, b(j; k, p),
        \qquad j = \lfloor y \rfloor

    (derivation in the module docstring). Valid for every real ``y``; the targets of interest are the
    integers ``0..k``. Differentiable in ``probs`` (through :func:`binomial_cdf` and ``lgamma``) and, almost
    everywhere, in ``target`` (slope :math:`2F(j) - 1`).

    Args:
        target (Tensor): :math:`y`.
        total_count (Tensor): :math:`k`, non-negative integer valued.
        probs (Tensor): :math:`p \in [0, 1]`; at 0 and 1 the point mass gives :math:`|kp - y|`.

    Returns:
        Tensor: broadcast shape of the inputs.

    Cost: that of :func:`binomial_cdf`, O(N (max j + 1)) for N entries. Evaluated in float64 (the two terms
    are of size :math:`\sqrt k` and partly cancel) and returned in the promoted dtype of ``target`` and
    ``probs``.
    """
    dtype = torch.promote_types(target.dtype, probs.dtype)
    y, k, p = torch.broadcast_tensors(
        target.to(torch.float64), total_count.to(torch.float64), probs.to(torch.float64)
    )
    j = torch.floor(y.detach())
    interior = (p > 0) & (p < 1)
    p_s = torch.where(interior, p, torch.full_like(p, 0.5))
    F = _cdf_with_edges(j, k, p_s)
    in_support = (j >= 0) & (j <= k)
    j_b = torch.minimum(j.clamp(min=0), k)
    b = torch.where(in_support, _binomial_log_pmf(j_b, k, p_s).exp(), torch.zeros_like(p))
    mean = k * p_s
    out = (mean - y) * (1 - 2 * F) + 2 * (k - j_b) * p_s * b
    return torch.where(interior, out, (k * p - y).abs()).to(dtype)


def binomial_expected_l2(target: Tensor, total_count: Tensor, probs: Tensor) -> Tensor:
    r"""Exact :math:`\mathbb E (Z - y)^2 = k p (1 - p) + (k p - y)^2` for :math:`Z \sim \mathrm{Bin}(k, p)`,
    broadcast over the inputs. Differentiable in ``probs`` and ``target``. Cost: O(N)."""
    mean = total_count * probs
    return mean * (1 - probs) + (mean - target) ** 2
