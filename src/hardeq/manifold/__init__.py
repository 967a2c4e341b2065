r"""Nonlinear equality constraints :math:`h(z) = k`: a Gaussian conditioned on a manifold.

* :class:`NonlinearConstraint` (:mod:`.constraint`) -- ``h``, ``k``, the Jacobian and the per-row feasibility test;
* :func:`project` (:mod:`.projection`) -- the :math:`\Sigma`-metric nearest point, by Newton on the KKT system,
  with an implicit gradient;
* :class:`ManifoldTarget` (:mod:`.target`) -- the small object the algorithms take;
* :func:`~hardeq.manifold.linearised.linearised_rsample` (:mod:`.linearised`) and :func:`manifold_hmc`
  (:mod:`.rattle`) -- the two samplers;
* :class:`ManifoldNormal` (:mod:`.distribution`) -- the distribution ``ConstrainedNormal(..., constraint=
  NonlinearConstraint(...))`` returns.
"""

from __future__ import annotations

from .constraint import ManifoldError, NonlinearConstraint, feasibility_tol
from .distribution import ManifoldNormal, ManifoldSamples
from .projection import kkt_solve, project
from .rattle import HMCResult, manifold_hmc
from .target import ManifoldTarget, TangentGram

__all__ = ["NonlinearConstraint", "ManifoldError", "feasibility_tol", "ManifoldNormal", "ManifoldSamples",
           "ManifoldTarget", "TangentGram", "project", "kkt_solve", "HMCResult", "manifold_hmc"]
