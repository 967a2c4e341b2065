"""Test helpers shipped with hardeq: dense oracles, Monte Carlo tolerances and conformance test cases.

* :mod:`hardeq.testing.oracles`: the dense null-space oracle of a conditioned Gaussian, ``mc_atol``.
"""

from __future__ import annotations

from .oracles import FAILURE_RATE, DenseConditional, dense_conditional, mc_atol, random_spd

__all__ = ["DenseConditional", "dense_conditional", "mc_atol", "FAILURE_RATE", "random_spd"]
