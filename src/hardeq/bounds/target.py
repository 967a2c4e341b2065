r"""The samplers' target: a Gaussian on the plane :math:`Az = k`, as a few operators (no distribution object).

Every sampler, the mode and the normalisers of :mod:`hardeq.bounds` see the law

.. math:: z \sim \mathcal N(\mu, \Sigma)\ \text{given}\ Az = k, \qquad l \le z \le u

through a :class:`PlaneTarget` and the bounds ``lower``, ``upper`` (``(*batch, n)`` tensors, passed next to it):

* ``loc`` :math:`\mu` (``(*batch, n)`` or broadcastable; may require grad, the samplers detach it);
* ``covariance``, a :class:`~hardeq.linalg.covariance.Covariance` (``variance``, ``matvec``, ``sqrt_matvec``,
  ``inv_quad``, ``diag_part`` / ``factor_part``, ``dense`` where the user gave a dense matrix);
* ``constraint``, an :class:`~hardeq.constraints.EqualityConstraint` (``matvec``, ``rmatvec``, ``abs_matvec``,
  ``check``, ``dense_rows``, the grouped-sum attributes ``group_index`` / ``group_sizes``);
* ``conditioner``, the :class:`~hardeq.linalg.conditioning.Conditioner` of the two: ``condition`` (the round-off
  re-projection of a state onto the plane), ``sample`` (exact untruncated draws), ``gain_matvec``, ``variance``
  (the conditional variances on the plane).

A sampler's state is a float64 (or compute-dtype) tensor ``(chains, *batch, n)``, chains leading.
:class:`~hardeq.TruncatedConstrainedNormal` builds the target from its base distribution
(:meth:`PlaneTarget.of`); a :class:`~hardeq.ConstrainedNormal` passed to a sampler function is read the same way,
so :mod:`hardeq.bounds` imports nothing from :mod:`hardeq.distributions`. A sampler for another kind of plane (a
later nonlinear constraint, say) needs only these attributes. ``hardeq.testing.sampler_case`` is the conformance
suite a new sampler runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..constraints.base import EqualityConstraint
from ..linalg.conditioning import Conditioner
from ..linalg.covariance import Covariance

__all__ = ["PlaneTarget"]


@dataclass(eq=False)
class PlaneTarget:
    r""":math:`\mathcal N(\mu, \Sigma)` given :math:`Az = k` (module docstring).

    Attributes:
        loc (Tensor): :math:`\mu`, broadcastable to ``batch_shape + (n,)``, in the compute dtype.
        covariance (Covariance): :math:`\Sigma`.
        constraint (EqualityConstraint): the rows and ``k``.
        conditioner (Conditioner): of ``covariance`` and ``constraint``.
        batch_shape (torch.Size): the law's batch shape.

    Example:
        >>> from hardeq.bounds.target import PlaneTarget
        >>> total = SumConstraint(torch.zeros(3, dtype=torch.long), torch.ones(1, dtype=torch.float64))
        >>> t = PlaneTarget.of(ConstrainedNormal(torch.zeros(3, dtype=torch.float64), 1.0, constraint=total))
        >>> t.event_size, tuple(t.batch_shape), t.mean
        (3, (), tensor([0.3333, 0.3333, 0.3333], dtype=torch.float64))
    """

    loc: Tensor
    covariance: Covariance
    constraint: EqualityConstraint
    conditioner: Conditioner
    batch_shape: torch.Size

    @classmethod
    def of(cls, dist: object, name: str = "dist") -> PlaneTarget:
        """``dist`` itself if a :class:`PlaneTarget`, else one read from an object with ``_unbroadcasted_loc``,
        ``covariance``, ``constraint``, ``conditioner`` and ``batch_shape`` (a :class:`~hardeq.ConstrainedNormal`);
        ``TypeError`` naming ``name`` otherwise."""
        if isinstance(dist, PlaneTarget):
            return dist
        try:
            loc, cov, con, cond, batch = (getattr(dist, a) for a in ("_unbroadcasted_loc", "covariance", "constraint",
                                                                      "conditioner", "batch_shape"))
        except AttributeError:
            raise TypeError(f"{name} must be a hardeq.ConstrainedNormal (or a hardeq.bounds.PlaneTarget), got "
                            f"{type(dist).__name__}.") from None
        if not (isinstance(loc, Tensor) and isinstance(cov, Covariance) and isinstance(con, EqualityConstraint)
                and isinstance(cond, Conditioner)):
            raise TypeError(f"{name} must be a hardeq.ConstrainedNormal (or a hardeq.bounds.PlaneTarget), got "
                            f"{type(dist).__name__}.")
        return cls(loc, cov, con, cond, torch.Size(batch))

    @property
    def event_size(self) -> int:
        """``n``."""
        return self.constraint.event_size

    @property
    def shape(self) -> torch.Size:
        """``batch_shape + (n,)``."""
        return self.batch_shape + (self.event_size,)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the conditioner's)."""
        return self.conditioner.dtype

    @property
    def mean(self) -> Tensor:
        r"""The conditional mean :math:`\bar\mu = \mu + K(k - A\mu)`, ``batch_shape + (n,)`` (differentiable in the
        parameters when grad mode is on; O(n a), computed on each call, so that no graph is kept between calls)."""
        mean: Tensor = self.conditioner.condition(self.loc).expand(self.shape)
        return mean

    def plane_variance(self) -> Tensor:
        """Conditional variances on the plane, ``batch_shape + (n,)`` (0 where the rows fix a coordinate)."""
        return self.conditioner.variance().expand(self.shape)
