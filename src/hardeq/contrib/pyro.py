r"""hardeq's distributions as Pyro sample sites (``pip install "hardeq[pyro]"``).

Pyro's inference (``pyro.sample`` sites under ``SVI`` with ``Trace_ELBO``, ``pyro.plate``, ``poutine.trace`` /
``replay``, ``Predictive``) calls methods a plain ``torch.distributions.Distribution`` lacks: ``score_parts``,
``expand_by``, ``to_event``, ``mask``, ``__call__``. The classes here are hardeq's distributions with Pyro's
``TorchDistributionMixin`` added, as Pyro does for torch's own distributions (``pyro.distributions.Normal`` is
``torch.distributions.Normal`` plus the mixin). They take the same arguments, compute the same numbers (the
mixin adds methods and overrides none of hardeq's), and are still instances of the hardeq classes::

    >>> import torch, pyro
    >>> from hardeq import SumConstraint
    >>> from hardeq.contrib.pyro import ConstrainedNormal
    >>> zero_sum = SumConstraint(torch.zeros(4, dtype=torch.long), torch.tensor([0.0]))
    >>> d = ConstrainedNormal(torch.zeros(4), 1.0, constraint=zero_sum)
    >>> with pyro.plate("effects", 3):
    ...     z = pyro.sample("z", d)
    >>> tuple(z.shape), bool(z.sum(-1).abs().max() < 1e-5)
    ((3, 4), True)

What each site means to an ELBO. :class:`ConstrainedNormal` has ``has_rsample = True``: Trace_ELBO
differentiates through its draws (the pathwise gradient), and its ``log_prob`` is a density with respect to
Lebesgue measure *on the plane* :math:`\{Az = k\}`. A model site and a guide site for the same latent must
therefore carry the same constraint (the same plane), so that their densities are with respect to the same
measure; the ELBO is then the usual one on the plane. A :class:`TruncatedConstrainedNormal` site (the same law
restricted to a box, from :meth:`ConstrainedNormal.truncate`) is scored by its restricted density; it has no
reparametrised sampler. A :class:`ConstrainedPoisson` site is discrete (its
``log_prob`` is the conditional pmf; as a latent, Trace_ELBO uses the score-function estimator).

Autoguides: ``AutoDelta``, ``AutoNormal``, ``AutoMultivariateNormal`` and the other autoguides that learn in an
unconstrained space work with a :class:`ConstrainedNormal` latent: ``biject_to(site.support)`` is
:class:`hardeq.distributions.PlaneTransform`, the isometry :math:`y \mapsto z_0 + Ny` of :math:`\mathbb R^{n-a}`
onto the plane (log-det Jacobian 0), registered by ``import hardeq``. A truncated latent (a box on the plane) has
none: an autoguide raises ``NotImplementedError`` asking for a hand-written guide.

Cost: none beyond the hardeq distribution's own; Pyro's plate broadcasting calls :meth:`expand`, which shares
the factorisation of the conditioner where the parameters are shared.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

try:
    from pyro.distributions.torch_distribution import TorchDistributionMixin
except ImportError as error:  # pragma: no cover - exercised only without Pyro
    raise ImportError("hardeq.contrib.pyro needs Pyro: pip install \"hardeq[pyro]\" (pyro-ppl >= 1.8).") from error

from .. import distributions as _distributions
from ..distributions import truncated as _truncated

__all__ = ["ConstrainedNormal", "ConstrainedPoisson", "TruncatedConstrainedNormal"]


class ConstrainedNormal(_distributions.ConstrainedNormal, TorchDistributionMixin):
    """:class:`hardeq.ConstrainedNormal` as a Pyro distribution: the same arguments and numbers, plus Pyro's
    ``TorchDistributionMixin`` (``score_parts``, ``expand_by``, ``to_event``, ``mask``, calling it draws).
    :meth:`truncate` returns this module's :class:`TruncatedConstrainedNormal`.

    Examples:
        >>> import torch, pyro, hardeq
        >>> from hardeq import SumConstraint
        >>> from hardeq.contrib.pyro import ConstrainedNormal
        >>> zero_sum = SumConstraint(torch.zeros(4, dtype=torch.long), torch.tensor([0.0]))
        >>> d = ConstrainedNormal(torch.zeros(4), 1.0, constraint=zero_sum)
        >>> z = pyro.sample("z", d.expand_by([3]))  # Pyro's mixin methods
        >>> isinstance(d, hardeq.ConstrainedNormal), z.shape, bool(zero_sum.check(z).all())
        (True, torch.Size([3, 4]), True)
    """

    def truncate(self, lower: Tensor | float | None = None, upper: Tensor | float | None = None,
                 **kwargs: Any) -> TruncatedConstrainedNormal:
        return TruncatedConstrainedNormal(self, lower, upper, **kwargs)


class TruncatedConstrainedNormal(_truncated.TruncatedConstrainedNormal, TorchDistributionMixin):
    """:class:`hardeq.TruncatedConstrainedNormal` as a Pyro distribution. It has no reparametrised sampler
    (``has_rsample = False``): as an observed site its ``log_prob`` (with the normaliser's gradient, exact for one
    free dimension and estimated otherwise) is what SVI differentiates; as a latent, Trace_ELBO falls back to the
    score-function estimator.

    Examples:
        >>> import torch, hardeq
        >>> from hardeq.contrib.pyro import ConstrainedNormal
        >>> zero_sum = hardeq.SumConstraint(torch.zeros(4, dtype=torch.long), torch.tensor([0.0]))
        >>> d = ConstrainedNormal(torch.zeros(4), 1.0, constraint=zero_sum).truncate(-1.0, 1.0)
        >>> type(d).__module__, d.has_rsample, isinstance(d, hardeq.TruncatedConstrainedNormal)
        ('hardeq.contrib.pyro', False, True)
    """


class ConstrainedPoisson(_distributions.ConstrainedPoisson, TorchDistributionMixin):
    """:class:`hardeq.ConstrainedPoisson` as a Pyro distribution: the same arguments and numbers, plus Pyro's
    ``TorchDistributionMixin``.

    Examples:
        >>> import math, torch, pyro
        >>> from hardeq.contrib.pyro import ConstrainedPoisson
        >>> d = ConstrainedPoisson(torch.tensor([1.0, 2.0, 3.0]), torch.tensor(6))  # Multinomial(6, (1, 2, 3) / 6)
        >>> with pyro.plate("draws", 5):
        ...     x = pyro.sample("x", d)
        >>> x.shape, x.sum(-1), round(float(d.log_prob(torch.tensor([1.0, 2.0, 3.0]))), 4)
        (torch.Size([5, 3]), tensor([6., 6., 6., 6., 6.]), -1.9741)
        >>> round(math.log(math.factorial(6) / (1 * 2 * 6) * (1 / 6) * (2 / 6) ** 2 * (3 / 6) ** 3), 4)  # the pmf
        -1.9741
    """
