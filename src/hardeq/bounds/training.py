r"""Training through the truncated law at the cost of a few sweeps: persistent chains for the normaliser's gradient.

The maximum-likelihood gradient of the truncated log-density is

.. math::
    \nabla_\theta \log p_{\text{trunc}}(y) = \nabla_\theta \log p(y \mid Az = k)
    - \mathbb E_{z\sim p_{\text{trunc}}}\big[\nabla_\theta \log p(z \mid Az = k)\big]

(differentiate :math:`Z(\theta) = \int_{\text{box}} p`; ``loc`` and the scales, which do not move the plane). The
expectation needs draws of the model's own truncated law, not :math:`\log Z` itself. In training mode
(``truncate(..., training=...)``) :meth:`~hardeq.TruncatedConstrainedNormal.log_prob` takes them from a few sweeps of
blocked Gibbs (exact HMC where Gibbs does not apply) started from where the chains were at the previous step:
*persistent contrastive divergence* (Tieleman 2008). :class:`PersistentChains` holds those states between steps.

**Where the chains start.** At the first step, or where a kept state no longer lies in the current polytope (``k``
or the box changed, or the batch shape), each chain starts at the observed value ``y`` of its batch element when
``log_prob`` is given one value per batch element that is feasible (contrastive divergence: the data are draws of
the target once the model fits), else at a point of the polytope built without a host read: where every coordinate
lies in at most one row :func:`~hardeq.bounds.start.feasible_start`'s, else
:func:`~hardeq.bounds.start_dual.dual_start`'s (certified with the chains' start check; where that fails, at the
mode).

**What is biased.** A draw after finitely many sweeps from a start not drawn from the current law is not distributed
as that law, so the gradient estimate is biased, by an amount that shrinks with ``sweeps`` and, because the chains
persist while the parameters move slowly, with the step size (the chains track the model). It is *not* the
unbiased estimate of the default mode (``grad_samples`` draws after a burn-in of 100 from the mode, with the
Monte Carlo :math:`\log Z`). Both are consistent stochastic gradients of the likelihood in the sense of stochastic
approximation (Younes 1999); use the default mode, or more ``sweeps``, to check a fit.

**The value.** Training mode never estimates :math:`\log Z`: ``log_prob`` returns the *unnormalised*
:math:`\log p(y \mid Az = k)` (``-inf`` outside the box), whose gradient carries the estimate above through a
zero-valued surrogate. Its value differs from the log-density by :math:`\log Z(\theta)`, the same for every value of
a batch element; report a likelihood with ``training=False`` (or :attr:`~hardeq.TruncatedConstrainedNormal.
log_normaliser`), which the exact path gives for free where ``n - a == 1``.

Cost per ``log_prob``: ``sweeps`` sweeps of ``chains`` chains per batch element (O(n) each for a grouped sum or one
row), plus one :meth:`~hardeq.ConstrainedNormal.log_prob` of the ``sweeps x chains`` draws.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["PersistentChains"]


@dataclass
class PersistentChains:
    """The chain states of training mode, kept across optimiser steps (module docstring).

    Args:
        chains (int): Markov chains per batch element (default 4).
        sweeps (int): sweeps per :meth:`~hardeq.TruncatedConstrainedNormal.log_prob` call (default 4); every sweep's
            state is one draw of the gradient estimate, so it averages ``chains * sweeps`` correlated draws.

    Attributes:
        state (Tensor | None): ``(chains, *batch, n)`` in the distribution's compute dtype, the chains' last states
            (``None`` before the first step). Reset it to ``None`` to restart from the data.
        steps (int): the ``log_prob`` calls that advanced the chains.

    Example:
        >>> import hardeq
        >>> from hardeq.bounds import PersistentChains
        >>> chains = PersistentChains(chains=2, sweeps=3)
        >>> loc = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        >>> total = hardeq.SumConstraint(torch.zeros(3, dtype=torch.long), torch.ones(1, dtype=torch.float64))
        >>> d = hardeq.ConstrainedNormal(loc, 0.3, constraint=total).truncate(0.0, 1.0, training=chains)
        >>> d.log_prob(torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)).backward()
        >>> chains.state.shape, chains.steps, loc.grad.shape
        (torch.Size([2, 3]), 1, torch.Size([3]))
    """

    chains: int = 4
    sweeps: int = 4
    state: Tensor | None = field(default=None, repr=False)
    steps: int = 0

    def __post_init__(self) -> None:
        for name in ("chains", "sweeps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"PersistentChains: {name} must be a positive int, got {value!r}.")

    @torch.no_grad()
    def start(self, shape: torch.Size, lower: Tensor, upper: Tensor, on_plane: Callable[[Tensor], Tensor],
              data: Tensor | None, mode: Callable[[], Tensor], point: Tensor | None = None) -> Tensor:
        """The chains' start ``(chains, *shape)`` in ``lower.dtype``: the kept state where it is feasible for the
        current polytope, else the data point of the batch element where given and feasible, else ``point`` (a
        point of the polytope, ``shape``: :mod:`hardeq.bounds.start`, :mod:`hardeq.bounds.start_dual`) where given,
        else the mode
        (module docstring). ``on_plane(z) -> (*z.shape[:-1])`` bool, ``mode() -> shape``. With ``point`` no host
        read; without it one (whether every chain has a start), and ``mode`` is called only where one has none."""
        full = (self.chains,) + tuple(shape)
        start = torch.empty(full, dtype=lower.dtype, device=lower.device)
        have = torch.zeros(full[:-1], dtype=torch.bool, device=lower.device)
        if self.state is not None and tuple(self.state.shape) == full and self.state.dtype == lower.dtype \
                and self.state.device == lower.device:
            s = self.state
            have = ((s >= lower) & (s <= upper)).all(-1) & on_plane(s)
            start = torch.where(have.unsqueeze(-1), s, start)
        if data is not None and tuple(data.shape) == tuple(shape):
            y = data.detach().to(lower.dtype)
            ok = ((y >= lower) & (y <= upper)).all(-1) & on_plane(y)
            use = ~have & ok
            start = torch.where(use.unsqueeze(-1), y.expand(full), start)
            have = have | use
        if point is not None:                                # a point of the polytope: no read, no mode
            return torch.where(have.unsqueeze(-1), start, point.to(lower.dtype).expand(full))
        if not bool(have.all()):                             # the one host read of a step (the mode only if needed)
            start = torch.where(have.unsqueeze(-1), start, mode().to(lower.dtype).expand(full))
        return start

