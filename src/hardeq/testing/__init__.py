"""Test helpers shipped with hardeq: dense oracles, Monte Carlo tolerances and conformance test cases.

* :mod:`hardeq.testing.oracles`: the dense null-space oracle of a conditioned Gaussian, ``mc_atol``, and the
  FFT oracle of a box-truncated diagonal Gaussian under one sum (``sum_conditioned_truncated_means``).
* :mod:`hardeq.testing.exactness`: the per-row exactness criterion (``row_residual_ratio``,
  ``assert_exact_per_row``).
* :mod:`hardeq.testing.counting`: ``count_calls``, a dispatch mode counting the ATen calls (GPU launches) and the
  host reads (device-to-host synchronisations) of a block of code.
* :mod:`hardeq.testing.covariance_case`: ``CovarianceTestCase``, the conformance suite of a covariance structure
  (imported on first use: it needs pytest).
* :mod:`hardeq.testing.constraint_case`: :class:`ConstraintTestCase`, the conformance suite of a constraint class.
"""

from __future__ import annotations

from typing import Any

from .constraint_case import ConstraintTestCase
from .counting import CallCount, count_calls
from .exactness import assert_exact_per_row, exactness_tolerance, row_residual_ratio
from .oracles import (FAILURE_RATE, DenseConditional, dense_conditional, mc_atol, random_spd,
                      sum_conditioned_truncated_means)

__all__ = ["DenseConditional", "dense_conditional", "mc_atol", "FAILURE_RATE", "random_spd",
           "sum_conditioned_truncated_means", "row_residual_ratio", "assert_exact_per_row", "exactness_tolerance",
           "CovarianceTestCase", "ConstraintTestCase", "count_calls", "CallCount"]


def __getattr__(name: str) -> Any:
    if name == "CovarianceTestCase":  # pytest is a test dependency, not a dependency of the library
        from .covariance_case import CovarianceTestCase

        return CovarianceTestCase
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
