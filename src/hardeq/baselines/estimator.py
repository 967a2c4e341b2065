r"""The ``constrained_layer`` gradient estimator, registered from the baselines side.

The estimator uses the constraint layer (a baseline) as its proxy, so it lives here: the core
(:mod:`hardeq.estimators`) never imports the baselines, and importing :mod:`hardeq` (which imports this
package) registers it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..estimators.normal import exact_sample, straight_through
from ..estimators.registry import register_estimator
from ..linalg.conditioning import Conditioner
from .elimination import constraint_layer

__all__ = ["constrained_layer_estimator"]


@register_estimator("constrained_layer")
def constrained_layer_estimator(
    cond: Conditioner, loc: Tensor, noise: Tensor, *, proxy_noise: Tensor | None = None,
    order: Tensor | None = None,
) -> Tensor:
    r"""Proxy :math:`m = \mathrm{CL}(\mu + F\varepsilon')`: the constraint layer (Stoian et al.) applied to a
    reparameterised *unconstrained* sample. :math:`\varepsilon'` is ``proxy_noise`` if given (independent
    noise, as in the source paper's table), otherwise the forward sample's own noise. A **biased** proxy:
    CL's output is not distributed as the conditional. Forward value: the exact sample, as for every
    estimator (see :mod:`hardeq.estimators.normal` for the shared signature).
    """
    with torch.no_grad():
        z = exact_sample(cond, loc, noise)
    eps = noise if proxy_noise is None else proxy_noise
    return straight_through(z, constraint_layer(loc + cond.cov.sqrt_matvec(eps), cond.constraint, order=order))
