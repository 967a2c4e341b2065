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

from ..ops import _cdf_with_edges, binomial_cdf, binomial_log_pmf

__all__ = ["binomial_cdf", "binomial_expected_l1", "binomial_expected_l2"]  # binomial_cdf re-exported from hardeq.ops

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

    Cost: that of :func:`binomial_cdf`, O(N W) for N entries, W the width of the window of pmf terms it sums
    (at most :math:`\min(j + 1, 48\sqrt{kp(1-p)} + 800)`); ``ValueError`` beyond ``hardeq.ops.CDF_MAX_TERMS``.
    Evaluated in float64 (the two terms are of size :math:`\sqrt k` and partly cancel) and returned in the
    promoted dtype of ``target`` and ``probs``.
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
    b = torch.where(in_support, binomial_log_pmf(j_b, k, p_s).exp(), torch.zeros_like(p))
    mean = k * p_s
    out = (mean - y) * (1 - 2 * F) + 2 * (k - j_b) * p_s * b
    return torch.where(interior, out, (k * p - y).abs()).to(dtype)


def binomial_expected_l2(target: Tensor, total_count: Tensor, probs: Tensor) -> Tensor:
    r"""Exact :math:`\mathbb E (Z - y)^2 = k p (1 - p) + (k p - y)^2` for :math:`Z \sim \mathrm{Bin}(k, p)`,
    broadcast over the inputs. Differentiable in ``probs`` and ``target``. Cost: O(N)."""
    mean = total_count * probs
    return mean * (1 - probs) + (mean - target) ** 2
