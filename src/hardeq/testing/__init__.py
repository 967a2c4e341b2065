"""Test helpers shipped with hardeq: dense oracles, Monte Carlo tolerances and conformance test cases.

* :mod:`hardeq.testing.oracles`: the dense null-space oracle of a conditioned Gaussian, ``mc_atol``.
* :mod:`hardeq.testing.constraint_case`: :class:`ConstraintTestCase`, the conformance suite of a constraint class.
"""

from __future__ import annotations

from .constraint_case import ConstraintTestCase
from .oracles import FAILURE_RATE, DenseConditional, dense_conditional, mc_atol, random_spd

__all__ = ["ConstraintTestCase", "DenseConditional", "dense_conditional", "mc_atol", "FAILURE_RATE", "random_spd"]
