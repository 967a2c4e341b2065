r"""Closed-form expected losses of Gaussian marginals.

For :math:`z \sim \mathcal N(m + y, s^2)` (so that :math:`z - y \sim \mathcal N(m, s^2)`):

.. math::
    \mathbb E|z - y| = s\sqrt{2/\pi}\,e^{-m^2/(2s^2)} + m\,\mathrm{erf}\!\big(m/(\sqrt2 s)\big)
    \quad(\to |m| \text{ as } s \to 0), \qquad
    \mathbb E(z - y)^2 = m^2 + s^2.

(The folded-normal mean. The source paper prints these with the variance where the standard deviation
belongs; these are the correct forms, checked against Monte Carlo in the tests.)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["gaussian_expected_abs", "gaussian_expected_square"]


def gaussian_expected_abs(m: Tensor, variance: Tensor) -> Tensor:
    r""":math:`\mathbb E|X|` for :math:`X \sim \mathcal N(m, \sigma^2)`, elementwise, differentiable.

    Finite (with finite gradients) where the variance is 0: the value there is :math:`|m|`.
    """
    positive = variance > 0
    safe_var = torch.where(positive, variance, torch.ones_like(variance))
    s = safe_var.sqrt()
    folded = s * math.sqrt(2 / math.pi) * torch.exp(-0.5 * m.square() / safe_var) + m * torch.erf(
        m / (math.sqrt(2) * s)
    )
    return torch.where(positive, folded, m.abs())


def gaussian_expected_square(m: Tensor, variance: Tensor) -> Tensor:
    r""":math:`\mathbb E X^2 = m^2 + \sigma^2` for :math:`X \sim \mathcal N(m, \sigma^2)`."""
    return m.square() + variance
